"""No gloo thread may still run when Python exits: a late one aborts a finished job.

gloo runs every collective on a worker thread, which wakes the caller and only then frees the
collective's tensors, taking the GIL for those that have a Python object. If Python is shutting
down by then, the thread is torn out of a C++ destructor: `terminate called without an active
exception`, SIGABRT, after training succeeded (about 1 launch in 100 on a busy 2-core machine).
destroy_process_group joins those threads, but only if it frees the group: nothing else may
still hold it (DDP, FSDP, torch.distributed.nn imported after init, a DeviceMesh).

Two checks, each deterministic: no gloo thread is left when Python starts to shut down
(tests/teardown_probe.py), and with gloo's workers made late on purpose by an LD_PRELOAD shim
(tests/late_gloo_worker.c) the launch exits 0. Before the fix both failed every time.
`python tests/stress_teardown.py` launches the real commands many times, without or with the shim.
"""
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, TEARDOWN_ABORT, TORCHRUN, run
from mingpt_helpers import copy_mingpt, tiny

STEP_ARGS = ["1", "1"]  # one epoch, one snapshot
MINGPT_ARGS = ("trainer_config.max_steps=2", "trainer_config.sample_tokens=4")  # FSDP samples too
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads gloo's thread names from /proc (Linux)")


def launch(tmp_path, target: str, *prefix: str, **env: str):
    """torchrun, 2 processes, of a step's train.py or of 05's main.py (`05-ddp`, `05-fsdp`,
    `05-fsdp-compile`)."""
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", *prefix]
    if target.startswith("05-"):
        method, *compile_ = target.removeprefix("05-").split("-")
        overrides = [f"trainer_config.distributed_method={method}",
                     *(["trainer_config.compile=True"] if compile_ else [])]
        return run([*cmd, "main.py", *tiny(f"run_name={method}", *MINGPT_ARGS, *overrides)],
                   cwd=copy_mingpt(tmp_path), check=False, **env)
    return run([*cmd, str(REPO / target / "train.py"), *STEP_ARGS], cwd=tmp_path, check=False,
               **env)


def assert_clean_exit(proc) -> None:
    assert TEARDOWN_ABORT not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@linux_only
@pytest.mark.parametrize("target", ["02_multigpu", "03_torchrun_fault_tolerance", "04_multinode",
                                    "05-ddp", "05-fsdp", "05-fsdp-compile"])
def test_no_gloo_thread_is_left_at_exit(tmp_path, target):
    proc = launch(tmp_path, target, str(REPO / "tests/teardown_probe.py"))
    assert_clean_exit(proc)
    counts = re.findall(r"gloo threads at exit: (\d+)", proc.stdout)
    assert counts == ["0", "0"], (
        f"gloo threads alive as Python exits, per rank: {counts}. Something still holds the "
        "process group after destroy_process_group (see the module docstring).")


@pytest.fixture(scope="module")
def late_worker_shim(tmp_path_factory):
    """tests/late_gloo_worker.c, built: gloo's workers run late (as on a busy machine)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if not sys.platform.startswith("linux") or compiler is None:
        pytest.skip("the late-worker shim needs Linux and a C compiler (cc)")
    shim = tmp_path_factory.mktemp("shim") / "late_gloo_worker.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(shim),
                    str(REPO / "tests/late_gloo_worker.c"), "-ldl"], check=True)
    return shim


@pytest.mark.parametrize("target", ["02_multigpu", "05-fsdp"])
def test_late_gloo_worker_cannot_abort_a_finished_run(tmp_path, target, late_worker_shim):
    assert_clean_exit(launch(tmp_path, target, LD_PRELOAD=str(late_worker_shim)))


@linux_only
def test_a_refused_run_leaves_no_gloo_thread_either(tmp_path):
    """The error path (exit 2 after the model exists: here a ddp snapshot where FSDP expects shards) releases
    FSDP and its meshes before destroy_process_group, as a finished run does."""
    mingpt = copy_mingpt(tmp_path)
    (mingpt / "bad.pt").write_bytes(b"not a snapshot")
    proc = run([TORCHRUN, "--standalone", "--nproc_per_node=2", str(REPO / "tests/teardown_probe.py"),
                "main.py", *tiny("run_name=bad", "trainer_config.distributed_method=fsdp",
                                 "trainer_config.snapshot_path=bad.pt")],
               cwd=mingpt, check=False)
    assert TEARDOWN_ABORT not in proc.stderr, proc.stderr[-3000:]
    assert "error: bad.pt holds a ddp snapshot" in proc.stderr, proc.stderr[-3000:]
    assert re.findall(r"gloo threads at exit: (\d+)", proc.stdout) == ["0", "0"], proc.stdout
