"""Context parallelism (cp): every sequence split over the cp_size ranks of a group, attention as
a ring over the group, composed with a data-parallel strategy (ddp, zero, fsdp) over a
(dp, cp) mesh, with TP, and with a pipeline (each stage's cp ranks keep the same tokens, and the
stages pass on the kept tokens' residual stream).

    python main.py trainer_config.cp_size=2 ...      # parallelize(): after TP, before the flavour
    apply(model, mesh["cp"])                          # then ddp.apply / fsdp.apply as usual

What each rank holds. The batch is the same on the cp ranks of one group (data_parallel() deals
data out over the `dp` dimension only); each rank keeps 1/cp of every sequence's tokens, so
embeddings, LayerNorms, the MLP, the logits and the loss cost 1/cp of the activations and the
work. Only attention needs the other tokens: rank r's queries must see the keys and values of
every earlier position, wherever they live.

The ring. Each rank computes attention of its queries against its own keys/values, then passes
those keys/values on to the next rank of the group while it receives the previous rank's, cp - 1
times; the partial results are merged exactly by their log-sum-exp (as flash attention merges
its tiles), so the output equals full attention up to the rounding of that merge. Backward runs
the ring again and sends each key/value gradient on with its block until it is home. Per layer
and step a rank sends (cp - 1) x its K and V forward, and about twice that in backward.

Load balance (zig-zag). With the causal mask, contiguous pieces would leave rank 0 almost idle
(its queries see only its own keys) and the last rank with cp times its work. So the sequence
is cut into 2 x cp chunks and rank r keeps chunks r and 2cp - 1 - r (one early, one late):
against any other rank's block exactly half of its (query, key) pairs are needed (all queries
against the other's first chunk, or its own second-half queries against both of the other's
chunks), so every rank does the same work at every step. Hence block_size must divide by
2 x cp_size. This is the layout of torch's own head-tail load balancer, so both rings agree.

Which ring. On a GPU, PyTorch's context parallelism (its `_ContextParallel` style on the
attention function, whose q, k, v become DTensors sharded on the sequence and whose
scaled_dot_product_attention is dispatched to the ring). On a CPU that dispatch stops at the
CPU flash-attention op (torch 2.14.1: "Operator aten._scaled_dot_product_flash_attention_for_cpu
.default does not have a sharding strategy registered"), so the ring runs through
torch's own ring functions (`_templated_ring_attention` and its backward, the same code the GPU
path reaches) called on the CPU flash kernel from a small autograd.Function here. Both are
private torch APIs (the public `context_parallel` context manager is built on them); tests pin
them: tests/test_mingpt_context.py on the CPU, tests/test_gpu.py on GPUs. Both rotate K/V
with all-to-all (a ring proper; torch's default on GPUs gathers every block at once), so
one memory prediction holds for both; distributed.release() calls end_run(), which switches
torch's dispatch off and restores its options when the run ends.

Gradients. Each rank's loss is the mean over its own tokens; the ring's backward sends every
key/value gradient back to the rank that owns it, so the sum of the cp ranks' gradients is the
gradient of the sum of their losses, and the mean over all dp x cp ranks (DDP's all-reduce,
FSDP's reduce-scatter over the whole world) is the gradient of the mean loss of the batch:
every rank holds the same number of tokens. (Padding targets, -1, would break that equality;
the text and image data here have none.)

Only forward calls with targets (training, evaluation) are split: generate() calls the model
without targets and then it computes on the whole sequence, as without cp. The model's file
knows nothing of this: GPT.forward takes the tokens' positions, and
CausalSelfAttention.attend is the function that is swapped. Not supported with cp: attention
dropout (the ring's kernels take none; gpt_config.dropout must be 0) and torch.compile
(the ring's collectives would break its graph); config.py refuses both in one line.
"""
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mingpt.model import causal_attention
from mingpt.parallel.pipeline import Stage

aten = torch.ops.aten


def torch_cp():
    """torch's context-parallel module (private: its path moves between releases), imported on
    first use, so that importing this file (config.py does, for check_config) needs none of it:
    xla_main.py imports the config under torch_xla's older torch, which keeps it elsewhere."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


def check_config(t: DictConfig, block_size: int, dropout: float) -> None:
    """ValueError (one line) unless trainer_config.cp_size fits the model (the other axes:
    layout.check_axes)."""
    cp = t.cp_size
    # Checked before any process exists; the world size (a multiple of cp_size) only in apply.
    if cp < 0:
        raise ValueError(f"trainer_config.cp_size must be an integer >= 0 (0 or 1: off), "
                         f"got {cp}")
    if cp <= 1:  # a group of one rank keeps whole sequences: nothing to split
        return
    # Zig-zag: 2 x cp equal chunks, so both the length and the causal work split evenly.
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
    # Early chunk r and late chunk 2cp - 1 - r: the causal mask gives the late one the most
    # keys and the early one the fewest, so every rank gets the same share of the work.
    first, second = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c, device=device),
                      torch.arange(second, second + c, device=device)])


class _Switch:
    """Whether the model's current forward is split over the group (it has targets).

    A flag rather than an argument: activation checkpointing recomputes the blocks during
    backward, after the forward returned, and must take the same path again; the flag keeps
    its value until the next forward call sets it."""

    active = False


def _set_ring_options() -> tuple:
    """torch's ring with the zig-zag layout and a true ring (send to the next rank) for K/V;
    the options it had before, for _restore_ring_options.

    ALL_TO_ALL is the ring proper: each rank holds two K/V blocks at a time (torch's default,
    ALL_GATHER, gathers all of them at once: fewer launches on a GPU, cp times the memory).
    Both rings use it, so the activations measured on the CPU (bench/README.md) and the
    dry run's cp plan hold on GPUs too."""
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
    """The CPU ring's options around each of its calls (forward, backward), restored after:
    torch keeps them in a module-level object that its context_parallel() sets for a whole
    run, and nothing else may see them."""
    saved = _set_ring_options()
    try:
        yield
    finally:
        _restore_ring_options(saved)


_TORCH_RING_SAVED: list[tuple] = []  # the options before torch's ring was switched on


def _torch_ring_on() -> None:
    """Switch torch's own ring on for the run (GPUs): DTensor's scaled_dot_product_attention
    dispatched to it (a global switch, for DTensor inputs only) and the options of
    _set_ring_options. For the whole run, not around each call as on the CPU: backward
    (autograd, after the call returned) dispatches to the ring and reads the options too."""
    if not _TORCH_RING_SAVED:  # once, whatever the number of stages that ask
        _TORCH_RING_SAVED.append(_set_ring_options())
        torch_cp()._enable_context_parallel_dispatcher()


def end_run() -> None:
    """The run is over (distributed.release): torch's context-parallel dispatch off and its
    options as they were, so that a later run in this process (a test's, a notebook's) or any
    DTensor attention gets torch's defaults again. Nothing to do where it was never on."""
    if _TORCH_RING_SAVED:
        torch_cp()._disable_context_parallel_dispatcher()
        _restore_ring_options(_TORCH_RING_SAVED.pop())


class RingAttention(torch.autograd.Function):
    """Causal ring attention over `group` on the CPU flash kernel; q, k, v (B, nh, T/cp, hs),
    this rank's zig-zag chunks. One Function for the whole ring: every rank's backward runs
    (and sends) whenever its output is used, so no rank can skip its part of the backward ring
    and leave the others waiting."""

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
        # Each block's gradients from the flash backward kernel, given the merged output and
        # log-sum-exp (so a block's softmax is normalised over all keys); dK and dV travel
        # on round the ring with their block until they reach the rank that owns it.
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
    """CausalSelfAttention.attend under cp: the ring while the switch is on, else the plain
    causal attention (generate, on whole sequences)."""

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
    """Split every sequence of `model` (a GPT or a pipeline stage, not yet wrapped) over the
    ranks of `cp_mesh`.

    parallelize() builds the mesh (layout.py): consecutive ranks form a cp group (inside TP's
    groups, if any), so the ring (which sends K and V at every layer) stays inside a node and
    the data-parallel reduction crosses nodes."""
    # One switch and one attention object for all blocks: every block runs the same way.
    switch = _Switch()
    cp_rank, cp_size = cp_mesh.get_local_rank(), cp_mesh.size()
    attend = ContextParallelAttention(cp_mesh, switch)
    for block in model.blocks:
        block.attn.attend = attend
    if isinstance(model, Stage):
        # A pipeline stage only trains and evaluates (generate runs on the whole GPT): always
        # the ring. The stages pass on the kept tokens' residual stream, (B, T / cp, C); the
        # first keeps its tokens (Stage.forward) and the schedule's loss their targets
        # (Pipeline), both by these positions. The cp ranks of one stage run the same
        # schedule, so their rings meet in the same order.
        switch.active = True
        model.cp = cp_size
        model.positions = lambda seq_len, device: zigzag_positions(seq_len, cp_size, cp_rank,
                                                                    device)
        return model
    # Before any wrapper: DDP calls the GPT itself, FSDP2 keeps the GPT's hooks.
    model.register_forward_pre_hook(
        lambda module, args, kwargs: _shard_sequences(switch, cp_rank, cp_size, module, args,
                                                      kwargs),
        with_kwargs=True)
    return model
