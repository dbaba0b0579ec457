"""Fast in-process checks of 05_mingpt's pieces: data order on resume, MFU peaks, the backend
choice, and how snapshots are found and loaded. No process is launched here."""
import atexit
import gc
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from mingpt_helpers import mingpt_imported


@pytest.fixture(scope="module")
def m():
    with mingpt_imported() as modules:
        yield modules


def test_importing_the_package_freezes_the_heap_at_exit(monkeypatch):
    """mingpt/__init__.py: a handler of a process's exit freezes every object, so the
    interpreter's teardown collects none of what torch's import made (about 1 s of CPU per
    rank of a finished run: bench/README.md, Snapshots and start-up)."""
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    with mingpt_imported():  # the package imported afresh
        pass
    assert gc.freeze in registered


def test_rank_indices_equal_distributed_sampler_when_nothing_changes(m):
    # The same order DistributedSampler gives, so runs stay comparable with earlier ones.
    for world_size in (1, 2, 3):
        for rank in range(world_size):
            sampler = DistributedSampler(range(103), num_replicas=world_size, rank=rank,
                                         shuffle=True, seed=7, drop_last=True)
            sampler.set_epoch(2)
            assert m["trainer"].rank_indices(103, 2, 7, 0, rank, world_size) == list(sampler)


@pytest.mark.parametrize("before, after", [(2, 3), (4, 1), (2, 4), (3, 2)])
def test_resume_on_another_world_size_trains_each_sample_once(m, before, after):
    n, seed, epoch = 103, 7, 1
    steps_done, per_step = 3, 4  # 3 steps of 4 samples per rank on `before` ranks
    start = steps_done * per_step * before
    rank_indices = m["trainer"].rank_indices
    trained = [i for r in range(before)
               for i in rank_indices(n, epoch, seed, 0, r, before)[:steps_done * per_step]]
    rest = [rank_indices(n, epoch, seed, start, r, after) for r in range(after)]
    assert len({len(r) for r in rest}) == 1  # every rank gets as many samples
    everything = trained + [i for r in rest for i in r]
    assert len(everything) == len(set(everything))  # nothing twice
    assert len(everything) == start + (n - start) // after * after  # only the tail is dropped


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
    ("NVIDIA H100 80GB HBM3", "fp32", 67e12),  # not the bf16 peak for an fp32 run
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100-SXM4-40GB", "fp32", 19.5e12),
    ("NVIDIA L40", "bf16", 181e12),  # not the L4's 121
    ("NVIDIA L4", "bf16", 121e12),
    ("NVIDIA L40S", "fp16", 362e12),
    ("NVIDIA RTX A1000", "bf16", None),  # not an A100
    ("NVIDIA A10G", "bf16", None),  # not in the table: no MFU rather than a wrong one
    ("Tesla V100-SXM2-16GB", "bf16", None),  # a V100 has no bf16
    ("Tesla V100-SXM2-16GB", "fp16", 125e12),
    (None, "fp32", None),  # a CPU
])
def test_peak_flops_match_whole_names_and_the_precision(m, name, precision, peak):
    assert m["mfu"].peak_flops(name, precision) == peak


def test_cpu_offload_on_a_gpu_gets_gloo_beside_nccl(m):
    backend_for = m["devices"].backend_for
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert backend_for(cuda, cpu_tensors_too=True) == "cuda:nccl,cpu:gloo"
    assert backend_for(cuda) == "nccl"
    assert backend_for(cpu, cpu_tensors_too=True) == backend_for(cpu) == "gloo"


def test_snapshot_directory_without_latest(m, tmp_path):
    snapshot = m["snapshot"]
    # A first sharded save cut off before its commit: no snapshot yet, with a warning.
    (tmp_path / "snap" / "step_00000004").mkdir(parents=True)
    (tmp_path / "snap" / "step_00000004" / "__0_0.distcp").write_bytes(b"partial")
    with pytest.warns(UserWarning, match="no committed snapshot"):
        assert snapshot.snapshot_kind(str(tmp_path / "snap")) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an empty directory is simply no snapshot
        (tmp_path / "empty").mkdir()
        assert snapshot.snapshot_kind(str(tmp_path / "empty")) is None
    # A directory of something else is still refused.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(snapshot.SnapshotError, match="without a 'latest' file"):
        snapshot.snapshot_kind(str(tmp_path / "other"))


def test_snapshots_load_to_the_cpu_and_restore_the_rng_exactly(m, tmp_path):
    shards = m["shards"]
    torch.manual_seed(3)
    np.random.seed(3)
    url = str(tmp_path / "snap.pt")
    shards.save_file(url, {"step": 1, "rng": [m["trainer"].rng_state(torch.device("cpu"))],
                            "w": torch.ones(2)})
    expected = torch.rand(3), np.random.rand(3)
    state = shards.load_file(url)  # no device: a GPU run copies weights over itself
    tensors = [state["w"], state["rng"][0]["torch"], state["rng"][0]["numpy"][1]]
    assert all(t.device.type == "cpu" for t in tensors)
    m["trainer"].set_rng_state(state["rng"][0], torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])


def test_a_crash_before_the_commit_keeps_the_old_snapshot(m, tmp_path):
    shards = m["shards"]
    url = str(tmp_path / "snap.pt")
    shards.save_file(url, {"step": 4})

    def crash() -> None:
        raise KeyboardInterrupt  # stands in for a SIGKILL at this point

    with pytest.raises(KeyboardInterrupt):
        shards.save_file(url, {"step": 8}, before_commit=crash)
    assert shards.load_file(url)["step"] == 4
