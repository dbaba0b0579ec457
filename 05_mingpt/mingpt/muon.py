"""Muon for the blocks' matrices, AdamW for everything else, as one optimizer
(optimizer_config.name=muon; optim.build_optimizer builds it).

    optimizer = MuonAdamW(groups, lr=1e-2, betas=(0.9, 0.99), muon_lr=0.02)

Muon (torch.optim.Muon) keeps a momentum of each weight matrix's gradient and steps along its
orthogonalized version (a few Newton-Schulz iterations push every singular value towards 1),
so every direction of the matrix moves by about the same amount. It is defined for matrices,
so the groups marked "muon" (model.GPT.optim_groups: the blocks' Linear weights, and each
expert's matrix of a MoE) take Muon's update; embeddings, the tied output layer, biases and
LayerNorms keep AdamW's, as modded-nanogpt does. The two kinds live in one optimizer, so the
trainer, the lr schedule, ZeRO and the snapshots see one object, as with AdamW alone.

Where a layout shards a matrix (FSDP's and tensor parallelism's DTensors), the step gathers the
update whole over the shard's mesh, orthogonalizes it on every rank of that mesh, and keeps
this rank's part: each rank computes what one process computes. (The other choice, one rank per
matrix orthogonalizing it and scattering the parts, spends less arithmetic but adds a second
collective and a schedule of owners; at this size the arithmetic is the smaller cost.) A MoE's
expert stack (E, in, out) sharded only along the experts holds whole matrices: no gather.
ZeRO gives whole parameters to their owner rank, and pipeline stages own whole blocks.
"""
from collections.abc import Callable
from functools import partial

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

# torch.optim.Muon's own Newton-Schulz iteration and lr scaling (private helpers of torch's
# optimizer, used rather than written again: its step cannot take a sharded matrix whole).
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from mingpt.parallel import strided

# torch.optim.Muon's defaults: Nesterov momentum 0.95, Keller Jordan's quintic coefficients.
MOMENTUM, NS_COEFFICIENTS, NS_STEPS, EPS = 0.95, (3.4445, -4.775, 2.0315), 5, 1e-7


class MuonAdamW(torch.optim.AdamW):
    """AdamW whose groups marked {"muon": True} take torch.optim.Muon's update instead, with
    their own lr (the schedule scales every group's lr by the same factor)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), weight_decay: float = 0.1,
                 muon_lr: float = 0.02, momentum: float = MOMENTUM, fused: bool | None = None,
                 ) -> None:
        groups = list(params)
        for group in groups:  # the Muon groups' lr is muon_lr unless the group says otherwise
            if group.get("muon"):
                group.setdefault("lr", muon_lr)
        super().__init__(groups, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused)
        for group in self.param_groups:
            group.setdefault("muon", False)
            group.setdefault("momentum", momentum)
        # muon_lr beside lr: a resume rebuilds each group's base lr from them (optim.py)
        self.defaults.update(muon=False, momentum=momentum, muon_lr=muon_lr)

    def __setstate__(self, state: dict) -> None:
        # (load_state_dict) Adam's own reads the "step" count of every state, which Muon's
        # momentum-only states lack: it sees the AdamW groups alone, then all are put back.
        groups = state["param_groups"]
        super().__setstate__({**state, "param_groups": [g for g in groups if not g.get("muon")]})
        self.param_groups = groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        for group in groups:
            if group["muon"]:
                for param in group["params"]:
                    if param.grad is not None:
                        self._muon_update(param, group)
        # AdamW's own step over the other groups (its fused kernel where build_optimizer chose
        # it); the Muon groups are out of its sight for that call.
        self.param_groups = [group for group in groups if not group["muon"]]
        try:
            super().step()
        finally:
            self.param_groups = groups
        return loss

    def _muon_update(self, param: torch.Tensor, group: dict) -> None:
        """torch.optim.Muon's step for one parameter: a matrix, or a stack of expert matrices
        (E, in, out), each orthogonalized on its own, sharded or not."""
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param.grad)
        buf = state["momentum_buffer"]
        momentum = group["momentum"]
        buf.lerp_(param.grad, 1 - momentum)
        update = param.grad.lerp(buf, momentum)  # Nesterov, as torch.optim.Muon's default
        whole, back = _whole(update)
        if whole.ndim == 2:
            ortho = _zeropower_via_newtonschulz(whole, NS_COEFFICIENTS, NS_STEPS, EPS)
            # nn.Linear's (out, in), as torch.optim.Muon scales it
            lr = _adjust_lr(group["lr"], None, param.shape)
        else:  # an expert stack (E, in, out): its matrices are (in, out), Linear's transposed
            ortho = torch.stack([_zeropower_via_newtonschulz(m, NS_COEFFICIENTS, NS_STEPS, EPS)
                                 for m in whole.unbind(0)]) if len(whole) else whole.bfloat16()
            lr = _adjust_lr(group["lr"], None, param.shape[:0:-1])
        ortho = back(ortho)
        param.mul_(1 - group["lr"] * group["weight_decay"])
        param.add_(ortho, alpha=-lr)


def _whole(update: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """(`update`'s whole matrices, a function that lays a result of that shape out as `update`
    is): a plain tensor as it is; TP's q/k/v rows through strided.py (a layout only it
    describes); a DTensor of whole matrices (replicated, or experts cut along the stack) as
    its local part; any other DTensor all-gathered over its shard mesh, and cut back locally,
    with no communication."""
    if strided.is_qkv(update):
        return strided.whole_strided(update), partial(strided.own_rows, update)
    if not isinstance(update, DTensor):
        return update, lambda t: t
    mesh, placements = update.device_mesh, update.placements
    if _whole_matrices(update):
        return update.to_local(), partial(DTensor.from_local, device_mesh=mesh,
                                          placements=placements, run_check=False,
                                          shape=update.shape, stride=update.stride())
    return update.full_tensor(), lambda t: DTensor.from_local(
        t, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(mesh, placements)


def _whole_matrices(t: DTensor) -> bool:
    """Whether this rank's part of `t` is made of whole matrices: replicated, or an expert
    stack (3-D) cut only along its experts."""
    return all(isinstance(p, Replicate) or (t.ndim == 3 and isinstance(p, Shard) and p.dim == 0)
               for p in t.placements)
