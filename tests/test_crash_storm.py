"""Step 03 killed in a short crash storm (tests/crash_storm.py: a random worker SIGKILLed at
two random points): the job finishes with the uninterrupted run's weights and momentum, bit for
bit; the storm's accounting has unit tests. It runs on torchrun's shared store, as a user's job
does: each of its restarts is a check of restarts.py (tests/README.md, "Restarts"). The one
kill its README shows (FAULT_AT_EPOCH, the README's command) is test_restarts.py's: the restart
trains the epochs after the snapshot.

The long storms (15 kills, step 03 and 05 with DDP and FSDP) run from the command line; their
measured figures are in tests/README.md, section "Crash storms".
"""
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import PYTHON, REPO, TEARDOWN_ABORT, TEARDOWN_PROBE, child_env
from crash_storm import account, final_tensors, run_storm, write_in_progress
from step_helpers import node_envs, probe

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="finds torchrun's workers in /proc (Linux)")


def test_step03_killed_worker_resumes_bitwise_exact_in_a_storm(tmp_path):
    # An uninterrupted run of 10 epochs (through the probe, which also shows both ranks agree).
    out = probe(tmp_path, "03_torchrun_fault_tolerance", 2, "10", "2", "--snapshot_path", "a.pt")
    rank0, rank1 = (torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    assert sorted(p.name for p in out.glob("writer_*")) == ["writer_rank0"]
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    assert a["EPOCHS_RUN"] == 10
    assert all(torch.equal(a["MODEL_STATE"][k], rank0[k]) for k in a["MODEL_STATE"])

    # The storm snapshots every epoch; the uninterrupted run above, every second one: how often
    # a run saves must not change what it computes either, so that run is the storm's reference.
    # Seed 1 kills after epochs 3 and 5: four epochs are left to train after the second kill.
    summary = run_storm("03", kills=2, seed=1, length=10, workdir=tmp_path,
                        ref=final_tensors(tmp_path / "a.pt"), shared_store=True)
    assert summary["exit"] == 0, summary["log_tail"]
    assert summary["kills"] == 2
    # Each kill cost one attempt, and each restarted group formed at once on the shared store.
    assert (summary["failed_attempts"], summary["mesh_failures"]) == (2, 0), summary["log_tail"]
    assert summary["bitwise_equal"]  # weights and momentum, tensor for tensor
    assert summary["snapshots_always_loadable"]
    # Every kill was followed by a restart that trained again, having to redo at most one
    # finished epoch (03 saves every epoch: one whose save the kill cut off).
    assert all(r["latency_s"] is not None for r in summary["records"]), summary["records"]
    assert all(0 <= lost <= 1 for lost in summary["lost_per_kill"]), summary["records"]


def test_the_rank_whose_peer_died_leaves_no_gloo_thread_behind(tmp_path):
    """The other side of a kill: the surviving rank's collective fails ("Connection reset by
    peer") and it exits with Python's traceback and status 1, having destroyed its process
    group. A group left alive keeps gloo's threads running as Python shuts down, which can
    abort the process ("terminate called without an active exception"; seen in the run above
    on a busy machine, when rank 0 saw the reset before torchrun stopped it). No torchrun here,
    so nothing stops rank 0 before it handles the error: the probe counts gloo's threads at
    exit every time. Step 03's train.py: 04's differs from it only in its start-up check of
    the shared snapshot and its log tags (`diff 03_torchrun_fault_tolerance/train.py
    04_multinode/train.py`), and their helpers are byte-identical copies (test_docs.py), so the
    failure path is the same."""
    cmd = [PYTHON, TEARDOWN_PROBE, str(REPO / "03_torchrun_fault_tolerance/train.py"), "3", "1",
           "--snapshot_path", "s.pt"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=child_env(**env, FAULT_AT_EPOCH="1"))
             for env in node_envs(2)]
    (out0, err0), (_, err1) = (proc.communicate(timeout=120) for proc in procs)
    assert procs[1].returncode == -signal.SIGKILL, err1[-2000:]  # rank 1 killed itself
    assert procs[0].returncode == 1 and "RuntimeError" in err0, err0[-2000:]
    assert "[rank 0] gloo threads at exit: 0" in out0 and TEARDOWN_ABORT not in err0, \
        (out0[-500:], err0[-2000:])


def test_a_kill_before_the_first_snapshot_is_timed_on_its_own_restart():
    """The first attempt is killed at step 2, before any snapshot: its restart trains from step
    0 and prints no resume line. The next attempt's resume line (killed at 13, resumed at 12)
    must not be taken for it."""
    lines = [(0.5, "step 1/30 | loss 4.1\n"), (0.6, "step 2/30 | loss 4.0\n"),
             (3.6, "step 1/30 | loss 4.1\n"), (3.7, "step 12: snapshot saved\n"),
             (3.8, "step 13/30 | loss 3.3\n"),
             (7.0, "resumed from snapshot at step 12 (epoch 0)\n"), (7.5, "step 13/30 | loss 3\n")]
    records = [{"t": 1.0, "restart_t": 1.5}, {"t": 4.0, "restart_t": 4.5}]
    account("05-ddp", records, lines, start=0.0)
    assert [(r["resumed_at"], r["lost"], r["latency_s"]) for r in records] == [
        (0, 2, 2.6), (12, 1, 3.5)]


def test_older_kept_step_directories_are_not_a_write_in_progress(tmp_path):
    snapshot = tmp_path / "snapshot"
    for step in (3, 6):  # keep_last=2: the committed step and the one before it
        (snapshot / f"step_{step:08d}").mkdir(parents=True)
    (snapshot / "latest").write_text("step_00000006")
    assert not write_in_progress(snapshot)
    (snapshot / "step_00000009").mkdir()  # being written: `latest` does not name it yet
    assert write_in_progress(snapshot)
    # Left unfinished by an attempt before the one that began now: not this attempt's write.
    assert not write_in_progress(snapshot, since=time.time() + 1)
