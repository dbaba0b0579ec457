"""Read the traces a hang left: which rank did not reach which collective, and where each was.

    python analyze_hang.py runs/<run_name>/flight_recorder     # or runs/<run_name>
    python analyze_hang.py runs/<run_name> --full              # also torch's analyzer in full

When a collective times out, every rank writes its Flight Recorder dump (torch's format:
rank<N>) and where it was (where<N>.json: its stack, the start time of its recent steps) into
runs/<run_name>/flight_recorder (mingpt/forensics.py; on NCCL torch's watchdog writes the
dumps itself). This prints, in a few lines:

- torch's own analyzer (torch.distributed.flight_recorder, the `torchfrtrace` command): the
  first collective that not all ranks joined, or whose sizes differ, with its stack;
- per step, the first one where the ranks' collectives differ: a rank that made none (it
  stalled) or that left one out and went on (its later collectives then pair with the others'
  earlier ones, off by one, which torch's analyzer cannot see: the sequence numbers agree);
- where each rank was when it stopped, and why it stopped.

The dumps are pickles: read only those of your own runs.
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


def gloo_pg_config(details: dict) -> bool:
    """Make gloo's dumps readable by torch's analyzer; True if anything changed.

    torch 2.14 keys a gloo dump's pg_config by '' (an empty group name) while its entries name
    their group ('0', 'default_pg'), so the analyzer's lookup fails (KeyError: ('0', 0)). Each
    group the entries name gets the ranks of that '' entry, as NCCL's dumps have them."""
    changed = False
    for dump in details.values():
        config = dump["pg_config"]
        if "" not in config:
            continue
        ranks = config.pop("")["ranks"]
        for name, desc in {tuple(e["process_group"]) for e in dump["entries"]}:
            # the fields NCCL's pg_config has for each group
            config.setdefault(name, {"name": name, "desc": desc, "ranks": ranks})
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


def torch_analysis(folder: str) -> tuple[list[str], str]:
    """torch's analyzer on the folder: its report's lines, and how it ran (as is, or with the
    gloo dumps' pg_config rewritten)."""
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
            if not gloo_pg_config(details):
                raise
            build_db(details, args, version)
            how = "with gloo's pg_config rewritten"
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    return list(dict.fromkeys(lines)), how  # each message once: it repeats one per collective


def describe(entry: dict) -> str:
    """'#17 all_reduce [[28576]] Float': sequence number, op, input sizes and dtypes."""
    # "gloo:all_reduce", "nccl:all_reduce": the op, without the backend's prefix
    op = entry["profiling_name"].split(":")[-1]
    dtypes = ",".join(sorted(set(entry.get("input_dtypes") or [])))
    return f"#{entry['collective_seq_id']} {op} {entry['input_sizes']} {dtypes}".rstrip()


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
    """{sequence number: entry} of a rank's collectives in the default group (point-to-point
    ops and other groups' collectives, such as DETAIL's own checks, left out)."""
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
    """The last collective of each rank, by sequence number (who is behind, and in what), and
    the first number at which the ranks' collectives differ in op, sizes or dtypes."""
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


def frames_of(stack: list[str]) -> list[tuple[str, int, str]]:
    """(file, line, function) of each frame of a formatted stack, outermost first."""
    return [(f, int(n), fn) for f, n, fn in FRAME.findall("".join(stack))]


def where_line(rank: int, where: dict | None, dump: dict | None) -> str:
    """'rank 1 (pid 4856, stopped by SIGTERM ...): faults.py:43 inject_fault < ...'."""
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
        analysis, how = torch_analysis(folder)
        # Its first finding without the stack (indented): the series' lines below show that.
        head = [line for line in analysis if not line.startswith(" ")]
        shown = analysis if full else head[:8]
        lines.append(f"torch's analyzer ({how}):")
        lines += [f"  {line}" for line in shown] or ["  no finding"]
        lines.append("by sequence number:")
        lines += sequence_differences(dumps)
        lines += step_differences(dumps, wheres)
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
