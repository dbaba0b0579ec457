"""Crash storm: SIGKILL random workers of a torchrun job at random moments, many times; the job
must still finish, with the weights of an uninterrupted run, bit for bit.

    .venv/bin/python tests/crash_storm.py --target 03 --kills 15
    .venv/bin/python tests/crash_storm.py --target 05-ddp --kills 15 --seed 1
    .venv/bin/python tests/crash_storm.py --target 05-fsdp --kills 15 --json storm.json

For one target (step 03, or 05_mingpt with DDP or FSDP; 2 CPU processes, gloo) it runs the job
once without faults (the reference), then again under `torchrun --max-restarts=K+2` while a
killer SIGKILLs a random worker at K random points of training, as the OOM killer or a lost
node would: no exception, no `finally`, no clean exit. Each kill lands a random few
milliseconds after the job logged a chosen epoch/step, so some land in the middle of a
snapshot write (counted: the write's temporary file or an uncommitted step directory exists).
After every kill the last committed snapshot must load. At the end the job must have exited 0
and its final snapshot must equal the reference's tensor for tensor (model and optimizer).

Printed per kill and in total: kill -> next training step latency (torchrun noticing the
death, stopping the other worker, starting two fresh Python processes, rendezvous, resume) and
the work lost (epochs or steps trained again). tests/test_crash_storm.py runs a short storm.
"""
import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from conftest import REPO, TORCHRUN, child_env
from mingpt_helpers import copy_mingpt, tiny
from restart_tries import SHARED_STORE, attempts

# Per target: how progress, resumes and snapshots show. 03 counts epochs, 05 optimizer steps
# (log_every=1); each is printed as it ends: 03 numbers epochs from 0, 05 steps from 1.
TARGETS = {
    "03": dict(progress=r"Epoch (\d+) \| Batchsize", resumed=r"from snapshot at epoch (\d+)"),
    "05-ddp": dict(progress=r"^step (\d+)/\d+ \| loss", resumed=r"at step (\d+) \(epoch"),
    "05-fsdp": dict(progress=r"^step (\d+)/\d+ \| loss", resumed=r"at step (\d+) \(epoch"),
}


def command(target: str, length: int, workdir: Path) -> tuple[list[str], Path, Path]:
    """The training command (without torchrun), its working folder and its snapshot path."""
    workdir.mkdir(parents=True, exist_ok=True)
    if target == "03":
        script = REPO / "03_torchrun_fault_tolerance/train.py"
        return [str(script), str(length), "1", "--snapshot_path", "snapshot.pt"], workdir, \
            workdir / "snapshot.pt"
    mingpt = copy_mingpt(workdir)
    method = target.removeprefix("05-")
    args = tiny("run_name=storm", f"trainer_config.distributed_method={method}",
                f"trainer_config.max_steps={length}", "trainer_config.save_every=3",
                "trainer_config.log_every=1", "trainer_config.eval_every=0",
                "trainer_config.sample_tokens=0")
    return ["main.py", *args], mingpt, mingpt / "runs/storm/snapshot"


def final_tensors(snapshot: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a committed snapshot (weights and optimizer state), by flat name."""
    if snapshot.is_dir():  # 05 fsdp: a DCP directory; `latest` names the committed step
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        step_dir = snapshot / (snapshot / "latest").read_text().strip()
        flat = step_dir.parent / f"{step_dir.name}.pt"
        dcp_to_torch_save(step_dir, flat)  # the shards, gathered into one plain file
        state = torch.load(flat, weights_only=True)
        flat.unlink()
    else:
        state = torch.load(snapshot, weights_only=True)
        state = {k: v for k, v in state.items() if k in ("MODEL_STATE", "OPTIMIZER_STATE",
                                                         "model", "optimizer")}
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, obj) -> None:
        if isinstance(obj, torch.Tensor):
            out[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)

    walk("", state)
    return out


def committed_snapshot_loads(snapshot: Path) -> bool:
    """The snapshot a restart would load is whole: the file loads, or `latest` names a
    complete DCP step directory (its .metadata is the last file DCP writes)."""
    if not snapshot.exists():
        return True  # nothing committed yet: a restart starts from step 0, which is correct
    if snapshot.is_dir():
        latest = snapshot / "latest"
        return not latest.exists() or (snapshot / latest.read_text().strip() / ".metadata").exists()
    try:
        torch.load(snapshot, weights_only=True)
        return True
    except Exception:  # any failure to load is what this check is for
        return False


def write_in_progress(snapshot: Path, since: float = 0.0) -> bool:
    """A snapshot write was cut off: its temporary file, or a step directory not yet committed,
    written to at or after `since` (time.time()). What an earlier attempt left unfinished stays
    until the next commit replaces it: that is no write of this attempt."""
    def written_since(path: Path) -> bool:
        files = [path, *path.rglob("*")] if path.is_dir() else [path]
        return max(f.stat().st_mtime for f in files) >= since

    if snapshot.is_dir():
        latest = (snapshot / "latest").read_text().strip() if (snapshot / "latest").exists() \
            else None
        # Older step directories stay (keep_last): only one newer than `latest` is unfinished.
        partial = [p for p in snapshot.iterdir() if p.is_dir() and p.name.startswith("step_")
                   and (latest is None or p.name > latest)]
        partial += list(snapshot.rglob("*.tmp"))
    else:
        partial = [p for p in [snapshot.with_name(snapshot.name + ".tmp")] if p.exists()]
    return any(written_since(p) for p in partial)


def worker_pids(agent: int) -> list[int]:
    """The torchrun agent's children: its worker processes (Linux /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[1]) == agent and fields[0] != "Z":  # ppid, state: not yet reaped
            pids.append(int(stat.parent.name))
    return pids


def reference(target: str, length: int, workdir: Path) -> tuple[dict, float]:
    cmd, cwd, snapshot = command(target, length, workdir)
    start = time.monotonic()
    subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", *cmd], cwd=cwd,
                   env=child_env(), check=True, capture_output=True, text=True, timeout=600)
    return final_tensors(snapshot), time.monotonic() - start


def account(target: str, records: list[dict], lines: list[tuple[float, str]],
            start: float) -> None:
    """Per kill (its time "t", and "restart_t" when the fresh workers were up): the step it
    resumed at, the work lost (finished epochs or steps trained again) and the kill -> next
    training step latency (to the first progress line after the restart), added to its record.
    03's progress lines number epochs from 0: epoch N done means N + 1 epochs done."""
    pattern, resumed = (re.compile(TARGETS[target][k], re.M) for k in ("progress", "resumed"))
    started = 1 if target == "03" else 0
    attempt_start = start
    for rec, following in zip(records, [*records[1:], None], strict=True):
        done = [int(m.group(1)) for t, line in lines if attempt_start <= t <= rec["restart_t"]
                and (m := pattern.search(line))]
        attempt_start = rec["restart_t"]
        # Only this attempt's lines: one that found no snapshot prints no resume line, and the
        # next attempt's must not stand in for it.
        until = following["t"] if following else float("inf")
        after = [(t, line) for t, line in lines if rec["t"] < t < until]
        resume = next(((t, int(m.group(1))) for t, line in after
                       if (m := resumed.search(line))), None)
        rec["resumed_at"] = resume[1] if resume else 0  # no snapshot yet: from the start
        first = next((t for t, line in after if pattern.search(line)
                      and t >= rec["restart_t"] and (resume is None or t >= resume[0])), None)
        rec["latency_s"] = round(first - rec["t"], 2) if first else None
        rec["lost"] = max(0, max(done, default=0) + started - rec["resumed_at"])
        del rec["t"], rec["restart_t"]


def storm(target: str, length: int, kills: int, seed: int, workdir: Path,
          shared_store: bool = False) -> dict:
    """Run the job under the killer; return what happened (see the module docstring).
    `shared_store`: torchrun's agent shares its rendezvous store with the workers, as a user's
    does (restart_tries.SHARED_STORE; the tests' default is a fresh one per attempt)."""
    rng = random.Random(seed)
    pattern = re.compile(TARGETS[target]["progress"], re.M)
    # Distinct points in the first 90 % of training, so every kill leaves work to resume.
    points = sorted(rng.sample(range(1, max(kills + 1, int(length * 0.9))), kills))
    cmd, cwd, snapshot = command(target, length, workdir)
    agent = subprocess.Popen([TORCHRUN, "--standalone", "--nproc_per_node=2",
                              f"--max-restarts={kills + 2}", *cmd], cwd=cwd,
                             env=child_env(**(SHARED_STORE if shared_store else {})),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []  # (time, line) of everything the job printed
    reader = threading.Thread(target=lambda: lines.extend(
        (time.monotonic(), line) for line in agent.stdout), daemon=True)
    reader.start()
    records, seen = [], 0
    start = time.monotonic()
    attempt_began = time.time()  # wall clock, as file times are
    progress = -1
    while agent.poll() is None and points:
        time.sleep(0.002)
        for _, line in lines[seen:]:
            if (m := pattern.search(line)):
                progress = int(m.group(1))
        seen = len(lines)
        if progress < points[0]:
            continue
        pids = worker_pids(agent.pid)
        if len(pids) < 2:  # a restart in progress: wait for the fresh workers
            continue
        time.sleep(rng.uniform(0, 0.05))  # a random moment within the next step or save
        victim = rng.choice(pids)
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed_at = time.monotonic()
        records.append({"point": points.pop(0), "progress": progress, "t": killed_at,
                        "mid_write": write_in_progress(snapshot, since=attempt_began)})
        # torchrun stops the other worker and starts two fresh ones: wait for them, so that
        # nothing the old attempt still printed counts as progress of the new one.
        while agent.poll() is None and len(set(worker_pids(agent.pid)) - set(pids)) < 2:
            time.sleep(0.02)
        records[-1]["restart_t"], attempt_began = time.monotonic(), time.time()
        records[-1]["snapshot_ok"] = committed_snapshot_loads(snapshot)
        seen, progress = len(lines), -1
    agent.wait(timeout=900)
    reader.join(timeout=10)
    wall = time.monotonic() - start
    account(target, records, lines, start)
    return {"exit": agent.returncode, "records": records, "wall_s": round(wall, 1),
            **attempts("".join(line for _, line in lines)),
            "tensors": final_tensors(snapshot) if agent.returncode == 0 else {},
            "log_tail": "".join(line for _, line in lines[-40:])}


def run_storm(target: str, kills: int, seed: int, length: int, workdir: Path,
              ref: dict[str, torch.Tensor] | None = None, shared_store: bool = False) -> dict:
    """Reference, storm, comparison: the summary that the test asserts on and main prints.
    `ref`: the uninterrupted run's final tensors, where the caller has them already;
    `shared_store`: storm()'s."""
    ref_wall = None
    if ref is None:
        ref, ref_wall = reference(target, length, workdir / "reference")
    (workdir / "storm").mkdir()
    result = storm(target, length, kills, seed, workdir / "storm", shared_store)
    tensors = result.pop("tensors")
    same = bool(tensors) and tensors.keys() == ref.keys() and all(
        torch.equal(tensors[k], ref[k]) for k in ref)
    latencies = [r["latency_s"] for r in result["records"] if r["latency_s"] is not None]
    return {"target": target, "kills": len(result["records"]), "seed": seed,
            "exit": result["exit"], "bitwise_equal": same,
            "failed_attempts": result["failed_attempts"],
            "mesh_failures": result["mesh_failures"],
            "reference_wall_s": None if ref_wall is None else round(ref_wall, 1),
            "storm_wall_s": result["wall_s"],
            "mid_write_kills": sum(r["mid_write"] for r in result["records"]),
            "snapshots_always_loadable": all(r["snapshot_ok"] for r in result["records"]),
            "median_latency_s": sorted(latencies)[len(latencies) // 2] if latencies else None,
            "max_latency_s": max(latencies, default=None),
            "lost_per_kill": [r["lost"] for r in result["records"]],
            "records": result["records"], "log_tail": result["log_tail"]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="03")
    parser.add_argument("--kills", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--length", type=int, default=None,
                        help="epochs (03) or steps (05) to train (default: 4 per kill, >= 20)")
    parser.add_argument("--shared-store", action="store_true",
                        help="torchrun's agent shares its store with the workers, as a user's")
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args(argv)
    length = args.length or max(20, 4 * args.kills)
    with tempfile.TemporaryDirectory(prefix="crash_storm_") as tmp:
        summary = run_storm(args.target, args.kills, args.seed, length, Path(tmp),
                            shared_store=args.shared_store)
    log_tail = summary.pop("log_tail")
    for r in summary["records"]:
        print(f"kill at {r['progress']:>3} -> resumed at {r['resumed_at']:>3} (lost {r['lost']}),"
              f" next step after {r['latency_s']} s{' | mid-write' if r['mid_write'] else ''}"
              f"{'' if r['snapshot_ok'] else ' | SNAPSHOT UNREADABLE'}")
    print(json.dumps({k: v for k, v in summary.items() if k != "records"}))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    ok = summary["exit"] == 0 and summary["bitwise_equal"] and summary["snapshots_always_loadable"]
    if not ok:
        print(log_tail, file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
