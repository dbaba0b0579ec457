"""Steps 01-04 run as a user runs them (CPU, gloo) and do what their READMEs promise."""
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import PYTHON, REPO, TORCHRUN, child_env, free_port, run

STEPS = ["01_single_gpu", "02_multigpu", "03_torchrun_fault_tolerance", "04_multinode"]


def losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"Loss: ([0-9.]+)", stdout)]


def copy_steps(tmp_path: Path) -> Path:
    """A private copy of the step folders, so commands run as written without touching the repo."""
    for step in STEPS:
        shutil.copytree(REPO / step, tmp_path / step, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def probe(tmp_path: Path, step: str, nproc: int, *args: str, **env: str) -> Path:
    """Train with the step's code under torchrun; return the folder of per-rank final weights."""
    out = tmp_path / f"probe_{step}"
    out.mkdir()
    run([TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", str(REPO / "tests/ddp_probe.py"),
         str(REPO / step), str(out), *args], cwd=tmp_path, **env)
    return out


def test_step01_default_command_learns(tmp_path):
    root = copy_steps(tmp_path)
    proc = run([PYTHON, "01_single_gpu/train.py"], cwd=root)
    loss = losses(proc.stdout)
    assert len(loss) == 50  # the default: 50 epochs
    assert loss[-1] < loss[0] / 5 and loss[-1] < 0.03  # the noise floor is 0.01
    state = torch.load(root / "checkpoint.pt", weights_only=True)
    assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_step02_spawn_learns_and_rank0_alone_logs_and_saves(tmp_path):
    proc = run([PYTHON, str(REPO / "02_multigpu/train.py"), "4", "2", "--nproc", "2"],
               cwd=tmp_path)
    loss = losses(proc.stdout)
    assert len(loss) == 4 and loss[-1] < loss[0]
    assert "Steps: 32" in proc.stdout  # 2048 samples / 2 ranks / batch 32: the data is sharded
    assert proc.stdout.count("checkpoint saved") == 2  # epochs 1 and 3, written once each
    assert (tmp_path / "checkpoint.pt").exists()


def test_step02_torchrun_command_as_written(tmp_path):
    root = copy_steps(tmp_path)
    proc = run([TORCHRUN, "--standalone", "--nproc_per_node=4", "02_multigpu/train.py"], cwd=root)
    loss = losses(proc.stdout)
    assert len(loss) == 50 and loss[-1] < loss[0] / 5
    assert "Steps: 16" in proc.stdout  # 4 ranks share the 64 batches


@pytest.mark.parametrize("step", ["02_multigpu", "04_multinode"])
def test_ddp_ranks_end_identical_and_only_rank0_writes(tmp_path, step):
    args = ["3", "1", "--snapshot_path" if step != "02_multigpu" else "--checkpoint_path", "s.pt"]
    out = probe(tmp_path, step, 2, *args)
    rank0, rank1 = (torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    assert sorted(p.name for p in out.glob("writer_*")) == ["writer_rank0"]
    saved = torch.load(tmp_path / "s.pt", weights_only=True)
    saved = saved.get("MODEL_STATE", saved)
    assert all(torch.equal(saved[k], rank0[k]) for k in rank0)


def test_step03_killed_worker_resumes_bitwise_exact(tmp_path):
    # An uninterrupted run of 6 epochs (through the probe, which also shows both ranks agree)...
    out = probe(tmp_path, "03_torchrun_fault_tolerance", 2, "6", "2", "--snapshot_path", "a.pt")
    rank0, rank1 = (torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    assert sorted(p.name for p in out.glob("writer_*")) == ["writer_rank0"]
    # ...and a run whose last rank is SIGKILLed in the middle of epoch 3, restarted by torchrun.
    proc = run([TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1",
                str(REPO / "03_torchrun_fault_tolerance/train.py"), "6", "2",
                "--snapshot_path", "b.pt"], cwd=tmp_path, FAULT_AT_EPOCH="3")
    assert "FAULT_AT_EPOCH=3: killing this worker" in proc.stdout
    assert f"exitcode: -{int(signal.SIGKILL)}" in proc.stderr
    # Epochs 0 and 1 were snapshotted, so the restart runs 2 (not 1, not 3) next.
    assert "Resuming training from snapshot at epoch 2" in proc.stdout
    after = proc.stdout.split("Resuming training")[-1]
    assert re.findall(r"Epoch (\d+) \| Batchsize", after) == ["2", "3", "4", "5"]
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    b = torch.load(tmp_path / "b.pt", weights_only=True)
    assert a["EPOCHS_RUN"] == b["EPOCHS_RUN"] == 6
    for k in a["MODEL_STATE"]:
        assert torch.equal(a["MODEL_STATE"][k], b["MODEL_STATE"][k]), k
        assert torch.equal(a["MODEL_STATE"][k], rank0[k]), k
    assert a["OPTIMIZER_STATE"]["state"][0]["momentum_buffer"].equal(
        b["OPTIMIZER_STATE"]["state"][0]["momentum_buffer"])


KILL_MID_WRITE = """
import os, signal, sys, torch
sys.path.insert(0, sys.argv[1])
import snapshot
real_save = torch.save
def dying_save(obj, f):
    real_save(obj, f)
    f.truncate(f.tell() // 2)   # half the bytes are out...
    os.kill(os.getpid(), signal.SIGKILL)   # ...when the process dies
snapshot.torch.save = dying_save
snapshot.atomic_save({"EPOCHS_RUN": 99, "MODEL_STATE": {}}, sys.argv[2])
"""


def test_kill_during_snapshot_write_keeps_previous_snapshot(tmp_path):
    step = REPO / "03_torchrun_fault_tolerance"
    run([TORCHRUN, "--standalone", "--nproc_per_node=1", str(step / "train.py"), "2", "1"],
        cwd=tmp_path)
    before = (tmp_path / "snapshot.pt").read_bytes()
    proc = run([PYTHON, "-c", KILL_MID_WRITE, str(step), "snapshot.pt"], cwd=tmp_path,
               check=False)
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / "snapshot.pt.tmp").exists()  # the torn write...
    assert (tmp_path / "snapshot.pt").read_bytes() == before  # ...never reached the snapshot
    proc = run([TORCHRUN, "--standalone", "--nproc_per_node=1", str(step / "train.py"), "3", "1"],
               cwd=tmp_path)
    assert "Resuming training from snapshot at epoch 2" in proc.stdout
    assert torch.load(tmp_path / "snapshot.pt", weights_only=True)["EPOCHS_RUN"] == 3


@pytest.mark.parametrize("content", [b"not a snapshot", None])
def test_corrupt_snapshot_is_an_error_and_is_not_overwritten(tmp_path, content):
    snap = tmp_path / "snapshot.pt"
    if content is None:  # a real snapshot, cut short (as by a full disk)
        torch.save({"MODEL_STATE": {"w": torch.zeros(1000)}}, snap)
        content = snap.read_bytes()[:300]
    snap.write_bytes(content)
    proc = run([TORCHRUN, "--standalone", "--nproc_per_node=1",
                str(REPO / "03_torchrun_fault_tolerance/train.py"), "2", "1"],
               cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "error: cannot load snapshot snapshot.pt" in proc.stderr
    assert snap.read_bytes() == content


def test_snapshot_of_another_script_is_refused(tmp_path):
    torch.save({"0.weight": torch.zeros(64, 20)}, tmp_path / "snapshot.pt")  # a 02 checkpoint
    proc = run([TORCHRUN, "--standalone", "--nproc_per_node=1",
                str(REPO / "03_torchrun_fault_tolerance/train.py"), "2", "1"],
               cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "error: snapshot snapshot.pt lacks MODEL_STATE" in proc.stderr


@pytest.mark.parametrize("step, args, message", [
    ("01_single_gpu", ["0"], "error: argument total_epochs: must be a positive integer, got 0"),
    ("01_single_gpu", ["5", "-2"], "error: argument save_every: must be a positive integer"),
    ("02_multigpu", ["--batch_size", "0"], "error: argument --batch_size: must be a positive"),
    ("02_multigpu", ["--nproc", "512"], "error: --nproc 512 is more than this machine can run"),
    ("02_multigpu", ["--device", "cuda"], "error: --device cuda was requested but no CUDA GPU"),
    ("03_torchrun_fault_tolerance", [], "error: launch with torchrun"),
    ("04_multinode", ["x"], "error: launch with torchrun"),
])
def test_bad_input_is_one_clear_line(tmp_path, step, args, message):
    proc = run([PYTHON, str(REPO / step / "train.py"), *args], cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().startswith(message), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_two_nodes_on_one_machine(tmp_path):
    root = copy_steps(tmp_path)
    proc = run(["bash", "04_multinode/run_two_nodes.sh", "4", "2"], cwd=root,
               PORT=str(free_port()), NPROC="1", PATH=f"{Path(TORCHRUN).parent}:/usr/bin:/bin")
    assert "Steps: 32" in proc.stdout  # two ranks, one per "node", share the data
    assert "[agent 0] [node 0 | local 0 | global 0 | cpu] Epoch 3" in proc.stdout \
        or "[agent 1] [node 0 | local 0 | global 0 | cpu] Epoch 3" in proc.stdout
    assert losses(proc.stdout)[-1] < losses(proc.stdout)[0]
    assert torch.load(root / "snapshot.pt", weights_only=True)["EPOCHS_RUN"] == 4


def test_snapshot_missing_on_one_node_is_an_error(tmp_path):
    """Two nodes without shared storage: the node that sees no snapshot must not start afresh."""
    nodes = [tmp_path / "node_a", tmp_path / "node_b"]
    for n in nodes:
        n.mkdir()
    script = REPO / "04_multinode/train.py"
    run([TORCHRUN, "--standalone", "--nproc_per_node=1", str(script), "1", "1"], cwd=nodes[0])
    port = free_port()
    cmd = [TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv-id=shared-storage-test",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", str(script), "2", "1"]
    procs = [subprocess.Popen(cmd, cwd=n, env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in nodes]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode != 0 for p in procs)
    assert "exists for 1 of 2 ranks: use shared storage" in outs[0][1] + outs[1][1]
    assert torch.load(nodes[0] / "snapshot.pt", weights_only=True)["EPOCHS_RUN"] == 1
