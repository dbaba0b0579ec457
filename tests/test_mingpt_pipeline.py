"""05_mingpt's pipeline parallelism (pp): every schedule computes what one process computes with
the same micro-batch accumulation, resumes bit for bit, trades snapshots with fsdp both ways,
holds the model state the dry run predicts (model_size.predict), and refuses sizes that do
not fit in one line.

Two spawned gloo processes train every schedule in-process through main.load_train_objs and
the Trainer, as main.py does; the one-process reference trains in this process (a one-rank
gloo group). fsdp_pp (a 2-D mesh) and fsdp_tp_pp (3-D) follow DDP in test_mingpt_layouts.py's
warm worlds of 4 and 8 ranks.
"""
import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before any group exists (test_teardown.py)

from mingpt_helpers import (
    U,
    assert_refused,
    join_world,
    log_units,
    mingpt_imported,
    spawn_world,
    tiny,
    train_losses,
)
from test_mingpt_strategies import configure, fit, run

CPU = torch.device("cpu")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb")
STEPS, HALF = 4, 2
# 4 blocks: 2 stages of 2 blocks, or (looped schedules, 2 stages per rank) 4 stages of 1.
MODEL = ("gpt_config.n_layer=4", "gpt_config.n_head=2", "gpt_config.n_embd=16")
# The bound for weights after STEPS AdamW steps whose gradients differ only by rounding:
# test_mingpt_strategies.py derives it (1% of the most a weight can move in these steps,
# sum(lr_t), and up to OUTLIERS weights whose gradient cancels to ~eps). Here the rounding is
# the tied embedding's gradient: the first stage sums its micro-batches' embedding parts, the
# last stage their head parts, and the two sums are added (pipeline.Pipeline.finish_step);
# one process adds each micro-batch's two parts first. The same terms in another order.
STEP_BUDGET = 3e-3 * (0.5 + 1 + 1 + 1)
WEIGHT_TOLERANCE, OUTLIERS = 1e-2 * STEP_BUDGET, 3
TIED = ("wte.weight", "lm_head.weight")


def overrides(run_dir: Path, text: Path, max_steps: int, method: str = "pp",
              schedule: str = "1f1b", batch: int = 8, accum: int = 1, *extra: str) -> list[str]:
    return tiny(f"run_dir={run_dir}", f"data_config.path={text}", *MODEL,
                f"trainer_config.distributed_method={method}",
                f"trainer_config.pp_schedule={schedule}", "trainer_config.microbatches=4",
                f"trainer_config.batch_size={batch}", f"trainer_config.grad_accum_steps={accum}",
                f"trainer_config.max_steps={max_steps}",
                f"trainer_config.snapshot_path={run_dir}/snapshot",
                # Clipping off: its norm is summed over the stages in another order (checked
                # apart, below); no dropout: other ranks draw other masks.
                "trainer_config.grad_clip=0.0", "gpt_config.dropout=0.0",
                "trainer_config.min_lr_ratio=1.0", "trainer_config.log_every=1",
                "trainer_config.save_every=0", "trainer_config.eval_batches=2",
                "trainer_config.sample_tokens=0", *extra)


def part_weights(m: dict, model: torch.nn.Module) -> dict:
    """This rank's weights (its stages' parameters, full tensors)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
            for k, v in m["wrappers"].unwrap(model).state_dict().items()}


NORM_CONFIG = dict(model_type=None, n_layer=4, n_head=2, n_embd=16, vocab_size=11,
                   block_size=8, dropout=0.0)


def norm_batch() -> torch.Tensor:
    return torch.randint(0, 11, (8, 8), generator=torch.Generator().manual_seed(3))


def clip_norm(m: dict) -> float:
    """The gradient norm clip_grad_norm_ takes over both stages after one round (a max_norm
    it does not reach: nothing is scaled)."""
    torch.manual_seed(0)
    model = m["parallel"].parallelize(m["model"].GPT(m["model"].GPTConfig(**NORM_CONFIG)), CPU,
                                      "pp", microbatches=4)
    pipeline, x = model.pipeline, norm_batch()
    pipeline.start_step(1)
    pipeline.train_step(x, x)
    pipeline.finish_step()
    return m["grads"].clip_grad_norm_(model.parameters(), 1e9, pipeline.group,
                                       pipeline.not_counted).item()


def _worker(rank: int, store: str, out: str, text: str) -> None:
    join_world(rank, store, 2)
    out_dir, result = Path(out), {}
    with mingpt_imported("main") as m:
        for schedule in SCHEDULES:
            log, model, optimizer = run(m, overrides(out_dir / schedule, text, STEPS,
                                                     schedule=schedule))
            result[schedule] = log
            if schedule == "1f1b":  # the bytes this rank holds, for the dry run's prediction
                model_state = m["memory"].model_state_bytes(model, optimizer)
                result["model_state"] = model_state | {"gradients": sum(
                    p.numel() * 4 for p in model.parameters())}  # zero_grad freed them
        log, *_ = run(m, overrides(out_dir / "one_step", text, 1))
        # Stopped halfway, then resumed: the snapshot at HALF goes on to STEPS.
        run(m, overrides(out_dir / "half", text, HALF))
        result["resumed"], *_ = run(m, overrides(out_dir / "half", text, STEPS))
        # Resumed with another weight decay: this run's on every stage, as with ddp and fsdp
        # (each rank's groups hold other parameters).
        run(m, overrides(out_dir / "decay", text, HALF))
        *_, optimizer = run(m, overrides(out_dir / "decay", text, HALF + 1, "pp", "1f1b", 8, 1,
                                         "optimizer_config.weight_decay=0.3"))
        result["weight_decay"] = [group["weight_decay"] for group in optimizer.param_groups]
        # Checkpointing recomputes the same operations: the same numbers.
        result["checkpointed"], *_ = run(m, overrides(out_dir / "ckpt", text, STEPS, "pp",
                                                      "1f1b", 8, 1, "trainer_config."
                                                      "activation_checkpointing=true"))
        result["bf16"], *_ = run(m, overrides(out_dir / "bf16", text, STEPS, "pp", "1f1b", 8,
                                              1, "trainer_config.precision=bf16"))
        result["clipped"], *_ = run(m, overrides(out_dir / "clipped", text, STEPS, "pp", "1f1b",
                                                 8, 1, "trainer_config.grad_clip=1e-3"))
        # Snapshots both ways: fsdp resumes pp's (its step STEPS: no step to run), pp fsdp's.
        _, weights = fit(m, overrides(out_dir / "1f1b", text, STEPS, "fsdp", batch=4))
        if rank == 0:
            torch.save(weights, out_dir / "pp_into_fsdp.pt")
        fit(m, overrides(out_dir / "fsdp", text, STEPS, "fsdp", batch=4))
        _, model, _ = run(m, overrides(out_dir / "fsdp", text, STEPS))
        torch.save(part_weights(m, model), out_dir / f"fsdp_into_pp{rank}.pt")
        result["norm"] = clip_norm(m)
        result["errors"] = {}
        for name, args in {"n_layer": ["gpt_config.n_layer=1"],
                           "pp_size": ["trainer_config.pp_size=1"]}.items():
            with contextlib.redirect_stdout(io.StringIO()):
                result["errors"][name] = m["main"].train(configure(
                    m, overrides(out_dir / "refused", text, STEPS) + args), CPU)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    m["distributed"].release()  # every reference dropped first: gloo's threads are joined


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    return out, out / "input.txt", spawn_world(_worker, 2, out)


@pytest.fixture(scope="module")
def reference(spawned):
    """One process, micro-batches of 2 sequences accumulated 4 times: the arithmetic of pp's
    8 sequences cut into 4 micro-batches (the same permutation, dealt out in the same order)."""
    out, text, _ = spawned
    # One thread, as the spawned ranks: a CPU kernel splits its sums over the threads it has
    # (LayerNorm's bias gradient did), which would change their order.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with mingpt_imported("main") as m:
            logs = {}
            for steps in (1, STEPS):
                logs[steps], weights = fit(m, overrides(out / f"one_{steps}", text, steps,
                                                        "ddp", batch=2, accum=4))
                torch.save(weights, out / f"one_{steps}.pt")
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    return logs, {steps: torch.load(out / f"one_{steps}.pt") for steps in (1, STEPS)}


def snapshot_weights(path: Path) -> dict:
    with mingpt_imported() as m:
        state = m["snapshot"].load_train_state(str(path), "fsdp")
        model = m["model"].GPT(m["model"].GPTConfig(**state["model_config"]))
        m["shards"].load_sharded_weights(str(path), model)
        return model.state_dict()


def test_one_step_equals_one_process_bit_for_bit_but_the_tied_weight(spawned, reference):
    """After one step every weight but the tied embedding is the one process's, bit for bit:
    its gradient is the same arithmetic; the tied one differs by rounding (module docstring)."""
    out, _, _ = spawned
    weights, expected = snapshot_weights(out / "one_step/snapshot"), reference[1][1]
    for key, value in expected.items():
        if key in TIED:
            torch.testing.assert_close(weights[key], value, rtol=0, atol=WEIGHT_TOLERANCE)
        else:
            assert torch.equal(weights[key], value), key


def test_every_schedule_follows_the_one_process_run(spawned, reference):
    out, _, (result, _) = spawned
    logs, weights = reference
    expected_loss = train_losses(logs[STEPS])
    for schedule in SCHEDULES:
        losses = train_losses(result[schedule])
        assert sorted(losses) == list(range(1, STEPS + 1)), (schedule, losses)
        # As test_mingpt_strategies: a few ulps of a loss of ~4 move a logged value by 1 unit.
        assert all(log_units(losses[s], expected_loss[s]) <= 1 for s in losses), schedule
        # (Validation losses do not compare: the validation set is eval_batches x batch_size
        # sequences, and the reference's batches are 4 times smaller.)
        got = snapshot_weights(out / schedule / "snapshot")
        diffs = torch.cat([(got[k] - v).abs().flatten() for k, v in weights[STEPS].items()])
        assert int((diffs > WEIGHT_TOLERANCE).sum()) <= OUTLIERS, (schedule, diffs.max())


def test_resume_is_bit_for_bit(spawned):
    out, _, (result, _) = spawned
    whole, resumed = train_losses(result["1f1b"]), train_losses(result["resumed"])
    assert sorted(resumed) == list(range(HALF + 1, STEPS + 1)), resumed
    assert all(resumed[s] == whole[s] for s in resumed), (resumed, whole)
    a, b = snapshot_weights(out / "1f1b/snapshot"), snapshot_weights(out / "half/snapshot")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_takes_this_runs_hyper_parameters_on_every_stage(spawned):
    """DCP saves each param group's list of parameter names once (rank 0's), though every
    pipeline rank holds other parameters: a rank that took it over matched none of its own.
    Every stage's groups come back whole (their AdamW state: test_resume_is_bit_for_bit), and
    with this run's weight decay, as config.yaml records it (optim.restore_settings)."""
    ranks = [result["weight_decay"] for result in spawned[2]]
    assert ranks == [[0.3, 0.0], [0.3, 0.0]], ranks


def test_checkpointing_bf16_and_clipping(spawned):
    _, _, (result, _) = spawned
    fp32 = train_losses(result["1f1b"])
    # Activation checkpointing recomputes the same operations in backward: equal.
    assert train_losses(result["checkpointed"]) == fp32
    # bf16 rounds each matmul's inputs to 8 bits of mantissa (2^-9 relative) with fp32 sums:
    # logits of size ~0.1 move by ~1e-3 and a loss of ~4 by less, far below 1% of it; a
    # broken cast (fp32 weights never used, a loss not computed) changes far more, or nothing.
    bf16 = train_losses(result["bf16"])
    assert all(abs(bf16[s] - fp32[s]) < 0.01 * fp32[s] for s in fp32) and bf16 != fp32
    # A norm of 1e-3 clips every step (gradients are ~1e-1): the loss falls more slowly than
    # unclipped, and the steps still differ (the norm covers every stage, or one stage's
    # gradients alone would be scaled and the run diverge from this the other way).
    clipped = train_losses(result["clipped"])
    assert fp32[1] == clipped[1] and clipped[STEPS] > fp32[STEPS], (clipped, fp32)


def test_the_clip_norm_covers_every_stage_once(spawned):
    """The norm over both stages (the tied embedding counted once) is the whole model's: the
    same squares, summed per rank and then over the ranks instead of all at once. Positive
    terms: the relative error of n additions is at most n U, n ~ 40 tensors here. Counting
    the tied weight twice or one stage alone would be off by its share, percents."""
    with mingpt_imported() as m:
        torch.manual_seed(0)
        model = m["model"].GPT(m["model"].GPTConfig(**NORM_CONFIG))
        for chunk in norm_batch().tensor_split(4):
            (model(chunk, chunk)[1] / 4).backward()
        expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
    for result in spawned[2]:
        assert abs(result["norm"] - expected) <= 64 * U * expected, (result["norm"], expected)


def test_snapshots_reshard_between_pp_and_fsdp(spawned):
    out, _, _ = spawned
    pp = snapshot_weights(out / "1f1b/snapshot")
    fsdp = torch.load(out / "pp_into_fsdp.pt")
    assert all(torch.equal(fsdp[k], pp[k]) for k in pp)
    fsdp_snapshot = snapshot_weights(out / "fsdp/snapshot")
    parts = [torch.load(out / f"fsdp_into_pp{r}.pt") for r in (0, 1)]
    for part in parts:
        assert all(torch.equal(value, fsdp_snapshot[k]) for k, value in part.items())
    assert set(parts[0]) | set(parts[1]) == set(fsdp_snapshot)  # every weight, somewhere
    assert "blocks.0.ln_1.weight" not in parts[1] and "blocks.3.ln_1.weight" not in parts[0]


def test_sample_reads_a_pipelines_snapshot_whole(spawned):
    """sample.py (and main.py's end-of-run sample) read every stage's weights into one GPT."""
    out = spawned[0]
    with mingpt_imported() as m:
        model, meta = m["sample"].load_model(str(out / "1f1b/snapshot"), CPU)
        text = m["sample"].generate_text(model, meta, "\n", 5, device=CPU)
    weights = snapshot_weights(out / "1f1b/snapshot")
    assert all(torch.equal(value, weights[k]) for k, value in model.state_dict().items())
    assert len(text) == 6, text


def test_model_size_predicts_each_ranks_model_state(spawned):
    """The dry run's plan of each stage (model_size.predict: 2 ranks, 8 sequences in 4
    micro-batches, 1f1b, as the spawned run) holds what the real stage held, to the byte."""
    _, _, results = spawned
    with mingpt_imported("model_size") as m:
        with torch.device("meta"):
            model = m["model"].GPT(m["model"].GPTConfig(**m["snapshot"].load_train_state(
                str(spawned[0] / "1f1b/snapshot"), "fsdp")["model_config"]))
        plans = m["model_size"].predict(model, {"pp": ["trainer_config.distributed_method=pp"]},
                                        2, 8, ranks=(0, 1), microbatches=4)["pp"]
    for rank, result in enumerate(results):
        assert {k: plans[rank][k] for k in result["model_state"]} == result["model_state"], rank


def test_sizes_that_do_not_fit_are_one_line(spawned):
    errors = spawned[2][0]["errors"]
    assert errors == {
        "n_layer": "pipeline parallelism over 2 stages needs at least 2 blocks (one per stage), "
                   "got n_layer=1; use fewer stages (pp_size, pp_stages_per_rank) or more "
                   "layers",
        "pp_size": "distributed_method=pp runs one pipeline, so pp_size must be 0 or the world "
                   "size (2), got 1; use fsdp_pp for data parallelism across pipelines"}


@pytest.mark.parametrize("args, message", [
    # pp_size is a degree of any flavour but dp (one process drives every GPU).
    (["trainer_config.distributed_method=dp", "trainer_config.pp_size=2"],
     "distributed_method=dp (nn.DataParallel, one process) combines with no other axis, got "
     "pp_size=2; use ddp or fsdp with it"),
    (["trainer_config.distributed_method=pp", "trainer_config.microbatches=3"],
     "trainer_config.microbatches must be a divisor of batch_size (8): each micro-step's batch "
     "is cut into that many micro-batches, got 3"),
    (["trainer_config.distributed_method=pp", "trainer_config.pp_schedule=zbv"],
     "trainer_config.pp_schedule must be one of gpipe, 1f1b, interleaved_1f1b, looped_bfs, "
     "interleaved_zb, got 'zbv'"),
    (["trainer_config.distributed_method=fsdp_tp_pp"],
     "trainer_config.tp_size must be >= 1 with fsdp_tp_pp (processes per TP group inside each "
     "stage), got 0"),
    (["trainer_config.distributed_method=pp", "trainer_config.precision=fp16"],
     "trainer_config.precision must be fp32 or bf16 with pipeline parallelism (fp16's loss "
     "scaling would have to run inside the schedule), got 'fp16'"),
])
def test_config_refuses_what_does_not_fit(args, message):
    with mingpt_imported() as m:
        assert_refused(m["config"], tiny(*args), message)


def test_split_and_mesh_layout():
    """The layout's pure functions: an even split, a given one, and the mesh order."""
    with mingpt_imported() as m:
        pipeline = __import__("mingpt.parallel.pipeline", fromlist=["x"])
        assert pipeline.split_blocks(5, 2) == [range(0, 3), range(3, 5)]
        assert pipeline.split_blocks(4, 2, [3, 1]) == [range(0, 3), range(3, 4)]
        with pytest.raises(ValueError, match="must give 2 stages"):
            pipeline.split_blocks(4, 2, [4, 0])
        assert [pipeline.rank_of_stage(s, 2) for s in range(4)] == [0, 1, 0, 1]
        # pp outermost, tp innermost: 8 ranks as (pp 2, dp 2, tp 2).
        layout = m["layout"].resolve("fsdp_tp_pp", 8, tp_size=2, pp_size=2)
        assert layout.sizes() == {"pp": 2, "dp": 2, "tp": 2}
        assert m["parallel"].STRATEGIES["fsdp_tp_pp"].pipeline
