"""gpt_config's options from recent recipes (model.OPTIONS): rotary, qk_norm, relu2, untied_head.

One process: each option does what its name says (rotary scores depend on relative positions
only, qk_norm makes attention blind to the scale of queries and keys, relu2 is ReLU squared in
the dense and the expert MLPs, an untied head is a weight of its own), generation with the KV
cache computes what the whole sequence does, and GPT-2's weights (init_from, export_hf.py) are
refused in one line each. On 4 gloo ranks (ONE spawned world, the runs in-process as main.py
runs them), with all four options on: every layout follows ddp's run within
test_mingpt_layouts' bound, including the two that meet the options (cp hands each rank its
zig-zag positions, which rotary turns q and k by; a pipeline's later stages know their
positions, and an untied head lives on the last stage only); a run stopped halfway resumes
under its own layout bit for bit and under another within the bound.
"""
import json
from pathlib import Path

import pytest
import torch

from mingpt_helpers import (
    assert_refused,
    assert_retraces,
    join_world,
    mingpt_imported,
    retrace,
    snapshot_weights,
    spawn_world,
    tiny,
)
from test_mingpt_layouts import BOUNDS, GLOBAL_BATCH
from test_mingpt_strategies import HALF, STEPS, run

OPTIONS = ["gpt_config.rotary=true", "gpt_config.qk_norm=true", "gpt_config.relu2=true",
           "gpt_config.untied_head=true"]
WORLD = 4
# name -> (distributed_method, tp_size, pp_size, cp_size, ep_size, n_expert)
LAYOUTS = {
    "ddp": ("ddp", 0, 0, 0, 0, 0),  # dp 4: the reference of the dense layouts
    "zero": ("zero", 0, 0, 0, 0, 0),
    "fsdp": ("fsdp", 0, 0, 0, 0, 0),
    "ddp_tp2": ("ddp", 2, 0, 0, 0, 0),  # each rank half of the heads: rotary per head
    "fsdp_tp2_cp2": ("fsdp", 2, 0, 2, 0, 0),  # zig-zag positions into rotary
    "ddp_pp2": ("ddp", 0, 2, 0, 0, 0),  # wte on stage 0, the untied head on stage 1
    "fsdp_pp2_cp2": ("fsdp", 0, 2, 2, 0, 0),  # stage 1 turns q, k by the kept positions
    "moe_ddp": ("ddp", 0, 0, 0, 0, 4),  # the reference of the ep layout
    "moe_ep2": ("ddp", 0, 0, 0, 2, 4),  # ReLU^2 in the experts behind the all-to-all
}


def overrides(name: str, run_dir: Path, text: Path, max_steps: int) -> list[str]:
    method, tp, pp, cp, ep, experts = LAYOUTS[name]
    dp = WORLD // (max(tp, 1) * max(pp, 1) * max(cp, 1))
    return retrace(run_dir, text, max_steps, *OPTIONS,
                   f"trainer_config.distributed_method={method}", f"trainer_config.tp_size={tp}",
                   f"trainer_config.pp_size={pp}", f"trainer_config.cp_size={cp}",
                   f"trainer_config.ep_size={ep}", f"gpt_config.n_expert={experts}",
                   f"trainer_config.batch_size={GLOBAL_BATCH // dp}",
                   f"trainer_config.microbatches={2 if pp else 1}")


def _worker(rank: int, store: str, out: str, text: str) -> None:
    join_world(rank, store, WORLD)
    out_dir, text, result = Path(out), Path(text), {}
    with mingpt_imported("main") as m:
        for name in LAYOUTS:
            result[name] = {"log": run(m, overrides(name, out_dir / name, text, STEPS))[0]}
        # Stopped halfway, resumed under the same layout (bit for bit) and under another.
        run(m, overrides("fsdp_pp2_cp2", out_dir / "half", text, HALF))
        run(m, overrides("fsdp_pp2_cp2", out_dir / "half", text, STEPS))
        run(m, overrides("fsdp_pp2_cp2", out_dir / "moved", text, HALF))
        result["moved"] = {"log": run(m, overrides("ddp_tp2", out_dir / "moved", text,
                                                   STEPS))[0]}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    m["distributed"].release()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("options")
    return out, spawn_world(_worker, WORLD, out)[0]


def test_every_layout_follows_ddp_with_every_option_on(spawned):
    out, result = spawned
    for name, (*_, experts) in LAYOUTS.items():
        assert_retraces(out, result, name, "moe_ddp" if experts else "ddp",
                        range(1, STEPS + 1), **BOUNDS)
    weights = snapshot_weights(out / "ddp")
    assert "wpe.weight" not in weights  # rotary: no learned positions
    assert not torch.equal(weights["lm_head.weight"], weights["wte.weight"])  # untied


def test_an_options_run_resumes_bitwise_and_under_another_layout(spawned):
    out, result = spawned
    whole, resumed = snapshot_weights(out / "fsdp_pp2_cp2"), snapshot_weights(out / "half")
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert_retraces(out, result, "moved", "fsdp_pp2_cp2", range(HALF + 1, STEPS + 1), **BOUNDS)


# --- one process ---------------------------------------------------------------------------

def gpt(m, **options):
    torch.manual_seed(0)
    config = m["model"].GPTConfig(model_type=None, n_layer=2, n_head=2, n_embd=32,
                                  vocab_size=11, block_size=32, dropout=0.0, **options)
    return m["model"].GPT(config).eval()


# fp32 logits of these models are O(1); the same arithmetic on other shapes or angles rounds
# each of the few hundred terms of a logit by at most 2^-24 relative: 1e-5 is ~100x that sum's
# typical error, while a lost or shifted position moves logits by O(0.1) (asserted below).
ROUNDING = 1e-5


def test_rotary_attention_sees_relative_positions_only():
    """Every position shifted by 7: the rotary model's logits stay (angles differ, their
    differences do not); the learned embedding's move."""
    with mingpt_imported() as m:
        idx = torch.randint(0, 11, (2, 12))
        at = torch.arange(12)
        for rotary in (True, False):
            model = gpt(m, rotary=rotary)
            with torch.no_grad():
                a = model(idx, positions=at)[0]
                b = model(idx, positions=at + 7)[0]
            moved = (a - b).abs().max().item()
            assert (moved < ROUNDING) if rotary else (moved > 1e-2), (rotary, moved)
        assert gpt(m, rotary=True).wpe is None


def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys():
    with mingpt_imported() as m:
        idx = torch.randint(0, 11, (2, 12))
        for qk_norm in (True, False):
            model = gpt(m, qk_norm=qk_norm)
            with torch.no_grad():
                before = model(idx)[0]
                for block in model.blocks:  # q's and k's rows of c_attn, times 5
                    block.attn.c_attn.weight[:64] *= 5
                    block.attn.c_attn.bias[:64] *= 5
                moved = (model(idx)[0] - before).abs().max().item()
            assert (moved < ROUNDING) if qk_norm else (moved > 1e-2), (qk_norm, moved)


def test_relu2_squares_the_relu_in_dense_and_expert_mlps():
    with mingpt_imported() as m:
        x = torch.randn(5, 32)
        mlp = gpt(m, relu2=True).blocks[0].mlp
        expected = mlp.c_proj(torch.relu(mlp.c_fc(x)).square())
        assert torch.equal(mlp(x), expected)
        experts = gpt(m, relu2=True, n_expert=2).blocks[0].mlp.experts
        w_fc, b_fc = experts.c_fc.weight, experts.c_fc.bias
        w_proj, b_proj = experts.c_proj.weight, experts.c_proj.bias
        expected = torch.cat([torch.relu(x[:2] @ w_fc[0] + b_fc[0]).square() @ w_proj[0]
                              + b_proj[0],
                              torch.relu(x[2:] @ w_fc[1] + b_fc[1]).square() @ w_proj[1]
                              + b_proj[1]])
        assert torch.equal(experts(x, [2, 3]), expected)


def test_an_untied_head_is_a_weight_of_its_own():
    """Its own tensor, counted once more; AdamW's (decayed) under Muon, which takes the blocks'
    matrices only; no FLOPs for the embedding lookup it leaves behind."""
    with mingpt_imported() as m:
        tied, untied = gpt(m), gpt(m, untied_head=True)
        assert untied.lm_head.weight is not untied.wte.weight
        assert untied.num_params() == tied.num_params() + 11 * 32
        groups = untied.optim_groups(0.1, muon=True)
        assert [any(p is untied.lm_head.weight for p in g["params"]) for g in groups] \
            == [False, True, False]
        assert groups[1]["weight_decay"] == 0.1
        # The same head matmul in both: the tied weight counts once, the untied lookup not.
        assert untied.num_params(non_embedding=True) == tied.num_params(non_embedding=True)
        assert untied.flops_per_token() == tied.flops_per_token()


def test_the_kv_cache_generates_what_the_whole_sequence_computes():
    """All four options: rotary turns each new key by its own position before it is cached."""
    with mingpt_imported() as m:
        model = gpt(m, rotary=True, qk_norm=True, relu2=True, untied_head=True)
        idx = torch.randint(0, 11, (2, 20))
        with torch.no_grad():
            whole = model(idx)[0]
            caches = [m["model"].KVCache(32) for _ in model.blocks]
            parts = [model(idx[:, :9], caches=caches)[0]]
            parts += [model(idx[:, t:t + 1], caches=caches)[0] for t in range(9, 20)]
        assert (torch.cat(parts, 1) - whole).abs().max().item() < ROUNDING


@pytest.mark.parametrize("option", ["rotary", "qk_norm", "relu2", "untied_head"])
def test_gpt2s_weights_refuse_each_option_in_one_line(option):
    """Before any data or weights are read: the config and export_hf.py's first check."""
    with mingpt_imported("export_hf") as m:
        has = m["model"].OPTIONS[option]
        assert_refused(m["config"], tiny("gpt_config.init_from=gpt2",
                                         f"gpt_config.{option}=true"),
                       f"gpt_config.{option} must be false with gpt_config.init_from=gpt2: "
                       f"GPT-2 has {has}")
        with pytest.raises(ValueError) as refused:
            m["export_hf"].check_representable("runs/x/snapshot", {option: True})
    assert str(refused.value) == (f"runs/x/snapshot holds a model with gpt_config.{option}="
                                  f"true, which GPT-2 (GPT2LMHeadModel) cannot represent: it "
                                  f"has {has}")


def test_rotary_needs_an_even_head_size():
    with mingpt_imported() as m:
        assert_refused(m["config"], tiny("gpt_config.model_type=null", "gpt_config.n_layer=1",
                        "gpt_config.n_head=2", "gpt_config.n_embd=6", "gpt_config.rotary=true"),
                       "gpt_config: rotary needs an even head size (n_embd / n_head), got 6 / 2")
