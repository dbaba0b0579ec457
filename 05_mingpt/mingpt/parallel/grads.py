"""Gradients of any layout: clipping across meshes and pipeline stages, sync per micro-step."""
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel as DDP


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float,
                    stages: dist.ProcessGroup | None = None, not_counted: set[int] = frozenset()
                    ) -> torch.Tensor:
    """torch's clip_grad_norm_, also for gradients on different meshes (TP: DTensors and plain
    tensors, which torch's refuses to mix) and over a pipeline's `stages` (squares summed over
    that group; `not_counted`: ids of parameters another stage counts, the tied embedding)."""
    params = [p for p in parameters if p.grad is not None]
    kinds: dict = {}  # mesh (None: plain tensors) -> its parameters, in parameter order
    for p in params:
        kinds.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None,
                         []).append(p)
    if len(kinds) <= 1 and stages is None:  # DDP, FSDP: one kind, torch's own (fused) version
        return torch.nn.utils.clip_grad_norm_(params, max_norm,
                                              foreach=_foreach(next(iter(kinds), None), params))
    norms = []
    for mesh, same_mesh in kinds.items():  # the same order on every rank: the collectives match
        norm = torch.nn.utils.get_total_norm([p.grad for p in same_mesh
                                              if id(p) not in not_counted],
                                             foreach=_foreach(mesh, same_mesh))
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    if stages is not None:  # the other stages' squares: sqrt(sum of squares), over the group
        square = total.square()
        dist.all_reduce(square, group=stages)
        total = square.sqrt()
    # As torch computes it, and as a tensor: reading it on the host would sync a GPU per step.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for mesh, same_mesh in kinds.items():
        # DTensor gradients take the factor as a DTensor replicated over their own mesh.
        factor = coef if mesh is None else DTensor.from_local(
            coef, mesh, [Replicate()] * mesh.ndim, run_check=False)
        torch._foreach_mul_([p.grad for p in same_mesh], factor)
    return total


def _foreach(mesh: object, params: list[nn.Parameter]) -> bool | None:
    """The `foreach` argument of torch's norm and clip for one of clip_grad_norm_'s kinds
    (`mesh` None: plain tensors): True for plain ones on a CPU or GPU, else None."""
    # True is torch's default for plain CPU and GPU gradients, said here because the dry run's
    # fake tensors would take the per-tensor loop instead: other ops than the real step's.
    plain = mesh is None and params and params[0].grad.device.type in ("cpu", "cuda")
    return True if plain else None


def set_grad_sync(model: nn.Module, sync: bool) -> AbstractContextManager:
    """A context for one micro-step: skip the gradient all-reduce unless `sync` (DDP's
    no_sync(); FSDP2's switch, which stays set until changed)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    return model.no_sync() if isinstance(model, DDP) and not sync else nullcontext()
