"""DistributedDataParallel: every data-parallel rank holds the whole model (or its whole part:
its TP shard, its pipeline stage) and trains on its own batches; gradients are averaged by
all-reduce during backward, bucket by bucket, overlapped with it.

    model = apply(model, device, settings, mesh["dp"])   # parallel.parallelize, flavour ddp
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt.parallel.fsdp import policies
from mingpt.parallel.layout import Settings
from mingpt.parallel.wrappers import wrap_blocks


def apply(model: nn.Module, device: torch.device, s: Settings, mesh: DeviceMesh,
          pipeline: bool = False) -> nn.Module:
    """DDP over the data-parallel ranks `mesh`: a whole replica each, gradients all-reduced.
    `pipeline`: `model` is a pipeline stage."""
    if pipeline or any(isinstance(p, DTensor) for p in model.parameters()):
        # FSDP2's replicate does DDP's job (an all-reduce of every gradient, no sharding)
        # where DDP cannot, as torchtitan does: tensor parallelism's weights are DTensors,
        # which DDP cannot broadcast ("no sharding strategy registered" for c10d.broadcast_);
        # and a pipeline runs several micro-batches' forwards before their backwards, while
        # DDP's no_sync must cover the forward too (torch's stages wrap only the backward, and
        # DDP's reducer then fails on its second step: "rebuilt parameter indices size is not
        # same as original model parameters size").
        return _replicate(model, s, mesh)
    # Blocks checkpointed one by one; compiled as ONE graph, so inductor also takes the output
    # layer and the loss: on an H100, GPT-2's step went from 72.2 ms (per block) to 41.3 ms
    # (bench/README.md). In place: parameter names (and snapshots) do not change.
    wrap_blocks(model, s.activation_checkpointing, compile=False)
    if s.compile:
        model.compile()
    if mesh.size() == 1:
        # One replica has no gradients to average, but DDP would still copy each one into
        # its buckets and all-reduce them over a group of one: about 10 % of a small
        # model's step on a CPU (bench/README.md). Snapshots hold unwrap(model) anyway.
        return model
    return wrap(model, device, mesh.get_group())


def wrap(model: nn.Module, device: torch.device, group: dist.ProcessGroup | None = None
         ) -> DDP:
    """The DDP wrapper itself, over `group` (None: every rank)."""
    # DDP broadcasts the group's first rank's weights at construction and all-reduces
    # gradients in backward. device_ids only for a GPU: on the CPU DDP must get none.
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               process_group=group)


def _replicate(model: nn.Module, s: Settings, mesh: DeviceMesh) -> nn.Module:
    """FSDP2's replicate, per block then the root (FSDP's units): gradients all-reduced over
    `mesh` block by block during backward, each rank keeping its whole (TP-sharded) weights."""
    # Imported here: xla_main.py imports this package under torch_xla's older torch.
    from torch.distributed._composable.replicate_with_fsdp import replicate  # noqa: PLC0415
    wrap_blocks(model, s.activation_checkpointing, s.compile)
    kwargs = {"mesh": mesh, **policies(s.precision, False, torch.device(mesh.device_type))}
    for block in model.blocks:
        replicate(block, **kwargs)
    replicate(model, **kwargs)
    return model
