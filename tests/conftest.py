"""Shared test helpers: every test launches the series' own commands as a user would.

Everything runs on CPU with the gloo backend. Child processes get one intra-op thread each:
the CI machine has two cores and the tests start several processes at once.
"""
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# torchrun installed next to the interpreter running the tests (the venv's own).
TORCHRUN = str(Path(PYTHON).with_name("torchrun"))
TEARDOWN_ABORT = "terminate called without an active exception"
# Runs a training script and prints, per rank, the gloo threads still alive as Python exits
# (tests/test_teardown.py). Launches that other tests make anyway go through it: the check
# costs no launch of its own.
TEARDOWN_PROBE = str(REPO / "tests/teardown_probe.py")


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a launched command: CPU only, one thread, unbuffered output."""
    env = dict(os.environ)
    env.update(
        CUDA_VISIBLE_DEVICES="",  # prove the CPU path even where a GPU exists
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # gloo: restarted worker groups need a fresh store (see 03's README).
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path = REPO, timeout: float = 240, check: bool = True,
        **env: str) -> subprocess.CompletedProcess:
    """Run a command, capture text output; with `check`, fail unless it exited 0, unaborted."""
    proc = subprocess.run(cmd, cwd=cwd, env=child_env(**env), capture_output=True, text=True,
                          timeout=timeout)
    # A gloo thread left running as Python exits aborts the process (tests/test_teardown.py).
    # Never expected, even where torchrun restarted the workers and the launch still exited 0.
    if check and (proc.returncode != 0 or TEARDOWN_ABORT in proc.stderr):
        pytest.fail(f"{cmd} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                    f"\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


def free_port() -> int:
    """A TCP port that is free right now on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_threads_at_exit(stdout: str) -> list[str]:
    """What tests/teardown_probe.py printed: one count per rank, each must be "0"."""
    return re.findall(r"gloo threads at exit: (\d+)", stdout)


@pytest.fixture(scope="session")
def late_worker_shim(tmp_path_factory):
    """tests/late_gloo_worker.c, built: gloo's workers run late (as on a busy machine)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if not sys.platform.startswith("linux") or compiler is None:
        pytest.skip("the late-worker shim needs Linux and a C compiler (cc)")
    shim = tmp_path_factory.mktemp("shim") / "late_gloo_worker.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(shim),
                    str(REPO / "tests/late_gloo_worker.c"), "-ldl"], check=True)
    return shim
