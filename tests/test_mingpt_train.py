"""05_mingpt trains as its README says: every command as written (with tiny overrides), DDP and
FSDP on several gloo processes, mixed precision, and exact resume after a killed worker.

The slowest tests (several torchrun launches each) have `slowest` in their names.
"""
import re
import signal

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import PYTHON, REPO, TEARDOWN_PROBE, TORCHRUN, gloo_threads_at_exit, run
from mingpt_helpers import (
    assert_learned,
    assert_same_curve,
    copy_mingpt,
    log_units,
    mingpt_imported,
    other_cpu_kernels,
    read_snapshot,
    script_in_process,
    tiny,
    train_losses,
    val_losses,
)
from restart_tries import SHARED_STORE, attempts


@pytest.fixture(scope="module")
def mingpt(tmp_path_factory):
    return copy_mingpt(tmp_path_factory.mktemp("mingpt"))


@pytest.fixture(scope="module")
def main_py(mingpt, mingpt_modules):
    """`python main.py ARGS` in the private copy, run in this process (no interpreter start):
    for the runs that only vary a setting; every command as written runs end to end too."""
    return lambda *args: script_in_process(mingpt_modules["main"], mingpt, *args)


@pytest.fixture(scope="module")
def sample_py(mingpt, mingpt_modules):
    """`python sample.py ARGS` likewise."""
    return lambda *args: script_in_process(mingpt_modules["sample"], mingpt, *args)


GOLDEN_CURVE = (REPO / "tests/golden/tiny_single_process.txt").read_text().splitlines()
# Gradient accumulation, and validation at every snapshot (steps 4 and 8) and the end.
DDP_ARGS = ("trainer_config.grad_accum_steps=2", "trainer_config.eval_every=4")


@pytest.fixture(scope="module")
def ddp_reference(mingpt):
    """`python launch.py` (2 CPU processes under torchrun; its default count is unit-tested in
    test_notebooks) with gradient accumulation, fp32, no run_name: the uninterrupted DDP run the
    kill tests compare with. Its output and the one run directory it made."""
    before = set((mingpt / "runs").glob("*"))  # other tests' runs, if any
    proc = run([PYTHON, "launch.py", "--nproc", "2", *tiny(*DDP_ARGS)], cwd=mingpt)
    new = set((mingpt / "runs").glob("*")) - before
    assert len(new) == 1, new  # see test_launch_py_runs_torchrun_and_its_workers_share_...
    return proc, new.pop()


def val_events(run_dir) -> list[int]:
    """The steps of every val/loss event TensorBoard holds for a run, resumed parts included."""
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return sorted(e.step for e in events.Scalars("val/loss"))


def scalar_tags(run_dir) -> set[str]:
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return set(events.Tags()["scalars"])


def loss_curve(stdout: str) -> list[str]:
    """Every train and val loss line, without the timing and memory figures that vary."""
    return [re.sub(r" \| [0-9,]+ tokens/s.*", "", line) for line in stdout.splitlines()
            if re.match(r"step \d+(/\d+ \| loss| \| val loss)", line)]


def test_python_main_py_then_sample_py(mingpt, sample_py):
    proc = run([PYTHON, "main.py", *tiny("run_name=single", "trainer_config.log_every=1")],
               cwd=mingpt)
    out = proc.stdout
    assert_learned(out)
    # The golden curve: this CPU run is deterministic, so every logged loss is as recorded, to
    # one unit of the log's 4th decimal: other CPUs' kernels round differently (assert_same_
    # curve; measured: equal to all 4 decimals under ATEN_CPU_CAPABILITY=default, avx2 and
    # avx512). A change beyond that is a change in what the trainer computes.
    assert_same_curve(loss_curve(out), GOLDEN_CURVE)
    assert re.search(r"^torch 2\.\S+ \| python 3\.\S+ \| hydra 1\.", out, re.M)  # versions
    assert "world size 1" in out and "trainer_config:\n  max_steps: 10" in out  # the config
    assert re.search(r"^step 10/10 \| loss [0-9.]+ \| lr [0-9.e+-]+ \| [0-9,]+ tokens/s", out,
                     re.M)
    assert re.search(r"^sample:\n.{5,}", out, re.M)
    run_dir = mingpt / "runs/single"
    assert {"train/loss", "val/loss", "train/lr", "perf/tokens_per_s",
            "memory/peak_mb_rank0"} <= scalar_tags(run_dir)
    assert "perf/mfu" not in scalar_tags(run_dir)  # no peak FLOP/s for a CPU
    snap = read_snapshot(run_dir / "snapshot")  # weights_only=True
    assert snap["step"] == 10 and snap["world_size"] == 1
    assert {"model", "optimizer", "scheduler", "scaler", "rng", "epoch", "samples_in_epoch",
            "model_config", "data_meta"} <= set(snap)
    assert snap["samples_in_epoch"] == 10 * 8
    assert set(snap["rng"][0]) == {"torch", "numpy", "python"}
    assert len(snap["data_meta"]["itos"]) == snap["model_config"]["vocab_size"] == 65
    assert not list(run_dir.glob("*.tmp"))
    # sample.py rebuilds the model and the vocabulary from the snapshot alone.
    proc = run([PYTHON, "sample.py", "--snapshot", "runs/single/snapshot", "--prompt", "ROMEO:",
                "--num_tokens", "40", "--temperature", "0.8", "--top_k", "5"], cwd=mingpt)
    text = proc.stdout.rstrip("\n")
    assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 40
    assert "(dcp, step 10, " in proc.stderr
    # Without --snapshot: the newest runs/*/snapshot (in this process: one launch is enough).
    again = sample_py("--prompt", "ROMEO:", "--num_tokens", "40", "--temperature", "0.8",
                      "--top_k", "5")
    assert again.returncode == 0, again.stderr
    assert again.stdout == proc.stdout  # same seed, same text


# `python main.py ARGS`, after printing the kernel set torch chose (so a test knows the one it
# forced was in effect): python -c THIS main.py ARGS.
CAPABILITY_THEN_SCRIPT = (
    "import runpy, sys, torch; print('cpu capability', torch.backends.cpu.get_cpu_capability());"
    " sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


# What only some processes of a run use: the dry run's counters (torch's flop counter, triton
# with it) and TensorBoard (rank 0's writer, log.TrainLog, imports it where it makes it).
LAZY = ("mingpt.dry_run", "torch.utils.flop_counter", "triton", "torch.utils.tensorboard")


def test_main_py_imports_only_what_every_run_uses(mingpt):
    """`import main`, which every rank of every launch and every restart pays, imports none
    of LAZY (bench/README.md: the start-up's cost)."""
    probe = "import sys, main; print(sorted(m for m in sys.argv[1:] if m in sys.modules))"
    assert run([PYTHON, "-c", probe, *LAZY], cwd=mingpt).stdout == "[]\n"


def test_golden_curve_holds_on_other_cpu_kernels(mingpt):
    """The golden run again, with a lower instruction set's kernels (other_cpu_kernels(), read
    as the process loads torch): the curve and its tolerance (assert_same_curve) hold on
    another CPU than the one that recorded it, wherever the suite runs."""
    kernels = other_cpu_kernels()
    proc = run([PYTHON, "-c", CAPABILITY_THEN_SCRIPT, "main.py", *tiny(
        "run_name=other_kernels", "trainer_config.log_every=1", "trainer_config.save_every=0",
        "trainer_config.sample_tokens=0")], cwd=mingpt, **kernels)
    assert proc.stdout.startswith(f"cpu capability {kernels['ATEN_CPU_CAPABILITY'].upper()}\n")
    assert_same_curve(loss_curve(proc.stdout), GOLDEN_CURVE)


def test_batch_size_128_with_fp16(mingpt, main_py):
    proc = main_py(*tiny("trainer_config.batch_size=128", "run_name=fp16",
                         "trainer_config.precision=fp16"))
    assert proc.returncode == 0, proc.stderr
    assert "128 sequences per step (batch_size 128 x grad_accum_steps 1 x world size 1)" \
        in proc.stdout
    assert_learned(proc.stdout)
    scaler = read_snapshot(mingpt / "runs/fp16/snapshot")["scaler"]
    # GradScaler state was saved: the scale (2**16 at the start, halved on each overflow) and the
    # count of overflow-free steps since the last change.
    assert 0 < scaler["scale"] <= 2.0**16 and scaler["_growth_tracker"] >= 1


def test_fsdp_single_process_bf16(mingpt, main_py):
    proc = main_py(*tiny("trainer_config.distributed_method=fsdp", "run_name=fsdp1",
                         "trainer_config.precision=bf16"))
    assert proc.returncode == 0, proc.stderr
    assert_learned(proc.stdout)
    snap = mingpt / "runs/fsdp1/snapshot"
    # DCP layout: only the newest step directory survives, and `latest` names it.
    assert (snap / "latest").read_text() == "step_00000010"
    # keep_last=2: the step before stays too (snapshots at 4, 8 and 10).
    assert sorted(p.name for p in snap.iterdir()) == ["latest", "step_00000008", "step_00000010"]
    assert {".metadata", "__0_0.distcp", "train_state.pt"} <= {
        p.name for p in (snap / "step_00000010").iterdir()}


def test_compiled_run_follows_the_eager_one_and_samples_eagerly(mingpt, main_py):
    # compile=True: ddp compiles the whole model (mingpt/parallel/ddp.py); sampling is eager.
    # No dropout (compiled code draws its masks from another generator); compiled kernels
    # round differently, so the curves agree to a tolerance, not bit for bit.
    args = ("gpt_config.dropout=0.0", "trainer_config.log_every=1")
    eager = main_py(*tiny(*args, "run_name=eager"))
    # Scalar C++ kernels: on a machine with no inductor cache yet, generating and compiling the
    # vectorised ones took 27 s here, these 15 s; what is checked does not depend on them.
    import torch._inductor.config  # here: only this test compiles in the test process

    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        proc = main_py(*tiny(*args, "run_name=compiled", "trainer_config.compile=True"))
    assert eager.returncode == proc.returncode == 0, proc.stderr
    # Inductor's kernels add in other orders (and call libm's exp and tanh): the unrounded
    # losses differ by a few ulps of ~4 (measured: at most 1.9e-6 over the 10 steps, in
    # TensorBoard, under ATEN_CPU_CAPABILITY=default, avx2 and avx512), so the log by at most
    # one unit of its 4th decimal (as in test_mingpt_strategies; measured: equal).
    compiled, eager_losses = train_losses(proc.stdout), train_losses(eager.stdout)
    assert len(compiled) == 10 and sorted(compiled) == sorted(eager_losses), compiled
    assert all(log_units(compiled[s], eager_losses[s]) <= 1 for s in compiled), (
        compiled, eager_losses)
    assert re.search(r"^sample:\n.{5,}", proc.stdout, re.M)
    snap = read_snapshot(mingpt / "runs/compiled/snapshot")
    assert not any("_orig_mod" in key for key in snap["model"])  # the plain model's names


def test_fsdp_cpu_offload_with_fp16(main_py):
    proc = main_py(*tiny("trainer_config.distributed_method=fsdp", "run_name=offload",
                         "trainer_config.cpu_offload=True", "trainer_config.precision=fp16"))
    assert proc.returncode == 0, proc.stderr
    assert_learned(proc.stdout)


def test_launch_py_runs_torchrun_and_its_workers_share_one_run_dir(ddp_reference):
    # launch.py only builds the torchrun command: one run shows it (the runs below use
    # torchrun directly, with the same overrides launch.py passes on).
    proc, run_dir = ddp_reference
    assert "--nproc_per_node=2" in proc.stdout
    assert "world size 2" in proc.stdout
    assert_learned(proc.stdout)
    # No run_name given: both workers still picked the same directory (torchrun's run id),
    # where each would compute its own start time to the second (the fixture found one).
    assert {f"memory/peak_mb_rank{r}" for r in range(2)} <= scalar_tags(run_dir)
    assert read_snapshot(run_dir / "snapshot")["world_size"] == 2


def test_ddp_killed_worker_resumes_bitwise_slowest(mingpt, ddp_reference):
    reference, a_dir = ddp_reference
    # Through tests/teardown_probe.py: no gloo thread may be left as the restarted workers
    # exit (tests/test_teardown.py). torchrun's restart as a user runs it: its rendezvous store
    # shared with the workers (SHARED_STORE), where each attempt's group forms on keys of its
    # own (mingpt/restarts.py; the other steps' restarts: tests/README.md, "Restarts").
    proc = run([TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=3",
                TEARDOWN_PROBE, "main.py", *tiny("run_name=ddp_b", *DDP_ARGS)], cwd=mingpt,
               FAULT_AT_STEP="7", **SHARED_STORE)
    assert "FAULT_AT_STEP=7: killing this worker" in proc.stdout
    # One failed attempt, the kill, and the first restart's group formed (no crash loop).
    seen = attempts(proc.stderr)
    assert (seen["exit_codes"], seen["mesh_failures"]) == ([-signal.SIGKILL], 0), \
        proc.stderr[-3000:]
    # Steps 4 and 8 are snapshotted; the kill comes before step 8 ends, so 4 is the restart.
    assert "resumed from" in proc.stdout and "at step 4 (epoch 0)" in proc.stdout
    assert "resuming with" not in proc.stdout  # the same config: the schedule goes on as saved
    after = proc.stdout.split("resumed from")[-1]
    assert gloo_threads_at_exit(after) == ["0", "0"], after[-2000:]
    assert sorted(train_losses(after)) == [5, 10]
    # Step 4 was evaluated before its snapshot was saved: the resumed run does not redo it.
    assert sorted(val_losses(after)) == [8, 10]
    assert val_events(mingpt / "runs/ddp_b") == val_events(a_dir) == [0, 4, 8, 10]
    a, b = read_snapshot(a_dir / "snapshot"), read_snapshot(mingpt / "runs/ddp_b/snapshot")
    assert a["step"] == b["step"] == 10
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for p, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][p][name]), (p, name)
    assert a["scheduler"] == b["scheduler"]
    for r in range(2):
        assert torch.equal(a["rng"][r]["torch"], b["rng"][r]["torch"])
    assert val_losses(reference.stdout)[10] == val_losses(proc.stdout)[10]


def test_fsdp_kill_resume_and_world_size_change_slowest(mingpt, ddp_reference, main_py,
                                                        sample_py):
    args = tiny("run_name=fsdp_k", "trainer_config.distributed_method=fsdp",
                "trainer_config.activation_checkpointing=true", "trainer_config.grad_accum_steps=2")
    # Killed during its first save, after the shards were written and before `latest`: the
    # restart finds no committed snapshot, says so, and trains from the start: what follows
    # is an uninterrupted run (the FSDP teardown check: tests/test_teardown.py; a resume in
    # the middle, bit for bit: test_mingpt_strategies.py).
    k = run([TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1", "main.py",
             *args], cwd=mingpt, FAULT_AT_SAVE="4")
    assert "FAULT_AT_SAVE=4: killing this worker" in k.stdout
    assert k.stderr.count("holds no committed snapshot") == 1  # rank 0 says it, once
    assert "resumed from" not in k.stdout
    restarted = k.stdout.split("| world size 2")[-1]  # the second workers' output
    final_a = assert_learned(restarted)
    assert sorted(p.name for p in (mingpt / "runs/fsdp_k/snapshot").iterdir()) == [
        "latest", "step_00000008", "step_00000010"]  # keep_last=2
    # Same data, same initial weights, fp32: FSDP computes what DDP computes, up to the order
    # of floating-point sums (reduce-scatter vs all-reduce), a few ulps of each loss: the same
    # logged curve to one unit of its 4th decimal (as in test_mingpt_strategies; measured:
    # equal unrounded, in TensorBoard, under ATEN_CPU_CAPABILITY=default, avx2 and avx512).
    ddp_train = train_losses(ddp_reference[0].stdout)
    assert log_units(final_a, val_losses(ddp_reference[0].stdout)[10]) <= 1
    fsdp_train = train_losses(restarted)
    assert sorted(fsdp_train) == sorted(ddp_train), fsdp_train
    assert all(log_units(fsdp_train[s], ddp_train[s]) <= 1 for s in ddp_train), (fsdp_train,
                                                                                 ddp_train)
    # The 2-rank sharded snapshot resumes on 1 process: DCP reshards on load.
    c = main_py(*tiny("run_name=fsdp_c", "trainer_config.distributed_method=fsdp",
                      "trainer_config.max_steps=12",
                      "trainer_config.snapshot_path=runs/fsdp_k/snapshot"))
    assert c.returncode == 0, c.stderr
    assert "snapshot saved by 2 ranks, now 1" in c.stdout
    assert "at step 10 (epoch 0)" in c.stdout and sorted(val_losses(c.stdout)) == [10, 12]
    # The same weights, evaluated on 1 rank instead of 2 (the loss sums in another order; an
    # ulp apart, measured): the same to one unit of the log's 4th decimal.
    assert log_units(val_losses(c.stdout)[10], final_a) <= 1
    assert (mingpt / "runs/fsdp_k/snapshot/latest").read_text() == "step_00000012"
    # sample.py reads the sharded snapshot into one process.
    s = sample_py("--snapshot", "runs/fsdp_k/snapshot", "--prompt", "JULIET:", "--num_tokens",
                  "25")
    assert s.returncode == 0, s.stderr
    assert s.stdout.startswith("JULIET:") and len(s.stdout.rstrip("\n")) == len("JULIET:") + 25
    assert "(dcp, step 12, " in s.stderr


def test_changed_adamw_settings_on_resume_are_followed_and_said(main_py, mingpt):
    """A snapshot's param groups hold the saving run's betas and weight decay; a resume with
    other values once kept those silently while config.yaml recorded the new ones."""
    args = tiny("run_name=adamw", "trainer_config.sample_tokens=0", "trainer_config.eval_every=0")
    first = [a.replace("max_steps=10", "max_steps=4") for a in args]
    assert main_py(*first).returncode == 0
    proc = main_py(*args, "optimizer_config.weight_decay=0.05", "optimizer_config.betas=[0.8,0.9]")
    assert proc.returncode == 0, proc.stderr
    assert ("resuming with trainer_config.max_steps 4 -> 10, "
            "optimizer_config.betas [0.9, 0.95] -> [0.8, 0.9], "
            "optimizer_config.weight_decay 0.1 -> 0.05: the lr schedule and AdamW follow the new "
            "values from step 4 on") in proc.stdout
    # In effect: the final snapshot's param groups (decayed Linear weights; the rest none).
    groups = read_snapshot(mingpt / "runs/adamw/snapshot")["optimizer"]["param_groups"]
    assert [(g["weight_decay"], list(g["betas"])) for g in groups] == [(0.05, [0.8, 0.9]),
                                                                      (0.0, [0.8, 0.9])]


def test_changed_schedule_on_resume_is_followed_and_said(main_py):
    args = tiny("run_name=sched", "trainer_config.sample_tokens=0", "trainer_config.eval_every=0")
    first = [a.replace("max_steps=10", "max_steps=4") for a in args]
    assert main_py(*first).returncode == 0
    proc = main_py(*args, "optimizer_config.lr=1e-3")
    assert proc.returncode == 0, proc.stderr
    assert ("resuming with trainer_config.max_steps 4 -> 10, optimizer_config.lr 0.003 -> 0.001"
            ": the lr schedule follows the new values from step 4 on") in proc.stdout
    with mingpt_imported() as m:  # the lr the new schedule gives after 5 and 10 steps
        expected = [1e-3 * m["optim"].lr_factor(s, 2, 10, 0.1) for s in (5, 10)]
    logged = re.findall(r"^step (?:5|10)/10 \| loss [0-9.]+ \| lr ([0-9.e+-]+)", proc.stdout,
                        re.M)
    assert [float(lr) for lr in logged] == [float(f"{lr:.2e}") for lr in expected]
