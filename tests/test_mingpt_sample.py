"""sample.py on any layout's snapshot (and an older run's one file), and why it can trust them.

A snapshot is a DCP directory whose tensors torch.load reads with weights_only=True. DCP
pickles its index (.metadata) and its non-tensor values (an optimizer's lr, betas, names), and
storage.load_dcp reads them as safely: code a tampered pickle names never runs, and the load
ends in one error line.
"""
import os
import pickle
import shutil

import pytest

from mingpt_helpers import copy_mingpt, mingpt_imported, read_snapshot, script_in_process, tiny


@pytest.fixture(scope="module")
def modules():
    with mingpt_imported("main") as modules:
        yield modules


@pytest.fixture(scope="module")
def mingpt(tmp_path_factory, modules):
    """A copy of 05_mingpt with a tiny ddp snapshot and a tiny fsdp one (one process each;
    main.py and sample.py run in this process, as `python main.py` / `python sample.py`), and
    the ddp one as an older run wrote it: one file (runs/ddp.pt)."""
    mingpt = copy_mingpt(tmp_path_factory.mktemp("mingpt_sample"))
    for method in ("ddp", "fsdp"):
        done = script_in_process(modules["main"], mingpt, *tiny(
            f"trainer_config.distributed_method={method}", f"run_name={method}",
            "trainer_config.max_steps=2", "trainer_config.warmup_steps=1",
            "trainer_config.log_every=1", "trainer_config.eval_every=0",
            "trainer_config.eval_batches=1", "trainer_config.save_every=0",
            "trainer_config.sample_tokens=0"))
        assert done.returncode == 0, done.stderr
    assert (mingpt / "runs/ddp/snapshot/latest").is_file()  # one format for every layout
    assert (mingpt / "runs/fsdp/snapshot/latest").is_file()
    modules["shards"].save_file(str(mingpt / "runs/ddp.pt"),
                                 read_snapshot(mingpt / "runs/ddp/snapshot"))
    return mingpt


def sample(mingpt, path: str, check: bool = True):
    with mingpt_imported() as modules:  # the sample module of the fixture's import
        proc = script_in_process(modules["sample"], mingpt, "--snapshot", path, "--prompt",
                                 "ROMEO:", "--num_tokens", "5")
    assert proc.returncode == 0 or not check, proc.stderr
    return proc


def test_sharded_snapshot_samples_without_a_warning(mingpt):
    proc = sample(mingpt, "runs/fsdp/snapshot")
    assert proc.returncode == 0 and proc.stdout.startswith("ROMEO:")
    assert "warning:" not in proc.stderr and "error:" not in proc.stderr, proc.stderr
    assert "(dcp, step 2, " in proc.stderr


def test_an_older_one_file_snapshot_samples_as_its_directory_does(mingpt):
    file, directory = sample(mingpt, "runs/ddp.pt"), sample(mingpt, "runs/ddp/snapshot")
    assert file.stdout.startswith("ROMEO:") and file.stdout == directory.stdout
    assert "warning:" not in file.stderr and "pickle" not in file.stderr, file.stderr
    assert "(file, step 2, " in file.stderr and "(dcp, step 2, " in directory.stderr


class _MakeDir:
    """Unpickling this runs os.mkdir(path): any code could run in its place."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_a_tampered_dcp_index_is_refused_before_its_code_runs(mingpt, tmp_path):
    # torch's own reader unpickles .metadata with plain pickle: this pickle would make the
    # directory (an earlier sample.py did, and said so in a warning).
    tampered = tmp_path / "snapshot"
    shutil.copytree(mingpt / "runs/fsdp/snapshot", tampered)
    step_dir = tampered / (tampered / "latest").read_text().strip()
    marker = tmp_path / "code_ran"
    (step_dir / ".metadata").write_bytes(pickle.dumps(_MakeDir(str(marker))))
    proc = sample(mingpt, str(tampered), check=False)
    assert not marker.exists()
    last = proc.stderr.splitlines()[-1]  # DCP's own wording around ours
    assert proc.returncode == 2 and last.startswith(
        f"error: cannot load sharded snapshot {tampered} (") and \
        "posix.mkdir is not a DCP metadata class" in last, proc.stderr


def test_a_tampered_value_in_the_shards_is_refused_before_its_code_runs(modules, tmp_path):
    """DCP writes a non-tensor value (an lr, the betas) as a pickle among the shards; one that
    names code is refused by weights_only=True, and the real values load (SafePlanner)."""
    import torch  # noqa: PLC0415
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415

    from mingpt import storage  # noqa: PLC0415
    marker = tmp_path / "code_ran"
    for name, value in (("good", (0.9, 0.95)), ("bad", _MakeDir(str(marker)))):
        dcp.save({"lr": 0.001, "betas": value, "w": torch.ones(2)},
                 checkpoint_id=tmp_path / name, no_dist=True)
    state = {"lr": None, "betas": None, "w": torch.zeros(2)}
    storage.load_dcp(state, str(tmp_path / "good"), no_dist=True)
    assert state == {"lr": 0.001, "betas": (0.9, 0.95), "w": state["w"]}
    assert state["w"].tolist() == [1.0, 1.0]
    # DCP reports a rank's failure as a CheckpointException (a BaseException) naming it.
    with pytest.raises(CheckpointException, match="unsupported GLOBAL posix.mkdir"):
        storage.load_dcp({"lr": None, "betas": None, "w": torch.zeros(2)},
                         str(tmp_path / "bad"), no_dist=True)
    assert not marker.exists()
