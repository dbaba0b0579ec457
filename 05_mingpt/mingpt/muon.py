"""Muon for the blocks' matrices, AdamW for everything else, as one optimizer that the trainer,
the lr schedule, ZeRO and the snapshots see as one (optimizer_config.name=muon). A matrix a layout
shards (FSDP's, TP's DTensors) is gathered whole over its shard mesh, orthogonalized on every rank
of it and cut back to this rank's part: one collective, and no schedule of owner ranks."""
from collections.abc import Callable
from functools import partial

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

# torch.optim.Muon's private helpers: its own step cannot take a sharded matrix whole.
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
        for group in (g for g in groups if g["muon"]):
            for param in (p for p in group["params"] if p.grad is not None):
                self._muon_update(param, group)
        # AdamW's own step (fused where build_optimizer chose it) over the other groups only.
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
    is): a plain tensor as it is, TP's q/k/v rows through strided.py, a DTensor of whole
    matrices as its local part, any other DTensor all-gathered and cut back locally."""
    if strided.is_qkv(update):
        return strided.whole_strided(update), partial(strided.own_rows, update)
    if not isinstance(update, DTensor):
        return update, lambda t: t
    mesh, placements = update.device_mesh, update.placements
    # This rank's part is whole matrices: replicated, or experts cut on dim 0.
    if all(isinstance(p, Replicate) or (update.ndim == 3 and isinstance(p, Shard) and p.dim == 0)
           for p in placements):
        return update.to_local(), partial(DTensor.from_local, device_mesh=mesh,
                                          placements=placements, run_check=False,
                                          shape=update.shape, stride=update.stride())
    return update.full_tensor(), lambda t: DTensor.from_local(
        t, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(mesh, placements)
