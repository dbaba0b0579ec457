"""A snapshot save or load that fails on one rank stops every rank with the same one `error:`
line, naming that rank and the file, within seconds; the snapshot before it stays, and still
resumes bit for bit.

Two ranks, as two one-worker "nodes" of one job on this machine (rank 0 in this process, rank
1 in its own, forked: mingpt_helpers.forked_peer), so that each prints its own node's line:
the two lines must be the same, which shows that both ranks stopped on the agreed error rather
than one on its own and the other on its absence (before: rank 0's failed commit, or a write
of its file, left rank 1 in the next collective: gloo's "Connection closed by peer" there, a
second `error:` line; on NCCL, a wait of the collective timeout). The faults are injected on
one rank only (mingpt/faults.py, FAULT_WRITE_ERROR / FAULT_READ_ERROR), or are real: a shard
file deleted.
"""
import hashlib
import json
import os
import re
import shutil
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import TORCHRUN, run
from mingpt_helpers import (
    _ForkedStaging,
    copy_mingpt,
    forked_peer,
    join_world,
    main_job,
    mingpt_imported,
    script_in_process,
    spawn_world,
    start_world,
    tiny,
)
from step_helpers import node_envs
from test_mingpt_strategies import run as train_in_world

# The bound from the fault to the exit of every rank: the agreement is one
# all_gather_object, but this machine is a loaded 2-core one.
BOUND_S = 30
ARGS = ("trainer_config.max_steps=6", "trainer_config.save_every=3", "trainer_config.keep_last=2",
        "trainer_config.sample_tokens=0",
        # Before the fix, rank 1 waited in its next collective: bounded here, for the test.
        "trainer_config.collective_timeout_s=60")


@pytest.fixture(scope="module")
def mingpt(tmp_path_factory):
    return copy_mingpt(tmp_path_factory.mktemp("snapshot_faults"))


def two_ranks(mingpt_modules, mingpt: Path, *args: str, **env: str) -> dict:
    """main.py on 2 ranks, each the one worker of its node; the outputs, exit codes, the
    fault's time (where one was injected) and when the last rank ended."""
    envs = node_envs(2)
    args = tiny(*args, *ARGS)
    with forked_peer(mingpt, "main.py", args, {**envs[1], **env}) as peer:
        a = script_in_process(mingpt_modules["main"], mingpt, *args, **envs[0], **env)
        peer.wait(timeout=240)
        ended = time.time()
    b_out, b_err = ((mingpt / f"peer.{kind}").read_text() for kind in ("out", "err"))
    fault = re.search(r"^\[rank \d\] FAULT_\w+=.* at ([0-9.]+)$", a.stdout + b_out, re.M)
    return {"codes": (a.returncode, peer.returncode), "stdout": (a.stdout, b_out),
            "stderr": (a.stderr, b_err), "fault": fault and float(fault[1]), "ended": ended}


def agreed_error_line(run: dict) -> str:
    """Both ranks exited 2 with one and the same `error:` line (each its node's), no traceback,
    within BOUND_S of the fault."""
    assert run["codes"] == (2, 2), run
    lines = [[line for line in err.splitlines() if line.strip()] for err in run["stderr"]]
    assert all(len(own) == 1 and own[0].startswith("error: ") for own in lines), run["stderr"]
    assert lines[0] == lines[1], lines
    assert "Traceback" not in "".join(run["stderr"] + run["stdout"])
    if run["fault"] is not None:  # an injected fault says when it struck (a deleted file not)
        assert run["ended"] - run["fault"] < BOUND_S, run["ended"] - run["fault"]
    return lines[0][0]


def digests(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def dcp_tensors(step_dir: Path, tmp_path: Path) -> dict:
    """Every tensor of a DCP checkpoint (weights and AdamW state), by its key."""
    out = tmp_path / f"{hashlib.sha256(str(step_dir).encode()).hexdigest()[:16]}.pt"
    dcp_to_torch_save(step_dir, out)
    return torch.load(out, weights_only=True)


def assert_bitwise(a: object, b: object, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bitwise(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


FSDP = "trainer_config.distributed_method=fsdp"


@pytest.fixture(scope="module")
def fsdp_ref(mingpt_modules, mingpt) -> Path:
    """The reference: 6 steps without a fault, blocking saves at steps 3 and 6 (keep_last=2)."""
    ref = two_ranks(mingpt_modules, mingpt, FSDP, "run_name=ref")
    assert ref["codes"] == (0, 0), ref
    return mingpt / "runs/ref/snapshot"


def previous(ref_snap: Path, snap: Path) -> Path:
    """What a run cut off after step 3's commit leaves: the previous snapshot of every case."""
    shutil.copytree(ref_snap, snap, ignore=shutil.ignore_patterns("step_00000006"))
    (snap / "latest").write_text("step_00000003")
    return snap


def assert_same_snapshot(step_dir: Path, ref_dir: Path, tmp_path: Path) -> None:
    """Weights, AdamW's state, torch's RNG streams and the schedule, bit for bit. (NumPy's
    and Python's streams are saved too, but nothing seeds them: each process starts its own.)"""
    assert_bitwise(dcp_tensors(step_dir, tmp_path), dcp_tensors(ref_dir, tmp_path))
    states = [torch.load(d / "train_state.pt", weights_only=True) for d in (step_dir, ref_dir)]
    assert_bitwise(*[{"step": state["step"], "scheduler": state["scheduler"],
                      "torch": [rng["torch"] for rng in state["rng"]]} for state in states])


@pytest.mark.timeout(1200, method="thread")  # rank 0 runs in this process
def test_sharded_save_and_load_faults_on_one_rank_stop_every_rank_slowest(
        mingpt_modules, mingpt, fsdp_ref, tmp_path):
    fsdp, ref_snap = FSDP, fsdp_ref
    snap = previous(ref_snap, tmp_path / "snapshot")
    before = digests(snap / "step_00000003")

    def fault(run_name: str, url: Path = snap, **env: str) -> str:
        line = agreed_error_line(two_ranks(mingpt_modules, mingpt, fsdp, f"run_name={run_name}",
                                           f"trainer_config.snapshot_path={url}", **env))
        assert (snap / "latest").read_text() == "step_00000003"  # nothing was committed
        assert digests(snap / "step_00000003") == before
        return line

    saving = f"cannot save the snapshot to {snap} (Input/output error: "
    kept = "); the previous snapshot, if any, is unchanged"
    # Rank 1's shard write: DCP hands its exception to every rank, which name it.
    assert fault("shard", FAULT_WRITE_ERROR="1:shard") == \
        f"error: rank 1: {saving}{snap}/step_00000006/__1_0.distcp{kept}: free some space or " \
        "set trainer_config.snapshot_path, then run again to resume"
    # Rank 0's train_state.pt, then its commit: rank 1 waited for them in a barrier.
    host = r"rank 0 on [^:]+: "
    assert re.fullmatch(f"error: {host}{re.escape(saving)}.*/step_00000006/train_state.pt"
                        f"{re.escape(kept)}.*", fault("train_state", FAULT_WRITE_ERROR="0:file"))
    assert re.fullmatch(f"error: {host}{re.escape(f'{saving}{snap}/latest{kept}')}.*",
                        fault("commit", FAULT_WRITE_ERROR="0:latest"))
    # Loads: rank 1 cannot read train_state.pt (its node's copy is missing); rank 0 used to
    # wait for it in the all_gather that follows.
    assert re.fullmatch(
        rf"error: rank 1 on [^:]+: cannot load snapshot {snap}/step_00000003/train_state.pt "
        r"\(FileNotFoundError: .*\): it is corrupt or not a snapshot: move it away or set "
        "trainer_config.snapshot_path", fault("train_state_read", FAULT_READ_ERROR="1:file"))
    # A shard rank 1 wrote is missing (deleted, in a copy of the snapshot): both ranks read
    # from it (rank 0 the entries DCP saved once), DCP hands each rank both failures.
    damaged = tmp_path / "damaged"
    shutil.copytree(snap, damaged)
    (damaged / "step_00000003/__1_0.distcp").unlink()
    assert fault("missing_shard", damaged) == (
        f"error: cannot load sharded snapshot {damaged}/step_00000003 (rank 0 (and 1 more): "
        f"FileNotFoundError: [Errno 2] No such file or directory: "
        f"'{damaged}/step_00000003/__1_0.distcp'): it is corrupt; move it away or set "
        "trainer_config.snapshot_path")
    # After all of these, the step 3 snapshot resumes to the reference's step 6, bit for bit.
    resumed = two_ranks(mingpt_modules, mingpt, fsdp, "run_name=resumed",
                        f"trainer_config.snapshot_path={snap}")
    assert resumed["codes"] == (0, 0), resumed
    assert "resumed from" in resumed["stdout"][0] and "at step 3" in resumed["stdout"][0]
    assert_same_snapshot(snap / "step_00000006", ref_snap / "step_00000006", tmp_path)


def torchrun(mingpt: Path, *args: str, restarts: int = 0, **env: str):
    """main.py under torchrun, 2 processes: DCP's staging process re-imports main.py, which a
    rank run inside pytest cannot offer."""
    return run([TORCHRUN, "--standalone", "--nproc_per_node=2", f"--max-restarts={restarts}",
                "main.py", *tiny(*args, *ARGS)], cwd=mingpt, check=False, timeout=400, **env)


@pytest.mark.timeout(900)
def test_async_snapshots_survive_a_crash_mid_write_and_resume_bitwise_slowest(
        mingpt, fsdp_ref, tmp_path):
    """FAULT_AT_SAVE=6 kills rank 0 while step 6's shards are written in the background (its
    commit waits for the write): torchrun restarts both, they resume from the asynchronous
    snapshot of step 3 and end with the blocking reference's weights, bit for bit."""
    proc = torchrun(mingpt, FSDP, "run_name=async", "trainer_config.async_save=true",
                    restarts=1, FAULT_AT_SAVE="6")
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "[rank 0] FAULT_AT_SAVE=6: killing this worker" in proc.stdout
    snap = mingpt / "runs/async/snapshot"
    assert f"resumed from {snap} at step 3" in proc.stdout
    assert (snap / "latest").read_text() == "step_00000006"
    for step in ("step_00000003", "step_00000006"):  # written asynchronously, both
        assert_same_snapshot(snap / step, fsdp_ref / step, tmp_path)


def test_async_write_failure_on_one_rank_is_agreed_before_any_commit_slowest(
        mingpt, fsdp_ref, tmp_path):
    """Rank 1's staging process fails to write a shard of step 6: no rank commits it, each
    stops with the one line (the node's first rank prints it), the snapshot of step 3 stays."""
    snap = previous(fsdp_ref, tmp_path / "snapshot")
    before = digests(snap / "step_00000003")
    # A job of forked ranks (their staging processes forked too: stage_in_forks): the claim
    # is the run's, not torchrun's.
    code, log, ended = main_job(mingpt, 2, *tiny(FSDP, "run_name=async_fault",
                                                 "trainer_config.async_save=true",
                                                 f"trainer_config.snapshot_path={snap}", *ARGS),
                                FAULT_WRITE_ERROR="1:shard")
    assert code != 0
    # (the log also has the staging process's log lines)
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert errors == [f"error: rank 1: cannot save the snapshot to {snap} (Input/output error: "
                      f"{snap}/step_00000006/__1_0.distcp); the previous snapshot, if any, is "
                      "unchanged: free some space or set trainer_config.snapshot_path, then run "
                      "again to resume"], log[-3000:]
    struck = float(re.search(r"FAULT_WRITE_ERROR=1:shard: .* at ([0-9.]+)$", log, re.M)[1])
    assert ended - struck < BOUND_S
    assert (snap / "latest").read_text() == "step_00000003"
    assert digests(snap / "step_00000003") == before


def test_a_nan_loss_commits_the_good_asynchronous_save_in_flight(mingpt, tmp_path):
    """lr 1e30: step 1 is finite and saved in the background, step 2's loss is inf. The run
    stops in one line that names the last good snapshot: step 1's, committed, not dropped
    in flight (it was: the message promised a snapshot that was never committed)."""
    snap = tmp_path / "snapshot"
    code, log, _ = main_job(mingpt, 2, *tiny(
        FSDP, "run_name=async_nan", "trainer_config.async_save=true", "trainer_config.max_steps=4",
        f"trainer_config.snapshot_path={snap}", "optimizer_config.lr=1e30",
        "trainer_config.save_every=1", "trainer_config.sample_tokens=0"))
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert (code != 0, errors) == (True, [
        f"error: the loss became nan or inf at step 2: training stopped and saved nothing "
        f"after it ({snap} keeps the last good snapshot, if any); lower optimizer_config.lr "
        "or set trainer_config.grad_clip, then resume"]), log[-3000:]
    assert (snap / "latest").read_text() == "step_00000001"
    assert (snap / "step_00000001/train_state.pt").is_file()


def _one_rank_raises(rank: int, store: str, folder: str) -> None:
    """Rank 1 raises what no check raises (a bug), in a part of a save and in main.py's
    build (errors.together): every rank must stop on the same error, not rank 1 alone while
    rank 0 waits in its next collective."""
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    said = []
    with mingpt_imported() as m:
        def part(url: str) -> None:
            if rank == 1:
                raise RuntimeError("a bug in a save")

        for call, error in ((lambda: m["errors"].save_part(folder, part),
                             m["errors"].SaveError),
                            (lambda: m["errors"].together(part, folder), ValueError)):
            try:
                call()
                said.append("no error")
            except error as e:
                said.append(str(e))
        dist.barrier()  # both ranks got here: neither waits for the other
    Path(folder, f"rank{rank}.json").write_text(json.dumps(said))
    dist.destroy_process_group()


def test_any_exception_in_a_save_or_a_build_is_agreed_by_every_rank(tmp_path):
    """Only OSError and DCP's CheckpointException were agreed in a save, only ValueError in
    main.py's build: any other exception left the peers waiting (start_world raises
    if any rank fails or hangs past the timeout)."""
    start_world(_one_rank_raises, 2, str(tmp_path / "store"), str(tmp_path))
    said = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert said[0] == said[1]
    save, build = said[0]
    assert re.fullmatch(rf"rank 1 on \S+: cannot save the snapshot to {tmp_path} \(a bug in a "
                        r"save\); the previous snapshot, if any, is unchanged: .*", save), save
    assert re.fullmatch(r"rank 1 on \S+: RuntimeError: a bug in a save", build), build


def _taken_port_rank(rank: int, store: str, out: str, text: str) -> None:
    """A run of 2 fsdp ranks saving in the background at every step, where the port DCP's own
    free-port pick hands its staging processes is already taken (a race with another program,
    as one was seen in a full suite run: EADDRINUSE)."""
    join_world(rank, store, 2)
    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen()
    executor = torch.distributed.checkpoint._async_process_executor
    executor.get_free_port = lambda: taken.getsockname()[1]
    with mingpt_imported("main") as m:
        train_in_world(m, tiny(FSDP, "trainer_config.async_save=true", f"run_dir={out}/run",
                               f"data_config.path={text}", "trainer_config.max_steps=2",
                               f"trainer_config.snapshot_path={out}/snap",
                               "trainer_config.save_every=1", "trainer_config.sample_tokens=0"))
        m["distributed"].release()
    taken.close()


def test_async_save_needs_no_port_that_another_program_could_take(tmp_path):
    """DCP's staging processes met on a port rank 0 picked free and closed again, seconds before
    they bound it (savers.staging_store): now on a store rank 0 already listens on. On the code
    before, rank 0's staging process failed (EADDRINUSE) and the peers waited for theirs."""
    spawn_world(_taken_port_rank, 2, tmp_path)
    assert (tmp_path / "snap/latest").read_text() == "step_00000002"


def test_async_save_takes_every_flavour(mingpt_modules):
    """One snapshot format: ddp and zero write DCP shards as fsdp does, so they save in the
    background too (refused while ddp and zero wrote one file from rank 0; the feature matrix
    trains them). With tp_size it stays refused: its staging copy loses q/k/v's layout."""
    load = mingpt_modules["config"].load
    for method in ("ddp", "zero", "fsdp"):
        cfg = load(tiny("trainer_config.async_save=true",
                        f"trainer_config.distributed_method={method}"))
        assert cfg.trainer_config.async_save
    with pytest.raises(ValueError, match=r"async_save must be False with tp_size > 1"):
        load(tiny("trainer_config.async_save=true", "trainer_config.tp_size=2"))


class _Racing(os._Environ):
    """os.environ as DCP's thread saw it while the main thread removed a variable: the keys
    listed, then one of them gone before its value is read."""

    def __iter__(self):
        keys = list(self._data)
        self._data.pop(b"GONE", None)
        yield from map(self.decodekey, keys)


def test_a_staging_process_takes_the_environment_in_one_piece(monkeypatch):
    """The tests' forked staging process (mingpt_helpers._ForkedStaging, in a forked rank)
    copies the rank's environment on DCP's thread while the main thread may change it
    (savers.staging_store puts its variables back): read key by key, a key removed in between
    raised KeyError, the staging process never started, and the replica groups' matrix failed
    (once in a run of the whole suite)."""
    data = {**os.environ._data, b"GONE": b"1", b"KEPT": b"2"}
    e = os.environ
    monkeypatch.setattr(os, "environ", _Racing(data, e.encodekey, e.decodekey, e.encodevalue,
                                               e.decodevalue))
    process = _ForkedStaging().get_context("spawn").Process(target=print, daemon=True)
    environ = process._args[0]
    assert environ["KEPT"] == "2" and environ["GONE"] == "1"
