"""optimizer_config.name=muon (mingpt/muon.py): torch.optim.Muon for the blocks' matrices,
AdamW for the rest, under every layout that shards or splits those matrices.

One process: the optimizer is torch.optim.Muon plus torch.optim.AdamW, bit for bit, and an
expert stack's matrices are orthogonalized one by one. On 4 gloo ranks, and again on 2 (ONE
spawned world each, the runs in-process as main.py runs them): ddp, zero, fsdp, tp (with ddp or
fsdp over it), pp and the experts' ep layouts follow ddp's run (one process's arithmetic up to
the all-reduce's order) within the bound derived below; on 4, a run stopped halfway resumes
under another layout, through either snapshot format, and still follows. (Same-layout resumes,
bit for bit, are the feature matrix's: tests/test_feature_matrix.py.)
"""
import copy
import json
from pathlib import Path

import pytest
import torch

from mingpt_helpers import (
    join_world,
    log_units,
    mingpt_imported,
    retrace,
    snapshot_weights,
    spawn_world,
    train_losses,
    weights_apart,
)
from test_mingpt_strategies import LOSS_UNITS, OUTLIERS, run

GLOBAL_BATCH, STEPS, HALF = 8, 4, 2
MUON_LR = 0.02
# The bound against ddp, derived. A Muon step moves a weight by lr_t * s * |O_ij|, O the
# orthogonalized update (singular values pushed into about [0.7, 1.2], so |O_ij| <= 1.2) and
# s = sqrt(max(1, rows / cols)) <= 2 here (c_fc's 128 x 32): in STEPS steps (warmup 2, then
# the constant lr) at most MUON_BUDGET, whatever the gradient. torch.optim.Muon runs its 5
# Newton-Schulz iterations in bf16 (unit roundoff 2^-8): gradients that differ in their last
# fp32 bits (another sum order: FSDP's reduce-scatter, TP's split matmuls, the pipeline's
# tied embedding) round to other bf16 values in a few entries, each iteration's rounding
# again, so an update can differ by about 5 * 2^-8 = 2% of its size in the entries it
# touches, and the next gradients by as much again through the weights: 4% of MUON_BUDGET.
# A MoE adds routing: a token whose two best experts nearly tie can go to the other expert
# in one layout, moving both experts' gradients by its share. Hence 10% of the budget.
# Measured worst (avx512, the 4-rank runs) / MUON_BUDGET: fsdp, ddp x tp, fsdp x tp 1.2%,
# ddp x pp 3.0%, the ep layouts 5.6%, the resumes 0.9%. The two bugs this test found moved
# weights by 28%: zero's Muon groups taking AdamW's lr, fsdp x tp gathering q/k/v rows in
# DTensor's order (a layout only mingpt/parallel/strided.py describes).
MUON_BUDGET = MUON_LR * (0.5 + 1 + 1 + 1) * 2 * 1.2
WEIGHT_TOLERANCE = 0.1 * MUON_BUDGET
# Losses (4 decimals) within LOSS_UNITS (test_mingpt_strategies); a MoE's routing flips move
# a loss by a few units of the 4th decimal (measured: 4).
MOE_LOSS_UNITS = 10
# world -> name -> (distributed_method, tp_size, pp_size, ep_size, n_expert); the
# data-parallel degree is what the world leaves: dp = world / (tp x pp).
LAYOUTS = {
    4: {"ddp": ("ddp", 0, 0, 0, 0),  # dp 4: the reference of the dense layouts
        "zero": ("zero", 0, 0, 0, 0),
        "fsdp": ("fsdp", 0, 0, 0, 0),
        "ddp_tp2": ("ddp", 2, 0, 0, 0),
        "fsdp_tp2": ("fsdp", 2, 0, 0, 0),
        "ddp_pp2": ("ddp", 0, 2, 0, 0),
        "moe_ddp": ("ddp", 0, 0, 0, 4),  # 4 experts, dp 4: the reference of the ep layouts
        "moe_ep2": ("ddp", 0, 0, 2, 4),  # each rank 2 whole experts: no gather
        "moe_fsdp_ep2": ("fsdp", 0, 0, 2, 4)},  # and FSDP over the 2 ranks sharing them
    2: {"ddp": ("ddp", 0, 0, 0, 0),  # dp 2
        "zero": ("zero", 0, 0, 0, 0),
        "fsdp": ("fsdp", 0, 0, 0, 0),
        "tp2": ("ddp", 2, 0, 0, 0),  # dp 1 x tp 2
        "pp2": ("ddp", 0, 2, 0, 0),  # two stages, dp 1
        "moe_ddp": ("ddp", 0, 0, 0, 4),
        "moe_ep2": ("ddp", 0, 0, 2, 4)},
}
# On 4 ranks: stopped at HALF under the first layout, resumed to STEPS under the second.
MOVES = {"fsdp_then_tp2": ("fsdp", "ddp_tp2"),  # shards into shards (DCP)
         "ddp_then_fsdp": ("ddp", "fsdp")}  # ddp's whole weights into FSDP's shards


def overrides(world: int, name: str, run_dir: Path, text: Path, max_steps: int) -> list[str]:
    method, tp, pp, ep, experts = LAYOUTS[world][name]
    dp = world // (max(tp, 1) * max(pp, 1))
    return retrace(run_dir, text, max_steps,
                   "optimizer_config.name=muon", f"optimizer_config.muon_lr={MUON_LR}",
                   f"trainer_config.distributed_method={method}", f"trainer_config.tp_size={tp}",
                   f"trainer_config.pp_size={pp}", f"trainer_config.ep_size={ep}",
                   f"gpt_config.n_expert={experts}",
                   f"trainer_config.batch_size={GLOBAL_BATCH // dp}",
                   f"trainer_config.microbatches={2 if pp else 1}")


def _worker(rank: int, store: str, out: str, text: str, world: int) -> None:
    join_world(rank, store, world)
    out_dir, text, result = Path(out), Path(text), {}
    with mingpt_imported("main") as m:
        for name in LAYOUTS[world]:
            result[name] = run(m, overrides(world, name, out_dir / name, text, STEPS))[0]
        for move, (first, then) in (MOVES if world == 4 else {}).items():
            run(m, overrides(world, first, out_dir / move, text, HALF))
            result[move] = run(m, overrides(world, then, out_dir / move, text, STEPS))[0]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    m["distributed"].release()


def spawn(tmp_path_factory, world: int) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp(f"muon{world}")
    return out, spawn_world(_worker, world, out, world)[0]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return spawn(tmp_path_factory, 4)


@pytest.fixture(scope="module")
def spawned2(tmp_path_factory):
    return spawn(tmp_path_factory, 2)


def tiny_gpt(m, **extra):
    config = m["model"].GPTConfig(model_type=None, n_layer=2, n_head=2, n_embd=16,
                                  vocab_size=11, block_size=8, dropout=0.0, **extra)
    torch.manual_seed(0)
    return m["model"].GPT(config)


def test_muon_is_torchs_muon_on_the_matrices_and_adamw_on_the_rest():
    with mingpt_imported() as m:
        model = tiny_gpt(m)
        ref = copy.deepcopy(model)
        groups = model.optim_groups(0.1, muon=True)
        # the blocks' 8 Linear weights; embeddings (the tied head), biases and norms: AdamW
        assert [len(g["params"]) for g in groups] == [8, 20]
        assert [g.get("muon", False) for g in groups] == [True, False]
        optimizer = m["muon"].MuonAdamW(groups, lr=1e-2, betas=(0.9, 0.99), muon_lr=MUON_LR)
        theirs = ref.optim_groups(0.1, muon=True)
        muon = torch.optim.Muon(theirs[0]["params"], lr=MUON_LR, weight_decay=0.1)
        adamw = torch.optim.AdamW(theirs[1:], lr=1e-2, betas=(0.9, 0.99))
        x = torch.randint(0, 11, (4, 8))
        for _ in range(3):
            for net, steps in ((model, [optimizer]), (ref, [muon, adamw])):
                net(x, x)[1].backward()
                for o in steps:
                    o.step()
                    o.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(),
                                                     strict=True))


def test_an_expert_stack_is_orthogonalized_one_matrix_at_a_time():
    """A stack (E, in, out) takes, per expert, torch.optim.Muon's step for the Linear weight
    (out, in) it is the transpose of: the same update and the same lr scaling."""
    with mingpt_imported() as m:
        torch.manual_seed(0)
        stack = torch.nn.Parameter(torch.randn(3, 8, 24))
        linears = [torch.nn.Parameter(w.T.clone()) for w in stack.detach()]
        grad = torch.randn(3, 8, 24)
        stack.grad = grad.clone()
        for linear, g in zip(linears, grad, strict=True):
            linear.grad = g.T.clone()
        m["muon"].MuonAdamW([{"params": [stack], "muon": True}], muon_lr=MUON_LR).step()
        torch.optim.Muon(linears, lr=MUON_LR, weight_decay=0.1).step()
        for w, linear in zip(stack.detach(), linears, strict=True):
            assert torch.equal(w, linear.detach().T)


@pytest.mark.parametrize("world", [4, 2])
def test_muon_follows_ddp_under_every_layout(world, request):
    out, logs = request.getfixturevalue("spawned" if world == 4 else "spawned2")
    for name, (_, _, _, _, experts) in LAYOUTS[world].items():
        reference = "moe_ddp" if experts else "ddp"
        losses, ref = train_losses(logs[name]), train_losses(logs[reference])
        assert sorted(losses) == list(range(1, STEPS + 1)), (name, losses)
        units = MOE_LOSS_UNITS if experts else LOSS_UNITS
        assert all(log_units(losses[s], ref[s]) <= units for s in losses), (name, losses, ref)
        worst, beyond = weights_apart(snapshot_weights(out / name),
                                      snapshot_weights(out / reference), WEIGHT_TOLERANCE)
        assert beyond <= OUTLIERS, (name, worst / MUON_BUDGET, beyond)
    assert all(torch.equal(a, b) for a, b in zip(snapshot_weights(out / "zero").values(),
                                                 snapshot_weights(out / "ddp").values(),
                                                 strict=True))  # the owner's own step


def test_a_muon_run_resumes_under_another_layout(spawned):
    """Stopped at HALF, resumed to STEPS under other degrees: it still follows the run that
    was never stopped (the same bound), the Muon momentum and AdamW moments carried over."""
    out, logs = spawned
    for move, (first, _) in MOVES.items():
        losses, ref = train_losses(logs[move]), train_losses(logs[first])
        assert sorted(losses) == list(range(HALF + 1, STEPS + 1)), (move, losses)
        assert all(log_units(losses[s], ref[s]) <= LOSS_UNITS for s in losses), (move, losses)
        worst, beyond = weights_apart(snapshot_weights(out / move),
                                      snapshot_weights(out / first), WEIGHT_TOLERANCE)
        assert beyond <= OUTLIERS, (move, worst / MUON_BUDGET, beyond)
