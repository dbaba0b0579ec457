"""Wrap a freshly built model for distributed training; the model itself knows nothing of it.

    model = parallelize(GPT(config).to(device), device, method="fsdp", precision="bf16")
    optimizer = AdamW(unwrap(model).optim_groups(0.1))  # only now: FSDP replaces the parameters

Order matters: activation checkpointing and torch.compile wrap each block first, then DDP or
FSDP wraps the result, and the optimizer is built last, from the wrapped model's parameters.
One function per strategy (apply_ddp, apply_fsdp); `parallelize` picks one by name.
"""
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
