"""05_mingpt's replica groups (trainer_config.ft_replicas, mingpt/parallel/ft.py, torchft):
two groups, each a job of main.py's ranks (torchrun's, forked: mingpt_helpers.Job), joined by
torchft's lighthouse.

- Without a fault they train as DDP over two processes does, bit for bit: the same rows, and
  the mean of two gradients ((a + b) / 2 here, a / 2 + b / 2 in DDP: halving is exact).
- One group killed mid-run (SIGKILL, FAULT_AT_STEP): the other goes on stepping, with no
  restart; the killed one, started again, joins, receives the weights, the optimizer's state
  (AdamW's, and Muon's: main.py's default) and the trainer's position from its peer, and both
  end with the same weights and optimizer state, bit for bit (every step after the join
  applies the same averaged gradient to the same state).
  Gates order the groups (FAULT_HOLD_QUORUM), not delays.
- One group of two fsdp processes restarted by torchrun resumes its own snapshot and ends as
  the run never killed, bit for bit.
- Bad values of the keys, and zero and fp16 with groups: one line each.
"""
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import PYTHON, TORCHRUN, run
from mingpt_helpers import (
    Job,
    assert_refused,
    copy_mingpt,
    mingpt_imported,
    read_snapshot,
    run_job,
    snapshot_weights,
    tiny,
)

LIGHTHOUSE = [PYTHON, str(Path(__file__).with_name("lighthouse.py"))]  # torchft_lighthouse
# Clipping is per group before the average (ft.py): off, so the run compares with DDP's.
COMMON = ("trainer_config.grad_clip=0", "trainer_config.sample_tokens=0",
          "trainer_config.save_every=0", "trainer_config.collective_timeout_s=30")


class Lighthouse:
    """torchft's lighthouse (lighthouse.py), for the block's replica groups: on a port the OS
    gives it (port 0), read from its first line once it listens. (A port picked beforehand and
    bound later could be taken in between: a lighthouse under load once found it in use, and
    its groups timed out asking it for a quorum.)"""

    def __init__(self, tmp: Path, min_replicas: int) -> None:
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in __exit__)
            "w", prefix="lighthouse", suffix=".log", dir=tmp, delete=False)
        self.path = Path(self.log.name)
        # join_timeout: how long a quorum waits for a group that heartbeats but has not asked
        self.proc = subprocess.Popen(
            [*LIGHTHOUSE, "--min_replicas", str(min_replicas), "--join_timeout_ms", "1000",
             "--bind", "[::]:0"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not (bound := re.search(r"Lighthouse listening on: \S+:(\d+)",
                                      self.path.read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                pytest.fail(f"the lighthouse did not start:\n{self.path.read_text()[-2000:]}")
            time.sleep(0.05)  # polling its log: what ends the wait is its line, not the time
        self.port = int(bound[1])

    def __enter__(self) -> "Lighthouse":
        return self

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        self.log.close()


def group(mingpt: Path, lighthouse: Lighthouse, g: int, *args: str, log: str | None = None,
          run_name: str | None = None, groups: int = 2, nproc: int = 1, **env: str) -> Job:
    """Replica group `g` of `groups`: `torchrun --standalone --nproc_per_node=NPROC main.py`
    as FAULT_TOLERANCE.md starts it, its ranks forked (mingpt_helpers.Job: the claims here are
    the groups', not torchrun's; the restarts below launch torchrun itself), in
    runs/<run_name> (ft<g>); its output in <log>.log (run_name's; a failed test's folder keeps
    every group's whole log)."""
    run_name = run_name or f"ft{g}"
    argv = tiny(*args, *COMMON, f"trainer_config.ft_replicas={groups}",
                f"trainer_config.ft_replica_group={g}", f"run_name={run_name}")
    return Job(mingpt, "main.py", argv, nproc, mingpt / f"{log or run_name}.log",
               TORCHFT_LIGHTHOUSE=f"http://localhost:{lighthouse.port}", **env)


def killed_and_whole(mingpt: Path, lighthouse: Lighthouse, args: tuple, resumed: int) -> None:
    """One group of two processes of `args`, twice: killed before step 5 and restarted by
    torchrun (runs/killed: it resumes its snapshot of step `resumed`), and never killed
    (runs/whole, a Job: the reference)."""
    env = {"TORCHFT_LIGHTHOUSE": f"http://localhost:{lighthouse.port}"}
    given = (*args, *COMMON[:2], "trainer_config.collective_timeout_s=30")
    out = run([TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1", "main.py",
               *tiny(*given, "run_name=killed")], cwd=mingpt, FAULT_AT_STEP="5", **env).stdout
    assert "FAULT_AT_STEP=5: killing this worker" in out, out[-3000:]
    assert "resumed from" in out and f"at step {resumed}" in out, out[-3000:]
    run_job(mingpt, 2, *tiny(*given, "run_name=whole"), **env)


def snapshot(mingpt: Path, run_name: str) -> dict:
    return read_snapshot(mingpt / "runs" / run_name / "snapshot")


def same(a: dict, b: dict) -> list[str]:
    """The weights and optimizer tensors that differ between two ddp-layout snapshots."""
    diff = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    for i, state in a["optimizer"]["state"].items():
        diff += [f"optimizer {i} {k}" for k, v in state.items()
                 if not torch.equal(v, b["optimizer"]["state"][i][k])]
    return diff


def test_two_groups_train_as_ddp_over_two_processes_bit_for_bit(tmp_path):
    mingpt = copy_mingpt(tmp_path)
    args = ("trainer_config.max_steps=6",)
    # min_replicas 2: the first quorum waits for both groups (otherwise the first to ask
    # would take step 0 alone and the other copy its state: right, but not DDP's run).
    with Lighthouse(tmp_path, min_replicas=2) as lighthouse:
        procs = [group(mingpt, lighthouse, g, *args) for g in (0, 1)]
        outs = [p.finish() for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]
    ddp_out = run_job(mingpt, 2, *tiny(*args, *COMMON, "run_name=ddp"))
    ft0, ft1, ddp = (snapshot(mingpt, n) for n in ("ft0", "ft1", "ddp"))
    assert (ft0["step"], ft1["step"]) == (6, 6)
    assert same(ft0, ft1) == [] and same(ft0, ddp) == []
    # Each group evaluates every validation sequence (ft.Hooks.evaluators), the ones DDP's two
    # ranks split: the groups log one val loss, and DDP's to the 4 decimals printed, but for
    # a rounding of the last (one rank sums the sequences in another order than two do).
    vals = [float(re.search(r"final val loss ([\d.]+)", out)[1]) for out in (*outs, ddp_out)]
    assert vals[0] == vals[1] and abs(vals[0] - vals[2]) <= 1.01e-4, vals
    # Each group reads its own rows: data-parallel rank g of 2, as DDP's rank g does.
    # The start line once said "0 processes per model replica" here (world 1 // dp 2).
    assert "data-parallel size 2 across replica groups, 1 processes each" in outs[0], \
        outs[0][-3000:]


def wait_for(line: str, *procs: Job, timeout: float = 300) -> None:
    """Until every one of `procs` has printed `line` (each still running)."""
    deadline = time.monotonic() + timeout
    while not all(line in p.log.read_text() for p in procs):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [p.log.read_text()[-2000:] for p in procs]
        time.sleep(0.2)  # polling the logs: what ends the wait is their line, not the time


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_killed_group_rejoins_without_a_restart_and_all_end_with_the_same_weights(
        tmp_path, optimizer):
    """Gates, not delays (faults.hold_quorum): both groups' first quorum waits until both
    wait there, so they start together at step 0 (without it, under load the second group to
    start found the first training alone and copied its state). The killed group dies before
    step 5; the survivor steps on alone to step 30's quorum and waits there until the group
    started again has asked the lighthouse for its first: they meet there, and it joins at
    step 30."""
    mingpt = copy_mingpt(tmp_path)
    args = ("trainer_config.max_steps=40", f"optimizer_config.name={optimizer}")
    start, meet = tmp_path / "start", tmp_path / "meet"
    with Lighthouse(tmp_path, min_replicas=1) as lighthouse:
        survivor = group(mingpt, lighthouse, 0, *args,
                         FAULT_HOLD_QUORUM=f"0:{start},30:{meet}")
        killed = group(mingpt, lighthouse, 1, *args, log="ft1_killed", FAULT_AT_STEP="5",
                       FAULT_HOLD_QUORUM=f"0:{start}")
        wait_for("FAULT_HOLD_QUORUM: step 0 waits", survivor, killed)
        start.touch()
        wait_for("FAULT_AT_STEP=5: killing this worker", killed)
        # Started once the survivor waits at step 30: the lighthouse forms no quorum of fewer
        # than half the groups that heartbeat, so a third heartbeat (the new group's, while the
        # dead one's has not yet timed out) would hold the survivor's steps alone up.
        wait_for("FAULT_HOLD_QUORUM: step 30 waits", survivor)
        asked = lighthouse.path.read_text().count("Received quorum request for replica mingpt_1")
        again = group(mingpt, lighthouse, 1, *args)  # no fault
        # The lighthouse holds its request (one group of the two alive is not a quorum) until
        # the survivor's comes: then the two form step 30's quorum together. (Released before
        # the new group asked, the survivor formed quorums alone again for a step or two.)
        deadline = time.monotonic() + 300
        while lighthouse.path.read_text().count(
                "Received quorum request for replica mingpt_1") == asked:
            assert time.monotonic() < deadline and again.poll() is None, \
                again.log.read_text()[-3000:]
            time.sleep(0.2)
        meet.touch()
        second, kept = again.finish(), survivor.finish()
        killed.finish()
    assert killed.returncode == -signal.SIGKILL  # the worker killed itself, no restart asked for
    assert again.returncode == 0, second[-4000:]
    assert survivor.returncode == 0, kept[-4000:]
    # The survivor took no peer's state (both started together, at step 0) and trained to the
    # end; the group started again took the survivor's at step 30, past the kill.
    assert re.findall(r"joined at step (\d+)", kept) == [], kept[-3000:]
    assert "step 40/40" in kept, kept[-3000:]
    assert re.findall(r"joined at step (\d+): weights, optimizer state and position from a peer",
                      second) == ["30"], second[-4000:]
    ft0, ft1 = snapshot(mingpt, "ft0"), snapshot(mingpt, "ft1")
    assert (ft0["step"], ft1["step"]) == (40, 40)
    assert same(ft0, ft1) == []
    assert ft0["scheduler"] == ft1["scheduler"]  # the same lr schedule, step for step


def test_a_group_killed_under_fsdp_restarts_from_its_own_snapshot_bit_for_bit(tmp_path):
    """FAULT_TOLERANCE.md's restart with the default save_every, under a sharded layout: one
    group of two fsdp processes, a worker killed before step 5, torchrun starts the group
    again, it resumes its own step 4 snapshot and ends as the run that was never killed.
    (The restart once crashed in the schedule's resume, which read the lr from the wrapper's
    missing `defaults`; DCP's state-dict code stepped the wrapper, a cross-group all-reduce.)"""
    mingpt = copy_mingpt(tmp_path)
    args = ("trainer_config.max_steps=6", "trainer_config.save_every=2",
            "trainer_config.distributed_method=fsdp", "trainer_config.ft_replicas=1")
    with Lighthouse(tmp_path, min_replicas=1) as lighthouse:
        killed_and_whole(mingpt, lighthouse, args, 4)
    killed, whole = (snapshot_weights(mingpt / "runs" / n) for n in ("killed", "whole"))
    assert [k for k in whole if not torch.equal(killed[k], whole[k])] == []


@pytest.mark.parametrize("args, message", [
    (["trainer_config.ft_replicas=-1"],
     "trainer_config.ft_replicas must be an integer >= 0 (0: off), got -1"),
    (["trainer_config.ft_replicas=2", "trainer_config.ft_replica_group=2"],
     "trainer_config.ft_replica_group must be in 0..1 (ft_replicas=2), got 2"),
    (["trainer_config.ft_replicas=2", "trainer_config.precision=fp16"],
     "trainer_config.ft_replicas needs precision fp32 or bf16, got fp16 (GradScaler's "
     "skipped steps are not agreed across replica groups)"),
    # ZeRO's first save killed rank 0 (torchft's wrapper hid ZeroRedundancyOptimizer).
    (["trainer_config.ft_replicas=2", "trainer_config.distributed_method=zero"],
     "trainer_config.ft_replicas needs distributed_method ddp, fsdp or a layout of them, not "
     "zero: a rejoining group copies each peer rank's whole AdamW state, which ZeRO spreads "
     "over the ranks and gathers only with a collective"),
])
def test_config_refuses_replica_groups_that_do_not_fit(args, message):
    with mingpt_imported() as m:
        assert_refused(m["config"], tiny(*args), message)

