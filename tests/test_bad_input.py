"""The bad-input matrix: every way a user commonly gets a command of 01-05 wrong ends
with ONE `error:` line on stderr that names the problem and the fix, a non-zero exit, no
traceback, and every file that existed before unchanged. tests/README.md, section "Bad input",
shows the table; `test_readme_lists_the_matrix` keeps the two in step.

Cases another test file already runs are listed in REUSED with that test's name (a check here
makes sure it still exists); they are not launched twice. The rest run here, in this process
wherever they can (runpy for the step scripts, `script_in_process` for 05's): a process start
costs seconds of imports, an in-process run that stops at its error costs almost nothing. Real
processes only for torchrun's own rendezvous. Disk full and read-only folders are tmpfs mounts
(root), skipped with the reason where mounting is not allowed.

The security cases are at the end: a pickled snapshot that would run code is refused.
"""
import contextlib
import hashlib
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, TORCHRUN, child_env, free_port
from mingpt_helpers import copy_mingpt, mingpt_imported, script_in_process, tiny
from step_helpers import step_in_process, worker_env

# Cases that other test files run already: (command as the user types it, the error line's
# start or key words, "file::test" that checks it).
REUSED = [
    ("python main.py trainer_config.foo=1", "error: unknown key trainer_config.foo; allowed in "
     "trainer_config: ...", "test_mingpt_errors.py::test_main_py_config_errors_create_nothing"),
    ("python main.py trainer_config.batch_size=-1", "error: trainer_config.batch_size must be "
     "a positive integer, got -1",
     "test_mingpt_errors.py::test_main_py_config_errors_create_nothing"),
    ("python main.py data_config.path=no/such.txt", "error: data file not found: .../no/such.txt "
     "(set data_config.path)", "test_mingpt_errors.py::test_main_py_missing_data_file"),
    ("python main.py data_config.path=100_chars.txt gpt_config.block_size=8 "
     "trainer_config.grad_accum_steps=6", "error: each rank gets 82 samples per epoch ... one "
     "step needs batch_size × grad_accum_steps = 16 × 6 = 96",
     "test_mingpt_errors.py::test_an_epoch_too_small_for_one_step_is_one_error_line"),
    ("python main.py (snapshot_path: a truncated train_state.pt)", "error: cannot load snapshot "
     "... it is corrupt or not a snapshot: move it away or set trainer_config.snapshot_path",
     "test_mingpt_errors.py::test_corrupt_and_incompatible_snapshots_are_refused_and_kept"),
    ("python main.py distributed_method=fsdp (a truncated shard)", "error: cannot load sharded "
     "snapshot ... it is corrupt; move it away or set trainer_config.snapshot_path",
     "test_mingpt_errors.py::test_corrupt_and_incompatible_snapshots_are_refused_and_kept"),
    ("python main.py gpt_config.n_embd=64 (snapshot of n_embd=32)", "error: snapshot ... holds a "
     "different model (n_embd=32 there, 64 here); set trainer_config.snapshot_path ...",
     "test_mingpt_errors.py::test_corrupt_and_incompatible_snapshots_are_refused_and_kept"),
    ("python prepare.py latin1.txt --out DIR", "error: latin1.txt is not UTF-8 text (byte 9: "
     "b'\\xe9')", "test_mingpt_bpe.py::test_prepare_errors_are_one_line"),
    ("python 02_multigpu/train.py --batch_size 0", "error: argument --batch_size: must be a "
     "positive integer, got 0", "test_steps.py::test_bad_input_is_one_clear_line"),
    ("torchrun ... 03_torchrun_fault_tolerance/train.py (snapshot.pt truncated)", "error: cannot "
     "load snapshot snapshot.pt (...): it is corrupt, truncated or not a snapshot; move it away",
     "test_steps.py::test_corrupt_snapshot_is_an_error_and_is_not_overwritten"),
    ("python xla_main.py trainer_config.distributed_method=tp", "error: "
     "trainer_config.distributed_method must be fsdp with xla_main.py (SPMD FSDP over every XLA "
     "device), got 'tp'", "test_xla.py::test_xla_refuses_what_only_main_py_has"),
    ("python xla_main.py trainer_config.precision=fp16", "error: trainer_config.precision must be "
     "fp32 or bf16 with xla_main.py, got 'fp16'",
     "test_xla.py::test_xla_refuses_what_only_main_py_has"),
    ("python main.py trainer_config.collective_timeout_s=0", "error: "
     "trainer_config.collective_timeout_s must be > 0 (seconds a collective may wait for the "
     "other ranks), got 0.0", "test_mingpt_hang.py::test_debugging_keys_are_checked"),
    ("python main.py trainer_config.profile_steps=-1", "error: trainer_config.profile_steps must "
     "be an integer >= 0 (0: off), got -1", "test_mingpt_hang.py::test_debugging_keys_are_checked"),
    ("python main.py trainer_config.memory_snapshot=true (no GPU)", "error: "
     "trainer_config.memory_snapshot must be False without a CUDA GPU (it records CUDA "
     "allocations; on a CPU, profile_steps shows where time goes), got True",
     "test_mingpt_hang.py::test_debugging_keys_are_checked"),
    ("python export_hf.py runs/r/snapshot hf/mine (hf/mine holds files)", "error: hf/mine exists "
     "and is not empty: give a new or empty directory (nothing there is overwritten)",
     "test_mingpt_export.py::test_bad_input_is_one_error_line_and_writes_nothing"),
    ("python export_hf.py notes.txt hf/mine", "error: cannot load snapshot notes.txt (...): it "
     "is corrupt or not a snapshot",
     "test_mingpt_export.py::test_bad_input_is_one_error_line_and_writes_nothing"),
    ("python export_hf.py runs/r/snapshot hf/mine (gpt_config.bias=false)", "error: "
     "runs/r/snapshot holds a model without biases (gpt_config.bias=false), which GPT-2 "
     "(GPT2LMHeadModel) cannot represent: it has a bias in every Linear and LayerNorm",
     "test_mingpt_export.py::test_models_gpt2_cannot_represent_are_refused"),
]


def test_reused_cases_still_exist():
    for _, _, where in REUSED:
        file, name = where.split("::")
        assert f"def {name}(" in (REPO / "tests" / file).read_text(), f"{where} is gone"


# ---------------------------------------------------------------------------------------------
# What every case checks


def contents(*folders: Path) -> dict[str, str]:
    """Every file under `folders` (caches aside): path -> sha256 of its bytes."""
    found = {}
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """The run failed with exactly one `error:` line holding every fragment, and no traceback."""
    assert proc.returncode not in (0, None), (proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@contextlib.contextmanager
def nothing_lost(*folders: Path):
    """Every file that existed under `folders` before still exists after, byte for byte."""
    before = contents(*folders)
    yield
    after = contents(*folders)
    changed = [path for path, digest in before.items() if after.get(path) != digest]
    assert not changed, f"overwritten or lost: {changed}"


# ---------------------------------------------------------------------------------------------
# Running the commands in this process


@pytest.fixture(scope="module")
def modules():
    with mingpt_imported("main", "launch") as modules:
        yield modules


@pytest.fixture(scope="module")
def mingpt(tmp_path_factory):
    return copy_mingpt(tmp_path_factory.mktemp("bad_input"))


@pytest.fixture
def main_py(modules, mingpt):
    """`python main.py ARGS` in the private 05_mingpt copy, run in this process."""
    return lambda *args, **env: script_in_process(modules["main"], mingpt, *args, **env)


# Trains (with sample_tokens=0 and a short evaluation) in about a second on one CPU core.
QUICK = ("trainer_config.sample_tokens=0", "trainer_config.eval_batches=1",
         "trainer_config.warmup_steps=0", "trainer_config.save_every=0")


@pytest.fixture(scope="module")
def good_snapshot(modules, mingpt):
    """A tiny model trained one step on tiny Shakespeare: snapshot/good in the 05 copy."""
    (mingpt / "snapshot").mkdir()
    proc = script_in_process(modules["main"], mingpt, *tiny(
        "run_name=good", "trainer_config.max_steps=1",
        "trainer_config.snapshot_path=snapshot/good", *QUICK))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return mingpt / "snapshot/good"


# ---------------------------------------------------------------------------------------------
# Mounts: a full disk and a read-only folder, as root


def mount_tmpfs(where: Path, options: str) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip(f"mounting a tmpfs ({options}) needs root and mount(8); "
                    f"running as uid {os.geteuid()}")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mount -t tmpfs -o {options} is not permitted here: {proc.stderr.strip()}")
    return where


@pytest.fixture
def tmpfs(tmp_path):
    """mount(options) -> a fresh tmpfs under tmp_path; unmounted again at the end."""
    mounted = []

    def mount(options: str) -> Path:
        mounted.append(mount_tmpfs(tmp_path / f"tmpfs{len(mounted)}", options))
        return mounted[-1]

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(folder: Path) -> None:
    """Leave (next to) no free space on `folder`'s filesystem."""
    stat = os.statvfs(folder)
    with open(folder / "filler", "wb") as f:
        with contextlib.suppress(OSError):
            f.write(b"\0" * (stat.f_bavail * stat.f_frsize))
    with contextlib.suppress(OSError):  # the last partial page too
        with open(folder / "filler2", "wb") as f:
            f.write(b"\0" * 4096)


@pytest.fixture(scope="module")
def busy_port():
    """A port something else listens on (as another job's would)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Steps 01-04


def test_step02_nproc_zero(tmp_path):
    with nothing_lost(tmp_path):
        proc = step_in_process("02_multigpu", tmp_path, "--nproc", "0")
    one_error_line(proc, "argument --nproc: must be a positive integer, got 0")
    assert list(tmp_path.iterdir()) == []


def test_step01_checkpoint_folder_read_only(tmp_path, tmpfs):
    read_only = tmpfs("ro,size=64k")
    with nothing_lost(tmp_path):
        proc = step_in_process("01_single_gpu", tmp_path, "1", "1", "--checkpoint_path",
                               f"{read_only}/checkpoint.pt")
    one_error_line(proc, f"cannot write {read_only}/checkpoint.pt (Read-only file system)",
                   "pass a writable path")


def test_step01_disk_full_keeps_the_previous_checkpoint(tmp_path, tmpfs):
    disk = tmpfs("size=64k")
    proc = step_in_process("01_single_gpu", tmp_path, "1", "1", "--checkpoint_path",
                           f"{disk}/checkpoint.pt")
    assert proc.returncode == 0, proc.stderr
    fill(disk)
    with nothing_lost(disk, tmp_path):
        proc = step_in_process("01_single_gpu", tmp_path, "2", "1", "--checkpoint_path",
                               f"{disk}/checkpoint.pt")
    one_error_line(proc, f"cannot write {disk}/checkpoint.pt (No space left on device)",
                   "the previous file there, if any, is unchanged", "free some space")
    assert not (disk / "checkpoint.pt.tmp").exists()  # the partial file is gone again


def test_step03_snapshot_of_another_model(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    torch.save({"MODEL_STATE": model.state_dict(), "OPTIMIZER_STATE": {}, "EPOCHS_RUN": 1,
                "RNG_STATES": []}, tmp_path / "snapshot.pt")
    with nothing_lost(tmp_path):
        proc = step_in_process("03_torchrun_fault_tolerance", tmp_path, "2", "1", **worker_env())
    one_error_line(proc, "snapshot snapshot.pt holds another model (0.bias: (32,) there, (64,) "
                   "here): move it away to start afresh")


def test_step03_worker_port_in_use(tmp_path, busy_port):
    with nothing_lost(tmp_path):
        proc = step_in_process("03_torchrun_fault_tolerance", tmp_path, "2", "1",
                               **worker_env(busy_port))
    # torch's own words (train.py's line budget leaves no room to add the fix to them).
    one_error_line(proc, f"port: {busy_port}", "EADDRINUSE", "address already in use")


def test_step02_worker_port_in_use(tmp_path, busy_port):
    with nothing_lost(tmp_path):
        proc = step_in_process("02_multigpu", tmp_path, "1", "1", **worker_env(busy_port))
    one_error_line(proc, f"port: {busy_port}", "EADDRINUSE", "address already in use")


@pytest.fixture(scope="module")
def unreachable_rendezvous(tmp_path_factory):
    """torchrun for a second node whose rendezvous endpoint is a closed port: it gives up after
    read_timeout=2 s instead of torchrun's default 60 s (join_timeout: 600 s)."""
    port = free_port()  # nothing listens there
    start = time.monotonic()
    proc = subprocess.run(
        [TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-conf=is_host=false,read_timeout=2",
         "--rdzv-id=unreachable", str(REPO / "04_multinode/train.py"), "1", "1"],
        cwd=tmp_path_factory.mktemp("rdzv"), env=child_env(), capture_output=True, text=True,
        timeout=90)
    return proc, time.monotonic() - start


def test_step04_unreachable_rendezvous_is_bounded(unreachable_rendezvous):
    proc, seconds = unreachable_rendezvous
    assert proc.returncode != 0 and seconds < 60, (seconds, proc.stderr[-2000:])
    # What the user sees last (torchrun's own words): tests/README.md, "Bad input".
    assert "RendezvousConnectionError: The connection to the C10d store has failed" in \
        proc.stderr.strip().splitlines()[-1]


@pytest.mark.xfail(strict=True, reason=(
    "torchrun's agent fails before any step code runs: its RendezvousConnectionError comes "
    "with torchrun's own traceback, which the series cannot shorten"))
def test_step04_unreachable_rendezvous_one_line(unreachable_rendezvous):
    one_error_line(unreachable_rendezvous[0], "rendezvous")


# ---------------------------------------------------------------------------------------------
# 05_mingpt: config (checked before anything is created)


@pytest.mark.parametrize("args, fragments", [
    (["trainer_config.max_steps=many"], ["trainer_config.max_steps", "Integer"]),
    (["trainer_config.distributed_method=zero3"],
     ["one of ddp, fsdp, zero, tp, fsdp_tp, pp, fsdp_pp, fsdp_tp_pp, dp", "'zero3'"]),
    (["gpt_config.model_type=null", "gpt_config.n_layer=2", "gpt_config.n_head=3",
      "gpt_config.n_embd=32"], ["n_embd (32) must be divisible by n_head (3)"]),
    (["~optimizer_config.lr"], ["optimizer_config.lr has no value (deleted with ~ or set to "
                                "???); give it one: optimizer_config.lr=VALUE"]),
    (["trainer_config.distributed_method=pp", "trainer_config.microbatches=3"],
     ["trainer_config.microbatches must be a divisor of batch_size (16)", "got 3"]),
], ids=["wrong_type", "invalid_strategy", "n_embd_not_divisible_by_n_head", "deleted_key",
        "pp_microbatches"])
def test_mingpt_config(mingpt, main_py, args, fragments):
    with nothing_lost(mingpt):
        proc = main_py(*args, "run_name=config_error")
    one_error_line(proc, *fragments)
    assert not (mingpt / "runs/config_error").exists()


# ---------------------------------------------------------------------------------------------
# 05_mingpt: data


@pytest.mark.parametrize("content, fragments", [
    (b"", ["is empty; set data_config.path to a UTF-8 text file"]),
    ("café au lait\n".encode("latin-1") * 100, ["is not UTF-8 text (byte 3: b'\\xe9'); "
                                                "convert it (iconv -t UTF-8)"]),
    (b"\x1f\x8b\x08\x00" + bytes(range(256)) * 8, ["is not UTF-8 text (byte 1: b'\\x8b')",
                                                   "set data_config.path to a text file"]),
    (b"short text, longer than one block", ["gpt_config.block_size (32) must be smaller than "
                                            "each split", "use a longer text or a smaller"]),
], ids=["empty", "not_utf8", "binary_gzip", "block_size_over_data"])
def test_mingpt_unusable_text(mingpt, main_py, tmp_path, content, fragments):
    data = tmp_path / "data.txt"
    data.write_bytes(content)
    with nothing_lost(mingpt, tmp_path):
        proc = main_py(*tiny(f"data_config.path={data}", "run_name=data_error"))
    one_error_line(proc, f"{data}", *fragments)
    assert not (mingpt / "runs/data_error").exists()  # refused before the run directory


# ---------------------------------------------------------------------------------------------
# 05_mingpt: snapshots, saving, ranks, ports


def test_mingpt_snapshot_of_another_vocabulary(mingpt, main_py, good_snapshot, tmp_path):
    # 65 distinct characters as in tiny Shakespeare, but other ones: the same model shapes.
    text = tmp_path / "cyrillic.txt"
    text.write_text("".join(chr(0x410 + i % 65) for i in range(5000)))
    with nothing_lost(mingpt):
        proc = main_py(*tiny(f"data_config.path={text}", "run_name=vocab",
                             f"trainer_config.snapshot_path={good_snapshot}",
                             "trainer_config.max_steps=2", *QUICK))
    one_error_line(proc, "was trained on different data (itos differs)",
                   "set trainer_config.snapshot_path to a new path")


def test_mingpt_snapshot_folder_read_only(mingpt, main_py, tmpfs):
    read_only = tmpfs("ro,size=64k")
    with nothing_lost(mingpt):
        proc = main_py(*tiny("run_name=read_only", f"trainer_config.snapshot_path={read_only}/s"))
    one_error_line(proc, f"trainer_config.snapshot_path {read_only}/s cannot be written",
                   "Read-only file system", "set trainer_config.snapshot_path to a writable path")
    assert "val loss" not in proc.stdout  # found before any training


def test_mingpt_disk_full_while_saving_keeps_the_snapshot(mingpt, main_py, good_snapshot, tmpfs):
    # Room for the one-step snapshot and a little more, not for a second one beside it.
    size = sum(f.stat().st_size for f in good_snapshot.rglob("*") if f.is_file())
    disk = tmpfs(f"size={size // 1024 + 64}k")
    shutil.copytree(good_snapshot, disk / "snap")
    fill(disk)
    with nothing_lost(mingpt, disk):
        proc = main_py(*tiny("run_name=full", f"trainer_config.snapshot_path={disk}/snap",
                             "trainer_config.max_steps=2", *QUICK))
    one_error_line(proc, f"cannot save the snapshot to {disk}/snap (No space left on device)",
                   "the previous snapshot, if any, is unchanged", "run again to resume")
    assert (disk / "snap/latest").read_text() == "step_00000001"  # step 2 was not committed


def test_mingpt_disk_full_while_saving_a_first_snapshot(mingpt, main_py, tmpfs):
    # DCP's CheckpointException holds the OSError of each rank.
    disk = tmpfs("size=64k")
    with nothing_lost(mingpt):
        proc = main_py(*tiny("run_name=full_fsdp", f"trainer_config.snapshot_path={disk}/snap",
                             "trainer_config.distributed_method=fsdp",
                             "trainer_config.max_steps=1", *QUICK))
    one_error_line(proc, f"cannot save the snapshot to {disk}/snap (No space left on device)")
    assert not (disk / "snap/latest").exists()  # nothing was committed


def test_mingpt_world_size_that_does_not_fit_tp_size(mingpt, main_py):
    with nothing_lost(mingpt):
        proc = main_py(*tiny("run_name=tp", "trainer_config.distributed_method=fsdp_tp",
                             "trainer_config.tp_size=2"))
    one_error_line(proc, "trainer_config.tp_size=2 must divide the world size 1")


def test_mingpt_block_size_that_does_not_split_over_cp_size(mingpt, main_py):
    with nothing_lost(mingpt):
        proc = main_py(*tiny("run_name=cp", "trainer_config.cp_size=2",
                             "gpt_config.block_size=30", "gpt_config.dropout=0.0"))
    one_error_line(proc, "gpt_config.block_size=30 must divide by 2 x cp_size = 4")


def test_mingpt_world_size_that_does_not_fit_cp_size(mingpt, main_py):
    with nothing_lost(mingpt):
        proc = main_py(*tiny("run_name=cp", "trainer_config.cp_size=2",
                             "gpt_config.dropout=0.0"))
    one_error_line(proc, "trainer_config.cp_size=2 must divide the world size 1")


def test_mingpt_port_in_use(mingpt, main_py, busy_port):
    with nothing_lost(mingpt):
        proc = main_py(*tiny("run_name=port"), **worker_env(busy_port))
    one_error_line(proc, f"cannot start the process group at MASTER_ADDR:MASTER_PORT "
                   f"127.0.0.1:{busy_port} (EADDRINUSE: address already in use); free that "
                   "port or give torchrun another --rdzv-endpoint")


def test_mingpt_non_finite_loss_stops_and_keeps_the_snapshot(mingpt, main_py, good_snapshot,
                                                           tmp_path):
    snap = tmp_path / "snap"
    shutil.copytree(good_snapshot, snap)
    with nothing_lost(tmp_path):
        proc = main_py(*tiny("run_name=nan", f"trainer_config.snapshot_path={snap}",
                             "optimizer_config.lr=1e30", "trainer_config.max_steps=3",
                             "trainer_config.log_every=1", *QUICK))
        one_error_line(proc, "loss", "step")


def test_launch_py_nproc_zero(modules, mingpt):
    with nothing_lost(mingpt):
        proc = script_in_process(modules["launch"], mingpt, "--nproc", "0")
    one_error_line(proc, "--nproc must be >= 1, got 0")


def test_sample_py_bad_argument(modules, mingpt):
    proc = script_in_process(modules["sample"], mingpt, "--num_tokens", "-5")
    one_error_line(proc, "--num_tokens must be >= 0, got -5")


# ---------------------------------------------------------------------------------------------
# Security: weights_only=True refuses a snapshot whose unpickling would run code


class _MakeDir:
    """Unpickling this runs os.mkdir(path): any code could run in its place."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


@pytest.fixture
def payload(tmp_path):
    snap, marker = tmp_path / "evil.pt", tmp_path / "code_ran"
    torch.save({"MODEL_STATE": _MakeDir(str(marker)), "OPTIMIZER_STATE": {}, "EPOCHS_RUN": 1,
                "RNG_STATES": [], "step": 1}, snap)
    assert not marker.exists()  # saving ran nothing...
    with open(snap, "rb") as f:  # ...and the file really is a payload: torch.load(weights_only
        torch.load(f, weights_only=False)  # =False) runs it
    assert marker.is_dir()
    marker.rmdir()
    return snap, marker


def test_step03_refuses_a_malicious_snapshot(tmp_path, payload):
    snap, marker = payload
    shutil.copy(snap, tmp_path / "snapshot.pt")
    with nothing_lost(tmp_path):
        proc = step_in_process("03_torchrun_fault_tolerance", tmp_path, "2", "1", **worker_env())
    one_error_line(proc, "cannot load snapshot snapshot.pt (UnpicklingError)")
    assert not marker.exists()


def test_mingpt_main_and_sample_refuse_a_malicious_snapshot(modules, mingpt, main_py, payload):
    snap, marker = payload
    with nothing_lost(mingpt, snap.parent):
        proc = main_py(*tiny("run_name=evil", f"trainer_config.snapshot_path={snap}"))
    one_error_line(proc, f"cannot load snapshot {snap} (UnpicklingError", "it is corrupt or "
                   "not a snapshot")
    assert not marker.exists()
    proc = script_in_process(modules["sample"], mingpt, "--snapshot", str(snap))
    one_error_line(proc, f"cannot load snapshot {snap} (UnpicklingError")
    assert not marker.exists()


KEYS = "AWS_ACCESS_KEY_ID|AWS_SECRET_ACCESS_KEY|AWS_SESSION_TOKEN"


def test_no_code_prints_aws_keys():
    """Credentials come only from the environment, where s3fs/botocore read them: no file of
    the series reads a key variable by its name (settings such as AWS_ENDPOINT_URL are not
    secret) or prints the whole environment, so no key reaches a log. (tests/test_mingpt_s3.py
    checks the output of real S3 runs for the keys.)"""
    for path in sorted([*REPO.glob("0[1-5]_*/*.py"), *REPO.glob("notebooks/*.py")]):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(REPO)}:{n}"
            assert not re.search(rf"(environ\S*|getenv)\(?\[?[\"']({KEYS})", line), \
                f"{where} reads a credential: {line.strip()}"
            assert not re.search(r"print\(.*environ(?!\.get|\[)", line), \
                f"{where} may print the environment: {line.strip()}"


def test_readme_lists_the_matrix():
    """tests/README.md's "Bad input" table: one row per case, each with the error line users
    see, and an **open** row for each case this file marks xfail (so fixing one updates the
    docs)."""
    readme = (REPO / "tests/README.md").read_text()
    section = readme.split("\n## Bad input\n", 1)[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # no header
    assert len(rows) >= 25, f"only {len(rows)} cases in tests/README.md's Bad input table"
    seen = [row.rsplit(" | ", 1)[1] for row in rows]
    assert all(cell.startswith(("`error: ", "**open**")) for cell in seen), seen
    xfails = len(re.findall(r"^@pytest.mark.xfail\(strict=True", Path(__file__).read_text(),
                            re.M))
    assert sum(cell.startswith("**open**") for cell in seen) == xfails
