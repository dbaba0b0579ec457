"""Stress check for the teardown abort: many short launches, and not one may fail or abort.

    .venv/bin/python tests/stress_teardown.py                  # 30 of step 02, 30 of 05 (DDP/FSDP)
    .venv/bin/python tests/stress_teardown.py -n 10 --jobs 3   # three launches at a time: more load
    .venv/bin/python tests/stress_teardown.py --late           # gloo's workers late on purpose

A gloo worker thread still running when Python exits aborts a finished job ("terminate called
without an active exception", SIGABRT), about once in 100 launches on a busy machine; see
tests/test_teardown.py. Each launch here is torchrun with 2 CPU processes: step 02 for 2 epochs,
or 05_mingpt's tiny model for a few steps, alternately DDP and FSDP. `--late` preloads
tests/late_gloo_worker.c, which makes that abort certain wherever a teardown leaves gloo's
threads running. Prints one line per failed launch (its output is kept) and a summary line;
exits 1 if any launch failed. Not collected by pytest (no `test_` prefix).
"""
import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import REPO, TEARDOWN_ABORT, TORCHRUN, child_env  # noqa: E402
from mingpt_helpers import copy_mingpt, tiny  # noqa: E402

MINGPT_ARGS = ("trainer_config.max_steps=3", "trainer_config.sample_tokens=4")


def commands(launches: int, work: Path) -> list[tuple[str, list[str], Path]]:
    """(name, command, working directory) for every launch, 02 and 05 interleaved."""
    mingpt = copy_mingpt(work)
    todo = []
    for i in range(launches):
        step_dir = work / f"02_{i}"
        step_dir.mkdir()
        todo.append(("02", [TORCHRUN, "--standalone", "--nproc_per_node=2",
                            str(REPO / "02_multigpu/train.py"), "2", "1"], step_dir))
        method = ("ddp", "fsdp")[i % 2]
        todo.append((f"05-{method}", [TORCHRUN, "--standalone", "--nproc_per_node=2", "main.py",
                                      *tiny(f"run_name=stress_{i}", *MINGPT_ARGS,
                                            f"trainer_config.distributed_method={method}")],
                     mingpt))
    return todo


def launch(job: tuple[str, list[str], Path], env: dict[str, str], logs: Path, i: int) -> tuple:
    name, cmd, cwd = job
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    aborted = TEARDOWN_ABORT in proc.stderr
    if proc.returncode != 0 or aborted:
        log = logs / f"{i:03d}_{name}.log"
        log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        print(f"launch {i} ({name}): exit {proc.returncode}{', ABORT' if aborted else ''} "
              f"-> {log}", flush=True)
    return name, proc.returncode, aborted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--launches", type=int, default=30,
                        help="launches of step 02, and as many of 05 (default 30)")
    parser.add_argument("--jobs", type=int, default=1, help="launches at a time (default 1)")
    parser.add_argument("--late", action="store_true",
                        help="preload tests/late_gloo_worker.c: gloo's workers run late")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stress_teardown_"))
    logs = work / "failed"
    logs.mkdir()
    env = child_env()
    if args.late:
        shim = work / "late_gloo_worker.so"
        subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-o", str(shim),
                        str(REPO / "tests/late_gloo_worker.c"), "-ldl"], check=True)
        env["LD_PRELOAD"] = str(shim)
    todo = commands(args.launches, work)
    start = time.monotonic()
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(launch, todo, [env] * len(todo), [logs] * len(todo),
                                range(len(todo))))
    per_target = {}
    for name, _, _ in results:
        per_target[name] = per_target.get(name, 0) + 1
    failed = sum(rc != 0 or aborted for _, rc, aborted in results)
    aborts = sum(aborted for _, _, aborted in results)
    targets = ", ".join(f"{name}: {n}" for name, n in sorted(per_target.items()))
    print(f"stress_teardown: {len(results)} launches ({targets}), {failed} failed, {aborts} aborts"
          f"{' [--late]' if args.late else ''}, {args.jobs} at a time, "
          f"{time.monotonic() - start:.0f} s", flush=True)
    if not failed:
        shutil.rmtree(work)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
