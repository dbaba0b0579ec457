"""Kill one worker and count what torchrun's restarts make of it, several tries in a row.

    .venv/bin/python tests/restart_tries.py --target 03 --tries 8

Each try launches the step's restart command as its README writes it, `torchrun --standalone
--nproc_per_node=4 --max-restarts=3 ...`, in the environment a user has: without
TORCH_DISABLE_SHARE_RDZV_TCP_STORE (the other tests set it, conftest.child_env), so the agent
shares its rendezvous store with the workers. The last rank kills itself once (SIGKILL, the
steps' fault injection); the job must come back in one restart and finish. A try that fails
is one whose job did not exit 0 within the time limit, or that needed more than one restart
(each a "failed (exitcode: ...)" line of the agent): a restarted group that cannot form,
"Gloo connectFullMesh failed ... Connection refused", is the crash loop this counts.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# (command after torchrun's options, the fault's variable, the line a resumed rank prints)
TARGETS = {
    # 4 epochs, a snapshot after each; the last rank dies halfway through epoch 2.
    "03": (["03_torchrun_fault_tolerance/train.py", "4", "1"], {"FAULT_AT_EPOCH": "2"},
           "Resuming training from snapshot at epoch 2"),
    "04": (["04_multinode/train.py", "4", "1"], {"FAULT_AT_EPOCH": "2"},
           "Resuming training from snapshot at epoch 2"),
    # 05 with the tiny model of the tests: a snapshot every 2 steps, the kill before step 5.
    "05": (["main.py", "gpt_config.model_type=null", "gpt_config.n_layer=1",
            "gpt_config.n_head=2", "gpt_config.n_embd=16", "gpt_config.block_size=16",
            "trainer_config.max_steps=6", "trainer_config.batch_size=4",
            "trainer_config.save_every=2", "trainer_config.log_every=2",
            "trainer_config.eval_every=0", "trainer_config.sample_tokens=0"],
           {"FAULT_AT_STEP": "5"}, " at step 4 (epoch "),
}
FAILED_ATTEMPT = re.compile(r"failed \(exitcode: (-?\d+)\)")
MESH_FAILURE = "connectFullMesh failed"
# torchrun's own default, for a launch that runs as a user's does: the agent shares its
# rendezvous store with the workers (conftest.child_env sets 1 for the other tests' launches).
SHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}


def attempts(log: str) -> dict:
    """What torchrun's log says of its attempts: the exit code of each failed one (the agent
    logs its first failed worker, once per attempt) and the restarted groups that could not
    form ("connectFullMesh failed")."""
    codes = [int(c) for c in FAILED_ATTEMPT.findall(log)]
    return {"failed_attempts": len(codes), "exit_codes": codes,
            "mesh_failures": log.count(MESH_FAILURE)}


def one_try(target: str, workdir: Path, nproc: int, timeout_s: float) -> dict:
    """One launch of the target's restart command in `workdir`; what became of it."""
    args, fault, resumed = TARGETS[target]
    workdir.mkdir(parents=True, exist_ok=True)
    cwd = REPO / "05_mingpt" if target == "05" else workdir
    script, *rest = args
    if target == "05":  # its run directory and snapshot in the try's own folder
        rest = [*rest, f"run_dir={workdir}/run"]  # its snapshot goes inside
    else:
        script, rest = str(REPO / script), [*rest, "--snapshot_path", str(workdir / "s.pt")]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(fault, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    # A session of its own: a job that hangs is ended whole, torchrun and its workers.
    proc = subprocess.Popen([TORCHRUN, "--standalone", f"--nproc_per_node={nproc}",
                             "--max-restarts=3", script, *rest], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:  # a restarted group that hangs instead of failing
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = "timeout"
    seen = attempts(err)
    # Steps 03 and 04: the epochs rank 0 trained after the last resume line (every rank prints
    # its line before the first epoch's all-reduce, so none comes after an epoch's).
    after = out.split("Resuming training")[-1] if "Resuming training" in out else ""
    return {"exit": code, "seconds": round(time.monotonic() - start, 1), **seen,
            "resumed": resumed in out,
            "epochs_after_resume": [int(e) for e in re.findall(r"Epoch (\d+) \| Batchsize",
                                                                after)],
            # the job came back: one kill, one restart, and it finished
            "recovered": code == 0 and seen["failed_attempts"] == 1 and resumed in out,
            "log_tail": err[-1500:]}


def tries(target: str, n: int, nproc: int = 4, timeout_s: float = 240,
          workdir: Path | None = None) -> list[dict]:
    """`n` tries one after the other, each in a fresh folder under `workdir`."""
    base = Path(workdir or tempfile.mkdtemp(prefix="restart-tries-"))
    results = []
    for i in range(n):
        results.append(one_try(target, base / f"try{i}", nproc, timeout_s))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="03")
    parser.add_argument("--tries", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=240,
                        help="seconds one try may take before it counts as hung")
    args = parser.parse_args()
    results = tries(args.target, args.tries, args.nproc, args.timeout)
    for r in results:  # one line per try, the log tail only for those that failed
        print(json.dumps({k: v for k, v in r.items() if k != "log_tail"}))
    print(f"{sum(r['recovered'] for r in results)} of {len(results)} tries recovered "
          f"(target {args.target}, {args.nproc} processes)")


if __name__ == "__main__":
    main()
