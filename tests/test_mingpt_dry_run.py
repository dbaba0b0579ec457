"""trainer_config.dry_run=N (mingpt/dry_run.py) against real runs: on 2, 4 and 8 gloo processes,
each layout's real step is counted with the dry run's own counters (dry_run.measure_step: the
same code, on a real group), and the dry run of the same config on the fake group must give
the same numbers for every rank it plans:

- model state (parameters, gradients, AdamW's state: memory.model_state_bytes of the rank's
  tensors), to the byte;
- bytes sent and received per axis and kind of collective (CommCounter), and the call counts,
  exactly: the dry run issues the collectives the real step issues, with the same shapes;
- saved activations per micro-batch and at their peak, to the byte: autograd saves tensors of
  the same shapes whatever the values (the dry run's are fake tensors: shapes only), and no
  term of them depends on a value. FSDP's gathered weights, saved by each Linear, are model
  state in a buffer, not activations, in both counts;
- the work the predicted step time is computed from (step_time.WorkCounter): matmul FLOPs,
  the other ops, the DTensor ops and the bytes the other ops touch, exactly: the same ops run
  on tensors of the same shapes.

One spawn of W processes per world size runs every layout of that size; one more, of 4, the
feature matrix's covering runs that hold every feature between them (tests/README.md's grid,
dry_run's row: the plan, not the work). A layout a real run refuses is refused by the dry
run with the same one `error:` line."""
import importlib
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before any group exists (test_teardown.py)

import feature_matrix
from conftest import in_process
from mingpt_helpers import MINGPT, mingpt_imported, overridden, start_world
from test_feature_matrix import pretrained  # noqa: F401 (a fixture: init_from's stand-in)

# A model small enough for 8 processes on 2 cores; dropout 0 (cp requires it).
BASE = ["gpt_config.model_type=null", "gpt_config.n_layer=2", "gpt_config.n_head=2",
        "gpt_config.n_embd=32", "gpt_config.block_size=32", "gpt_config.dropout=0.0",
        "trainer_config.batch_size=4", "trainer_config.microbatches=2",
        "trainer_config.grad_accum_steps=2",
        "optimizer_config.name=adamw"]  # AdamW unless a layout names muon (below)
# world size -> layouts (their overrides): ddp, zero, fsdp, tp, pp, cp and pp in bf16 at 2;
# FSDP and TP with Muon, DDP with its fp16 hook at 2; FSDP x TP, FSDP x PP, DDP x PP in bf16,
# DDP x PP x CP, ZeRO x PP and TP x PP at 4;
# FSDP x TP x PP at 8.
LAYOUTS = {
    2: {"ddp": ["trainer_config.distributed_method=ddp"],
        "zero": ["trainer_config.distributed_method=zero"],
        "fsdp": ["trainer_config.distributed_method=fsdp"],
        "tp": ["trainer_config.distributed_method=tp"],
        "pp": ["trainer_config.distributed_method=pp"],
        "ddp_cp": ["trainer_config.distributed_method=ddp", "trainer_config.cp_size=2"],
        # bf16 through a pipeline: the stages send what autocast or FSDP2's policy leaves
        "pp_bf16": ["trainer_config.distributed_method=pp", "trainer_config.precision=bf16"],
        # Muon gathers each sharded matrix whole (mingpt/muon.py): its all-gathers counted,
        # and its state, a momentum per matrix instead of AdamW's two moments
        "fsdp_muon": ["trainer_config.distributed_method=fsdp", "optimizer_config.name=muon"],
        "tp_muon": ["trainer_config.distributed_method=tp", "optimizer_config.name=muon"],
        # DDP's fp16 communication hook: its buckets all-reduced in half the bytes
        "ddp_fp16": ["trainer_config.distributed_method=ddp", "trainer_config.comm_hook=fp16"]},
    4: {"fsdp_tp": ["trainer_config.distributed_method=fsdp", "trainer_config.tp_size=2"],

        "fsdp_pp": ["trainer_config.distributed_method=fsdp", "trainer_config.pp_size=2"],
        # ddp's replicate over 2 pipelines in bf16; cp's share of each sequence between stages
        # (the dry run's stage shapes were fp32 and whole sequences: its backward failed)
        "ddp_pp_bf16": ["trainer_config.distributed_method=ddp", "trainer_config.pp_size=2",
                        "trainer_config.precision=bf16"],
        "ddp_pp_cp": ["trainer_config.distributed_method=ddp", "trainer_config.pp_size=2",
                      "trainer_config.cp_size=2"],
        # ZeRO's plain stages: the pipeline's one all-reduce, each owner's broadcasts
        "zero_pp": ["trainer_config.distributed_method=zero", "trainer_config.pp_size=2"],
        # tp beside a pipeline with dp 1: the real step's tp collectives went through another
        # group of the tp ranks, counted as "world" (dry_run.group_axes now knows it by ranks)
        "tp_pp": ["trainer_config.distributed_method=fsdp", "trainer_config.tp_size=2",
                  "trainer_config.pp_size=2"]},
    8: {"fsdp_tp_pp": ["trainer_config.distributed_method=fsdp", "trainer_config.tp_size=2",
                       "trainer_config.pp_size=2"]},
}
KEYS = ("parameters", "gradients", "optimizer", "activations / micro-batch",
        "peak activations", "comm", "work")
# Layouts whose dry run takes other paths inside torch than their real step, so that its work
# (step_time.WorkCounter) differs in ops and bytes: the counts still held equal, and why the
# rest differs. Where FLOPs differ, the gap is open (DRY_RUN.md, Open).
WORK_GAPS = {
    # The real pipeline's counted step is its second (its first infers the stages' shapes);
    # the dry run's is a first step, which creates AdamW's state (a zeros_like per moment,
    # an op on DTensors where the parameters are).
    **dict.fromkeys(("pp", "pp_bf16", "ddp_pp_bf16", "ddp_pp_cp", "fsdp_pp", "zero_pp"),
                   ("flops",)),
    # FSDP2 copies gathered parameters out on real tensors (copy_) and not on fake ones;
    # Muon's step dispatches more ops in the dry run's processes than in a real one; torch's
    # fp16 hook copies the reduced bucket back in a callback on another thread, unseen.
    **dict.fromkeys(("fsdp", "fsdp_tp", "fsdp_muon", "ddp_fp16"), ("flops", "dtensor_ops")),
    # Open: the dry run counts more FLOPs than the real step (Newton-Schulz under TP; TP
    # with a pipeline).
    "tp_muon": ("dtensor_ops",), "fsdp_tp_pp": (), "tp_pp": (),
}


@pytest.fixture(scope="module")
def m():
    with mingpt_imported("main", "dry_run") as modules:
        yield modules


def configs(m: dict, layouts: dict[str, list[str]], *extra: str) -> dict:
    """Each layout's config (`extra` added), as config.load([*BASE, *overrides, *extra]) makes
    it, with hydra's composition done once per data (its `data_config...` overrides: the
    config group and the path; mingpt_helpers.overridden puts the other keys into a copy and
    checks them by validate), and the model each builds: each data read once."""
    bases: dict[tuple[str, ...], tuple] = {}
    out = {}
    for name, overrides in layouts.items():
        data = tuple(arg for arg in overrides if arg.startswith("data_config"))
        if data not in bases:
            base = m["config"].load([*BASE, *data, *extra])
            d = base.data_config
            _, _, meta = m["data"].data_module(d.name).build_datasets(
                d, base.gpt_config.block_size, base.trainer_config.seed)
            bases[data] = base, meta
        base, meta = bases[data]
        rest = [arg for arg in overrides if arg not in data]
        cfg = overridden(m["config"], base, [*rest, *extra])
        out[name] = cfg, m["config"].model_config(cfg, meta)[0]  # init_from: its sizes
    return out


def _real_worker(rank: int, world: int, store_path: str, out_dir: str,
                 layouts: dict[str, list[str]]) -> None:
    """One rank of a real gloo run: each of `layouts` built as main.py builds it, one step
    counted by dry_run.measure_step."""
    torch.set_num_threads(1)  # W processes share 2 cores
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    sys.path.insert(0, str(MINGPT))
    m = {name.rpartition(".")[2]: importlib.import_module(name) for name in (
        "mingpt.config", "mingpt.dry_run", "mingpt.model", "mingpt.parallel", "mingpt.optim",
        "mingpt.distributed", "mingpt.data")}
    parallel, dry_run = m["parallel"], m["dry_run"]
    results = {}
    for name, (cfg, gpt_config) in configs(m, layouts).items():
        t, o = cfg.trainer_config, cfg.optimizer_config
        torch.manual_seed(t.seed)
        model = parallel.parallelize(m["model"].GPT(gpt_config), dry_run.CPU,
                                     t.distributed_method,
                                     **{key: t[key] for key in parallel.Settings._fields})
        optimizer = m["optim"].build_optimizer(model, t.distributed_method, o.lr, o.betas,
                                               o.weight_decay, o.name, o.muon_lr)
        # A pipeline's first step infers its stages' shapes (one more forward and a metadata
        # exchange); the dry run gives them up front, as every later step runs: the second
        # step is the one to compare.
        steps = 2 if "pp" in parallel.wrappers.unwrap(model).layout.sizes() else 1
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            results[name] = dry_run.measure_step(model, optimizer, t,
                                                 dry_run.batches(t, gpt_config))
        del model, optimizer
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    m["distributed"].release()


def dry_against_real(m, tmp_path: Path, world: int, layouts: dict[str, list[str]],
                     keys: tuple[str, ...]) -> list[tuple]:
    """Each of `layouts` run for real on `world` gloo ranks (one spawn) and planned dry: for
    every rank the dry run plans, (layout, rank, key, dry, real) where `keys` differ (the work
    only in the counts WORK_GAPS still holds equal)."""
    start_world(_real_worker, world, world, str(tmp_path / "store"), str(tmp_path), layouts)
    real = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    wrong = []
    for name, (cfg, gpt_config) in configs(m, layouts, f"trainer_config.dry_run={world}").items():
        lay, plans = m["dry_run"].plan(cfg, gpt_config)
        # Each representative rank planned, at least one: the comparison is not vacuous.
        ranks = sorted(m["dry_run"].representative_ranks(lay))
        assert ranks and sorted(plans) == ranks, (name, sorted(plans), ranks)
        for rank, planned in plans.items():
            measured = json.loads(json.dumps(planned))  # as JSON keeps it (tuple keys, ints)
            for key in keys:
                dry, got = measured[key], real[rank][name][key]
                if key == "work" and name in WORK_GAPS:  # the counts that still agree
                    dry, got = ({k: w[k] for k in WORK_GAPS[name]} for w in (dry, got))
                if dry != got:
                    wrong.append((name, rank, key, dry, got))
        # Something is counted on every axis the layout has: the check is not vacuous.
        assert set(real[0][name]["comm"]), name
        assert all(real[r][name]["parameters"] > 0 for r in range(world))
    return wrong


# 8 processes on 2 cores beside other test workers took over 300 s (load average 16 to 20).
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_dry_run_equals_the_real_run(m, tmp_path, world):
    wrong = dry_against_real(m, tmp_path, world, LAYOUTS[world], KEYS)
    assert not wrong, "\n".join(f"{w[:3]}: dry {w[3]}, real {w[4]}" for w in wrong)


# --- dry_run with every other feature ---------------------------------------------------------
# The plan, not the work: the work's gaps are the layouts' above (WORK_GAPS), which these runs
# share, and Muon's and FSDP2's paths add ops on real tensors that fake ones skip.
PLAN_KEYS = tuple(key for key in KEYS if key != "work")


# 58 s alone on 2 cores when it planned all 15 covering runs, 45 s with the 4 of dry_runs
# (Xeon); beside another test worker, about twice that: room for a slower one.
@pytest.mark.timeout(600)
def test_the_dry_run_plans_every_feature_of_the_matrix_as_it_steps(
        m, tmp_path, pretrained):  # noqa: F811 (pretrained: imported)
    """tests/README.md's grid, dry_run's row: the covering runs of the feature matrix that
    hold every feature between them (feature_matrix.dry_runs: each run's features on, with
    this file's small model), each planned dry on feature_matrix.WORLD ranks, hold and send,
    on every rank it plans, what the real step does, to the byte. init_from's runs start
    from the stand-in GPT-2 (test_feature_matrix's, the same sizes as BASE) on its BPE data:
    the sizes the dry run plans are read from its folder, as a real run reads them before it
    loads the weights."""
    on = feature_matrix.features(m["config"])
    gpt2, bpe = pretrained
    stand_in = {"gpt_config.init_from=gpt2": [f"gpt_config.init_from={gpt2}", "data_config=bpe",
                                              f"data_config.path={bpe}"]}
    layouts = {"+".join(names): [new for arg in feature_matrix.overrides(on, *names)
                                 if arg not in feature_matrix.BASE
                                 for new in stand_in.get(arg, [arg])]
               for names in feature_matrix.dry_runs(m["config"])}
    assert any("data_config=bpe" in args for args in layouts.values())  # init_from is planned
    wrong = dry_against_real(m, tmp_path, feature_matrix.WORLD, layouts, PLAN_KEYS)
    assert not wrong, "\n".join(f"{w[:3]}: dry {w[3]}, real {w[4]}" for w in wrong)


# --- a layout a real run refuses: the same one line -------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["trainer_config.distributed_method=fsdp", "trainer_config.tp_size=4"],
     "error: trainer_config.tp_size=4 must divide the world size 6 (the ranks form "
     "world_size / tp_size tensor-parallel groups)"),
    (["trainer_config.distributed_method=fsdp", "trainer_config.tp_size=3"],
     None),  # heads not divisible by tp_size: tensor.check_tp's line, the same in both
])
def test_a_refused_layout_is_one_error_line_in_dry_and_real_run(m, overrides, message):
    main = m["main"]
    args = [*BASE, *overrides]
    dry = in_process(lambda: main.main([*args, "trainer_config.dry_run=6"]), args, MINGPT)
    # The real run's check, before any process group: torchrun's WORLD_SIZE (config.py).
    real = in_process(lambda: main.main(args), args, MINGPT, WORLD_SIZE="6")
    assert dry.returncode == real.returncode != 0, (dry, real)
    assert dry.stderr == real.stderr, (dry.stderr, real.stderr)
    assert dry.stderr.count("\n") == 1 and dry.stderr.startswith("error: "), dry.stderr
    if message is not None:
        assert dry.stderr == message + "\n"


# --- replica groups: one group's plan, and what each rank sends the others --------------------

@pytest.mark.parametrize("sync, when, per", [
    (["trainer_config.ft_sync=step"], "every step (ft_sync=step)", "step"),
    (["trainer_config.ft_sync=local_sgd", "trainer_config.ft_sync_every=5"],
     "every 5 steps (ft_sync=local_sgd)", "5 steps"),
    (["trainer_config.ft_sync=diloco", "trainer_config.ft_sync_every=10",
      "trainer_config.ft_fragments=2"],
     "every 10 steps, 2 fragments in turn (one every 5 steps) (ft_sync=diloco)", "10 steps"),
])
def test_a_dry_run_of_replica_groups_plans_one_group_and_what_it_sends(m, sync, when, per):
    """With ft_replicas, each group is a torchrun job of its own: the plan is one group's
    step (the table said nothing of the groups: a plan read as the whole job's), and a line
    says what each rank sends the same rank of the other groups: every parameter it holds,
    once per interval (test_mingpt_diloco.py holds the bytes against a real run's, fsdp)."""
    args = [*BASE, "trainer_config.dry_run=2", "trainer_config.ft_replicas=2", *sync]
    proc = in_process(lambda: m["main"].main(args), args, MINGPT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("dry run: ddp: dp 2 (2 ranks)")  # one group's ranks
    cfg = m["config"].load(args)
    model = m["model"].GPT(m["dry_run"].model_config(cfg))
    held = 4 * sum(p.numel() for p in model.parameters())  # ddp: all of it, float32
    assert (f"replica groups: the plan above is one of trainer_config.ft_replicas=2 groups; "
            f"they meet {when}, each rank with the same rank of the other groups through "
            f"torchft's all-reduce, per {per}: rank 0 {held:,} bytes, rank 1 {held:,} "
            "bytes\n") in proc.stdout


# --- compile: the eager step's plan, and a line that says so ---------------------------------

def test_a_dry_run_with_compile_plans_the_eager_step_and_says_so(m):
    """compile's cell of dry_run's row is "◐" (tests/README.md): the dry run plans the
    eager step, the same table as without compile, and a line under it says so (before, the
    table was read as the compiled step's)."""
    args = [*BASE, "trainer_config.distributed_method=fsdp", "trainer_config.dry_run=2"]
    eager, compiled = (in_process(lambda a=a: m["main"].main(a), a, MINGPT)
                       for a in (args, [*args, "trainer_config.compile=true"]))
    assert eager.returncode == compiled.returncode == 0, compiled.stderr
    line = m["dry_run"].COMPILE_LINE + "\n"
    assert line in compiled.stdout and line not in eager.stdout
    assert compiled.stdout.replace(line, "") == eager.stdout


# --- a script without the __main__ guard: an error, not a wait --------------------------------

def test_a_script_without_the_main_guard_ends_in_one_error(tmp_path):
    """The dry run plans each rank in a child from multiprocessing's fork server, which runs
    the calling script's top level again in the child: without the guard, the child dies
    while starting. multiprocessing.Pool (the first version) replaced it for ever and the
    caller waited; the executor now reports the broken pool."""
    script = tmp_path / "plan.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(MINGPT)!r})\n"
        "from mingpt import config, dry_run\n"
        "cfg = config.load(['trainer_config.distributed_method=fsdp', "
        "'trainer_config.dry_run=2'])\n"
        "dry_run.plan(cfg)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.splitlines()[-1] == (
        "RuntimeError: a dry-run process died before it finished; a script that calls the "
        "dry run needs multiprocessing's `if __name__ == \"__main__\":` guard"), proc.stderr
    # The child that re-ran the script stops before it makes a pool of its own: locks it made
    # would be left to the resource tracker, whose warning printed after this error (CI, once).
    assert "leaked" not in proc.stderr, proc.stderr


# --- the predicted peak against the resident set ----------------------------------------------

PEAK_SCRIPT = """
import json, sys
sys.path.insert(0, {mingpt!r})
import torch, torch.distributed as dist
from mingpt import config, dry_run, memory, model, optim, parallel

if __name__ == "__main__":
    torch.set_num_threads(1)
    cfg = config.load({overrides!r})
    t, o = cfg.trainer_config, cfg.optimizer_config
    gpt_config = dry_run.model_config(cfg)
    planned = dry_run.plan(cfg, gpt_config, [0])[1][0]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(t.seed)
    gpt = parallel.parallelize(model.GPT(gpt_config), dry_run.CPU, t.distributed_method)
    opt = optim.build_optimizer(gpt, t.distributed_method, o.lr, o.betas, o.weight_decay)
    batches = dry_run.batches(t, gpt_config)
    dry_run.measure_step(gpt, opt, t, batches)  # AdamW's state exists from here on
    opt.zero_grad(set_to_none=True)
    memory.reset_peak_memory(dry_run.CPU)
    before = memory.peak_memory_mb(dry_run.CPU)[0]
    dry_run.measure_step(gpt, opt, t, batches)
    grown = (memory.peak_memory_mb(dry_run.CPU)[0] - before) * 2**20
    print(json.dumps({{"planned": {{k: v for k, v in planned.items() if k != "comm"}},
                      "grown": grown}}))
"""


def test_the_predicted_peak_bounds_the_resident_set(tmp_path):
    """One process, gpt-mini's sizes, 8 x 256 tokens: the resident set's growth over a
    training step against the plan's. Before the step the process holds the parameters and
    AdamW's state (and torch, the data, Python: the baseline, which is not compared); the
    step adds the gradients, buffers and saved activations, which the plan counts, and
    transients it does not. With glibc returning every block over 128 KiB to the kernel
    when freed (MALLOC_MMAP_THRESHOLD_), the resident set follows the live tensors:
    - at least the peak of saved activations: they are all alive at the end of the forward;
    - at most gradients + buffers + peak activations (the plan's peak less what was there
      before) plus the transients of a backward: two MLP-wide activation gradients
      (B x T x 4C fp32: the GELU's input and output) and two of the logits (B x T x vocab).
    """
    overrides = ["gpt_config.model_type=gpt-mini", "gpt_config.block_size=256",
                 "trainer_config.batch_size=8", "trainer_config.distributed_method=ddp",
                 "trainer_config.dry_run=1"]
    script = tmp_path / "peak.py"
    script.write_text(PEAK_SCRIPT.format(mingpt=str(MINGPT), overrides=overrides))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=MINGPT, env={**os.environ,
                                                        "MALLOC_MMAP_THRESHOLD_": "131072"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    planned, grown = result["planned"], result["grown"]
    tokens, width, vocab = 8 * 256, 4 * 192, 65  # gpt-mini: n_embd 192; the char vocabulary
    transients = 4 * tokens * (2 * width + 2 * vocab)
    low = planned["peak activations"]
    high = planned["gradients"] + planned["buffers"] + planned["peak activations"] + transients
    assert low <= grown <= high, (low, grown, high)
