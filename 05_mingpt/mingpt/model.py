"""A minGPT-style GPT: token + position embeddings, a stack of transformer blocks, a tied LM head.

Plain PyTorch with no distributed code (parallel/ wraps the model after it is built); GPT-2's
names (`c_attn`, `ln_1`, ...), so its weights map one to one. OPTIONS: four from
modded-nanogpt's speedrun, off by default (GPT-2 lacks them).
"""
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

# Named model sizes. gpt2* are the four OpenAI GPT-2 models; the small ones train on a CPU.
PRESETS: dict[str, dict[str, int]] = {
    "gpt-nano": dict(n_layer=3, n_head=3, n_embd=48),
    "gpt-micro": dict(n_layer=4, n_head=4, n_embd=128),
    "gpt-mini": dict(n_layer=6, n_head=6, n_embd=192),
    # gpt-micro with 4 experts per block, one per token: gpt-micro's active parameters (MOE.md).
    "gpt-micro-moe": dict(n_layer=4, n_head=4, n_embd=128, n_expert=4, expert_top_k=1),
    "gopher-44m": dict(n_layer=8, n_head=16, n_embd=512),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M parameters
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}
SIZE_KEYS = ("n_layer", "n_head", "n_embd")
EXPERT_KEYS = ("n_expert", "expert_top_k")  # a preset may set these too (0, 1 when it doesn't)


@dataclass
class GPTConfig:
    model_type: str | None = "gpt-nano"  # a preset name, or None to use n_layer/n_head/n_embd
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    vocab_size: int | None = None  # set from the dataset
    block_size: int | None = None  # longest context the model sees; set from the dataset
    dropout: float = 0.1  # embedding, attention and residual dropout
    bias: bool = True  # biases in Linear and LayerNorm layers, as in GPT-2
    # Mixture of experts (MOE.md): n_expert MLPs per block (0: the dense MLP), expert_top_k of
    # them per token; aux_loss_coef weighs the load-balancing loss added to the training loss.
    n_expert: int = 0
    expert_top_k: int = 1
    aux_loss_coef: float = 0.01
    rotary: bool = False  # this and the next three: options GPT-2 lacks (OPTIONS)
    qk_norm: bool = False
    relu2: bool = False
    untied_head: bool = False


def _is_positive_int(value: object) -> bool:
    # bool is a subclass of int: `n_layer=True` is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def resolve_config(cfg: GPTConfig) -> GPTConfig:
    """A copy with the preset's sizes filled in; ValueError (one line) if invalid or off-preset."""
    sizes = {key: getattr(cfg, key) for key in SIZE_KEYS}
    if cfg.model_type is not None:
        if cfg.model_type not in PRESETS:
            raise ValueError(f"unknown model_type {cfg.model_type!r}; allowed: "
                             f"{', '.join(PRESETS)}, or null with n_layer/n_head/n_embd set")
        preset = PRESETS[cfg.model_type]
        for key, value in sizes.items():
            if value is not None and value != preset[key]:
                raise ValueError(f"model_type={cfg.model_type} sets {key}={preset[key]}, got "
                                 f"{key}={value}; set model_type=null to choose sizes yourself")
        sizes = {key: preset[key] for key in SIZE_KEYS}
        for key in EXPERT_KEYS:  # a MoE preset's experts, unless the config says otherwise
            default = GPTConfig.__dataclass_fields__[key].default
            if key in preset and getattr(cfg, key) not in (default, preset[key]):
                raise ValueError(f"model_type={cfg.model_type} sets {key}={preset[key]}, got "
                                 f"{key}={getattr(cfg, key)}; set model_type=null to choose")
            sizes[key] = preset.get(key, getattr(cfg, key))
    missing = [key for key, value in sizes.items() if value is None]
    if missing:
        raise ValueError(f"model_type is null, so {', '.join(missing)} must be set "
                         f"(or pick a model_type: {', '.join(PRESETS)})")
    for key in (*SIZE_KEYS, "vocab_size", "block_size"):
        value = sizes.get(key, getattr(cfg, key))
        if value is None:
            raise ValueError(f"{key} is not set (it comes from the dataset)")
        if not _is_positive_int(value):
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if sizes["n_embd"] % sizes["n_head"] != 0:
        raise ValueError(f"n_embd ({sizes['n_embd']}) must be divisible by "
                         f"n_head ({sizes['n_head']})")
    if isinstance(cfg.dropout, bool) or not isinstance(cfg.dropout, int | float) \
            or not 0.0 <= cfg.dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {cfg.dropout!r}")
    n_expert = sizes.get("n_expert", cfg.n_expert)
    top_k = sizes.get("expert_top_k", cfg.expert_top_k)
    if not (isinstance(n_expert, int) and not isinstance(n_expert, bool) and n_expert >= 0):
        raise ValueError(f"n_expert must be an integer >= 0 (0: the dense MLP), got {n_expert!r}")
    if n_expert and not (_is_positive_int(top_k) and top_k <= n_expert):
        raise ValueError(f"expert_top_k must be between 1 and n_expert ({n_expert}), got "
                         f"{top_k!r}")
    if isinstance(cfg.aux_loss_coef, bool) or not isinstance(cfg.aux_loss_coef, int | float) \
            or cfg.aux_loss_coef < 0:
        raise ValueError(f"aux_loss_coef must be >= 0, got {cfg.aux_loss_coef!r}")
    for key in OPTIONS:
        if not isinstance(getattr(cfg, key), bool):
            raise ValueError(f"{key} must be true or false, got {getattr(cfg, key)!r}")
    if cfg.rotary and sizes["n_embd"] // sizes["n_head"] % 2:
        raise ValueError(f"rotary needs an even head size (n_embd / n_head), got "
                         f"{sizes['n_embd']} / {sizes['n_head']}")
    return replace(cfg, **sizes)


# GPTConfig's options GPT-2 lacks -> what it has instead (pretrained.py, export_hf.py refuse them).
OPTIONS = {"rotary": "learned position embeddings (wpe), not rotary ones",
           "qk_norm": "no norm on its queries and keys",
           "relu2": "GELU in its MLPs, not ReLU squared",
           "untied_head": "its output layer tied to the token embedding"}


def rotate(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (RoFormer): x (B, nh, T, hs) with each channel pair (i, i +
    hs/2) turned by pos * base^(-2i/hs), pos (T,): q_m . k_n then depends on m - n only."""
    half = x.size(-1) // 2
    inv_freq = base ** -(torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = pos.to(torch.float32)[:, None] * inv_freq[None, :]  # (T, hs / 2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class KVCache:
    """One block's keys and values of the positions processed so far, for generate. A plain
    object, updated in place: FSDP rebuilds lists and dataclasses in forward arguments."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.length = 0  # positions stored so far
        self.k: torch.Tensor | None = None  # (B, nh, size, hs), as is self.v
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) after the cached ones; return all, (B, nh, length, hs) each."""
        if self.k is None:  # first use: the keys' dtype (autocast, FSDP's mixed precision)
            self.k = k.new_empty(k.size(0), k.size(1), self.size, k.size(3))
            self.v = v.new_empty(v.size(0), v.size(1), self.size, v.size(3))
        start, self.length = self.length, self.length + k.size(2)  # k.size(2): new positions
        self.k[:, :, start:self.length] = k
        self.v[:, :, start:self.length] = v
        return self.k[:, :, :self.length], self.v[:, :, :self.length]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float
                     ) -> torch.Tensor:
    """softmax(q k^T / sqrt(hs)) v, masked in the kernel (is_causal): (B, nh, T, hs) -> same."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only attends to positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_size = config.n_embd // config.n_head  # hs: channels per head
        self.dropout = config.dropout
        self.rotary, self.qk_norm = config.rotary, config.qk_norm
        # How q, k, v become the output when nothing is cached: a plain attribute, so that a
        # wrapper can put another here (context parallelism's ring attention, parallel/context.py).
        self.attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float],
                              torch.Tensor] = causal_attention
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                pos: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C). With a cache, x holds only the positions after the cached
        ones, which they also attend to. pos (T,): x's positions in its sequence (for rotary)."""
        B, T, _ = x.size()  # batch, sequence length, n_embd
        qkv = self.c_attn(x)  # (B, T, 3 * C)
        # C is this process's share of the heads' channels: n_embd / tp where tensor
        # parallelism split the heads (parallel/tensor.py), so nh comes from the width.
        C = qkv.size(2) // 3
        nh = C // self.head_size
        # Split channels into heads and move heads next to batch: attention runs per head.
        q, k, v = (t.view(B, T, nh, self.head_size).transpose(1, 2)  # 3 x (B, nh, T, hs)
                   for t in qkv.split(C, dim=2))  # 3 x (B, T, C)
        if self.qk_norm:  # each head's vectors to RMS 1: the scores' scale stays bounded
            q, k = F.rms_norm(q, (self.head_size,)), F.rms_norm(k, (self.head_size,))
        if self.rotary:  # before the cache: cached keys keep their own positions' angles
            q, k = rotate(q, pos), rotate(k, pos)
        past = 0  # positions before x's first one
        if cache is not None:
            past = cache.length
            k, v = cache.update(k, v)  # (B, nh, past + T, hs): keys of earlier positions first
        # Query i is at position past + i and sees keys 0..past + i: nothing cached, the lower
        # triangle (self.attend); one new query, every key; several, the shifted triangle as a
        # bool mask (True: attend; a 0/1 *float* mask would be added to the scores).
        dropout_p = self.dropout if self.training else 0.0
        if past == 0:
            y = self.attend(q, k, v, dropout_p)  # (B, nh, T, hs)
        else:
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past) \
                if T > 1 else None
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                               dropout_p=dropout_p)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.resid_dropout(self.c_proj(y))


def activation(x: torch.Tensor, relu2: bool) -> torch.Tensor:
    """GELU's tanh approximation (GPT-2's own: weight parity), or with relu2 ReLU(x)^2 (Primer)."""
    return F.relu(x).square() if relu2 else F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    """Position-wise feed-forward: widen 4x, GELU (or ReLU^2), project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.relu2 = config.relu2
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(activation(self.c_fc(x), self.relu2)))  # (B, T, C)


class ExpertLinear(nn.Module):
    """n_expert Linear layers stacked: weight (E, in, out), bias (E, out). One tensor per kind,
    so that expert parallelism can cut the experts over ranks along dim 0 (parallel/expert.py)."""

    def __init__(self, n_expert: int, fan_in: int, fan_out: int, bias: bool) -> None:
        super().__init__()
        # Uninitialised: init_weights draws every value (no draws here, as on the meta device).
        self.weight = nn.Parameter(torch.empty(n_expert, fan_in, fan_out))
        self.bias = nn.Parameter(torch.empty(n_expert, fan_out)) if bias else None


def expert_mlp(x: torch.Tensor, counts: list[int], c_fc: ExpertLinear | tuple,
               c_proj: ExpertLinear | tuple, relu2: bool = False) -> torch.Tensor:
    """Each expert's MLP on its own rows: x (N, C) sorted by expert, counts[e] rows for expert
    e -> (N, C). c_fc and c_proj give (weight, bias) per expert along dim 0 of their tensors."""
    # unbind: one view per expert, whose backward stacks the experts' gradients once (indexing
    # w[e] would give each expert a zero-filled gradient of the whole stack).
    (w_fc, b_fc), (w_proj, b_proj) = ((t.unbind(0) if t is not None else None for t in pair)
                                      for pair in (c_fc, c_proj))
    out, start = [], 0
    for e, n in enumerate(counts):
        h = x[start:start + n] @ w_fc[e]  # (n, 4C)
        if b_fc is not None:
            h = h + b_fc[e]
        h = activation(h, relu2) @ w_proj[e]  # (n, C)
        out.append(h + b_proj[e] if b_proj is not None else h)
        start += n
    return torch.cat(out) if out else x[:0]


class Experts(nn.Module):
    """n_expert MLPs on x (N, C) sorted by expert id, counts (n_expert,) rows each. Expert
    parallelism (parallel/expert.py) swaps in a class that sends the rows to their experts."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        C, E = config.n_embd, config.n_expert
        self.c_fc = ExpertLinear(E, C, 4 * C, config.bias)
        self.c_proj = ExpertLinear(E, 4 * C, C, config.bias)
        self.relu2 = config.relu2

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return expert_mlp(x, counts, (self.c_fc.weight, self.c_fc.bias),
                          (self.c_proj.weight, self.c_proj.bias), self.relu2)


class MoE(nn.Module):
    """A dropless mixture of experts in the MLP's place (Switch Transformer; MOE.md). After each
    forward `aux_loss` (the load-balancing loss) and `counts` (rows per expert) stay for the log."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_expert, self.top_k = config.n_expert, config.expert_top_k
        self.router = nn.Linear(config.n_embd, config.n_expert, bias=False)
        self.experts = Experts(config)
        self.dropout = nn.Dropout(config.dropout)
        self.aux_loss: torch.Tensor | None = None
        self.counts: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        x = x.view(B * T, C)  # (N, C): routing is per token
        probs = F.softmax(self.router(x).float(), dim=-1)  # (N, E), in fp32 under autocast
        y, counts_t = self.route(x, probs)
        # Switch's balancing loss: f_e (no gradient, from the hard choices) times P_e.
        f = counts_t.float() / (B * T * self.top_k)  # (E,): each expert's share of the pairs
        self.aux_loss = self.n_expert * (f * probs.mean(dim=0)).sum()
        return self.dropout(y.view(B, T, C))

    def route(self, x: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token (N, C) through its top_k experts, weighted: (N, C), and the number of
        (token, expert) pairs each expert took (E,). Its shapes depend on the data (how many
        rows each expert gets), so compile leaves it out of its graphs (wrappers.py)."""
        top_p, top_e = probs.topk(self.top_k, dim=-1)  # (N, k) each
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)  # the chosen experts' weights sum to 1
        # Sort the N * k (token, expert) pairs by expert, so each expert's rows are contiguous.
        flat_e = top_e.view(-1)  # (N * k,)
        order = flat_e.argsort(stable=True)  # pair positions, expert by expert
        counts_t = torch.bincount(flat_e, minlength=self.n_expert)  # (E,)
        self.counts = counts_t.tolist()  # host sync: the loop and the all-to-all need them
        rows = x[order // self.top_k]  # (N * k, C): pair i is token i // k's choice i % k
        out = self.experts(rows, self.counts)  # (N * k, C), in the same order
        weighted = out * top_p.view(-1)[order].unsqueeze(1).to(out.dtype)  # (N * k, C)
        y = torch.zeros_like(x).index_add_(0, order // self.top_k, weighted)  # (N, C)
        return y, counts_t


class AuxLossGrad(torch.autograd.Function):
    """carrier unchanged; in backward `aux` also gets a gradient: scale times the carrier's
    where it is the scalar loss (so the loss's scaling applies to it too), else `scale` (a
    pipeline stage's activation). As Megatron-LM's MoEAuxLossAutoScaler."""

    @staticmethod
    def forward(ctx, carrier: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.scalar = scale, carrier.dim() == 0
        return carrier.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        aux_grad = grad.float() * ctx.scale if ctx.scalar else \
            torch.tensor(ctx.scale, device=grad.device)
        return grad, aux_grad, None


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MoE(config) if config.n_expert else MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                pos: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, pos)  # (B, T, C); pos: x's positions
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


def next_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
               do_sample: bool = True) -> torch.Tensor:
    """Pick the next token (B, 1) from the last position's logits (B, vocab_size)."""
    logits = logits / temperature  # < 1 sharpens the distribution, > 1 flattens it
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if do_sample:
        return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # (B, 1)
    return logits.argmax(dim=-1, keepdim=True)  # (B, 1)


class GPT(nn.Module):
    """GPT language model: idx (B, T) token ids -> logits (B, T, vocab_size) for the next token."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config = resolve_config(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding
        # Learned position embedding; none with rotary (each attention turns q and k instead).
        self.wpe = None if config.rotary else nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        # A ModuleList of identical blocks: the unit FSDP shards and activation checkpointing wraps.
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: the output layer reuses the token embedding; untied_head keeps them apart.
        if not config.untied_head:
            self.wte.weight = self.lm_head.weight
        self.init_weights()

    def init_weights(self, fill: Callable[[torch.Tensor, Callable], object] | None = None
                     ) -> None:
        """GPT-2's initialisation, drawn from torch's global RNG in a fixed order. `fill(param,
        init)` gives `param` its values; a sharded model passes one that draws the full tensor
        and keeps its own part, so every rank gets this model's numbers (parallel/fsdp.py)."""
        fill = fill or (lambda param, init: init(param))
        # N(0, 0.02) weights, zero biases; LayerNorm ones/zeros (a model built on the meta
        # device has no values until now). modules() visits them in the order they were built;
        # the tied wte/lm_head weight is drawn twice (as wte, then as lm_head): the second stays.
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding | ExpertLinear):
                fill(module.weight, partial(nn.init.normal_, mean=0.0, std=0.02))
            elif isinstance(module, nn.LayerNorm):
                fill(module.weight, nn.init.ones_)
            if isinstance(module, nn.Linear | nn.LayerNorm | ExpertLinear) \
                    and module.bias is not None:
                fill(module.bias, nn.init.zeros_)
        # GPT-2: residual projections scaled down, so the stream's variance stays flat with depth.
        std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                fill(param, partial(nn.init.normal_, mean=0.0, std=std))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                caches: list[KVCache] | None = None, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab_size), and the mean cross-entropy when targets are given (-1:
        ignored). With caches (one KVCache per block), idx holds only the uncached tokens.
        `positions` (T,): each token's place in its sequence (by default past, past + 1, ...)."""
        B, T = idx.size()
        past = caches[0].length if caches else 0  # positions already in the caches
        if past + T > self.config.block_size:
            raise ValueError(f"sequence length {past + T} exceeds block_size "
                             f"{self.config.block_size}")
        pos = positions if positions is not None else \
            torch.arange(past, past + T, dtype=torch.long, device=idx.device)  # (T,)
        logits = self.head(self.layers(idx, pos, caches))  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            # Flatten batch and time: cross_entropy wants (N, vocab) scores and (N,) labels.
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
            moe = self.moe_layers()
            if moe and self.training and self.config.aux_loss_coef:
                # The experts' balancing loss (training only) joins the gradient, not the value.
                aux = torch.stack([m.aux_loss for m in moe]).mean()
                loss = AuxLossGrad.apply(loss, aux, self.config.aux_loss_coef)
        return logits, loss

    def layers(self, x: torch.Tensor, pos: torch.Tensor, caches: list[KVCache] | None = None,
               first: bool = True) -> torch.Tensor:
        """The residual stream (B, T, C) after every block; with `first`, x is token ids (B, T),
        embedded first. A pipeline stage runs this and `head` on its own blocks and ends."""
        if first:
            x = self.drop(self.embed(x, pos))  # (B, T, C)
        for block, cache in zip(self.blocks, caches or [None] * len(self.blocks), strict=True):
            x = block(x, cache, pos)  # (B, T, C)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab_size) of the residual stream (B, T, C)."""
        return self.lm_head(self.ln_f(x))

    def embed(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Token embeddings (B, T, C), plus the learned positions' (T, C) unless rotary."""
        x = self.wte(idx)
        return x if self.wpe is None else x + self.wpe(pos)

    def moe_layers(self) -> list["MoE"]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, do_sample: bool = True) -> torch.Tensor:
        """Append max_new_tokens tokens to idx (B, T), one at a time; returns (B, T + new).
        Call model.eval() first; with FSDP on every rank (the root's forward gathers weights)."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        block_size = self.config.block_size
        # The model has position embeddings for block_size positions only: keep the tail.
        idx_cond = idx[:, -block_size:]  # (B, <= block_size)
        # A KV cache per block: after the prompt, each step processes only the newest token.
        size = min(block_size, idx_cond.size(1) + max_new_tokens)
        caches: list[KVCache] | None = [KVCache(size) for _ in self.blocks]
        # Eagerly, even where training compiled the model: every new length (and the cache
        # objects) would trigger another compilation for a few hundred tiny steps.
        with torch.compiler.set_stance("force_eager"):
            for _ in range(max_new_tokens):
                if caches is not None and caches[0].length + idx_cond.size(1) > block_size:
                    # The context is full: cropping moves every token to another position than
                    # its cached keys and values, so from now on run the whole cropped sequence.
                    caches, idx_cond = None, idx[:, -block_size:]
                logits, _ = self(idx_cond, caches=caches)  # (B, T_cond, vocab_size)
                idx_next = next_token(logits[:, -1, :], temperature, top_k, do_sample)  # (B, 1)
                idx = torch.cat((idx, idx_next), dim=1)  # (B, T + 1)
                idx_cond = idx_next if caches is not None else idx[:, -block_size:]
        return idx

    def describe(self) -> str:
        c = self.config
        experts = (f", {c.n_expert} experts, top {c.expert_top_k}: "
                   f"{self.num_active_params():,} active") if c.n_expert else ""
        return (f"{self.num_params():,} parameters ({c.n_layer} layers, {c.n_head} heads, "
                f"{c.n_embd} wide, vocab {c.vocab_size}, block {c.block_size}{experts})")

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters (the tied weight once); non_embedding=True leaves out the position
        embedding, and the token embedding when untied (tied, it is also the output matmul)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if self.wpe is not None:  # rotary: no position table
                n -= self.wpe.weight.numel()
            if self.config.untied_head:
                n -= self.wte.weight.numel()
        return n

    def num_active_params(self) -> int:
        """Non-embedding parameters one token computes with: of each block's experts only top_k."""
        c = self.config
        experts = sum(p.numel() for m in self.moe_layers() for p in m.experts.parameters())
        inactive = experts - experts // c.n_expert * c.expert_top_k if c.n_expert else 0
        return self.num_params(non_embedding=True) - inactive

    def flops_per_token(self) -> float:
        """Training FLOPs per token (PaLM appendix B): 6 per active weight + attention's matmuls."""
        cfg = self.config
        return 6.0 * self.num_active_params() + 12.0 * cfg.n_layer * cfg.n_embd * cfg.block_size

    def optim_groups(self, weight_decay: float, muon: bool = False) -> list[dict]:
        """AdamW groups, decay on Linear weights only (not the tied embedding); with `muon` first
        the blocks' matrices, {"muon": True}. By identity: wrapping may rename parameters."""
        decay, no_decay = set(), set()  # parameter ids
        for module in self.modules():
            for name, param in module.named_parameters(recurse=False):
                weight = isinstance(module, nn.Linear | ExpertLinear) and name == "weight"
                (decay if weight else no_decay).add(id(param))
        decay -= no_decay  # a weight shared by a Linear and an Embedding counts as embedding
        params = list(self.parameters())  # unique parameters, in a fixed order
        if muon:  # the blocks' matrices (every decayed weight but an untied output layer's)
            matrices = {id(p) for p in self.blocks.parameters()} & decay
            rest = [p for p in params if id(p) in decay - matrices]
            return [{"params": [p for p in params if id(p) in matrices],
                     "weight_decay": weight_decay, "muon": True},
                    *([{"params": rest, "weight_decay": weight_decay}] if rest else []),
                    {"params": [p for p in params if id(p) not in decay], "weight_decay": 0.0}]
        return [{"params": [p for p in params if id(p) in decay], "weight_decay": weight_decay},
                {"params": [p for p in params if id(p) not in decay], "weight_decay": 0.0}]
