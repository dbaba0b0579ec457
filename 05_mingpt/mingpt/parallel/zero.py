"""ZeRO stage 1: DDP (apply), with AdamW's state sharded over the data-parallel ranks by
ZeroRedundancyOptimizer (optimizer, which optim.build_optimizer calls).

Every parameter has an owner rank, which alone keeps its AdamW moments, updates it and
broadcasts the new values; gradients are still all-reduced whole. With a pipeline (pp_size)
each stage's data-parallel ranks share its optimizer state, and the stages stay plain modules
whose gradients the pipeline averages (Pipeline.finish_step): DDP cannot wrap a stage (ddp.py),
and FSDP2's replicate makes the weights DTensors, which ZeroRedundancyOptimizer cannot broadcast.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.optim import ZeroRedundancyOptimizer

from mingpt.parallel import ddp
from mingpt.parallel.layout import Settings
from mingpt.parallel.wrappers import wrap_blocks


def apply(model: nn.Module, device: torch.device, s: Settings, mesh: DeviceMesh,
          pipeline: bool = False) -> nn.Module:
    """ddp's apply; a pipeline stage (`pipeline`) stays a plain module, its blocks wrapped."""
    if not pipeline:
        return ddp.apply(model, device, s, mesh)
    # Plain weights on every data-parallel rank of the stage, equal from the start: every rank
    # built the model from the same seed (main.py), as ddp's replicate also relies on.
    wrap_blocks(model, s.activation_checkpointing, s.compile)
    # parallel.parallelize hands the pipeline the ranks to average over (layout.grad_mesh).
    return model


def optimizer(groups: list[dict], group: dist.ProcessGroup | None = None,
              kind: type[torch.optim.Optimizer] = torch.optim.AdamW,
              **settings) -> ZeroRedundancyOptimizer:
    """`kind` (AdamW, or muon.MuonAdamW) over `groups`, each rank of `group` (the
    data-parallel ranks; None: every rank) keeping the state of the parameters it owns: whole
    parameters, so Muon orthogonalizes each of its matrices on its owner alone."""
    # Snapshots write each owner's state under its parameters' names (shards.dcp_state), so
    # any layout resumes a zero snapshot and zero resumes any.
    return ZeroRedundancyOptimizer(groups, optimizer_class=kind, process_group=group,
                                   **settings)
