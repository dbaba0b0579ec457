"""05_mingpt resumes a snapshot under another strategy of its layout with this run's own
settings: the optimizer's kernel choice (fused or not), where AdamW's step counts live, and
dropout streams that stay alike within a tensor-parallel group. Also the strategy pairs that
cannot work are refused in one line, and nn.DataParallel's replicas keep the run's autocast
dtype and count every GPU for MFU (the GPU side: tests/test_gpu.py).

The multi-rank checks run in ONE pair of spawned gloo processes, through main.load_train_objs
and the Trainer as main.py runs them (test_mingpt_strategies.run)."""
import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mingpt_helpers import (
    assert_refused,
    join_world,
    mingpt_imported,
    spawn_world,
    train_losses,
)
from test_mingpt_strategies import overrides, run

CPU = torch.device("cpu")
HALF, STEPS = 2, 4


def settings(optimizer: torch.optim.Optimizer) -> dict:
    """The kernel choice of every param group, and where each AdamW step count lives."""
    local = getattr(optimizer, "optim", optimizer)  # ZeRO's local AdamW
    return {"fused": sorted({str(g["fused"]) for g in
                             [*optimizer.param_groups, *local.param_groups]}),
            "steps_on_param_device": all(s["step"].device == p.device
                                         for p, s in local.state.items())}


def _worker(rank: int, store: str, out: str, text: str) -> None:
    join_world(rank, store, 2)
    out_dir, result = Path(out), {}
    with mingpt_imported("main") as m:
        # (first, then): HALF steps under `first`, then the same run_dir resumed under `then`.
        # With dropout: the resumed tp run must draw one mask per TP group.
        for first, then in (("fsdp", "tp"), ("tp", "fsdp"), ("zero", "zero"), ("tp", "tp")):
            folder = out_dir / f"{first}-{then}"
            dropout = ["gpt_config.dropout=0.1"]
            run(m, overrides(first, folder, text, HALF) + dropout)
            log, model, optimizer = run(m, overrides(then, folder, text, STEPS) + dropout)
            # ln_f is whole on every rank under tp: both ranks must hold the same values.
            ln_f = m["wrappers"].unwrap(model).ln_f.weight
            ln_f = ln_f.full_tensor() if hasattr(ln_f, "full_tensor") else ln_f.detach()
            both = [torch.empty_like(ln_f) for _ in range(2)]
            dist.all_gather(both, ln_f.contiguous())
            result[f"{first}-{then}"] = {**settings(optimizer), "log": log,
                                         "ln_f_equal": torch.equal(*both)}
            del model, optimizer
        # The same tp run in one go: the half-and-resumed tp-tp run must end at its weights.
        run(m, overrides("tp", out_dir / "tp-whole", text, STEPS) + dropout)
        result["tp_resume_bitwise"] = all(
            torch.equal(a, b) for a, b in zip(whole_weights(m, out_dir / "tp-whole"),
                                             whole_weights(m, out_dir / "tp-tp"), strict=True))
        result["head_masks"] = head_masks(m)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    m["distributed"].release()  # every reference dropped first: gloo's threads are joined


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    out = tmp_path_factory.mktemp("strategy_mix")
    return spawn_world(_worker, 2, out)


def test_an_fsdp_snapshot_resumes_under_tp_with_tps_optimizer(mixed):
    # The fsdp run's groups said fused=True; tp's mix of DTensors and plain tensors cannot take
    # the fused kernel, and the restored groups crashed at the first step.
    for result in mixed:
        assert result["fsdp-tp"]["fused"] == ["False"], result["fsdp-tp"]
        assert sorted(train_losses(result["fsdp-tp"]["log"])) in ([], [3, 4])
    assert sorted(train_losses(mixed[0]["fsdp-tp"]["log"])) == [3, 4]


def test_a_tp_snapshot_resumes_under_fsdp_with_the_fused_kernel(mixed):
    for result in mixed:
        assert result["tp-fsdp"]["fused"] == ["True"], result["tp-fsdp"]  # not tp's False


def test_zero_resumes_with_its_fused_adamw_and_step_counts_beside_the_parameters(mixed):
    # ZeRO's load_state_dict puts AdamW's step counts on the CPU; on a GPU the fused kernel
    # refused them (tests/test_gpu.py resumes zero on CUDA). Here: what build_optimizer built.
    for result in mixed:
        assert result["zero-zero"]["fused"] == ["True"]
        assert result["zero-zero"]["steps_on_param_device"]


def test_a_changed_tp_layout_keeps_one_dropout_stream_per_tp_group(mixed):
    # fsdp -> tp at the same world size: the two fsdp ranks' RNG states were restored onto
    # the two ranks of one TP group, whose dropout masks then differed, and the weights both
    # ranks must hold alike (ln_f) drifted apart. tp -> tp restores the (equal) states.
    for pair in ("fsdp-tp", "tp-tp"):
        assert mixed[0][pair]["ln_f_equal"] and mixed[1][pair]["ln_f_equal"], pair
    assert "data-parallel size 2 then, 1 now" in mixed[0]["fsdp-tp"]["log"]
    assert "then," not in mixed[0]["tp-tp"]["log"]  # the same layout: the saved streams


def whole_weights(m: dict, run_dir: Path) -> list[torch.Tensor]:
    """The final snapshot's weights, whole, as sample.py reads them."""
    model, _ = m["sample"].load_model(str(run_dir / "snapshot"), CPU)
    return list(model.state_dict().values())


def head_masks(m: dict) -> dict:
    """Each rank's attention-dropout mask for its own head under tp over both ranks, read
    through the head's attention with q = k = 0 (every weight 1/T... causally: row i has
    i + 1 equal weights) and v the identity (the output is the weights, dropped and
    rescaled); and whether the ranks' shared RNG stream is still alike after drawing it."""
    torch.manual_seed(3)  # the same shared stream on both ranks, as the trainer seeds them
    config = m["model"].GPTConfig(model_type=None, n_layer=1, n_head=2, n_embd=16,
                                  vocab_size=11, block_size=8, dropout=0.5)
    model = m["parallel"].parallelize(m["model"].GPT(config), CPU, "tp")
    attend = model.blocks[0].attn.attend
    q = torch.zeros(1, 1, 8, 8)  # (B, this rank's one head, T, hs): uniform causal weights
    dropped = attend(q, q, torch.eye(8).view(1, 1, 8, 8), 0.5)[0, 0] != 0  # (T, T) kept
    both = [torch.empty_like(dropped) for _ in range(2)]
    dist.all_gather(both, dropped)
    state = torch.get_rng_state()
    states = [torch.empty_like(state) for _ in range(2)]
    dist.all_gather(states, state)
    return {"differ": not torch.equal(*both), "kept": int(dropped.sum()),
            "shared_stream_alike": torch.equal(*states)}


def test_each_tp_rank_draws_its_own_heads_dropout_and_a_resume_stays_bitwise(mixed):
    """One process draws every head its own mask; TP's ranks shared one stream, so head h on
    every rank got the same mask. Now each rank's heads draw from a stream of their own (36
    causal weights of 8 x 8, half kept: two equal masks have odds of about 2^-36), the shared
    stream stays alike, and a resume of tp with dropout ends where one run does, bit for bit."""
    for result in mixed:
        assert result["head_masks"]["differ"], result["head_masks"]
        assert result["head_masks"]["shared_stream_alike"]
        assert 0 < result["head_masks"]["kept"] < 36
        assert result["tp_resume_bitwise"]


# --- in this process -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def m():
    with mingpt_imported() as modules:
        yield modules


@pytest.mark.parametrize("args, message", [
    (["trainer_config.distributed_method=tp", "trainer_config.precision=fp16"],
     "trainer_config.precision must be fp32 or bf16 with distributed_method=tp (fp16's "
     "GradScaler cannot unscale its sharded and plain gradients together; fsdp_tp takes "
     "fp16), got 'fp16'"),
    (["trainer_config.distributed_method=dp", "trainer_config.compile=true"],
     "trainer_config.compile must be False with distributed_method=dp (each GPU's replica "
     "would run the first GPU's compiled blocks); use ddp to compile, got True"),
])
def test_pairs_that_cannot_work_are_refused_in_one_line(m, args, message):
    assert_refused(m["config"], args, message)


def test_the_config_takes_fsdp_tp_with_fp16(m):
    """Only the config: FSDP's GradScaler unscales sharded and plain gradients alike, so
    fsdp_tp keeps fp16, which ddp with tp_size refuses (tensor.check_config)."""
    t = m["config"].load(["trainer_config.distributed_method=fsdp_tp",
                          "trainer_config.precision=fp16"]).trainer_config
    assert (t.distributed_method, t.precision) == ("fsdp_tp", "fp16")


def test_a_replica_thread_computes_in_the_callers_autocast_dtype(m):
    # nn.DataParallel's threads enter autocast with `enabled` only; a new thread starts from
    # the device's default dtype (CUDA: fp16, CPU: bf16). Here the CPU shows the mechanism:
    # the caller asks for fp16, a plain thread computes in bf16, keep_autocast's in fp16.
    dtypes = {}

    def matmul(name: str) -> None:
        a = torch.ones(4, 4)
        dtypes[name] = (a @ a).dtype

    def in_thread(function, name: str) -> None:
        def body() -> None:
            with torch.autocast("cpu", enabled=True):  # as parallel_apply's worker does
                function(name)
        thread = threading.Thread(target=body)
        thread.start()
        thread.join()

    with torch.autocast("cpu", dtype=torch.float16):
        in_thread(matmul, "plain")
        in_thread(m["precision"].keep_autocast(matmul, "cpu"), "kept")
    assert dtypes == {"plain": torch.bfloat16, "kept": torch.float16}


def test_dataparallel_counts_every_gpu_for_mfu(m):
    model = m["dataparallel"].DataParallel(nn.Linear(2, 2))  # no GPU: no device ids
    assert m["wrappers"].local_devices(model, CPU) == [CPU]
    model.device_ids = [0, 1]  # as on a 2-GPU machine
    cuda = torch.device("cuda")
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert m["wrappers"].local_devices(model, cuda) == gpus
    # One process, two GPUs: the model's FLOP/s over both GPUs' peak, not one.
    assert m["mfu"].mfu(6e9, 1e4, 1e14, devices=2) == pytest.approx(0.3)
