"""The axes of parallelism, one module each, and `parallelize`, which composes them.

    model = parallelize(GPT(config).to(device), device, "fsdp", tp_size=2, pp_size=2)
    optimizer = optim.build_optimizer(model, "fsdp", lr=3e-3)  # after: FSDP replaces parameters

A layout is a data-parallel flavour plus degrees (layout.py). `parallelize` builds the mesh and
applies the axes in one order, as torchtitan does: pipeline.split into stages; on each part
TP, CP, EP, then the flavour (with checkpointing and compile); pipeline.schedule. TP comes first
because its plan names the blocks' own submodules (attn.c_attn, ...), which the checkpoint
wrapper would hide; the flavour last because it wraps whatever the others left. Every rank's
model then carries `mesh` and `layout`. Adding an axis: README, "Extending".
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mingpt.parallel import context, dataparallel, ddp, expert, fsdp, layout, pipeline, tensor, zero
from mingpt.parallel.layout import FLAVOURS, METHODS, SHORTHANDS, Layout, Settings, resolve
from mingpt.parallel.runner import Runner
from mingpt.parallel.wrappers import unwrap, wrap_blocks


@dataclass(frozen=True)
class Strategy:
    """A name of distributed_method: a flavour, or a shorthand for degrees (layout.py)."""

    summary: str  # one line for the docs and --help
    tp: bool = False  # tp_size is this name's own (0: every rank)
    pipeline: bool = False  # pp_size is this name's own (0: every rank)


STRATEGIES = {
    "ddp": Strategy("a whole replica per rank, gradients all-reduced"),
    "fsdp": Strategy("parameters, gradients and optimizer state sharded over all ranks"),
    "zero": Strategy("ddp, with AdamW's state sharded over the ranks"),
    "tp": Strategy("every block's matmuls split over all ranks", tp=True),
    "fsdp_tp": Strategy("TP inside groups of tp_size ranks, FSDP across the groups", tp=True),
    "pp": Strategy("the blocks split into stages over all ranks, micro-batches "
                   "pipelined", pipeline=True),
    "fsdp_pp": Strategy("pipelines of pp_size ranks, FSDP across the pipelines", pipeline=True),
    "fsdp_tp_pp": Strategy("TP inside each stage, pipelines of pp_size stages, FSDP "
                           "across", tp=True, pipeline=True),
    "dp": Strategy("nn.DataParallel: one process drives every GPU"),
}
assert set(STRATEGIES) == set(METHODS), "every name of layout.py has an entry here"


def parallelize(model: nn.Module, device: torch.device, method: str = "ddp",
                **settings) -> nn.Module:
    """`model` laid out by `method` and the degrees in `settings` (Settings: tp_size, pp_size,
    cp_size, precision, ...); its `blocks` (a ModuleList) are the units of every axis.
    ValueError (one line) where the world size or the model does not fit the layout."""
    s = Settings(**settings)
    lay = resolve(method, dist.get_world_size(), **layout.degrees(s))
    axes = lay.sizes()  # the axes that are on: a degree > 1, or named by a shorthand
    mesh = layout.build_mesh(lay, device)
    parts = pipeline.split(model, mesh, s) if "pp" in axes else [model]
    wrapped = [_apply_axes(part, device, s, lay, mesh) for part in parts]
    if "pp" in axes:
        average = layout.grad_mesh(mesh).get_group() if lay.pipeline_averages else None
        model.pipeline = pipeline.schedule(model, wrapped, mesh, s, device, average)
    else:
        model = wrapped[0]
    unwrap(model).mesh, unwrap(model).layout = mesh, lay  # the trainer and snapshots read them
    return model


def _apply_axes(part: nn.Module, device: torch.device, s: Settings, lay: Layout,
                mesh) -> nn.Module:
    """TP, CP, then the flavour (with checkpointing and compile), on one part of the model."""
    axes = lay.sizes()
    if "tp" in axes:
        tensor.apply(part, mesh["tp"])
    if "cp" in axes:
        context.apply(part, mesh["cp"])
    if "ep" in axes:  # the experts over ep, their gradients averaged over edp
        expert.apply(part, mesh, lay.flavour, s)
    grads = layout.grad_mesh(mesh)  # the ranks that average gradients: dp (x cp)
    if lay.flavour == "ddp":
        return ddp.apply(part, device, s, grads, pipeline="pp" in axes)
    if lay.flavour == "zero":
        return zero.apply(part, device, s, grads, pipeline="pp" in axes)
    if lay.flavour == "fsdp":
        # Under a pipeline every micro-batch runs each stage's forward and backward: resharding
        # after forward would gather the weights again for its backward (torchtitan turns it
        # off with PP too); the stage's weights stay gathered until the round's last backward.
        return fsdp.apply(part, device, s, grads, reshard_after_forward="pp" not in axes)
    if lay.flavour == "dp":
        return dataparallel.apply(part, device, s)
    wrap_blocks(part, s.activation_checkpointing, s.compile)  # tp, pp: no data-parallel axis
    return part


def runner(model: nn.Module, device: torch.device, precision: str):
    """The step of `model`'s layout: its pipeline's schedule, or a forward and a backward per
    micro-batch (runner.Runner). Both have forward_backward, evaluate and clip_grad_norm."""
    return getattr(unwrap(model), "pipeline", None) or Runner(model, device, precision)


AXIS_NAMES = {"pp": "pipeline-parallel", "cp": "context-parallel", "tp": "tensor-parallel",
              "ep": "expert-parallel"}


def describe(model: nn.Module) -> str:
    """The axes that split each model replica, for the log: "pipeline-parallel 2 x ..."."""
    lay = getattr(unwrap(model), "layout", None)
    if not isinstance(lay, Layout):
        return "none"
    return " x ".join(f"{AXIS_NAMES[axis]} {size}" for axis, size in lay.sizes().items()
                      if axis not in ("dp", "edp")) or "none"


__all__ = ["FLAVOURS", "METHODS", "SHORTHANDS", "STRATEGIES", "Layout", "Runner", "describe",
           "parallelize", "resolve", "runner"]
