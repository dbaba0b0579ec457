"""Context parallelism (cp): every sequence split over the cp_size ranks of a group, attention a
ring over the group; composes with ddp, zero and fsdp (over a (dp, cp) mesh), TP and a pipeline.

The cp ranks of a group read the same batch; each keeps 1/cp of every sequence's tokens and
passes its keys/values on round the ring, cp - 1 times, the partial attentions merged exactly
by their log-sum-exp. Zig-zag: rank r keeps chunks r and 2cp - 1 - r of 2 x cp, so under the
causal mask every rank does the same work (torch's head-tail load balancer). On a GPU the ring
is torch's context parallelism (`_ContextParallel`); on a CPU, whose flash op that dispatch
cannot shard, RingAttention calls torch's ring functions directly: private torch APIs, pinned
by tests/test_mingpt_context.py and tests/test_gpu.py. Every rank's loss is the mean over as
many tokens, so the mean of the dp x cp ranks' gradients is the batch's (generate: unsplit).
"""
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mingpt.model import causal_attention
from mingpt.parallel.pipeline import Stage

aten = torch.ops.aten


def torch_cp():
    """torch's private context-parallel module, imported on first use: config.py imports this
    file, and xla_main.py imports the config under torch_xla's older torch, which lacks it."""
    from torch.distributed.tensor.experimental._context_parallel import _attention
    return _attention


def check_config(t: DictConfig, block_size: int, dropout: float) -> None:
    """ValueError (one line) unless trainer_config.cp_size fits the model."""
    cp = t.cp_size
    if cp < 0:
        raise ValueError(f"trainer_config.cp_size must be an integer >= 0 (0 or 1: off), "
                         f"got {cp}")
    if cp <= 1:  # a group of one rank keeps whole sequences: nothing to split
        return
    if block_size % (2 * cp):
        raise ValueError(f"gpt_config.block_size={block_size} must divide by 2 x cp_size = "
                         f"{2 * cp} (each rank keeps 2 of the 2 x cp_size equal chunks of a "
                         "sequence); change block_size or trainer_config.cp_size")
    if dropout:
        raise ValueError(f"trainer_config.cp_size={cp} needs gpt_config.dropout=0 (the ring "
                         f"attention has no attention dropout), got {dropout}")
    if t.compile:
        raise ValueError(f"trainer_config.compile must be false with cp_size={cp} (the ring "
                         "attention's collectives would break the compiled graph)")


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int,
                     device: torch.device | None = None) -> torch.Tensor:
    """The positions rank `cp_rank` keeps of a sequence of `seq_len`: chunks cp_rank and
    2 cp_size - 1 - cp_rank of 2 cp_size equal chunks, in order; (seq_len / cp_size,)."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} does not divide by 2 x cp_size = "
                         f"{2 * cp_size}")
    c = seq_len // (2 * cp_size)  # chunk length
    first, second = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c, device=device),
                      torch.arange(second, second + c, device=device)])


class _Switch:
    """Whether the model's current forward is split over the group (it has targets). A flag,
    not an argument: activation checkpointing recomputes the blocks in backward, after the
    forward returned, and must take the same path again."""

    active = False


def _set_ring_options() -> tuple:
    """torch's ring with the zig-zag layout and K/V rotated by all-to-all, on both rings (two
    blocks held at a time, not all-gather's cp: one memory plan); returns the prior options."""
    options = torch_cp()._cp_options
    saved = (options.enable_load_balance, options.rotate_method)
    options.enable_load_balance = True
    torch_cp().set_rotate_method("alltoall")  # torch's public setter of rotate_method
    return saved


def _restore_ring_options(saved: tuple) -> None:
    options = torch_cp()._cp_options
    options.enable_load_balance, options.rotate_method = saved


@contextmanager
def _ring_options() -> Iterator[None]:
    """The CPU ring's options around each of its calls, restored after: torch keeps them in a
    module-level object, and nothing else may see them."""
    saved = _set_ring_options()
    try:
        yield
    finally:
        _restore_ring_options(saved)


_TORCH_RING_SAVED: list[tuple] = []  # the options before torch's ring was switched on


def _torch_ring_on() -> None:
    """Switch torch's own ring on for the run (GPUs): DTensor's SDPA dispatched to it (a global
    switch, DTensor inputs only) with _set_ring_options' options. For the whole run, not per
    call as on the CPU: backward, after the call returned, dispatches to the ring too."""
    if not _TORCH_RING_SAVED:  # once, whatever the number of stages that ask
        _TORCH_RING_SAVED.append(_set_ring_options())
        torch_cp()._enable_context_parallel_dispatcher()


def end_run() -> None:
    """The run is over (distributed.release): torch's context-parallel dispatch off and its
    options restored, so that a later run in this process gets torch's defaults again."""
    if _TORCH_RING_SAVED:
        torch_cp()._disable_context_parallel_dispatcher()
        _restore_ring_options(_TORCH_RING_SAVED.pop())


class RingAttention(torch.autograd.Function):
    """Causal ring attention over `group` on the CPU flash kernel; q, k, v (B, nh, T/cp, hs),
    this rank's zig-zag chunks. One Function for the whole ring, so every rank's backward runs
    (and sends) whenever its output is used: no rank skips its part, leaving others waiting."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                group: dist.ProcessGroup) -> torch.Tensor:
        # The kernel and the exchanges want dense tensors (q, k, v are transposed views).
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # seq_dim 2 of (B, nh, T, hs); torch's ring merges the blocks by log-sum-exp in fp32.
        with _ring_options():
            out, lse = torch_cp()._templated_ring_attention(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v,
                is_causal=True, dropout_p=0.0, scale=None)[:2]
        # What flash attention keeps for backward, as without cp: inputs, output, log-sum-exp.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        # Each block's gradients given the merged output and log-sum-exp (a block's softmax is
        # normalised over all keys); dK and dV travel on with their block until it is home.
        with _ring_options():
            dq, dk, dv = torch_cp()._templated_ring_attention_backward(
                ctx.group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward,
                grad_out.contiguous(), "grad_out", q, k, v, out, lse, True,
                dropout_p=0.0, scale=None)[:3]
        return dq, dk, dv, None  # no gradient for the group


class _SDPA(nn.Module):
    """scaled_dot_product_attention as a module: torch's CP style hooks modules."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class ContextParallelAttention:
    """CausalSelfAttention.attend under cp: the ring with the switch on, else plain (generate)."""

    def __init__(self, cp_mesh: DeviceMesh, switch: _Switch) -> None:
        self.switch, self.group = switch, cp_mesh.get_group()
        self.torch_ring: nn.Module | None = None
        if cp_mesh.device_type == "cuda":  # PyTorch's own context parallelism
            from torch.distributed.tensor.parallel import parallelize_module
            self.torch_ring = parallelize_module(_SDPA(), cp_mesh, torch_cp()._ContextParallel(
                seq_dim=2, attention_type=torch_cp()._ContextParallel.AttentionType.SDPA))
            _torch_ring_on()  # until end_run: the zig-zag layout, all-to-all rotation

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float
                 ) -> torch.Tensor:
        if not self.switch.active:  # a forward without targets: whole sequences (generate)
            return causal_attention(q, k, v, dropout_p)
        if dropout_p:  # config.py refuses it; a direct caller gets told too
            raise ValueError("context parallelism has no attention dropout: set dropout=0")
        if self.torch_ring is not None:
            return self.torch_ring(q, k, v)
        return RingAttention.apply(q, k, v, self.group)


def _shard_sequences(switch: _Switch, cp_rank: int, cp_size: int, model: nn.Module,
                     args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """GPT's forward pre-hook: with targets, keep this rank's zig-zag chunks of idx and
    targets and pass their positions; without (generate), leave the call as it is."""
    # The trainer calls model(x, y); a caller may also name targets=.
    idx, targets = args[0], args[1] if len(args) > 1 else kwargs.get("targets")
    switch.active = targets is not None
    if targets is None:
        return None
    pos = zigzag_positions(idx.size(1), cp_size, cp_rank, idx.device)  # (T / cp,)
    # The same positions for idx and targets: each kept token predicts its own next token,
    # whose label sits in targets at the same place, so the loss needs no other rank.
    kwargs = {key: value for key, value in kwargs.items() if key != "targets"}
    return (idx[:, pos], targets[:, pos]), {**kwargs, "positions": pos}


def apply(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Split every sequence of `model` (a GPT or a stage, not yet wrapped) over `cp_mesh`."""
    # One switch and one attention object for all blocks: every block runs the same way.
    switch = _Switch()
    cp_rank, cp_size = cp_mesh.get_local_rank(), cp_mesh.size()
    attend = ContextParallelAttention(cp_mesh, switch)
    for block in model.blocks:
        block.attn.attend = attend
    if isinstance(model, Stage):
        # A stage only trains and evaluates: always the ring. The stages pass on the kept
        # tokens' residual stream (B, T / cp, C); Stage.forward and the schedule's loss keep
        # tokens and targets by these positions. The cp ranks of one stage run the same
        # schedule, so their rings meet in the same order.
        switch.active = True
        model.cp = cp_size
        model.positions = lambda seq_len, device: zigzag_positions(seq_len, cp_size, cp_rank,
                                                                    device)
        return model
    # Before any wrapper: DDP calls the GPT itself, FSDP2 keeps the GPT's hooks.
    model.register_forward_pre_hook(partial(_shard_sequences, switch, cp_rank, cp_size),
                                    with_kwargs=True)
    return model
