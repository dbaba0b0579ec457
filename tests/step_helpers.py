"""Run a step's train.py in the test process, as `python train.py` or as torchrun's worker, and
the other helpers the steps' tests share: torchrun's variables for a worker, a second rank as a
process beside one in the test process, and the probe launch that dumps each rank's weights.

A launch costs seconds of interpreter and torch start-up; for the runs that stop at an error or
train an epoch or two, this costs none. What only a real process shows (a kill, the exit of a
finished job, torchrun's agent) stays end to end.
"""
import contextlib
import runpy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from conftest import (
    REPO,
    TEARDOWN_PROBE,
    TORCHRUN,
    child_env,
    free_port,
    gloo_threads_at_exit,
    in_process,
    run,
)

HELPERS = ("datautils", "devices", "faults", "snapshot")  # the same names in every step folder
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")


@contextlib.contextmanager
def step_on_path(step: str) -> Iterator[None]:
    """The step's folder first on sys.path, as `python STEP/train.py` has it, with its helpers
    (HELPERS: every step folder and 05 use these names) imported afresh from there; afterwards
    sys.path and those modules are as before."""
    saved = {m: sys.modules.pop(m) for m in HELPERS if m in sys.modules}
    old_path = list(sys.path)
    sys.path.insert(0, str(REPO / step))
    try:
        yield
    finally:
        sys.path[:] = old_path
        for m in HELPERS:
            sys.modules.pop(m, None)
        sys.modules.update(saved)


def step_in_process(step: str, cwd: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    """`python STEP/train.py ARGV` (with `env`, e.g. torchrun's worker variables) run here by
    runpy, through conftest.in_process."""
    script = str(REPO / step / "train.py")
    old_argv = list(sys.argv)
    sys.argv = [script, *argv]
    try:
        with step_on_path(step):
            # TORCHRUN_VARS unset: only what this case gives (`python train.py` or one worker).
            return in_process(lambda: runpy.run_path(script, run_name="__main__"),
                              [script, *argv], cwd, unset=TORCHRUN_VARS, **env)
    finally:
        if dist.is_initialized():  # a worker stopped by its error left its group behind
            dist.destroy_process_group()
        sys.argv[:] = old_argv


def worker_env(port: int | None = None) -> dict[str, str]:
    """The variables torchrun gives the one worker of `--nproc_per_node=1` on a free port."""
    return dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()),
                TORCHELASTIC_RESTART_COUNT="0")


def node_envs(nodes: int) -> list[dict[str, str]]:
    """The variables torchrun gives the one worker of each of `nodes` nodes (one rendezvous)."""
    port = free_port()
    return [{**worker_env(port), "RANK": str(n), "GROUP_RANK": str(n), "WORLD_SIZE": str(nodes)}
            for n in range(nodes)]


@contextlib.contextmanager
def peer_process(cmd: list[str], cwd: Path, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """Another rank, as its own process, beside one that runs in the test process: its output
    goes to files in `cwd` (a pipe no one reads while this process works could fill and block
    it), and it is killed if it still runs when the block ends (an assertion failed)."""
    with open(cwd / "peer.out", "w") as out, open(cwd / "peer.err", "w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=child_env(**env), stdout=out, stderr=err,
                                text=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def probe(tmp_path: Path, step: str, nproc: int, *args: str, **env: str) -> Path:
    """Train with the step's code under torchrun; return the folder of per-rank final weights.

    Through tests/teardown_probe.py too: no gloo thread may be left as each rank's Python exits
    (tests/test_teardown.py)."""
    out = tmp_path / f"probe_{step}"
    out.mkdir()
    proc = run([TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", TEARDOWN_PROBE,
                str(REPO / "tests/ddp_probe.py"), str(REPO / step), str(out), *args],
               cwd=tmp_path, **env)
    assert gloo_threads_at_exit(proc.stdout) == ["0"] * nproc, proc.stdout[-2000:]
    return out
