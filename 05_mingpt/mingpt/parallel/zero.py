"""ZeRO stage 1: DDP, with AdamW's state sharded over the data-parallel ranks
(ZeroRedundancyOptimizer).

    model = ddp.apply(model, device, settings, mesh["dp"])     # the model is DDP's
    optimizer = optimizer(groups, group, torch.optim.AdamW, lr=3e-3)   # optim.build_optimizer

ZeroRedundancyOptimizer gives every parameter an owner rank: only the owner keeps its AdamW
moments and updates it, then broadcasts the new values. Gradients are still all-reduced whole
by DDP (optimizer state sharded, nothing else): 3/4 of DDP's model state with AdamW in fp32.
"""
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer


def optimizer(groups: list[dict], group: dist.ProcessGroup | None = None,
              kind: type[torch.optim.Optimizer] = torch.optim.AdamW,
              **settings) -> ZeroRedundancyOptimizer:
    """`kind` (AdamW, or muon.MuonAdamW) over `groups`, each rank of `group` (the
    data-parallel ranks; None: every rank) keeping the state of the parameters it owns: whole
    parameters, so Muon orthogonalizes each of its matrices on its owner alone."""
    # Snapshots gather every owner's state to rank 0 first (snapshot.save:
    # consolidate_state_dict), so a zero snapshot is a ddp file and either resumes it.
    # ZeRO builds one `kind` per rank over the parameters that rank owns, with `settings`.
    return ZeroRedundancyOptimizer(groups, optimizer_class=kind, process_group=group,
                                   **settings)
