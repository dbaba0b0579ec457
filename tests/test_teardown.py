"""No gloo thread may still run when Python exits: a late one aborts a finished job.

gloo runs every collective on a worker thread, which wakes the caller and only then frees the
collective's tensors, taking the GIL for those that have a Python object. If Python is shutting
down by then, the thread is torn out of a C++ destructor: `terminate called without an active
exception`, SIGABRT, after training succeeded (about 1 launch in 100 on a busy 2-core machine).
destroy_process_group joins those threads, but only if it frees the group: nothing else may
still hold it (DDP, FSDP, torch.distributed.nn imported after init, a DeviceMesh).

Two checks, each deterministic, in one launch: no gloo thread is left when Python starts to
shut down (tests/teardown_probe.py), and with gloo's workers made late on purpose by an
LD_PRELOAD shim (tests/late_gloo_worker.c) the launch exits 0. Before the fix the probe failed
every time and the shim made most launches abort (about 1 in 100 without it).
The probe also runs in launches other tests make anyway (no extra launch): steps 02 and 04
(tests/test_steps.py, 02 with the shim too), 03's uninterrupted run, and 05's DDP kill run
(tests/test_mingpt_train.py). Here: 05's FSDP under torch.compile, probe and shim together (a
compiled run holds every reference an eager one does, and dynamo's besides: 10 s less CPU
than an eager launch with the shim beside a compiled one with the probe, the Xeon).
`python tests/stress_teardown.py` launches the real commands many times, without or with the shim.
"""
import subprocess
import sys

import pytest

from conftest import (
    PYTHON,
    TEARDOWN_ABORT,
    TEARDOWN_PROBE,
    TORCHRUN,
    child_env,
    gloo_threads_at_exit,
    run,
)
from mingpt_helpers import copy_mingpt, tiny
from step_helpers import worker_env

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads gloo's thread names from /proc (Linux)")


@linux_only
def test_a_compiled_fsdp_run_with_late_gloo_workers_exits_0_leaving_no_thread(
        tmp_path, late_worker_shim):
    """torchrun, 2 processes, of 05's main.py with FSDP and torch.compile (it samples too), under
    the probe and the shim. dynamo traces, the graphs run eagerly: dynamo's references are what
    teardown must drop (with isinstance() instead of type() in distributed.release, this run
    fails with ReferenceError on either backend); inductor's kernels: test_mingpt_train.py."""
    proc = run([TORCHRUN, "--standalone", "--nproc_per_node=2", TEARDOWN_PROBE, "main.py",
                *tiny("run_name=fsdp", "trainer_config.max_steps=2",
                      "trainer_config.sample_tokens=4", "trainer_config.distributed_method=fsdp",
                      "trainer_config.compile=True")],
               cwd=copy_mingpt(tmp_path), check=False, PROBE_COMPILE_BACKEND="eager",
               LD_PRELOAD=str(late_worker_shim))
    assert TEARDOWN_ABORT not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    counts = gloo_threads_at_exit(proc.stdout)
    assert counts == ["0", "0"], (
        f"gloo threads alive as Python exits, per rank: {counts}. Something still holds the "
        "process group after destroy_process_group (see the module docstring).")


@linux_only
def test_a_refused_run_leaves_no_gloo_thread_either(tmp_path):
    """The error path (exit 2 after the model exists: here a file that is no snapshot, which
    FSDP would read into its shards) releases FSDP and its meshes before
    destroy_process_group, as a finished run does."""
    mingpt = copy_mingpt(tmp_path)
    (mingpt / "bad.pt").write_bytes(b"not a snapshot")
    codes, out, err = ranks(mingpt, [TEARDOWN_PROBE, "main.py", *tiny(
        "run_name=bad", "trainer_config.distributed_method=fsdp",
        "trainer_config.snapshot_path=bad.pt")])
    assert codes == [2, 2] and TEARDOWN_ABORT not in err, err[-3000:]
    assert "error: cannot load snapshot bad.pt" in err, err[-3000:]
    assert sorted(gloo_threads_at_exit(out)) == ["0", "0"], out


def ranks(cwd, argv: list[str], nproc: int = 2) -> tuple[list[int], str, str]:
    """`python ARGV` as each of torchrun's nproc workers, with the variables it sets, each run
    to its own end: every exit status, and their stdout and stderr. Without torchrun's agent,
    which stops the other workers (SIGTERM) once one has failed: a refused run's ranks each
    exit 2, and a rank still in its teardown when the first one exits would never reach the
    probe's line (a run of the whole suite once lost rank 1's)."""
    env = child_env(**{**worker_env(), "WORLD_SIZE": str(nproc),
                       "LOCAL_WORLD_SIZE": str(nproc)})
    logs = [(cwd / f"rank{r}.out", cwd / f"rank{r}.err") for r in range(nproc)]
    procs = []
    for r, (out, err) in enumerate(logs):
        with out.open("w") as o, err.open("w") as e:
            procs.append(subprocess.Popen([PYTHON, *argv], cwd=cwd, stdout=o, stderr=e,
                                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}))
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:  # one that hangs (its peer gone) fails the test, and is stopped
            p.kill()
            p.wait()
    return (codes, "".join(out.read_text() for out, _ in logs),
            "".join(err.read_text() for _, err in logs))
