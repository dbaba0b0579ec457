"""05_mingpt's mixture of experts and expert parallelism (MOE.md, mingpt/parallel/expert.py):
with its experts split over ep ranks the MoE model computes the gradients, losses and weights
of one process on the same global batch, resumes bit for bit, and its snapshots resume where
the experts are not split (ddp, fsdp).

All runs share ONE group of 4 spawned gloo processes (as test_mingpt_layouts). The gradient
reference is one plain GPT on every rank, run on the global batch as a one-process run with
gradient accumulation does (4 micro-batches of 2 sequences, loss / 4 each: the arithmetic of
ddp over 4 ranks of 2, whose losses the trainer runs then follow). Refusals run in this process.
"""
import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mingpt_helpers import (
    MINGPT,
    Job,
    assert_refused,
    assert_retraces,
    graphs_compiled,
    join_world,
    mingpt_imported,
    recorded_warnings,
    retrace,
    snapshot_weights,
    spawn_world,
    tiny,
    train_losses,
    weights_at,
)
from test_mingpt_layouts import BOUNDS
from test_mingpt_strategies import HALF, STEPS, run

WORLD = 4
GLOBAL_BATCH = 8  # sequences per step, whatever the layout: batch_size x dp
MOE = ("gpt_config.n_expert=4", "gpt_config.expert_top_k=2")
# name -> (distributed_method, ep_size, pp_size). ep does not reduce dp: batch_size is
# GLOBAL_BATCH / (world / pp) whatever ep_size is.
LAYOUTS = {
    "ddp": ("ddp", 0, 0),          # dp 4, experts whole on every rank: the reference
    "ddp_ep2": ("ddp", 2, 0),      # dp 4 = edp 2 x ep 2 (FSDP2's replicate)
    "fsdp_ep4": ("fsdp", 4, 0),    # dp 4 = edp 1 x ep 4, FSDP from the meta device
    # dp 4 = edp 2 x ep 2: each expert's weights also sharded over its 2 edp ranks, and
    # offloaded with the rest (cpu_offload: on a CPU the policy is all there is to see)
    "fsdp_ep2": ("fsdp", 2, 0),
    "ddp_pp2": ("ddp", 0, 2),      # pp 2 x dp 2, experts whole: ddp_ep2_pp2's reference
    "ddp_ep2_pp2": ("ddp", 2, 2),  # pp 2 x (edp 1 x ep 2)
    "to_ddp": ("ddp", 0, 0),       # ddp_ep2's snapshot at HALF, resumed here
    "to_fsdp": ("fsdp", 0, 0),
}
MEMORY = ("ddp", "ddp_ep2", "fsdp_ep4")  # model_size.predict checked on these, every rank
GRAD_CASES = (("ddp", 2), ("fsdp", 4), ("fsdp", 2), ("ddp", 4))
# The first step's gradients against the one-process reference, every entry within
# GRAD_REL of its tensor's largest magnitude. Both sum the same token terms, in another order
# (another batch shape per matmul, the all-to-all's regrouping, DDP's and FSDP's sums over
# ranks): each rounding moves a sum by U = 6e-8 of its terms' size, and a sum over the
# ~2^9 token terms of a batch accumulates at most ~log2(2^9) = 9 levels of it in a blocked
# reduction, ~1e-6 of the largest gradient. A bug (a row sent to the wrong expert, an
# expert's gradient averaged over the wrong ranks: off by a factor ep) changes entries by
# their own size. 1e-4 sits two orders above the one and four below the other.
GRAD_REL = 1e-4


def overrides(name: str, run_dir: Path, text: Path, max_steps: int) -> list[str]:
    method, ep, pp = LAYOUTS[name]
    dp = WORLD // max(pp, 1)
    offload = ("trainer_config.cpu_offload=true",) if name == "fsdp_ep2" else ()
    return retrace(run_dir, text, max_steps, *MOE, *offload,
                   f"trainer_config.distributed_method={method}", f"trainer_config.ep_size={ep}",
                   f"trainer_config.pp_size={pp}",
                   f"trainer_config.batch_size={GLOBAL_BATCH // dp}",
                   f"trainer_config.microbatches={2 if pp else 1}")


def _gradients(m: dict, method: str, ep: int) -> dict:
    """The largest |gradient - reference| / max |reference| per parameter after one forward
    and backward of the global batch, split over the data-parallel ranks."""
    GPT, GPTConfig = m["model"].GPT, m["model"].GPTConfig
    config = GPTConfig(model_type=None, n_layer=2, n_head=2, n_embd=32, vocab_size=65,
                       block_size=16, dropout=0.0, n_expert=4, expert_top_k=2)
    data = torch.randint(65, (GLOBAL_BATCH, 17), generator=torch.Generator().manual_seed(7))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    torch.manual_seed(0)
    reference = GPT(config)
    for rows in range(0, GLOBAL_BATCH, 2):  # one process, 4 micro-steps of 2 sequences
        (reference(x[rows:rows + 2], y[rows:rows + 2])[1] / 4).backward()
    torch.manual_seed(0)
    model = m["parallel"].parallelize(GPT(config), torch.device("cpu"), method, ep_size=ep)
    rank, size = m["wrappers"].data_parallel(model)
    assert size == WORLD  # ep does not reduce the data-parallel degree
    share = GLOBAL_BATCH // size
    model(x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share])[1].backward()
    apart = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        expected = dict(reference.named_parameters())[name].grad
        apart[name] = ((grad - expected).abs().max() / expected.abs().max()).item()
    return apart


def _memory(m: dict, model, optimizer) -> dict[str, int]:
    """This rank's parameter, gradient and AdamW bytes, counted from its tensors (one more
    forward and backward first: gradients exist, as after the dry run's step)."""
    config = m["wrappers"].unwrap(model).config
    rank = dist.get_rank()
    x = torch.randint(config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(rank))
    model(x, x)[1].backward()
    return m["memory"].model_state_bytes(model, optimizer)


def _offload_policies(model) -> dict[str, str]:
    """The offload policy of every module FSDP wraps, by the kind of module."""
    return {("experts" if "experts" in name else "dense"):
            type(module._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
            for name, module in model.named_modules()
            if hasattr(module, "_get_fsdp_state") and module._get_fsdp_state()._fsdp_param_group}


def _worker(rank: int, store: str, out: str, text: str) -> None:
    join_world(rank, store, WORLD)
    out_dir, text, result = Path(out), Path(text), {"grads": {}}
    with mingpt_imported("main") as m:
        for method, ep in GRAD_CASES:
            result["grads"][f"{method}_ep{ep}"] = _gradients(m, method, ep)
        for name in ("ddp", "ddp_ep2", "fsdp_ep4", "fsdp_ep2", "ddp_pp2", "ddp_ep2_pp2"):
            with recorded_warnings() as warned:
                log, model, optimizer = run(m, overrides(name, out_dir / name, text, STEPS))
            result[name] = {"log": log, "offload": _offload_policies(model),
                            "warnings": warned}
            if name in MEMORY:
                result[name]["memory"] = _memory(m, model, optimizer)
                # The model the runs built (the data's vocabulary): what the dry run plans.
                result["model"] = dataclasses.asdict(m["wrappers"].unwrap(model).config)
        # Stopped halfway and resumed under the same layout: bit for bit.
        run(m, overrides("ddp_ep2", out_dir / "half", text, HALF))
        run(m, overrides("ddp_ep2", out_dir / "half", text, STEPS))
        # ep 2's snapshot at HALF resumed with the experts whole: ddp and fsdp.
        run(m, overrides("ddp_ep2", out_dir / "to_ddp", text, HALF))
        if rank == 0:
            shutil.copytree(out_dir / "to_ddp", out_dir / "to_fsdp")
        dist.barrier()
        for moved in ("to_ddp", "to_fsdp"):
            result[moved] = {"log": run(m, overrides(moved, out_dir / moved, text, STEPS))[0]}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    m["distributed"].release()  # every reference dropped first: gloo's threads are joined


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """Rank 0's results; each run's snapshot in out/<name>/snapshot."""
    out = tmp_path_factory.mktemp("experts")
    return out, spawn_world(_worker, WORLD, out)[0]


def test_model_size_predicts_every_ranks_expert_bytes(spawned):
    """model_size.predict's bytes per rank (the dry run's plan: a MoE model's runs on real
    shards of its own, as routing reads values) equal the trained runs' to the byte, on every
    rank (FSDP's chunks differ). Planned here, in the test's process: the dry run starts a
    process per rank, which a spawned gloo rank should not."""
    out, result = spawned
    layouts = {name: [f"trainer_config.distributed_method={LAYOUTS[name][0]}",
                      f"trainer_config.ep_size={LAYOUTS[name][1]}"] for name in MEMORY}
    with mingpt_imported("model_size") as m:
        with torch.device("meta"):
            model = m["model"].GPT(m["model"].GPTConfig(**result["model"]))
        planned = m["model_size"].predict(model, layouts, WORLD, GLOBAL_BATCH // WORLD,
                                          ranks=tuple(range(WORLD)))
    for rank in range(WORLD):
        measured = json.loads((out / f"rank{rank}.json").read_text())
        for name in MEMORY:
            plan = {key: planned[name][rank][key] for key in ("parameters", "gradients",
                                                               "optimizer")}
            assert measured[name]["memory"] == plan, (rank, name, measured[name]["memory"],
                                                      plan)
        # ep 2 holds half the experts of ep 1, ep 4 (fsdp) a quarter, dense weights alike.
        assert measured["ddp_ep2"]["memory"]["parameters"] < \
            measured["ddp"]["memory"]["parameters"]


def test_the_first_gradients_are_one_process_gradients(spawned):
    _, result = spawned
    for case, apart in result["grads"].items():
        assert any("experts" in name for name in apart), case
        worst = max(apart, key=apart.get)
        assert apart[worst] <= GRAD_REL, (case, worst, apart[worst])


def test_every_ep_layout_follows_one_process_losses_and_weights(spawned):
    """The balancing loss is a product of two means over a micro-batch's tokens, so it
    depends on which sequences share a micro-batch: dp 4 x 2 sequences groups the global
    batch as a one-process run with 4 micro-steps of 2 does, a pipeline over dp 2 as one with
    2 x 2 micro-batches of 2 (measured: 5 log units apart after 4 steps at aux_loss_coef 0.01,
    equal at 0). So the pipeline's reference is the same pipeline with the experts whole."""
    out, result = spawned
    for reference in ("ddp", "ddp_pp2"):  # both learn
        losses = train_losses(result[reference]["log"])
        assert sorted(losses) == list(range(1, STEPS + 1)), (reference, losses)
        assert losses[STEPS] < losses[1] - 0.1, (reference, losses)
    # ddp_pp2 against ddp: the grouping only, so the same cross-entropy at step 1.
    assert train_losses(result["ddp_pp2"]["log"])[1] == train_losses(result["ddp"]["log"])[1]
    for name, reference in (("ddp_ep2", "ddp"), ("fsdp_ep4", "ddp"), ("fsdp_ep2", "ddp"),
                            ("ddp_ep2_pp2", "ddp_pp2")):
        assert_retraces(out, result, name, reference, range(1, STEPS + 1), **BOUNDS)


def test_cpu_offload_moves_the_experts_too(spawned):
    """fsdp with ep_size and cpu_offload: the experts' shards are offloaded as the dense ones
    are (they were left out: the experts, most of a MoE model's weights, stayed put)."""
    _, result = spawned
    assert result["fsdp_ep2"]["offload"] == {"experts": "CPUOffloadPolicy",
                                             "dense": "CPUOffloadPolicy"}
    assert result["fsdp_ep4"]["offload"] == {"experts": "OffloadPolicy", "dense": "OffloadPolicy"}


def test_ep_keeps_the_batch_and_the_log_shows_the_experts_load(spawned):
    _, result = spawned
    # ep keeps every rank a data-parallel one: 2 sequences x 4 ranks per step.
    for name in ("ddp_ep2", "fsdp_ep4", "fsdp_ep2"):
        assert "8 sequences per step (batch_size 2 x grad_accum_steps 1 x world size 4)" \
            in result[name]["log"], name
    for name in ("ddp", "ddp_ep2", "fsdp_ep4"):
        lines = [line for line in result[name]["log"].splitlines() if line.startswith("step ")
                 and "| loss " in line]
        assert len(lines) == STEPS and all("| aux " in line and "tokens/expert " in line
                                           for line in lines), (name, lines)


def test_an_ep_run_warns_of_nothing(spawned):
    """Every ep layout's run (build, train, save) raises no warning: before, each rank's log
    carried torch 2.14's FutureWarning for torch.distributed.nn.functional.all_to_all_single
    (deprecated: expert.py sends the rows with all_to_all_single_autograd), FSDP2's warning
    that the experts returned a view tensor (its output), and DeviceMesh's that slicing the
    flattened "dp" from the root mesh will go (layout.axis keeps the flattened meshes)."""
    _, result = spawned
    warned = {name: result[name]["warnings"] for name in LAYOUTS if "ep" in name
              and name in result}
    assert sorted(warned) == ["ddp_ep2", "ddp_ep2_pp2", "fsdp_ep2", "fsdp_ep4"]
    assert warned == {name: [] for name in warned}, warned


def test_a_resume_is_bitwise_and_ep1_layouts_resume_it(spawned):
    out, result = spawned
    whole, resumed = snapshot_weights(out / "ddp_ep2"), snapshot_weights(out / "half")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    for moved in ("to_ddp", "to_fsdp"):
        assert_retraces(out, result, moved, "ddp", range(HALF + 1, STEPS + 1), **BOUNDS)
    # ddp writes its snapshot as the shards it resumed from were written: one format.
    assert (out / "to_ddp/snapshot/latest").is_file()


def test_ep_size_must_divide_the_data_parallel_degree(monkeypatch):
    """torchrun's WORLD_SIZE is known before any group: ep groups are cut out of dp ranks."""
    monkeypatch.setenv("WORLD_SIZE", "6")
    with mingpt_imported() as m:
        assert_refused(m["config"], tiny(*MOE, "trainer_config.ep_size=4"),
                       "trainer_config.ep_size=4 must divide the data-parallel degree 6 (world "
                       "size 6 / (pp x cp x tp)): the experts are split over groups of ep_size "
                       "data-parallel ranks")
        # pp 2 of 4 ranks leaves dp 2: ep 2 fits, ep 4 does not.
        resolve = m["layout"].resolve
        assert resolve("fsdp", 4, pp_size=2, ep_size=2).sizes() == {"pp": 2, "edp": 1, "ep": 2}
        assert resolve("ddp", 8, ep_size=2).dp == 8  # ep does not reduce the data degree
        with pytest.raises(ValueError, match="ep_size=4 must divide the data-parallel degree 2"):
            resolve("fsdp", 4, pp_size=2, ep_size=4)


# --- compile: the routing stays out of the graphs ---------------------------------------------

def test_a_compiled_moe_run_keeps_its_graphs_through_any_routing(tmp_path):
    """trainer_config.compile=true with experts, 12 steps on one process, as forked jobs
    compiling with aot_eager (dynamo and AOTAutograd as under inductor). The routing's shapes
    are the data's (rows per expert): compiled, each routing that emptied an expert or gave it
    one row recompiled the block, and at step 5, where an expert first got no token, the
    recompiled graph failed (BackendCompilerFailed: "AssertionError: 234 not in VR[256, 256]",
    under inductor too). Now MoE.route runs eagerly (wrappers.compile_in_place): the run ends
    with the eager run's weights, bit for bit (the same ops on the same tensors, in the same
    order), and with as many graphs as a 2-step run compiles: none for a routing."""
    text = tmp_path / "input.txt"
    text.write_text((MINGPT / "data/input.txt").read_text()[:40_000])

    def job(name: str, steps: int, compile: bool) -> tuple[str, str]:
        args = tiny(*MOE[:1], f"trainer_config.compile={str(compile).lower()}",
                    f"trainer_config.max_steps={steps}", "trainer_config.log_every=1",
                    "trainer_config.save_every=0", "trainer_config.sample_tokens=0",
                    "trainer_config.eval_batches=2", "gpt_config.dropout=0.0",
                    f"data_config.path={text}", f"run_dir={tmp_path / name}")
        ran = Job(MINGPT, "main.py", args, 1, tmp_path / f"{name}.log",
                  compile_backend="aot_eager")
        log = ran.finish()
        assert ran.returncode == 0, log[-3000:]
        return log, str(tmp_path / name / "snapshot")

    (short, _), (log, compiled), (_, eager) = (job("short", 2, True), job("long", 12, True),
                                               job("eager", 12, False))
    graphs = [graphs_compiled(out) for out in (short, log)]
    assert graphs[0] == graphs[1] and graphs[0][0] > 0, graphs
    # A routing that left an expert without a token came (the case that failed), and went.
    assert re.search(r"^step [3-9]/12 .*\| tokens/expert 0-", log, re.M), log
    whole, reference = weights_at(compiled), weights_at(eager)
    assert all(torch.equal(whole[k], reference[k]) for k in reference)
