"""Unit tests for 05_mingpt/mingpt/model.py and model_size.py (CPU, a few seconds each)."""
import ast
import importlib.util
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import PYTHON, REPO, run
from mingpt_helpers import U, assert_close_ulps, mingpt_imported, script_in_process

MINGPT = REPO / "05_mingpt"


sys.path.insert(0, str(MINGPT))  # as 05's scripts import it
M = importlib.import_module("mingpt.model")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models on a shared 2-core machine: a second intra-op thread only adds contention.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(dropout: float = 0.0, **kw) -> "M.GPT":
    torch.manual_seed(0)
    cfg = dict(model_type="gpt-nano", vocab_size=11, block_size=16, dropout=dropout) | kw
    return M.GPT(M.GPTConfig(**cfg))


def test_forward_shapes_and_loss():
    model = tiny_model()
    idx = torch.randint(0, 11, (2, 16))
    logits, loss = model(idx)
    assert logits.shape == (2, 16, 11) and loss is None
    targets = torch.randint(0, 11, (2, 16))
    logits, loss = model(idx, targets)
    # The model's loss is this call on the same logits: equal but for the layout the kernel
    # sees, a mean of 32 positive terms in another order at most, within 32 U relative (sums of
    # positive terms: (n - 1) U). Measured: equal, under ATEN_CPU_CAPABILITY=default, avx2,
    # avx512.
    assert loss.shape == () and loss.item() == pytest.approx(
        F.cross_entropy(logits.view(-1, 11), targets.view(-1)).item(), rel=32 * U, abs=0)
    # Fresh init predicts nearly uniformly: loss close to ln(vocab) for unrelated targets (a
    # behaviour check, not a rounding bound).
    assert abs(loss.item() - math.log(11)) < 0.15
    # -1 targets are ignored: masking half the targets equals the loss over the other half.
    masked = targets.clone()
    masked[:, 8:] = -1
    _, loss_masked = model(idx, masked)
    expected = F.cross_entropy(logits[:, :8].reshape(-1, 11), targets[:, :8].reshape(-1))
    # The same 16 positive terms, averaged in another order (ignore_index skips the others):
    # each sum within 15 U of exact (sums of positive terms: (n - 1) U), so within 2 x 16 U of
    # each other. Measured: equal, under all three capabilities.
    assert loss_masked.item() == pytest.approx(expected.item(), rel=2 * 16 * U, abs=0)
    # Shorter sequences work; longer than block_size is a clear error.
    assert model(idx[:, :5])[0].shape == (2, 5, 11)
    with pytest.raises(ValueError, match="exceeds block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def future_leak(model) -> float:
    """Largest change of the logits at positions < t when only token t changes."""
    model.eval()
    torch.manual_seed(1)
    idx = torch.randint(0, 11, (3, 16))
    worst = 0.0
    for t in (1, 7, 15):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % 11
        with torch.no_grad():
            a, _ = model(idx)
            b, _ = model(changed)
        assert not torch.equal(a[:, t], b[:, t])  # the changed position itself does change
        worst = max(worst, (a[:, :t] - b[:, :t]).abs().max().item())
    return worst


def test_causal_no_future_leak(monkeypatch):
    model = tiny_model(dropout=0.1)  # eval() must also switch attention dropout off
    assert future_leak(model) == 0.0  # bitwise: the past never sees the future
    # The check can fail: the same model without the causal mask leaks.
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: sdpa(*a, **(kw | {"is_causal": False})))
    assert future_leak(model) > 1e-4


def test_overfits_one_batch():
    model = tiny_model()
    torch.manual_seed(2)
    x = torch.randint(0, 11, (4, 16))
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(50):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 2.0 and losses[-1] < 0.1, losses[::10]


def test_weight_tying_and_init():
    model = tiny_model(model_type="gpt-mini", vocab_size=512, block_size=64)
    assert model.wte.weight is model.lm_head.weight
    assert model.wte.weight.data_ptr() == model.lm_head.weight.data_ptr()
    n_layer = model.config.n_layer
    # Sampling error, not rounding: the sample std of N normal draws is off by 1/sqrt(2N)
    # relative (N >= 12,288 for wpe: 0.64%), so 5% is 7.8 standard errors; the sample mean by
    # 0.02/sqrt(N) = 1.8e-4, so 2e-3 is 11. (Seeded draws; measured: the same under all three
    # capabilities, at most 0.6% off.)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):  # residual projections: scaled by 1/sqrt(2 n_layer)
            assert p.std().item() == pytest.approx(0.02 / math.sqrt(2 * n_layer), rel=0.05), name
        elif name.endswith(("c_attn.weight", "c_fc.weight", "wte.weight", "wpe.weight")):
            assert p.std().item() == pytest.approx(0.02, rel=0.05), name
            assert abs(p.mean().item()) < 2e-3, name
        elif "ln_" in name and name.endswith("weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert name.endswith("bias") and torch.equal(p, torch.zeros_like(p)), name
    # bias=False removes every bias (Linear and LayerNorm).
    no_bias = tiny_model(bias=False)
    assert not any(n.endswith("bias") for n, _ in no_bias.named_parameters())


def test_generate():
    model = tiny_model(dropout=0.1).eval()
    idx = torch.randint(0, 11, (2, 3))
    # Longer than block_size (16): the context is cropped, generation goes on.
    greedy = model.generate(idx, 20, do_sample=False)
    assert greedy.shape == (2, 23) and torch.equal(greedy[:, :3], idx)
    assert greedy.min() >= 0 and greedy.max() < 11
    assert torch.equal(greedy, model.generate(idx, 20, do_sample=False))
    # Greedy picks the argmax of the model's own next-token logits.
    logits, _ = model(greedy[:, -16 - 1:-1])
    assert torch.equal(logits[:, -1].argmax(-1), greedy[:, -1])
    # top_k=1 leaves one candidate: sampling becomes greedy, at any temperature.
    torch.manual_seed(3)
    assert torch.equal(model.generate(idx, 20, temperature=2.0, top_k=1), greedy)
    # Sampling is seeded by torch's RNG and differs from greedy for a near-uniform model.
    torch.manual_seed(4)
    a = model.generate(idx, 20, top_k=5)
    torch.manual_seed(4)
    assert torch.equal(a, model.generate(idx, 20, top_k=5)) and not torch.equal(a, greedy)
    for kwargs, text in [(dict(temperature=0.0), "temperature"), (dict(top_k=0), "top_k"),
                         (dict(max_new_tokens=-1), "max_new_tokens")]:
        with pytest.raises(ValueError, match=text):
            model.generate(idx, **(dict(max_new_tokens=2) | kwargs))


@torch.no_grad()
def generate_by_recomputing(model, idx, max_new_tokens, **kwargs):
    """generate without a KV cache, as it was: the whole (cropped) sequence every step."""
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.config.block_size:])
        idx = torch.cat((idx, M.next_token(logits[:, -1, :], **kwargs)), dim=1)
    return idx


@pytest.mark.parametrize("prompt, new", [
    (1, 15),  # fills the context exactly: 16 positions, the cache all the way
    (3, 20),  # past block_size: the cache until the context is full, then recomputing
    (20, 5),  # a prompt longer than block_size: cropped, then recomputing at once
])
def test_generate_with_kv_cache_equals_recomputing(prompt, new):
    model = tiny_model(dropout=0.1).eval()
    idx = torch.randint(0, 11, (2, prompt))
    for kwargs in ({"do_sample": False}, {}, {"top_k": 5}, {"temperature": 2.0}):
        torch.manual_seed(7)
        cached = model.generate(idx, new, **kwargs)
        torch.manual_seed(7)  # the same draws from torch's RNG, one multinomial per step
        assert torch.equal(cached, generate_by_recomputing(model, idx, new, **kwargs)), kwargs


def test_generate_processes_the_prompt_once_then_one_token_per_step():
    model = tiny_model().eval()
    lengths = []  # the sequence length each forward of the first block sees
    model.blocks[0].register_forward_pre_hook(lambda _, args: lengths.append(args[0].size(1)))
    model.generate(torch.zeros(2, 3, dtype=torch.long), 20)
    # The prompt, then one token at a time until 16 = block_size positions are cached; after
    # that the last 16 tokens are recomputed each step (their positions shift).
    assert lengths == [3] + [1] * 13 + [16] * 6


def test_forward_with_kv_cache_equals_full_forward():
    model = tiny_model().eval()
    idx = torch.randint(0, 11, (2, 16))
    with torch.no_grad():
        full, _ = model(idx)  # (2, 16, 11)
        caches = [M.KVCache(16) for _ in model.blocks]
        # A prompt, single tokens, then several tokens after cached ones (the shifted mask).
        chunks = [(0, 5), (5, 6), (6, 7), (7, 12), (12, 13), (13, 16)]
        cached = torch.cat([model(idx[:, a:b], caches=caches)[0] for a, b in chunks], dim=1)
        assert caches[0].length == 16 and caches[0].k.shape == (2, 3, 16, 16)  # (B, nh, T, hs)
        # The same logits through other matmul shapes (chunks of queries against the cached
        # keys), so other blocking and sum orders, in each of the chain's ~10 ops per layer:
        # within 64 ulps of the largest logit (measured: 3.8 ulps, under ATEN_CPU_CAPABILITY=
        # default, avx2 and avx512).
        assert_close_ulps(cached, full, 64)
        # Positions beyond block_size do not exist, cached or not.
        with pytest.raises(ValueError, match="sequence length 17 exceeds block_size 16"):
            model(idx[:, :1], caches=caches)


@pytest.mark.parametrize("kwargs, text", [
    (dict(model_type="gpt-huge"), "unknown model_type 'gpt-huge'; allowed: gpt-nano, gpt-micro"),
    (dict(model_type=None), "n_layer, n_head, n_embd must be set"),
    (dict(model_type=None, n_layer=2, n_head=5, n_embd=48), r"n_embd \(48\) must be divisible"),
    (dict(model_type=None, n_layer=0, n_head=4, n_embd=48), "n_layer must be a positive integer"),
    (dict(n_layer=5), "model_type=gpt-nano sets n_layer=3, got n_layer=5"),
    (dict(vocab_size=None), "vocab_size is not set"),
    (dict(block_size=-3), "block_size must be a positive integer, got -3"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
    (dict(dropout=-0.1), r"dropout must be in \[0, 1\)"),
])
def test_invalid_config(kwargs, text):
    cfg = M.GPTConfig(**(dict(vocab_size=11, block_size=16) | kwargs))
    with pytest.raises(ValueError, match=text):
        M.GPT(cfg)


def test_resolve_config_presets():
    cfg = M.resolve_config(M.GPTConfig(model_type="gpt2", vocab_size=50257, block_size=1024))
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd) == (12, 12, 768)
    assert M.resolve_config(cfg) == cfg  # a resolved config (as stored in a snapshot) resolves
    own = M.resolve_config(M.GPTConfig(model_type=None, n_layer=2, n_head=2, n_embd=8,
                                       vocab_size=5, block_size=4))
    assert (own.n_layer, own.n_head, own.n_embd) == (2, 2, 8)
    assert list(M.PRESETS) == ["gpt-nano", "gpt-micro", "gpt-mini", "gpt-micro-moe",
                               "gopher-44m", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]
    # A MoE preset sets its experts; the dense presets keep the dense MLP.
    moe = M.resolve_config(M.GPTConfig(model_type="gpt-micro-moe", vocab_size=5, block_size=4))
    assert (moe.n_layer, moe.n_embd, moe.n_expert, moe.expert_top_k) == (4, 128, 4, 1)
    assert M.resolve_config(cfg).n_expert == 0


def test_optim_groups():
    model = tiny_model()
    decay, no_decay = model.optim_groups(0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(ids) == len(set(ids))  # each parameter once
    assert set(ids) == {id(p) for p in model.parameters()}  # every parameter
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = sorted(names[id(p)] for p in decay["params"])
    # Linear weights only: 4 per block; the tied wte/lm_head weight is an embedding.
    assert len(decayed) == 4 * model.config.n_layer
    assert all(n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) for n in decayed)
    assert {"wte.weight", "wpe.weight"} <= {names[id(p)] for p in no_decay["params"]}
    # Identity-based: renaming modules (as wrappers do) changes nothing.
    wrapped = torch.nn.Sequential(torch.nn.Module())
    wrapped[0].inner = model.blocks[0]
    model.blocks[0] = wrapped
    assert [len(g["params"]) for g in model.optim_groups(0.1)] == [len(decayed), len(names)
                                                                   - len(decayed)]
    torch.optim.AdamW(model.optim_groups(0.1), lr=1e-3)  # accepted as-is by AdamW


def independent_param_count(V: int, T: int, L: int, C: int) -> int:
    """GPT-2 parameter count from its shapes: embeddings, L blocks, final LayerNorm."""
    attn = (C * 3 * C + 3 * C) + (C * C + C)
    mlp = (C * 4 * C + 4 * C) + (4 * C * C + C)
    layer_norms = 2 * 2 * C
    return V * C + T * C + L * (attn + mlp + layer_norms) + 2 * C


def test_num_params_and_flops():
    model = tiny_model(model_type="gpt-micro", vocab_size=65, block_size=128)
    n = independent_param_count(65, 128, 4, 128)
    assert model.num_params() == n
    assert model.num_params(non_embedding=True) == n - 128 * 128
    # PaLM appendix B: 6 N + 12 L C T, N without the position embedding.
    assert model.flops_per_token() == 6 * (n - 128 * 128) + 12 * 4 * 128 * 128


def test_model_file_has_no_distributed_imports():
    tree = ast.parse((MINGPT / "mingpt/model.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported |= {f"{node.module}.{alias.name}" for alias in node.names}
    assert "torch" in imported
    assert not [m for m in imported if "distributed" in m], imported


def hf_gpt2(n_layer: int, n_head: int, n_embd: int, vocab: int, block: int, **kw):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=block, n_embd=n_embd,
                                     n_layer=n_layer, n_head=n_head, bos_token_id=0,
                                     eos_token_id=0, **kw)
    return transformers.GPT2LMHeadModel(config)


def test_parity_with_huggingface_gpt2():
    torch.manual_seed(5)
    hf = hf_gpt2(2, 4, 32, vocab=50, block=24, activation_function="gelu_new",
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).eval()
    with torch.no_grad():  # perturb every tensor (LayerNorms, biases too); large enough weights
        for p in hf.parameters():  # that the two GELU variants would differ visibly
            p.add_(torch.randn_like(p) * 0.1)
    ours = M.GPT(M.GPTConfig(model_type=None, n_layer=2, n_head=4, n_embd=32, vocab_size=50,
                             block_size=24, dropout=0.0)).eval()
    # Same names, "transformer." prefix and "h" -> "blocks"; HF's Conv1D stores weights (in, out).
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    state = {}
    for name, tensor in hf.state_dict().items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # old HF versions keep the causal mask as a buffer
        key = name.removeprefix("transformer.").replace("h.", "blocks.", 1)
        state[key] = tensor.t() if key.endswith(conv1d) else tensor
    missing, unexpected = ours.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    idx = torch.randint(0, 50, (2, 24))
    with torch.no_grad():
        expected = hf(idx).logits
        logits, _ = ours(idx)
    assert logits.abs().max() > 0.1  # random weights give non-trivial logits
    # The same function computed otherwise (HF: Conv1D's addmm and eager attention; ours:
    # Linear and scaled_dot_product_attention): a few roundings per op of the chain, each sum
    # in another order: within 64 ulps of the largest logit (measured: 4.1 ulps, under
    # ATEN_CPU_CAPABILITY=default, avx2 and avx512). Erf's GELU for tanh's: 4.5e-4 off, 57 x that.
    assert_close_ulps(logits, expected, 64)


def test_model_size_script():
    proc = run([PYTHON, "model_size.py"], cwd=MINGPT, timeout=120)
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert "124,439,808" in rows["gpt2"]
    assert str(independent_param_count(50257, 1024, 12, 768)) == "124439808"
    # Every preset's count equals Hugging Face's GPT2 with the same shapes (built on meta).
    for name, sizes in M.PRESETS.items():
        if "n_expert" in sizes:  # no Hugging Face GPT2 has experts: the module's own count
            with torch.device("meta"):
                moe = M.GPT(M.GPTConfig(model_type=name, vocab_size=50257, block_size=1024))
            assert f"{moe.num_params():,}" in rows[name], rows[name]
            # top-1 of 4 experts the size of gpt-micro's MLP: gpt-micro's active parameters
            # and each block's router (4 x 128).
            with torch.device("meta"):
                dense = M.GPT(M.GPTConfig(model_type="gpt-micro", vocab_size=50257,
                                          block_size=1024))
            assert moe.num_active_params() == dense.num_active_params() + 4 * 4 * 128
            assert moe.flops_per_token() == dense.flops_per_token() + 6 * 4 * 4 * 128
            continue
        with torch.device("meta"):
            hf = hf_gpt2(**sizes, vocab=50257, block=1024)
        n_hf = sum(p.numel() for p in hf.parameters())
        assert f"{n_hf:,}" in rows[name], (name, n_hf, rows[name])
        # weights-only fp32 size printed: 4 bytes per parameter
        assert f"{n_hf * 4 / 2**20:.2f} MiB" in rows[name] or \
            f"{n_hf * 4 / 2**30:.2f} GiB" in rows[name], rows[name]
    assert "1.39 GiB" in rows["gpt2"]  # train snapshot: 12 bytes/param = 1.39 GiB
    # Bad arguments, in this process (the same main() as above, without a second start-up).
    with mingpt_imported("model_size") as modules:
        size_script = modules["model_size"]
        bad = script_in_process(size_script, MINGPT, "--preset", "gpt5")
        assert bad.returncode != 0 and bad.stdout == ""
        assert bad.stderr.strip() == (
            "error: unknown preset 'gpt5'; allowed: gpt-nano, gpt-micro, gpt-mini, "
            "gpt-micro-moe, gopher-44m, gpt2, gpt2-medium, gpt2-large, gpt2-xl")
        bad = script_in_process(size_script, MINGPT, "--block_size", "0")
    assert bad.returncode != 0 and bad.stderr.startswith("error: ")
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
