"""Start main.py under torchrun on this machine: one process per GPU, or a few on a CPU.

    python launch.py                                          # every GPU (or CPU processes)
    python launch.py "trainer_config.distributed_method=fsdp" trainer_config.precision=bf16
    python launch.py --nproc 2 --max_restarts 3 trainer_config.max_steps=2000

Everything that is not a launch.py option is passed on to main.py. The process becomes
torchrun (exec), so signals and the exit code are torchrun's own. The notebooks
(../notebooks/nbutils.py) start their runs with the same functions.
"""
import argparse
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from mingpt.errors import one_line_errors

HERE = Path(__file__).resolve().parent


def on_cpu(overrides: list[str]) -> bool:
    """Whether main.py will train on the CPU: no GPU here, or trainer_config.device=cpu."""
    # A plain look at the overrides, not config.load: every worker composes and checks the
    # config itself, and launch.py needs only this one answer to size the job.
    return "trainer_config.device=cpu" in overrides or not torch.cuda.is_available()


def default_nproc(cpu: bool) -> int:
    """One process per GPU; on a CPU a few processes (at least two, so the collectives really
    run between processes, at most four, as they share the cores)."""
    return max(2, min(4, os.cpu_count() or 1)) if cpu else torch.cuda.device_count()


def process_count(nproc: int | None, cpu: bool) -> int:
    """nproc, or the default for this machine when None; ValueError when below 1."""
    nproc = default_nproc(cpu) if nproc is None else nproc
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    return nproc


def worker_env(nproc: int, cpu: bool, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for torchrun and its workers: `env` (default: ours), and on a CPU the
    thread count, unless the caller set it."""
    env = dict(os.environ if env is None else env)
    if cpu:
        # Processes sharing the CPU: each gets its share of the cores. Not a thread per core in
        # every process (they would fight over the cores), nor torchrun's default when this is
        # unset: 1 thread each, with a warning, leaving cores idle when there are more of them.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def torchrun_command(nproc: int, max_restarts: int, overrides: list[str]) -> list[str]:
    """`torchrun --standalone ... main.py overrides`, as this interpreter's module (so it is the
    torchrun of this environment, venv or notebook kernel)."""
    # --standalone: a rendezvous on this machine at a free port, so no address or port to pick.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
            str(HERE / "main.py"), *overrides]


def main(argv: list[str]) -> None:
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes to start (default: GPUs, else 2 to 4 CPU processes)")
    parser.add_argument("--max_restarts", "--max-restarts", type=int, default=0,
                        help="times torchrun restarts all workers after one fails (default 0)")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for main.py")
    args = parser.parse_args(argv)
    cpu = on_cpu(args.overrides)
    try:
        nproc = process_count(args.nproc, cpu)
    except ValueError as e:
        parser.error(str(e))
    if args.max_restarts < 0:
        parser.error(f"--max_restarts must be >= 0, got {args.max_restarts}")
    overrides = args.overrides
    if not any(o.startswith("run_name=") for o in overrides):
        # A readable run directory (plain torchrun --standalone names it by a random id).
        overrides = [*overrides, f"run_name={time.strftime('%Y-%m-%d_%H-%M-%S')}"]
    command = torchrun_command(nproc, args.max_restarts, overrides)
    print(" ".join(command), flush=True)  # flushed now: execve drops Python's unwritten buffers
    # exec, not a subprocess: Ctrl-C and a scheduler's SIGTERM reach torchrun itself, which
    # stops its workers, and torchrun's exit code is the job's.
    os.execve(sys.executable, command, worker_env(nproc, cpu))


if __name__ == "__main__":
    main(sys.argv[1:])
