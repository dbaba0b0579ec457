"""The model and its wrappers: per-block activation checkpointing and compile, the GPT behind
DDP or DataParallel, the data-parallel rank, the devices one process computes on.

    wrap_blocks(model, activation_checkpointing=True, compile=False)   # before any wrapper
    unwrap(model).generate(...)          # the GPT inside DDP / DataParallel
    dp_rank, dp_size = data_parallel(model)   # the ranks that see different data
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.nn.parallel import DistributedDataParallel as DDP


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


def unwrap(model: nn.Module) -> nn.Module:
    """The model whose methods (generate, optim_groups) to call: DDP and DataParallel hide it
    in `.module`.

    An FSDP2 model is its own root (fully_shard changes the class in place), and must be called
    through it: its forward hooks gather the sharded parameters. So is a TP model.
    """
    return model.module if isinstance(model, DDP | nn.DataParallel) else model


def data_parallel(model: nn.Module) -> tuple[int, int]:
    """(rank, size) among the ranks that see different data: the dp dimension of the mesh
    parallelize() built (layout.py).

    Every rank of one TP group computes on the same batch (each with its slice of the weights),
    and so does every rank of one CP group (each with its slice of the sequences) and of one
    pipeline (each with its stages), so samplers, seeds and tokens/s count data-parallel
    ranks, not processes."""
    mesh = getattr(unwrap(model), "mesh", None)
    if mesh is None:  # a model parallelize() did not lay out (a test's own DDP, say)
        return dist.get_rank(), dist.get_world_size()
    return mesh["dp"].get_local_rank(), mesh["dp"].size()


def pipeline_stage(model: nn.Module) -> int:
    """This rank's place along its pipeline (the mesh's pp dimension; 0 without one)."""
    mesh = getattr(unwrap(model), "mesh", None)
    # Only the axes that are on are dimensions of the mesh (layout.py): no pp, no stage.
    if mesh is None or "pp" not in (mesh.mesh_dim_names or ()):
        return 0
    # Stage s of a pipeline sits at pp rank s (looped schedules: its first stage).
    return mesh["pp"].get_local_rank()


def local_devices(model: nn.Module, device: torch.device) -> list[torch.device]:
    """The devices this process computes on: every GPU of nn.DataParallel, else `device`.

    MFU and peak memory count these: one dp process keeps N GPUs busy."""
    if isinstance(model, nn.DataParallel) and model.device_ids:
        return [torch.device(device.type, index) for index in model.device_ids]
    return [device]
