"""ZeRO stage 1: DDP, with AdamW's state sharded over the ranks (ZeroRedundancyOptimizer).

    model = ddp.apply(model, device, settings)             # the model is DDP's
    optimizer = optimizer(groups, lr=3e-3, fused=True)    # parallel.STRATEGIES["zero"]

ZeroRedundancyOptimizer gives every parameter an owner rank: only the owner keeps its AdamW
moments and updates it, then broadcasts the new values. Gradients are still all-reduced whole
by DDP (optimizer state sharded, nothing else): 3/4 of DDP's model state with AdamW in fp32.
"""
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer


def optimizer(groups: list[dict], **adamw) -> ZeroRedundancyOptimizer:
    """AdamW over `groups`, each rank keeping the state of the parameters it owns."""
    # Snapshots gather every owner's state to rank 0 first (snapshot.save:
    # consolidate_state_dict), so a zero snapshot is a ddp file and either resumes it.
    return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **adamw)
