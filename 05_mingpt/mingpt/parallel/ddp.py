"""DistributedDataParallel: every rank holds the whole model and trains on its own batches;
gradients are averaged by all-reduce during backward, bucket by bucket, overlapped with it.

    model = apply(model, device, settings)   # parallel.STRATEGIES["ddp"]
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt.parallel.common import wrap_blocks
from mingpt.parallel.settings import Settings


def apply(model: nn.Module, device: torch.device, s: Settings) -> nn.Module:
    """DDP: a whole replica per rank, gradients all-reduced in backward."""
    # Blocks checkpointed one by one; compiled as ONE graph, so inductor also takes the output
    # layer and the loss: on an H100, GPT-2's step went from 72.2 ms (per block) to 41.3 ms
    # (bench/README.md). In place: parameter names (and snapshots) do not change.
    wrap_blocks(model, s.activation_checkpointing, compile=False)
    if s.compile:
        model.compile()
    if dist.get_world_size() == 1:
        # One process has no gradients to average, but DDP would still copy each one into
        # its buckets and all-reduce them over a group of one: about 10 % of a small
        # model's step on a CPU (bench/README.md). Snapshots hold unwrap(model) anyway.
        return model
    return wrap(model, device)


def wrap(model: nn.Module, device: torch.device) -> DDP:
    """The DDP wrapper itself, on any number of ranks."""
    # DDP broadcasts rank 0's weights at construction and all-reduces gradients in backward.
    # device_ids only for a GPU: on the CPU DDP must get none.
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
