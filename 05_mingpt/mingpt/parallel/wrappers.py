"""The model and its wrappers: per-block activation checkpointing and compile, the GPT behind
DDP or DataParallel, the data-parallel rank, the devices one process computes on."""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt.model import MoE
from mingpt.parallel import layout


def wrap_blocks(model: nn.Module, activation_checkpointing: bool, compile: bool) -> None:
    """Activation checkpointing and compile, per block and in place, before any strategy."""
    for i, block in enumerate(model.blocks):
        if activation_checkpointing:
            # Non-reentrant: works with DDP's and FSDP's backward hooks; the wrapper hides
            # itself from state_dict keys, so snapshots stay interchangeable.
            block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        if compile:
            compile_in_place(block)
        model.blocks[i] = block


def compile_in_place(module: nn.Module) -> None:
    """module.compile(): in place, so parameter names (and snapshots) do not change. A mixture
    of experts' routing (MoE.route) stays out of the graphs and runs eagerly: its shapes are
    the data's (rows per expert), so each routing that emptied an expert, or gave it one row,
    recompiled it, and on the 5th step of a 1-process run the recompiled graph failed
    (dynamo's "AssertionError: 234 not in VR[256, 256]"); the rest of the block compiles."""
    for part in module.modules():
        if isinstance(part, MoE):
            # On the instance, here, not on the class in model.py: torch.compiler.disable
            # imports torch._dynamo (a second), which an uncompiled model (sample.py's,
            # export_hf.py's) need not pay.
            part.route = torch.compiler.disable(part.route, reason="data-dependent shapes")
    module.compile()


def unwrap(model: nn.Module) -> nn.Module:
    """The model whose methods (generate, optim_groups) to call: DDP and DataParallel hide it
    in `.module`. An FSDP2 or TP model is its own root (fully_shard changes the class in place)."""
    return model.module if isinstance(model, DDP | nn.DataParallel) else model


def data_parallel(model: nn.Module) -> tuple[int, int]:
    """(rank, size) among the ranks that see different data (the mesh's dp dimension, not a TP
    or CP group or a pipeline): samplers, seeds and tokens/s count these, not processes."""
    mesh = getattr(unwrap(model), "mesh", None)
    if mesh is None:  # a model parallelize() did not lay out (a test's own DDP, say)
        return dist.get_rank(), dist.get_world_size()
    dp = layout.axis(mesh, "dp")
    return dp.get_local_rank(), dp.size()


def pipeline_stage(model: nn.Module) -> int:
    """This rank's place along its pipeline (the mesh's pp dimension; 0 without one)."""
    mesh = getattr(unwrap(model), "mesh", None)
    # Only the axes that are on are dimensions of the mesh (layout.py): no pp, no stage.
    if mesh is None or "pp" not in (mesh.mesh_dim_names or ()):
        return 0
    # Stage s of a pipeline sits at pp rank s (looped schedules: its first stage).
    return mesh["pp"].get_local_rank()


def local_devices(model: nn.Module, device: torch.device) -> list[torch.device]:
    """The devices this process computes on (MFU, peak memory): DataParallel's, else `device`."""
    if isinstance(model, nn.DataParallel) and model.device_ids:
        return [torch.device(device.type, index) for index in model.device_ids]
    return [device]
