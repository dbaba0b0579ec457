"""Read the traces a hang left: which rank did not reach which collective, and where each was.

    python analyze_hang.py runs/<run_name>/flight_recorder     # or runs/<run_name>
    python analyze_hang.py runs/<run_name> --full              # also torch's analyzer in full

The dumps are mingpt/forensics.py's (DEBUGGING.md). This prints torch's own analyzer's finding
(`torchfrtrace`), the first step whose collectives differ between ranks (a rank that stalled,
or left one out and went on: off by one, which torch's analyzer cannot see), per process group
who is behind and the rank that stopped first, and where each rank was. The dumps are pickles:
read only those of your own runs.
"""
import argparse
import contextlib
import io
import json
import logging
import os
import re
import sys
from collections.abc import Iterator

from mingpt import errors
from mingpt.errors import one_line_errors
from mingpt.forensics import DIR, PREFIX, load_dump

LIBRARY = re.compile(r"site-packages|dist-packages|/lib/python3")  # torch's frames, not ours
FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def find_folder(path: str) -> str:
    """The dump folder: `path` itself, or its flight_recorder/ (a run directory)."""
    inner = os.path.join(path, DIR)  # forensics.DIR, under the run directory
    return inner if os.path.isdir(inner) else path


def load(folder: str) -> tuple[dict[int, dict], dict[int, dict]]:
    """{rank: Flight Recorder dump} and {rank: where<N>.json} of the folder."""
    dumps, wheres = {}, {}
    # rank<N>: torch's dump (gloo: forensics.dump; NCCL: the watchdog); where<N>.json: ours.
    for name in sorted(os.listdir(folder)):
        if m := re.fullmatch(rf"{PREFIX}(\d+)", name):
            dumps[int(m[1])] = load_dump(os.path.join(folder, name))
        elif m := re.fullmatch(r"where(\d+)\.json", name):
            with open(os.path.join(folder, name)) as f:
                wheres[int(m[1])] = json.load(f)
    return dumps, wheres


def gloo_pg_config(details: dict, groups: dict[str, dict] | None = None) -> bool:
    """Make gloo's dumps readable by torch's analyzer; True if anything changed.

    torch 2.14 keys a gloo dump's pg_config by '' while its entries name their group, so the
    analyzer's lookup fails (KeyError: ('0', 0)). Each group named gets its ranks from `groups`
    (group_table), else from that '' entry, which holds one group's ranks only: the analyzer
    given a group's wrong ranks runs out of memory."""
    changed = False
    for dump in details.values():
        config = dump["pg_config"]
        if "" not in config:
            continue
        ranks = config.pop("")["ranks"]
        for name, desc in {tuple(e["process_group"]) for e in dump["entries"]}:
            known = (groups or {}).get(name)
            # the fields NCCL's pg_config has for each group (its ranks as a string)
            config.setdefault(name, {"name": name, "desc": desc,
                                     "ranks": str(known["ranks"]) if known else ranks})
        changed = True
    return changed


@contextlib.contextmanager
def captured(logger_name: str) -> Iterator[io.StringIO]:
    """What a logging logger writes while the block runs, instead of on stderr."""
    logger, text = logging.getLogger(logger_name), io.StringIO()
    handler = logging.StreamHandler(text)
    handler.setFormatter(logging.Formatter("%(message)s"))
    saved, logger.handlers = logger.handlers, [handler]
    try:
        yield text
    finally:
        logger.handlers = saved


def torch_analysis(folder: str, groups: dict[str, dict] | None = None) -> tuple[list[str], str]:
    """torch's analyzer on the folder: its report's lines, and how it ran."""
    # The analyzer's logger adds its stderr handler when first made: make it now, so that the
    # capture below replaces it (the import warns that tabulate is missing: not our concern).
    from torch.distributed.flight_recorder.components.fr_logger import FlightRecorderLogger
    FlightRecorderLogger()
    with captured("Flight Recorder"):
        from torch.distributed.flight_recorder.components.builder import build_db
        from torch.distributed.flight_recorder.components.config_manager import JobConfig
        from torch.distributed.flight_recorder.components.loader import read_dir
    # Incomplete: a rank killed before it could write (gloo's SIGABRT) must not stop the rest.
    args = JobConfig().parse_args([folder, "--prefix", PREFIX, "--allow-incomplete-ranks"])
    with captured("Flight Recorder") as text:
        how = "as is"
        try:
            details, version = read_dir(args)
            build_db(details, args, version)
        except KeyError:  # gloo's dumps (gloo_pg_config): again, on fixed copies
            text.seek(0)
            text.truncate()
            details, version = read_dir(args)
            if not gloo_pg_config(details, groups):
                raise
            build_db(details, args, version)
            how = "with gloo's pg_config rewritten"
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    return list(dict.fromkeys(lines)), how  # each message once: it repeats one per collective


def describe(entry: dict) -> str:
    """'#17 all_reduce [[28576]] Float': sequence number, op, input sizes and dtypes."""
    return f"#{entry['collective_seq_id']} {op_name(entry)}"


def signature(entry: dict) -> tuple:
    """What must agree across ranks for one collective: its op, sizes and dtypes."""
    return (entry["profiling_name"], str(entry["input_sizes"]), str(entry.get("input_dtypes")))


def step_of(entry: dict, marks: list) -> int | None:
    """The step in which this rank created the collective (None: before the first step)."""
    # time_created_ns is wall-clock time (as time.time_ns()), on the rank that made both.
    step = None
    for mark_step, start_ns in marks:
        if start_ns <= entry["time_created_ns"]:
            step = mark_step
    return step


def collectives(dump: dict) -> dict[int, dict]:
    """{sequence number: entry} of a rank's collectives in the default group."""
    return {e["collective_seq_id"]: e for e in dump["entries"]
            if not e.get("is_p2p") and e.get("pg_id", 0) == 0}


def by_step(dump: dict, where: dict | None) -> dict[int | None, list[dict]]:
    """This rank's collectives (of the default group), by the step that made them."""
    marks = where["steps"] if where else []
    steps: dict[int | None, list[dict]] = {}
    for entry in collectives(dump).values():
        steps.setdefault(step_of(entry, marks), []).append(entry)
    return steps


def step_differences(dumps: dict[int, dict], wheres: dict[int, dict]) -> list[str]:
    """The first step whose collectives differ between ranks, and what each rank made in it."""
    ranks = [r for r in sorted(dumps) if r in wheres and wheres[r]["steps"]]
    if len(ranks) < 2:
        return []
    steps = {r: by_step(dumps[r], wheres[r]) for r in ranks}
    # Only the steps every rank's marks cover (a rank that stopped early marked fewer).
    last = min(wheres[r]["steps"][-1][0] for r in ranks)
    first = max(wheres[r]["steps"][0][0] for r in ranks)
    for step in range(first, last + 1):
        made = {r: [signature(e) for e in steps[r].get(step, [])] for r in ranks}
        if len({tuple(m) for m in made.values()}) == 1:
            continue
        lines = [f"step {step}: the ranks' collectives differ"]
        # The ranks with fewer collectives in this step are the ones that left some out.
        most = max(len(m) for m in made.values())
        for r in ranks:
            entries = steps[r].get(step, [])
            shown = ", ".join(describe(e) for e in entries) or "none"
            lines.append(f"  rank {r} made {shown}")
        short = [r for r in ranks if len(made[r]) < most]
        later = {r: steps[r].get(step + 1, []) for r in short}
        for r in short:
            if later[r]:  # it went on: its next collectives pair with the others' earlier ones
                lines.append(f"  rank {r} left out {most - len(made[r])} and went on: its "
                             f"{describe(later[r][0])} (step {step + 1}) pairs with the other "
                             "ranks' collective of the same number from step "
                             f"{step}, off by one from here on")
            else:
                lines.append(f"  rank {r} made no collective after step {step - 1}'s: it "
                             "stopped before them (its stack, below)")
        return lines
    return []


def sequence_differences(dumps: dict[int, dict]) -> list[str]:
    """Each rank's last collective (who is behind, in what), and the first sequence number at
    which the ranks' collectives differ."""
    seqs = {r: collectives(d) for r, d in sorted(dumps.items())}
    newest = max((max(c, default=0) for c in seqs.values()), default=0)
    lines = []
    for r, by_seq in seqs.items():
        if not by_seq:
            lines.append(f"  rank {r}: no collective recorded")
            continue
        # No "completed" here: gloo's entries stay `scheduled`, and one that timed out may be
        # marked retired like one that finished.
        entry = by_seq[max(by_seq)]
        behind = "" if entry["collective_seq_id"] == newest else \
            f", {newest - entry['collective_seq_id']} behind: never issued #{newest}"
        lines.append(f"  rank {r}: last issued {describe(entry)}{behind}")
    # The numbers every rank recorded (the recorder keeps only the newest entries).
    common = sorted(set.intersection(*(set(c) for c in seqs.values()))) if seqs else []
    for k in common:  # the first number whose op, sizes or dtypes are not the same everywhere
        if len({signature(c[k]) for c in seqs.values()}) > 1:
            lines.append(f"  #{k} differs: " + "; ".join(
                f"rank {r} {describe(c[k])}" for r, c in seqs.items()))
            break
    return lines


def step_name(entry: dict, marks: list) -> str:
    """'step 3', or 'before the first step' (a rank's set-up: its mesh, a barrier)."""
    step = step_of(entry, marks)
    return "before the first step" if step is None else f"step {step}"


def group_table(dumps: dict[int, dict], wheres: dict[int, dict]) -> dict[str, dict]:
    """{group name: {"axis", "ranks"}} of every process group where<N>.json or NCCL's
    pg_config names."""
    table: dict[str, dict] = {}
    for where in wheres.values():
        for name, info in (where.get("groups") or {}).items():
            entry = table.setdefault(name, {"ranks": info["ranks"], "axes": [],
                                            "desc": info["desc"]})
            entry["axes"] += [a for a in info.get("axes", []) if a not in entry["axes"]]
    for dump in dumps.values():
        for name, info in dump.get("pg_config", {}).items():
            if name and name not in table:  # gloo's '' entry names no group (gloo_pg_config)
                ranks = info["ranks"]
                table[name] = {"ranks": json.loads(ranks) if isinstance(ranks, str) else ranks,
                               "axes": [], "desc": info.get("desc", "")}
    for info in table.values():
        # The dimensions the files name for a group, else a DeviceMesh's mesh_<dimension>
        # name; the default group alone is the world.
        desc = info["desc"]
        info["axis"] = "/".join(info["axes"]) or (
            desc.removeprefix("mesh_") if desc.startswith("mesh_") else
            "world" if desc == "default_pg" else desc or "?")
    return table


def operations(dump: dict | None, where: dict | None) -> list[dict]:
    """Every operation a rank issued, in every group, oldest first: its dump's entries and the
    point-to-point ops forensics recorded (gloo's recorder keeps none)."""
    ops = list(dump["entries"]) if dump else []
    ops += (where or {}).get("p2p", [])
    return sorted(ops, key=lambda e: e["time_created_ns"])


def number(entry: dict) -> tuple[str, int]:
    """An operation's place in its group: point-to-point ops and collectives count apart."""
    if entry.get("is_p2p"):
        return "point-to-point", entry["p2p_seq_id"]
    return "", entry["collective_seq_id"]


def op_name(entry: dict) -> str:
    """'all_reduce [[4, 8]] Float', 'send 0->1 [[4, 8]] Float' (group ranks in the arrow)."""
    op = entry["profiling_name"].split(":", 1)[-1]  # without the backend's "gloo:", "nccl:"
    dtypes = ",".join(sorted(set(entry.get("input_dtypes") or [])))
    return f"{op} {entry['input_sizes']} {dtypes}".rstrip()


def axis_stalls(dumps: dict[int, dict], wheres: dict[int, dict]) -> list[str]:
    """Per process group (a mesh axis, or the world), how far each member got; then the rank
    that stopped first, and the operation its peers wait for it in."""
    table = group_table(dumps, wheres)
    ranks = sorted(set(dumps) | set(wheres))
    ops = {r: operations(dumps.get(r), wheres.get(r)) for r in ranks}
    marks = {r: (wheres.get(r) or {}).get("steps", []) for r in ranks}
    # {group: {rank: {kind: the rank's newest op of that kind in the group}}}
    last: dict[str, dict[int, dict[str, dict]]] = {}
    for r in ranks:
        for entry in ops[r]:
            name = entry["process_group"][0]
            last.setdefault(name, {}).setdefault(r, {})[number(entry)[0]] = entry
    for name in last:
        table.setdefault(name, {"ranks": sorted(last[name]), "axis": f"group {name}"})
    # behind: {rank: [(group, kind)]}; ahead: the ranks that issued an operation some member
    # of its group never issued (they wait on another rank)
    lines, behind, ahead, agree = [], {}, set(), 0
    # Groups by number ('2' before '10'), as torch counts them.
    for name, info in sorted(table.items(), key=lambda kv: (len(kv[0]), kv[0])):
        members = [r for r in info["ranks"] if r in ranks]
        if len(info["ranks"]) < 2 or not members:
            continue  # a group of one waits for no one
        for kind in sorted({k for r in members for k in last.get(name, {}).get(r, {})}):
            got = {r: last[name].get(r, {}).get(kind) for r in members}
            newest = max(number(e)[1] if e else 0 for e in got.values())
            shown = []
            for r, e in got.items():
                seq = number(e)[1] if e else 0
                where = f"#{seq} {op_name(e)} ({step_name(e, marks[r])})" if e else "none"
                shown.append(f"rank {r} {where}" + (f", {newest - seq} behind" if seq < newest
                                                      else ""))
                if seq < newest:
                    behind.setdefault(r, []).append((name, kind))
                elif any((number(o)[1] if o else 0) < seq for o in got.values()):
                    ahead.add(r)
            if all((number(e)[1] if e else 0) == newest for e in got.values()):
                agree += 1  # every member at the same operation: nothing to show
                continue
            label = f"{kind} " if kind else ""
            lines.append(f"  {info['axis']} (group {name}, ranks {info['ranks']}), last "
                         f"{label}op: " + "; ".join(shown))
    lines.append(f"  {agree} more: every member at the same operation")
    if not behind:
        return ["by process group:", *lines]
    # The rank that stopped first: of those behind somewhere, one ahead of no member of any
    # group (a rank blocked in an operation a peer never issued is behind the stall too); of
    # those, the one whose newest operation is the oldest (the others went on to wait for it).
    first = [r for r in behind if r not in ahead] or list(behind)
    stalled = min(first, key=lambda r: ops[r][-1]["time_created_ns"] if ops[r] else 0)
    findings = []
    for name, kind in behind[stalled]:
        info, mine = table[name], last[name].get(stalled, {}).get(kind)
        seq = number(mine)[1] if mine else 0
        for r in info["ranks"]:
            if r == stalled or r not in ops:
                continue
            # The first operation of this group and kind the stalled rank never matched.
            waiting = next((e for e in ops[r] if e["process_group"][0] == name
                            and number(e)[0] == kind and number(e)[1] > seq), None)
            if waiting is not None:
                label = f"{kind} " if kind else ""
                findings.append(f"  rank {r} waits for it in {op_name(waiting)} on "
                                f"{info['axis']} ({label}#{number(waiting)[1]}, "
                                f"{step_name(waiting, marks[r])})")
        last_seen = f"#{seq}, {step_name(mine, marks[stalled])}" if mine else "none"
        findings.append(f"  rank {stalled}'s last {info['axis']} op: {last_seen}")
    axes = ", ".join(dict.fromkeys(table[name]["axis"] for name, _ in behind[stalled]))
    return ["by process group:", *lines, f"stalled: rank {stalled}, on {axes}", *findings]


def frames_of(stack: list[str]) -> list[tuple[str, int, str]]:
    """(file, line, function) of each frame of a formatted stack, outermost first."""
    return [(f, int(n), fn) for f, n, fn in FRAME.findall("".join(stack))]


def where_line(rank: int, where: dict | None, dump: dict | None) -> str:
    """'rank 1 (pid 4856, stopped by SIGTERM ...): faults.py:56 inject_fault < ...'."""
    if where:
        frames = frames_of(where["stack"])
        # gloo's source location ("[.../unbound_buffer.cc:78] ") says nothing to a reader
        why = re.sub(r"\[[^\]]*:\d+\] ", "", where["reason"])
        # DETAIL's mismatch: its last words say what differs (shapes, op, dtypes)
        why = re.sub(r"^Detected mismatch.*differ in the following aspects:\s*",
                     "collectives differ: ", why)
        head = f"rank {rank} (pid {where['pid']} on {where['host']}: {why[:90]})"
    elif dump and dump["entries"]:  # NCCL's own dump: the stack of its last collective
        last = dump["entries"][-1]
        frames = [(f["filename"], f["line"], f["name"]) for f in reversed(last["frames"])]
        head = f"rank {rank} (its last collective was issued at)"
    else:
        return f"rank {rank}: no dump"
    # The innermost frames of the program (torch's own frames say only "in a collective").
    ours = [f for f in frames if not LIBRARY.search(f[0])][-3:]
    shown = " < ".join(f"{os.path.basename(f)}:{n} {fn}" for f, n, fn in reversed(ours))
    return f"{head}: {shown}"


def report(folder: str, full: bool = False) -> list[str]:
    """The lines analyze_hang.py prints for the dumps in `folder`."""
    dumps, wheres = load(folder)
    # A rank with only where<N>.json: the recorder was off; with only rank<N>: NCCL's dump.
    ranks = sorted(set(dumps) | set(wheres))
    if not ranks:
        raise ValueError(f"no Flight Recorder dumps (rank<N>, where<N>.json) in {folder}")
    # The world size from our files; NCCL's dumps alone give only the ranks that wrote one.
    size = max([w["world_size"] for w in wheres.values()] or [len(ranks)])
    missing = sorted(set(range(size)) - set(ranks))
    lines = [f"{len(dumps)} Flight Recorder dumps of {size} ranks in {folder}"
             + (f"; none from rank(s) {missing} (killed before they could write)"
                if missing else "")]
    if dumps:
        analysis, how = torch_analysis(folder, group_table(dumps, wheres))
        # Its first finding without the stack (indented): the series' lines below show that.
        head = [line for line in analysis if not line.startswith(" ")]
        shown = analysis if full else head[:8]
        lines.append(f"torch's analyzer ({how}):")
        lines += [f"  {line}" for line in shown] or ["  no finding"]
        lines.append("by sequence number:")
        lines += sequence_differences(dumps)
        lines += step_differences(dumps, wheres)
    # Every group, point-to-point ops too: a stall under pp, tp, cp or all three.
    lines += axis_stalls(dumps, wheres)
    lines.append("where each rank was:")
    lines += [f"  {where_line(r, wheres.get(r), dumps.get(r))}" for r in ranks]
    return lines


def main(argv: list[str]) -> None:
    # Bad arguments: one `error:` line, as every command of this folder answers them.
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("path", help="runs/<run_name> or its flight_recorder folder")
    parser.add_argument("--full", action="store_true",
                        help="torch's analyzer's whole report (every stack)")
    args = parser.parse_args(argv)
    folder = find_folder(args.path)
    try:
        if not os.path.isdir(folder):
            raise ValueError(f"{args.path} is not a folder; give runs/<run_name> or its "
                             f"{DIR} folder")
        print("\n".join(report(folder, args.full)))
    except ValueError as e:
        errors.report(e)
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
