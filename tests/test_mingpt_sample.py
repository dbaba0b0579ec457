"""sample.py on both snapshot formats, and what it says about trusting them.

A ddp snapshot is one file that torch.load reads with weights_only=True. An fsdp snapshot is a
DCP directory whose `.metadata` torch reads with plain pickle, which can run code: sample.py
says so on stderr (a warning, not an error) whenever it loads one.
"""
import os
import pickle
import shutil

import pytest

from mingpt_helpers import copy_mingpt, mingpt_imported, script_in_process, tiny

WARNING = ("warning: {} is a sharded (DCP) snapshot: its .metadata is read with pickle, which "
           "can run code; load only snapshots you trust")


@pytest.fixture(scope="module")
def modules():
    with mingpt_imported("main") as modules:
        yield modules


@pytest.fixture(scope="module")
def mingpt(tmp_path_factory, modules):
    """A copy of 05_mingpt with a tiny ddp snapshot and a tiny fsdp one (one process each;
    main.py and sample.py run in this process, as `python main.py` / `python sample.py`)."""
    mingpt = copy_mingpt(tmp_path_factory.mktemp("mingpt_sample"))
    for method in ("ddp", "fsdp"):
        done = script_in_process(modules["main"], mingpt, *tiny(
            f"trainer_config.distributed_method={method}", f"run_name={method}",
            "trainer_config.max_steps=2", "trainer_config.warmup_steps=1",
            "trainer_config.log_every=1", "trainer_config.eval_every=0",
            "trainer_config.eval_batches=1", "trainer_config.save_every=0",
            "trainer_config.sample_tokens=0"))
        assert done.returncode == 0, done.stderr
    assert (mingpt / "runs/ddp/snapshot").is_file()
    assert (mingpt / "runs/fsdp/snapshot/latest").is_file()
    return mingpt


def sample(mingpt, path: str, check: bool = True):
    with mingpt_imported() as modules:  # the sample module of the fixture's import
        proc = script_in_process(modules["sample"], mingpt, "--snapshot", path, "--prompt",
                                 "ROMEO:", "--num_tokens", "5")
    assert proc.returncode == 0 or not check, proc.stderr
    return proc


def test_sharded_snapshot_warns_about_pickle(mingpt):
    proc = sample(mingpt, "runs/fsdp/snapshot")
    assert proc.returncode == 0 and proc.stdout.startswith("ROMEO:")
    lines = proc.stderr.splitlines()
    assert lines.count(WARNING.format("runs/fsdp/snapshot")) == 1, proc.stderr
    assert not [line for line in lines if line.startswith("error:")], proc.stderr
    assert "(fsdp, step 2, " in proc.stderr


def test_file_snapshot_has_no_warning(mingpt):
    proc = sample(mingpt, "runs/ddp/snapshot")
    assert proc.returncode == 0 and proc.stdout.startswith("ROMEO:")
    assert "warning:" not in proc.stderr and "pickle" not in proc.stderr, proc.stderr
    assert "(ddp, step 2, " in proc.stderr


class _MakeDir:
    """Unpickling this runs os.mkdir(path): any code could run in its place."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_the_warning_is_true_dcp_metadata_is_unpickled(mingpt, tmp_path):
    # The docs and the warning say that DCP unpickles .metadata. If a torch release stops
    # doing that, this test fails: then the warning and the docs should change.
    tampered = tmp_path / "snapshot"
    shutil.copytree(mingpt / "runs/fsdp/snapshot", tampered)
    step_dir = tampered / (tampered / "latest").read_text().strip()
    marker = tmp_path / "code_ran"
    (step_dir / ".metadata").write_bytes(pickle.dumps(_MakeDir(str(marker))))
    proc = sample(mingpt, str(tampered), check=False)
    assert marker.is_dir()  # loading the snapshot ran os.mkdir
    assert WARNING.format(tampered) in proc.stderr.splitlines()
    # What was unpickled is no DCP metadata, so the load then fails with one error line.
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1].startswith(
        f"error: cannot load sharded snapshot {tampered}"), proc.stderr
