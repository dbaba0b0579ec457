"""Steps 01-04 run as a user runs them (CPU, gloo) and do what their READMEs promise."""
import importlib.util
import json
import os
import random
import re
import runpy
import shutil
import signal
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import (
    PYTHON,
    REPO,
    TORCHRUN,
    free_port,
    run,
)
from step_helpers import (
    node_envs,
    peer_process,
    probe,
    step_in_process,
    step_on_path,
    worker_env,
)

STEPS = ["01_single_gpu", "02_multigpu", "03_torchrun_fault_tolerance", "04_multinode"]


def losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"Loss: ([0-9.]+)", stdout)]


def copy_steps(tmp_path: Path) -> Path:
    """A private copy of the step folders, so commands run as written without touching the repo."""
    for step in STEPS:
        shutil.copytree(REPO / step, tmp_path / step, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def import_step(step: str, name: str) -> ModuleType:
    """Import one step's `name`.py in-process. The step folders share helper module names, so
    the helpers imported here are taken out of sys.modules again afterwards."""
    with step_on_path(step):
        spec = importlib.util.spec_from_file_location(f"{step}_{name}", REPO / step / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


@pytest.fixture
def keep_rng():
    """Tests that seed the global RNGs put them back as they found them."""
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    yield
    torch.set_rng_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def draws() -> tuple:
    """The next numbers of the three RNGs a snapshot restores."""
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random()


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


class DevicePicked(Exception):
    """Stops step 02's main once it has asked for a device: no process group is needed."""


@pytest.mark.parametrize("env, rank, gpu", [
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}, 3, 1),  # torchrun: node 1 of 2x2 GPUs
    ({}, 1, 1),  # python train.py: mp.spawn starts every rank on this machine
], ids=["torchrun_second_node", "spawn"])
def test_step02_gpu_index_is_the_local_rank(monkeypatch, env, rank, gpu):
    train = import_step("02_multigpu", "train")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(name, "")  # recorded, so what spawn_rank sets is undone afterwards
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    asked = []

    def recording_pick_device(local_rank: int, requested: str) -> torch.device:
        asked.append((local_rank, requested))
        raise DevicePicked

    monkeypatch.setattr(train, "pick_device", recording_pick_device)
    args = train.parse_args(["--device", "cuda"])
    with pytest.raises(DevicePicked):
        if env:  # as the file's __main__ calls it under torchrun
            train.main(args)
        else:  # as mp.spawn calls it in rank 1's process
            train.spawn_rank(rank, 4, args)
    assert asked == [(gpu, "cuda")]  # cuda:1, not cuda:3 (a node with 2 GPUs has no cuda:3)


def test_step02_torchrun_command_as_written(tmp_path):
    root = copy_steps(tmp_path)
    proc = run([TORCHRUN, "--standalone", "--nproc_per_node=4", "02_multigpu/train.py"], cwd=root)
    loss = losses(proc.stdout)
    assert len(loss) == 50 and loss[-1] < loss[0] / 5
    assert "Steps: 16" in proc.stdout  # 4 ranks share the 64 batches


@pytest.mark.parametrize("step", ["02_multigpu", "04_multinode"])
def test_ddp_ranks_end_identical_and_only_rank0_writes(tmp_path, step, late_worker_shim):
    args = ["3", "1", "--snapshot_path" if step != "02_multigpu" else "--checkpoint_path", "s.pt"]
    # 02 with gloo's workers late on purpose (tests/test_teardown.py): still no abort at exit.
    late = {"LD_PRELOAD": str(late_worker_shim)} if step == "02_multigpu" else {}
    out = probe(tmp_path, step, 2, *args, **late)
    rank0, rank1 = (torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    assert sorted(p.name for p in out.glob("writer_*")) == ["writer_rank0"]
    saved = torch.load(tmp_path / "s.pt", weights_only=True)
    saved = saved.get("MODEL_STATE", saved)
    assert all(torch.equal(saved[k], rank0[k]) for k in rank0)


def tensors_in(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else []
    return [t for item in items for t in tensors_in(item)]


def test_load_snapshot_gives_cpu_tensors_and_set_rng_state_restores_them(tmp_path, keep_rng):
    snapshot = import_step("01_single_gpu", "snapshot")  # the copies are identical (test_docs)
    seed_all(1)
    path = str(tmp_path / "s.pt")
    snapshot.atomic_save({"RNG_STATES": [snapshot.rng_state()], "W": torch.ones(2)}, path)
    expected = draws()
    seed_all(2)
    loaded = snapshot.load_snapshot(path, ("RNG_STATES", "W"))
    assert {t.device for t in tensors_in(loaded)} == {torch.device("cpu")}
    snapshot.set_rng_state(loaded["RNG_STATES"][0])
    assert draws() == expected


def test_rng_state_mapped_off_the_cpu_cannot_be_set(tmp_path):
    """Why snapshots load to the CPU: map_location=cuda:N would move the numpy RNG key too, and
    set_rng_state's .numpy() fails on it. The "meta" device stands in for a GPU here."""
    snapshot = import_step("01_single_gpu", "snapshot")
    torch.save({"RNG_STATES": [snapshot.rng_state()]}, tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", map_location="meta", weights_only=True)
    state = state["RNG_STATES"][0]
    state["torch"] = torch.get_rng_state()  # a GPU tensor's .cpu() works; a meta one has no data
    with pytest.raises(TypeError, match="can't convert meta device type tensor to numpy"):
        snapshot.set_rng_state(state)


@pytest.mark.parametrize("step", ["03_torchrun_fault_tolerance", "04_multinode"])
def test_resume_on_a_non_cpu_device_restores_weights_momentum_and_rng(tmp_path, monkeypatch,
                                                                        keep_rng, step):
    """Trainer._load_snapshot on rank 1 of 2 whose device is not the CPU ("meta" stands in for
    cuda:N): the weights and momentum reach the model and rank 1 gets its own RNG state back."""
    train = import_step(step, "train")
    _, model, optimizer = train.load_train_objs()
    model(torch.randn(4, 20)).sum().backward()
    optimizer.step()  # now there are momentum buffers to save
    rng_states = []
    for seed in (10, 11):  # rank 0's and rank 1's RNG states
        seed_all(seed)
        rng_states.append(train.rng_state())
    expected = draws()  # what rank 1 draws next
    path = str(tmp_path / "snapshot.pt")
    train.atomic_save({"MODEL_STATE": model.state_dict(), "EPOCHS_RUN": 4,
                       "OPTIMIZER_STATE": optimizer.state_dict(), "RNG_STATES": rng_states}, path)
    _, fresh, fresh_optimizer = train.load_train_objs()  # other initial weights, no momentum
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    rank1 = SimpleNamespace(model=SimpleNamespace(module=fresh), optimizer=fresh_optimizer,
                            rank=1, tag="rank 1", device=torch.device("meta"), epochs_run=0)
    train.Trainer._load_snapshot(rank1, path)
    assert draws() == expected
    assert rank1.epochs_run == 4
    loaded = fresh.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        momentum = fresh_optimizer.state[q]["momentum_buffer"]
        assert momentum.device == q.device  # load_state_dict put it next to its parameter
        assert torch.equal(momentum, optimizer.state[p]["momentum_buffer"])


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
    assert step_in_process(step.name, tmp_path, "2", "1", **worker_env()).returncode == 0
    before = (tmp_path / "snapshot.pt").read_bytes()
    proc = run([PYTHON, "-c", KILL_MID_WRITE, str(step), "snapshot.pt"], cwd=tmp_path,
               check=False)
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / "snapshot.pt.tmp").exists()  # the torn write...
    assert (tmp_path / "snapshot.pt").read_bytes() == before  # ...never reached the snapshot
    proc = step_in_process(step.name, tmp_path, "3", "1", **worker_env())
    assert proc.returncode == 0, proc.stderr
    assert "Resuming training from snapshot at epoch 2" in proc.stdout
    assert torch.load(tmp_path / "snapshot.pt", weights_only=True)["EPOCHS_RUN"] == 3


@pytest.mark.parametrize("content", [b"not a snapshot", None])
def test_corrupt_snapshot_is_an_error_and_is_not_overwritten(tmp_path, content):
    snap = tmp_path / "snapshot.pt"
    if content is None:  # a real snapshot, cut short (as by a full disk)
        torch.save({"MODEL_STATE": {"w": torch.zeros(1000)}}, snap)
        content = snap.read_bytes()[:300]
    snap.write_bytes(content)
    proc = step_in_process("03_torchrun_fault_tolerance", tmp_path, "2", "1", **worker_env())
    assert proc.returncode != 0
    assert "error: cannot load snapshot snapshot.pt" in proc.stderr
    assert snap.read_bytes() == content


def test_snapshot_of_another_script_is_refused(tmp_path):
    torch.save({"0.weight": torch.zeros(64, 20)}, tmp_path / "snapshot.pt")  # a 02 checkpoint
    proc = step_in_process("03_torchrun_fault_tolerance", tmp_path, "2", "1", **worker_env())
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
def test_bad_input_is_one_clear_line(tmp_path, monkeypatch, capsys, step, args, message):
    # In this process (no interpreter start per case): `python train.py ARGS` is runpy running
    # the script as __main__, and Python prints a SystemExit's text as the one stderr line.
    monkeypatch.chdir(tmp_path)
    # A private environment: 02 sets MASTER_ADDR/MASTER_PORT before its --nproc check.
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"})
    monkeypatch.setattr(sys, "argv", [str(REPO / step / "train.py"), *args])
    with step_on_path(step), pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(REPO / step / "train.py"), run_name="__main__")
    out = capsys.readouterr()
    assert isinstance(exit_.value.code, str), exit_.value.code  # a message: exit status 1
    assert exit_.value.code.startswith(message), exit_.value.code
    assert len(exit_.value.code.splitlines()) == 1 and out.err == "" and out.out == ""
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


@pytest.mark.timeout(180, method="thread")  # node a waits in C++ (in this process) for node b
def test_snapshot_missing_on_one_node_is_an_error(tmp_path):
    """Two nodes without shared storage: the node that sees no snapshot must not start afresh.
    Node b's worker is a process, node a's runs here (what is checked is the workers' check;
    torchrun's multi-node start: test_two_nodes_on_one_machine)."""
    nodes = [tmp_path / "node_a", tmp_path / "node_b"]
    for n in nodes:
        n.mkdir()
    # Node a's snapshot: its content is never read (the ranks compare what they see first).
    torch.save({"EPOCHS_RUN": 1}, nodes[0] / "snapshot.pt")
    env = node_envs(2)
    with peer_process([PYTHON, str(REPO / "04_multinode/train.py"), "2", "1"], nodes[1],
                      env[1]) as node_b:
        node_a = step_in_process("04_multinode", nodes[0], "2", "1", **env[0])
        node_b.wait(timeout=120)
    assert node_a.returncode != 0 and node_b.returncode != 0
    # Each rank stops with the same one line (no traceback).
    for err in (node_a.stderr, (nodes[1] / "peer.err").read_text()):
        assert [line for line in err.splitlines() if line.startswith("error")] == [
            "error: snapshot.pt exists for 1 of 2 ranks: use shared storage"], err
        assert "Traceback" not in err
    assert torch.load(nodes[0] / "snapshot.pt", weights_only=True)["EPOCHS_RUN"] == 1


# Stands in for srun, scontrol and hostname: records its name, arguments and SRUN_CPUS_PER_TASK.
STUB = """#!{python}
import json, os, sys, time
name = os.path.basename(sys.argv[0])
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps([name, sys.argv[1:], os.environ.get("SRUN_CPUS_PER_TASK")]) + "\\n")
if name == "scontrol":  # show hostnames node-[7-8], one write per line as a long list comes
    for host in ("node-7", "node-8"):
        print(host, flush=True)
        time.sleep(0.2)  # a reader that stops after one line has gone: broken pipe
elif "--ip-address" in sys.argv:  # what Debian's /etc/hosts often gives for the own name
    print("127.0.1.1")
"""


def test_sbatch_script_hands_cpus_to_srun_kills_on_bad_exit_and_meets_at_head_node(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol", "hostname"):
        (bin_dir / name).write_text(STUB.format(python=PYTHON))
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.jsonl"
    proc = run(["bash", "slurm_scripts/sbatch_run.sh", "50", "10"], cwd=REPO,
               PATH=f"{bin_dir}:/usr/bin:/bin", STUB_LOG=str(log), SLURM_JOB_NODELIST="node-[7-8]",
               SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_CPUS_PER_TASK="16",
               SLURM_GPUS_ON_NODE="4")
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [
        ["scontrol", ["show", "hostnames", "node-[7-8]"], "16"],
        ["srun", ["--kill-on-bad-exit=1", "torchrun", "--nnodes=2", "--nproc_per_node=4",
                  "--rdzv-id=4242", "--rdzv-backend=c10d", "--rdzv-endpoint=node-7:29742",
                  "--max-restarts=3", "04_multinode/train.py", "50", "10"], "16"],
    ], proc.stdout
