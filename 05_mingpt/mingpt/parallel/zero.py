"""ZeRO stage 1: DDP, with AdamW's state sharded over the data-parallel ranks
(ZeroRedundancyOptimizer).

    model = apply(model, device, settings, mesh["dp"])         # the model is DDP's
    optimizer = optimizer(groups, group, torch.optim.AdamW, lr=3e-3)   # optim.build_optimizer

ZeroRedundancyOptimizer gives every parameter an owner rank: only the owner keeps its AdamW
moments and updates it, then broadcasts the new values. Gradients are still all-reduced whole
(optimizer state sharded, nothing else): 3/4 of DDP's model state with AdamW in fp32.

With a pipeline (pp_size) this is what Megatron's distributed optimizer and DeepSpeed run:
each stage's data-parallel ranks share the optimizer state of that stage's parameters. The
stages stay plain modules, and the pipeline averages their gradients after a step's last
backward (pipeline.Pipeline.finish_step): DDP cannot wrap a stage (its no_sync would have to
cover the pipeline's forwards too, ddp.py), and FSDP2's replicate, which ddp uses there,
makes the weights DTensors, which ZeroRedundancyOptimizer cannot broadcast.
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
    """ddp's apply; a pipeline stage (`pipeline`) stays a plain module, its blocks
    checkpointed and compiled where asked, its gradients the pipeline's to average."""
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
    # ZeRO builds one `kind` per rank over the parameters that rank owns, with `settings`.
    return ZeroRedundancyOptimizer(groups, optimizer_class=kind, process_group=group,
                                   **settings)
