"""2-D parallelism: tensor parallelism inside groups of tp_size ranks, FSDP across the groups.

    model = apply(model, device, settings)   # parallel.STRATEGIES["fsdp_tp"]

A (dp, tp) mesh: consecutive ranks form a TP group, so a group stays inside a node (TP's
all-reduces want the fast links) and FSDP's gathers cross nodes.
"""
import torch
from torch import nn

from mingpt.parallel import fsdp, tensor
from mingpt.parallel.common import wrap_blocks
from mingpt.parallel.settings import Settings


def apply(model: nn.Module, device: torch.device, s: Settings) -> nn.Module:
    mesh = tensor.tp_mesh(device, s.tp_size)
    tensor.apply_tp(model, mesh["tp"])  # TP first: its plan names the blocks' own submodules
    wrap_blocks(model, s.activation_checkpointing, s.compile)
    # FSDP over the dp dimension only: each parameter's TP shard is sharded once more.
    fsdp.shard(model, device, s.precision, mesh=mesh["dp"])
    model.dp_tp_mesh = mesh  # data_parallel() reads it: the trainer deals data out over dp
    return model
