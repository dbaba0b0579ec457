"""Wrap a freshly built model for distributed training; the model itself knows nothing of it.

    model = parallelize(GPT(config).to(device), device, method="fsdp", precision="bf16")
    optimizer = AdamW(unwrap(model).optim_groups(0.1))  # only now: FSDP replaces the parameters

Order matters: activation checkpointing and torch.compile wrap each block first, then DDP or
FSDP wraps the result, and the optimizer is built last, from the wrapped model's parameters.
One function per strategy (apply_ddp, apply_fsdp); `parallelize` picks one by name.
"""
import copy
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from precision import fsdp_policy


def wrap_blocks(model: nn.Module, activation_checkpointing: bool, compile: bool) -> None:
    """Activation checkpointing and compile, per block and in place, before any strategy."""
    blocks = model.blocks
    for i, block in enumerate(blocks):
        if activation_checkpointing:
            # Keep only each block's input; recompute its activations during backward. The
            # non-reentrant implementation works with DDP's and FSDP's backward hooks, and the
            # wrapper hides itself from state_dict keys, so snapshots stay interchangeable.
            block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        if compile:
            block.compile()  # in place: parameter names (and snapshots) do not change
        blocks[i] = block


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """DDP: a whole replica per rank, gradients all-reduced in backward."""
    # DDP broadcasts rank 0's weights at construction and all-reduces gradients in backward.
    # device_ids only for a GPU: on the CPU DDP must get none.
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def apply_fsdp(model: nn.Module, device: torch.device, precision: str = "fp32",
               cpu_offload: bool = False) -> nn.Module:
    """FSDP2: every block sharded on its own, then the root (embeddings, final LayerNorm)."""
    # Each block's parameters are all-gathered just before it runs and freed right after, so
    # only one block is ever whole in memory. Compute in `precision`, reduce gradients in fp32.
    # A 1-D mesh over all ranks, on this process's device type: pure data-parallel sharding.
    kwargs: dict = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),))}
    if precision != "fp32":
        kwargs["mp_policy"] = fsdp_policy(precision)
    if cpu_offload:
        # Shards, gradients and optimizer state live in CPU memory and are copied over for each
        # use. Pinned memory speeds up those copies but needs an accelerator to exist.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def parallelize(model: nn.Module, device: torch.device, method: str = "ddp",
                precision: str = "fp32", cpu_offload: bool = False,
                activation_checkpointing: bool = False, compile: bool = False) -> nn.Module:
    """`model` wrapped by `method` (ddp or fsdp); its `blocks` (a ModuleList) are the units."""
    wrap_blocks(model, activation_checkpointing, compile)
    if method == "ddp":
        return apply_ddp(model, device)
    return apply_fsdp(model, device, precision, cpu_offload)


def unwrap(model: nn.Module) -> nn.Module:
    """The model whose methods (generate, optim_groups) to call: DDP hides it in `.module`.

    An FSDP2 model is its own root (fully_shard changes the class in place), and must be called
    through it: its forward hooks gather the sharded parameters.
    """
    return model.module if isinstance(model, DDP) else model


def set_grad_sync(model: nn.Module, sync: bool) -> AbstractContextManager:
    """A context for one micro-step: skip the gradient all-reduce unless `sync`.

    DDP has the `no_sync()` context; FSDP2 has a switch that stays set until changed.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    if isinstance(model, DDP) and not sync:
        return model.no_sync()
    return nullcontext()


# --- FSDP from the meta device: no rank ever holds the whole model --------------------------

def _replay_constructor_draws(module: nn.Module) -> None:
    """Draw from torch's RNG what building `module` outside the meta device drew, and drop it.

    nn.Linear and nn.Embedding initialise themselves when built (reset_parameters: Kaiming-
    uniform weights, uniform biases, N(0, 1) embeddings). GPT-2's init overwrites those values,
    but the draws moved the RNG on: on the meta device nothing is drawn, so without this replay
    the init would start from another RNG state and give other weights than the plain path.
    """
    params = dict(module.named_parameters(recurse=False))
    if not params or not hasattr(module, "reset_parameters"):
        return
    # A shallow copy keeps the module's class and settings (in/out features, padding_idx);
    # its parameters become full-size plain CPU tensors (a DTensor's shape is the global one),
    # on the CPU because GPT(config) is built on the CPU: its draws come from the CPU generator.
    twin = copy.copy(module)
    # (None entries too: a Linear without bias still has `bias`, set to None.)
    twin._parameters = {name: p if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype))
                        for name, p in module._parameters.items()}
    twin.reset_parameters()  # the constructor's own code: the same draws, into scratch memory


def _fill_shard(param: torch.Tensor, init: Callable[[torch.Tensor], object]) -> None:
    """`init` on a full-size CPU tensor, then keep this rank's part of it (model.init_weights)."""
    full = torch.empty(param.shape, dtype=param.dtype)  # one full parameter at a time
    init(full)
    if isinstance(param, DTensor):
        # Cut it as the parameter is cut (FSDP: dim 0 in world-size chunks, the last one
        # shorter). src_data_rank=None: every rank drew the same tensor, so each takes its
        # chunk locally instead of receiving it from rank 0.
        local = distribute_tensor(full, param.device_mesh, param.placements,
                                  src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


@torch.no_grad()
def init_sharded(model: nn.Module, device: torch.device, cpu_offload: bool = False) -> None:
    """Storage and initial weights for a model built on the meta device and sharded there.

        torch.manual_seed(seed)
        with torch.device("meta"):
            model = GPT(config)          # shapes only, no memory, no RNG draws
        model = parallelize(model, device, "fsdp")
        init_sharded(model, device)      # == GPT(config) after the same seed, sharded

    `to_empty` gives each rank memory for its own shards only (uninitialised); then every
    parameter is drawn full-size on the CPU, in the plain path's order, and each rank keeps its
    chunk. So the weights equal the plain path's bit for bit (DDP and FSDP runs stay
    comparable), and at most one full parameter (the embedding, the largest) exists at a time.
    The model needs `init_weights(fill)` (model.GPT) and no buffers (to_empty leaves them
    uninitialised too).
    """
    # FSDP keeps its tied parameters tied (wte and lm_head share one sharded tensor after this).
    model.to_empty(device="cpu" if cpu_offload else device)
    for module in model.modules():  # in the order they were built
        _replay_constructor_draws(module)
    model.init_weights(fill=_fill_shard)
