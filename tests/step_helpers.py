"""Run a step's train.py in the test process, as `python train.py` or as torchrun's worker.

A launch costs seconds of interpreter and torch start-up; for the runs that stop at an error or
train an epoch or two, this costs none. What only a real process shows (a kill, the exit of a
finished job, torchrun's agent) stays end to end.
"""
import contextlib
import io
import os
import runpy
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from conftest import REPO, free_port

HELPERS = ("datautils", "devices", "faults", "snapshot")  # the same names in every step folder
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")


def step_in_process(step: str, cwd: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    """`python STEP/train.py ARGV` (with `env`, e.g. torchrun's worker variables) run here by
    runpy; the exit status and output as `subprocess.run` gives them. Python prints a
    SystemExit's text on stderr and exits 1: so does this."""
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd(), dict(os.environ), list(sys.argv), list(sys.path)
    saved = {m: sys.modules.pop(m) for m in HELPERS if m in sys.modules}
    # The steps' helpers share 05's module names: the step's own folder first, as for python.
    sys.path.insert(0, str(REPO / step))
    for var in TORCHRUN_VARS:  # only what this case gives: `python train.py` or one worker
        os.environ.pop(var, None)
    os.environ.update(env)
    sys.argv = [str(REPO / step / "train.py"), *argv]
    os.chdir(cwd)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as conftest.child_env gives a launched command
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(sys.argv[0], run_name="__main__")
            except SystemExit as e:
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        if dist.is_initialized():  # a worker stopped by its error left its group behind
            dist.destroy_process_group()
        torch.set_num_threads(threads)
        os.chdir(old[0])
        os.environ.clear()
        os.environ.update(old[1])
        sys.argv[:], sys.path[:] = old[2], old[3]
        for m in HELPERS:
            sys.modules.pop(m, None)
        sys.modules.update(saved)
    return subprocess.CompletedProcess(sys.argv, code, out.getvalue(), err.getvalue())


def worker_env(port: int | None = None) -> dict[str, str]:
    """The variables torchrun gives the one worker of `--nproc_per_node=1` on a free port."""
    return dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()),
                TORCHELASTIC_RESTART_COUNT="0")
