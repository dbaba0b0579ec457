"""05_mingpt/xla_main.py on XLA's CPU devices: 4-way SPMD FSDP trains the same model as eager
main.py (losses and weights within rounding), its parameters and AdamW state lie in 4 real
shards, it resumes bit for bit, and sample.py (in the series' own venv) reads its snapshot.

torch_xla pins torch 2.9.0 and the series runs torch 2.14.1, so the XLA side has its own venv,
.venv-xla at the repository root (requirements-xla.txt). The first test builds it, once: it
is kept, and rebuilt only when requirements-xla.txt changes (a hash beside it says which file
it was built from). A file lock keeps two test sessions from building it at once.
"""
import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import PYTHON, REPO, run
from mingpt_helpers import (
    U,
    copy_mingpt,
    log_units,
    read_snapshot,
    step_files,
    tiny,
    train_losses,
    val_losses,
    weights_apart,
)

XLA_VENV = REPO / ".venv-xla"
REQUIREMENTS = REPO / "requirements-xla.txt"
BUILT_FROM = XLA_VENV / "requirements-xla.sha256"  # written last: a cut-off build has none
DEVICES = 4
# XLA's CPU devices: CPU_NUM_DEVICES of them, one process driving all (SPMD). LLVM's
# optimisation level 0 for the machine code XLA emits for them: compiling is most of a tiny
# run's time, and level 0 halves it (a 4-step run, 20.4 -> 10.8 s of CPU on the 2-core EPYC).
# It compiles the same HLO with other machine code (no fused multiply-adds, for one), so the
# weights differ from level 2's by rounding, which the bounds below are derived for (any
# order of the same additions); a resumed run is compiled the same way as its whole run.
XLA_ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(DEVICES),
           "XLA_FLAGS": "--xla_backend_optimization_level=0"}
# Building the venv downloads about 4 GB (torch 2.9's CUDA libraries come with its PyPI wheel)
# on a cold pip cache: minutes, beyond pyproject's 300 s per test. Measured: tests/README.md.
pytestmark = pytest.mark.timeout(1800)

STEPS, BATCH = 4, 8  # BATCH sequences per device: 32 per step, as main.py's batch_size=32
# The keys every run here shares: a constant lr after the warmup (min_lr_ratio 1), a log line
# and a TensorBoard loss every step.
COMMON = ("trainer_config.min_lr_ratio=1.0", "trainer_config.log_every=1",
          f"trainer_config.max_steps={STEPS}")
QUIET = ("trainer_config.save_every=0", "trainer_config.sample_tokens=0")


def requirements_hash() -> str:
    return hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def xla_python() -> str:
    """.venv-xla's interpreter, the venv built first where it is missing or out of date."""
    lock = Path(tempfile.gettempdir()) / \
        f"ddp-series-venv-xla-{hashlib.sha256(str(REPO).encode()).hexdigest()[:12]}.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        if not (BUILT_FROM.exists() and BUILT_FROM.read_text() == requirements_hash()):
            shutil.rmtree(XLA_VENV, ignore_errors=True)
            # The README's command, from the interpreter that runs the tests (Python 3.11).
            for cmd in ([sys.executable, "-m", "venv", str(XLA_VENV)],
                        [str(XLA_VENV / "bin/pip"), "install", "-q", "-r", str(REQUIREMENTS)]):
                done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
                if done.returncode:
                    pytest.fail(f"{cmd} exited {done.returncode}:\n{done.stderr[-4000:]}")
            BUILT_FROM.write_text(requirements_hash())
    return str(XLA_VENV / "bin/python")


def xla_run(python: str, folder: Path, *overrides: str) -> str:
    """`python xla_main.py OVERRIDES` on 4 XLA CPU devices; its stdout."""
    return run([python, "xla_main.py", *overrides], cwd=folder, timeout=600, **XLA_ENV).stdout


def tensorboard(run_dir: Path, tag: str) -> dict[int, float]:
    """A run's logged scalars at full precision (the log lines round to 4 decimals)."""
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {s.step: s.value for s in events.Scalars(tag)}


@pytest.fixture(scope="module")
def runs(xla_python, tmp_path_factory) -> dict:
    """The runs the comparison with eager reads: eager main.py and xla_main.py on the same 32
    sequences per step (the resumed runs are the probe's, below)."""
    out = tmp_path_factory.mktemp("xla")
    folder = copy_mingpt(out)
    text = out / "input.txt"  # 40,000 characters of the usual text: fast to read, same vocab
    text.write_text((REPO / "05_mingpt/data/input.txt").read_text()[:40_000])
    data = f"data_config.path={text}"
    # Eager: one process, batch 32. XLA: 4 devices of 8, device d holding what main.py's rank
    # d of 4 would, so each step trains on the same 32 sequences (XlaHooks.feeds_every_rank:
    # the Trainer's loader puts device d's rows d-th in each global batch).
    # Validation: eval_batches * batch_size = 64 sequences in both, the same seeded choice.
    # No dropout: the devices draw other masks than the CPU.
    same = (*COMMON, data, "gpt_config.dropout=0.0")
    run([PYTHON, "main.py", *tiny(*same, *QUIET, f"run_dir={out}/eager",
                                  "trainer_config.eval_batches=2",
                                  f"trainer_config.batch_size={BATCH * DEVICES}")], cwd=folder)
    logs = {"xla": xla_run(xla_python, folder, *tiny(
        *same, f"run_dir={out}/xla", "trainer_config.eval_batches=8",
        f"trainer_config.batch_size={BATCH}", "trainer_config.save_every=0",
        "trainer_config.sample_tokens=30"))}
    return {"out": out, "folder": folder, "logs": logs}


def snapshot(path: Path) -> dict:
    return read_snapshot(path)


# --- The same model as eager CPU -------------------------------------------------------------
# Both runs start from the same weights (drawn on the CPU from the same seed) and train on the
# same sequences; what differs is arithmetic order. XLA compiles each step into fused loops
# of its own (Eigen's matmuls, its own exp and log, the batch split in 4 and summed across
# devices), and eager AdamW is the fused CPU kernel where XLA's is the per-op one.
#
# Before any update (the val loss at step 0, the train loss at step 1), the loss is the same
# function of the same numbers: a mean over N token losses (N = 1024 per train step, 2048
# for validation), each from dot products of at most 4 * n_embd = 128 terms per layer (3
# layers' worth with the head: < N). Summed in another order, a sum of N terms moves by at
# most N roundings (U each) of its size, the mean likewise; the terms' own errors add at most
# as much again. Hence FIRST_BOUND = 2 * N * U * |loss| (2.5e-4 at a loss of 4, far below the
# 1e-2 a wrong batch or an untied weight moves it; measured: equal, 0.0).
#
# After updates the weights differ by rounding too: test_mingpt_strategies.py derives, for
# AdamW with these settings, that every weight stays within 1% of STEP_BUDGET (the most lr can
# move a weight in STEPS steps) of the reference, but for a few whose gradient cancels to
# about 0 and may flip its step's sign. The same bound holds here (WEIGHT_TOLERANCE, OUTLIERS).
# Such differences move a loss of ~4 by a few ulps, so a logged loss (4 decimals) moves only
# where it lies within ~1e-6 of a rounding boundary, and then by one unit: LOSS_UNITS.
# Measured (a 2-core AMD EPYC, AVX-512, TensorBoard's unrounded values, XLA_ENV's level 0):
# losses at most 4.8e-7 apart (1 ulp of 4.06), equal at step 2 and at step 0's evaluation;
# the worst weight 8.7e-5 * STEP_BUDGET from eager's, none beyond WEIGHT_TOLERANCE (at level
# 2: 2.4e-7 and 6.9e-5).
LOSS_UNITS = 1
STEP_BUDGET = 3e-3 * (0.5 + 1 + 1 + 1)  # tiny()'s lr 3e-3: half of it at step 1 (warmup 2)
WEIGHT_TOLERANCE, OUTLIERS = 1e-2 * STEP_BUDGET, 3


def first_bound(loss: float, tokens: int) -> float:
    return 2 * tokens * U * abs(loss)


def test_xla_follows_eager_cpus_losses(runs):
    out, log = runs["out"], runs["logs"]["xla"]
    xla, cpu = train_losses(log), tensorboard(out / "eager", "train/loss")
    assert sorted(xla) == list(range(1, STEPS + 1)) and xla[STEPS] < xla[1] - 0.1, xla
    for step, loss in cpu.items():
        assert log_units(xla[step], round(loss, 4)) <= LOSS_UNITS, (step, xla, cpu)
    exact = tensorboard(out / "xla", "train/loss")
    assert abs(exact[1] - cpu[1]) <= first_bound(cpu[1], BATCH * DEVICES * 32), (exact, cpu)
    val, cpu_val = tensorboard(out / "xla", "val/loss"), tensorboard(out / "eager", "val/loss")
    assert sorted(val) == sorted(cpu_val) == [0, STEPS], (val, cpu_val)
    assert abs(val[0] - cpu_val[0]) <= first_bound(cpu_val[0], 64 * 32), (val, cpu_val)
    assert log_units(val_losses(log)[STEPS], round(cpu_val[STEPS], 4)) <= LOSS_UNITS


def test_xla_ends_at_eager_cpus_weights(runs):
    out = runs["out"]
    xla, cpu = snapshot(out / "xla/snapshot"), snapshot(out / "eager/snapshot")
    assert xla["step"] == cpu["step"] == STEPS
    assert {k: v.shape for k, v in xla["model"].items()} == \
        {k: v.shape for k, v in cpu["model"].items()}  # whole tensors, gathered from shards
    worst, beyond = weights_apart(xla["model"], cpu["model"], WEIGHT_TOLERANCE)
    assert beyond <= OUTLIERS, (worst, beyond)
    # The tied embedding and head stay one tensor, in the file as in the model.
    assert xla["model"]["wte.weight"].data_ptr() == xla["model"]["lm_head.weight"].data_ptr()


# --- 4 real shards ---------------------------------------------------------------------------
# Run in .venv-xla, in 05_mingpt/: xla_main.py's own build and Trainer, then every parameter
# and AdamW moment as XLA holds it (its sharding and each device's shard), once after a fresh
# start and one step (max_steps=1, saved), once right after a resume (the moments loaded from
# the file). Then, in the same process (its imports paid once, and each compiled step once:
# a resumed run steps in its whole run's programs), xla_main.main on the arguments of the nan
# run (test_xla_stops_at_a_nan_loss_before_saving_it's), then of the run with dropout, whole,
# then resumed from a copy of its step-2 snapshot (test_xla_resumes_bit_for_bit's): each
# one's exit status and what it wrote; and the config of each of REFUSED's override lists:
# its one line, or None. Its one argument, JSON, holds them all.
PROBE = """
import contextlib, io, json, shutil, sys, warnings, torch, torch_xla
from torch_xla.distributed.spmd.xla_sharding import wrap_as_sharded_tensor
from mingpt import distributed
import xla_main

def shards(model, optimizer):
    found = {}
    for name, p in model.module.named_parameters():
        for key, t in [("param", p), *optimizer.state[p].items()]:
            if t.device.type != "xla":
                continue  # AdamW's step count: a CPU scalar
            sharded, whole = wrap_as_sharded_tensor(t), t.cpu()
            rebuilt = torch.full_like(whole, float("nan"))  # from the shards alone
            for s in sharded.local_shards:
                rebuilt[tuple(s.indices)] = s.data[tuple(slice(0, i.stop - i.start)
                                                         for i in s.indices)]
            found[f"{name}/{key}"] = {
                "shape": list(whole.shape), "spec": sharded.sharding_spec,
                "devices": sorted(s.shard_device for s in sharded.local_shards),
                "shards": [list(s.data.shape) for s in sharded.local_shards],
                "rebuilt": torch.equal(rebuilt, whole)}
    return found

given = json.loads(sys.argv[1])
cfg = xla_main.load_config(given["probe"])
mesh, device = xla_main.make_mesh(), torch_xla.device()
distributed.setup("cpu")  # xla_main.train's one-rank group
report = {}
for phase in ("fresh", "resumed"):
    trainer, _ = xla_main.build(cfg, mesh, device)
    if phase == "fresh":  # one step: AdamW's moments exist from then on
        trainer.train()
    report[phase] = shards(trainer.model, trainer.optimizer)
distributed.release()  # xla_main.main makes its own group
# A second use_spmd in one process warns that XLA_USE_SPMD (set by the first) is deprecated;
# a launched xla_main.py calls it once. Only that warning is silenced.
warnings.filterwarnings("ignore", "XLA_USE_SPMD is being deprecated")

def command(argv):
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            xla_main.main(argv)
        except SystemExit as e:  # as the interpreter turns it into an exit status
            code = e.code
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}

report["nan"] = command(given["nan"])
# A run with dropout, whole, then resumed from a copy of its step-2 snapshot (the step
# directory and `latest` naming it: mingpt_helpers.copy_step's copy, which this process, in
# .venv-xla, cannot import).
dropout = {"whole": command(given["whole"])}
source, target, step, latest = given["copy"]
shutil.copytree(f"{source}/{step}", f"{target}/{step}")
with open(f"{target}/{latest}", "w") as f:
    f.write(step)
dropout["resumed"] = command(given["resumed"])
report["dropout"] = dropout
# Each refused config's one line (xla_main.load_config, which main() calls first), and the
# optimizer of a config that names none.
refusals = []
for overrides in given["refused"]:
    try:
        xla_main.load_config(overrides)
        refusals.append(None)
    except ValueError as e:
        refusals.append(str(e))
report["refusals"] = [refusals, xla_main.load_config([]).optimizer_config.name]
print(json.dumps(report))
"""


# Resume: with dropout (the device's RNG stream must resume too), a snapshot at step 2,
# kept (keep_last=2) when step 4's is committed; the resumed run starts from a copy of it.
DROPOUT = (*COMMON, f"trainer_config.batch_size={BATCH}", "trainer_config.eval_batches=8",
           "trainer_config.save_every=2", "trainer_config.keep_last=2",
           "trainer_config.sample_tokens=0")
# The nan run: the loss turns nan at step 2 (lr 1e30), a save step but no log step.
NAN = ("optimizer_config.lr=1e30", "trainer_config.max_steps=4", "trainer_config.log_every=4",
       "trainer_config.save_every=2", "trainer_config.sample_tokens=0")


# What else xla_main.py refuses (the precision's refusal is launched as a command, below):
# the one line -> the overrides.
REFUSED = {
    "trainer_config.distributed_method must be fsdp with xla_main.py (SPMD FSDP over every "
    "XLA device), got 'tp'": ["trainer_config.distributed_method=tp"],
    "trainer_config.ep_size must be 0 or 1 with xla_main.py, got 2":
        ["gpt_config.n_expert=4", "trainer_config.ep_size=2"],
    "trainer_config.ft_replicas must be 0 with xla_main.py (torchft's replica groups join "
    "main.py's jobs), got 2": ["trainer_config.ft_replicas=2"],
    "trainer_config.dry_run must be 0 with xla_main.py (it plans main.py's layouts), "
    "got 8": ["trainer_config.dry_run=8"],
    "optimizer_config.name must be adamw with xla_main.py (Muon's gathered matrices are "
    "main.py's layouts' code), got 'muon'": ["optimizer_config.name=muon"],
}


@pytest.fixture(scope="module")
def probe(runs, xla_python) -> dict:
    """PROBE's report: the shards, the nan run, the run with dropout whole and resumed (each
    run's exit status, stdout and stderr), and the refusals."""
    out = runs["out"]
    data = f"data_config.path={out}/input.txt"
    step, latest = step_files(2)
    given = {"probe": tiny("trainer_config.max_steps=1", *QUIET, data, f"run_dir={out}/probe"),
             "nan": tiny(*NAN, data, f"run_dir={out}/nan"),
             "whole": tiny(*DROPOUT, data, f"run_dir={out}/whole"),
             "resumed": tiny(*DROPOUT, data, f"run_dir={out}/resumed"),
             "copy": [str(out / "whole/snapshot"), str(out / "resumed/snapshot"), step, latest],
             "refused": list(REFUSED.values())}
    proc = run([xla_python, "-c", PROBE, json.dumps(given)], cwd=runs["folder"], timeout=600,
               **XLA_ENV)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, ran in report["dropout"].items():
        assert ran["code"] == 0, (name, ran["stderr"][-3000:])
    return report


@pytest.mark.parametrize("phase", ["fresh", "resumed"])
def test_parameters_and_adamw_state_lie_in_4_shards(probe, phase):
    report = probe[phase]
    # 28 parameter tensors (2 blocks of 12, 2 embeddings, the final LayerNorm's 2; the head is
    # the tied embedding), each with AdamW's 2 moments.
    assert len(report) == 28 * 3, sorted(report)
    for name, t in report.items():
        # Split along the largest dimension (SpmdFullyShardedDataParallel's rule), a quarter
        # (rounded up: XLA pads the last shard) on each of the 4 devices.
        dim = t["shape"].index(max(t["shape"]))
        split = [1] * len(t["shape"])
        split[dim] = DEVICES
        assert t["spec"] == f"{{devices=[{','.join(map(str, split))}]0,1,2,3}}", (name, t)
        assert t["devices"] == [f"CPU:{d}" for d in range(DEVICES)], (name, t)
        shard = [-(-n // s) for n, s in zip(t["shape"], split, strict=True)]
        assert t["shards"] == [shard] * DEVICES, (name, t)
        assert t["rebuilt"], name  # the 4 shards hold the whole tensor between them


# --- Resume, snapshot, sample.py -------------------------------------------------------------

def test_xla_resumes_bit_for_bit(runs, probe):
    out, logs = runs["out"], {name: ran["stdout"] for name, ran in probe["dropout"].items()}
    whole, resumed = snapshot(out / "whole/snapshot"), snapshot(out / "resumed/snapshot")
    assert "resumed from" in logs["resumed"] and whole["step"] == resumed["step"] == STEPS
    for key in whole["model"]:
        assert torch.equal(whole["model"][key], resumed["model"][key]), key
    saved, again = whole["optimizer"]["state"], resumed["optimizer"]["state"]
    assert saved.keys() == again.keys()
    for index, state in saved.items():
        for key, value in state.items():
            assert torch.equal(value, again[index][key]), (index, key)
    # Dropout (0.1 here) drew the same masks: the device's RNG stream resumed too.
    assert whole["rng"][0]["xla"] == resumed["rng"][0]["xla"]
    for key in ("epoch", "samples_in_epoch", "last_val", "scheduler"):
        assert whole[key] == resumed[key], key
    losses, again_losses = train_losses(logs["whole"]), train_losses(logs["resumed"])
    assert sorted(again_losses) == [3, 4], again_losses
    assert all(again_losses[s] == losses[s] for s in again_losses), (losses, again_losses)


def test_sample_reads_the_xla_snapshot(runs):
    """sample.py, in the series' own venv (torch 2.14), writes what xla_main.py sampled at the
    end of its run (torch 2.9): the same weights, the same seeded draws."""
    out, log = runs["out"], runs["logs"]["xla"]
    sampled = log.split("sample:\n", 1)[1].strip()
    proc = run([PYTHON, "sample.py", "--snapshot", str(out / "xla/snapshot"), "--num_tokens",
                "30", "--temperature", "0.8", "--top_k", "10"], cwd=runs["folder"])
    assert proc.stdout.strip() == sampled and len(sampled) > 20, (proc.stdout, sampled)


def test_xla_stops_at_a_nan_loss_before_saving_it(runs, probe):
    """The Trainer's check, on XLA too: the loss turns nan at step 2 (lr 1e30), a save step
    but no log step, and the run stops there with one line, no snapshot written. (xla_main.py's
    loop of its own checked at log steps only: it saved step 2's nan weights.) xla_main.main
    in the probe's process: the exit status and the line are the command's (the refusals
    below launch it)."""
    out, nan = runs["out"], probe["nan"]
    assert not (out / "nan/snapshot").exists()
    assert (nan["code"], nan["stderr"].strip()) == (2, (
        f"error: the loss became nan or inf at step 2: training stopped and saved nothing "
        f"after it ({out}/nan/snapshot keeps the last good snapshot, if any); lower "
        "optimizer_config.lr or set trainer_config.grad_clip, then resume")), nan


def test_xla_refuses_what_only_main_py_has(xla_python, tmp_path):
    """One `error:` line (tests/README.md: Bad input), before any run folder exists: the
    command's own exit, once; every other refusal is the next test's, in one process."""
    folder = copy_mingpt(tmp_path)
    proc = run([xla_python, "xla_main.py", "trainer_config.precision=fp16"], cwd=folder,
               check=False, **XLA_ENV)
    assert (proc.returncode, proc.stderr.strip()) == (2, "error: trainer_config.precision must "
                                                      "be fp32 or bf16 with xla_main.py, got "
                                                      "'fp16'")
    assert not (folder / "runs").exists()


def test_xla_refuses_the_axes_and_jobs_only_main_py_has(probe):
    """xla_main.py once ignored these silently (trained dense SPMD FSDP, one job, for real).
    The probe's process checks them all (xla_main.load_config, which main() calls first): the
    exit and the one line are the case above's. Where no optimizer is named, xla_main.py takes
    AdamW (main.py's default, Muon, it refuses)."""
    assert probe["refusals"] == [list(REFUSED), "adamw"]

