"""A layout: a data-parallel flavour plus the degree of every other axis, and the mesh they make.

    layout = resolve("fsdp", world=8, tp_size=2, pp_size=2)  # ValueError (one line) if it can't
    mesh = build_mesh(layout, device)                       # dims pp, dp, cp, tp (sizes > 1)

dp is what the world size leaves, world / (pp x cp x tp); ep_size splits it (edp x ep, flattened
back into "dp"; MOE.md). Mesh order, outermost first: pp, dp, cp, tp (torchtitan's): a TP group
is tp consecutive ranks (inside a node, for its per-block all-reduces), a CP ring the next
level, pipeline stages farthest apart (point to point). Only the axes that are on become mesh
dimensions (dp always), so a plain ddp run keeps the one default process group.
"""
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils.weak import WeakIdKeyDictionary


class Settings(NamedTuple):
    """What every axis's `apply` reads: the degrees and the run's settings (trainer_config's
    keys of the same names; main.py passes them all)."""

    precision: str = "fp32"  # fp32, bf16 or fp16 (FSDP's mixed-precision policy)
    cpu_offload: bool = False  # FSDP: shards, gradients and optimizer state in CPU memory
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    compile: bool = False  # torch.compile: per block, or the whole model (ddp, zero)
    tp_size: int = 0  # ranks per tensor-parallel group (0: every rank)
    cp_size: int = 0  # ranks per context-parallel group (0, 1: off; context.py)
    ep_size: int = 0  # data-parallel ranks per expert-parallel group (0, 1: off; expert.py)
    pp_size: int = 0  # ranks per pipeline (0: every rank, or every rank of a TP group)
    pp_schedule: str = "1f1b"  # gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zb, ...
    microbatches: int = 1  # micro-batches each micro-step's batch is cut into
    pp_stages_per_rank: int = 2  # the looped schedules' stages per rank
    pp_split: list[int] | None = None  # blocks per stage; None: as even as possible
    batch_size: int = 0  # sequences per micro-step (a dry run's pipeline stages: their shapes)
    comm_hook: str = "none"  # DDP's gradient all-reduce: none, fp16 or bf16 compressed (ddp.py)


FLAVOURS = ("ddp", "zero", "fsdp", "dp")  # how the data-parallel ranks hold the model
# Shorthand -> (flavour, None: no data-parallel axis; axes that are on, 0 meaning every rank).
SHORTHANDS = {
    "tp": (None, ("tp",)),
    "fsdp_tp": ("fsdp", ("tp",)),
    "pp": (None, ("pp",)),
    "fsdp_pp": ("fsdp", ("pp",)),
    "fsdp_tp_pp": ("fsdp", ("tp", "pp")),
}
METHODS = (*FLAVOURS, *SHORTHANDS)
AXES = ("pp", "dp", "cp", "tp")  # mesh order, outermost first
# The keys of trainer_config (and Settings) that give a degree: every caller passes
# degrees(config), so an axis added here reaches every check without a change elsewhere.
DEGREES = ("tp_size", "pp_size", "cp_size", "ep_size")


def degrees(source: object) -> dict[str, int]:
    return {key: getattr(source, key) for key in DEGREES}


@dataclass(frozen=True)
class Layout:
    """A resolved layout: the flavour and every degree (1: off), for `world` ranks."""

    # As the config names it (a flavour or a shorthand), for messages; not part of equality:
    # fsdp_tp_pp with tp_size 2 is fsdp with tp_size 2 and pp_size 2.
    method: str = field(compare=False)
    flavour: str | None
    world: int
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # splits dp: dp / ep groups (edp) of ep ranks, each group all the experts
    # Axes a shorthand turns on even at size 1 (tp on one process: TP over a group of one).
    on: tuple[str, ...] = field(default=(), compare=False)

    @property
    def dp(self) -> int:
        """Ranks that see different data: what the world size leaves."""
        return self.world // (self.pp * self.cp * self.tp)

    @property
    def whole(self) -> bool:
        """Every rank holds the whole model: a ddp, zero or dp flavour with no tp, pp or ep
        degree (cp splits the sequences, not the weights)."""
        return self.flavour in ("ddp", "zero", "dp") and not self.on and \
            max(self.tp, self.pp, self.ep) <= 1

    @property
    def pipeline_averages(self) -> bool:
        """The pipeline averages its stages' gradients itself: zero's stay plain (zero.py)."""
        return self.flavour == "zero" and self.pp > 1

    def sizes(self) -> dict[str, int]:
        """The mesh's dimensions, outermost first: dp always (edp x ep), others where on."""
        every = {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}
        sizes = {axis: size for axis, size in every.items()
                 if axis == "dp" or size > 1 or axis in self.on}
        if self.ep > 1:  # in dp's place, in this order: an ep group is ep consecutive dp ranks
            sizes = {k: v for axis, size in sizes.items() for k, v in
                     ({"edp": self.dp // self.ep, "ep": self.ep} if axis == "dp"
                      else {axis: size}).items()}
        return sizes

    def describe(self) -> str:
        """One line for the log: `fsdp: pp 2 x dp 2 x tp 2` (8 ranks)."""
        return f"{self.flavour or self.method}: " + " x ".join(
            f"{axis} {size}" for axis, size in self.sizes().items())


def resolve(method: str, world: int, tp_size: int = 0, pp_size: int = 0, cp_size: int = 0,
            ep_size: int = 0) -> Layout:
    """The layout `method` names with these degrees on `world` ranks; ValueError (one line)
    where they do not fit (main.py calls it before any process group, parallelize() again)."""
    check_axes(method, tp_size, pp_size, cp_size, ep_size)
    flavour, on = SHORTHANDS.get(method, (method, ()))
    cp = max(cp_size, 1)
    tp = (tp_size or world) if "tp" in on else max(tp_size, 1)
    if world % tp:
        raise ValueError(f"trainer_config.tp_size={tp} must divide the world size {world} "
                         "(the ranks form world_size / tp_size tensor-parallel groups)")
    if method == "tp" and tp != world:
        # Pure TP has nothing that would average gradients across TP groups.
        raise ValueError(f"distributed_method=tp puts every rank in one tensor-parallel group, "
                         f"so tp_size must be 0 or the world size ({world}), got {tp_size}; "
                         "use fsdp_tp for data parallelism across TP groups")
    pp = (pp_size or world // tp) if "pp" in on else max(pp_size, 1)
    if world % (pp * tp):
        raise ValueError(f"pp_size={pp} x tp_size={tp} = {pp * tp} must divide the world size "
                         f"{world} (the mesh is pp x dp x tp)")
    if method == "pp" and pp * tp != world:
        # Nothing in pure pp would average gradients across pipelines.
        raise ValueError(f"distributed_method=pp runs one pipeline, so pp_size must be 0 or the "
                         f"world size ({world}), got {pp_size}; use fsdp_pp for data "
                         "parallelism across pipelines")
    if world % (pp * cp * tp):
        what = " x ".join(f"{k}_size={v}" for k, v in (("pp", pp), ("cp", cp), ("tp", tp))
                          if v > 1)
        raise ValueError(f"trainer_config.cp_size={cp} must divide the world size {world}"
                         if what == f"cp_size={cp}" else
                         f"{what} = {pp * cp * tp} must divide the world size {world} (each "
                         "model replica takes that many ranks)")
    ep, dp = max(ep_size, 1), world // (pp * cp * tp)
    if dp % ep:
        raise ValueError(f"trainer_config.ep_size={ep} must divide the data-parallel degree "
                         f"{dp} (world size {world} / (pp x cp x tp)): the experts are split "
                         "over groups of ep_size data-parallel ranks")
    return Layout(method, flavour, world, pp=pp, cp=cp, tp=tp, ep=ep, on=on)


def check_axes(method: str, tp_size: int = 0, pp_size: int = 0, cp_size: int = 0,
               ep_size: int = 0) -> None:
    """The pairs of a flavour and an axis, or of two axes, that cannot work: ValueError, one
    line saying which and why. Needs no world size: config.py calls it for every run."""
    if method not in METHODS:
        raise ValueError(f"unknown distributed_method {method!r}")
    flavour, on = SHORTHANDS.get(method, (method, ()))
    sizes = {"pp": pp_size, "cp": cp_size, "tp": tp_size, "ep": ep_size}
    axes = [f"{axis}_size={size}" for axis, size in sizes.items() if size > 1 or axis in on]
    if flavour == "dp" and axes:
        raise ValueError(f"distributed_method=dp (nn.DataParallel, one process) combines with "
                         f"no other axis, got {axes[0]}; use ddp or fsdp with it")
    if flavour == "zero" and tp_size > 1:
        raise ValueError(f"distributed_method=zero cannot take tp_size={tp_size}: its "
                         "ZeroRedundancyOptimizer broadcasts plain tensors, and tensor "
                         "parallelism's weights are DTensors; use fsdp, which shards the "
                         "optimizer state too")
    if ep_size > 1:  # expert parallelism's refusals
        if flavour is None:  # tp, pp: one group or pipeline, no data-parallel ranks to split
            raise ValueError(f"ep_size={ep_size} splits the data-parallel ranks, and "
                             f"distributed_method={'pp' if 'pp' in on else 'tp'} has none; use "
                             "ddp or fsdp (with pp_size)")
        if flavour == "zero":
            raise ValueError(f"distributed_method=zero cannot take ep_size={ep_size}: its "
                             "ZeroRedundancyOptimizer broadcasts plain tensors, and the split "
                             "experts are DTensors; use fsdp, which shards the optimizer state too")
        if tp_size > 1 or "tp" in on:
            raise ValueError(f"ep_size={ep_size} with tensor parallelism (tp_size={tp_size}): "
                             "the experts would need a TP plan of their own (torchtitan's ETP), "
                             "which is not built; use one of the two")
        if cp_size > 1:
            raise ValueError(f"ep_size={ep_size} with cp_size={cp_size}: the experts' gradients "
                             "would average over the cp ranks too, which is not built; use one of "
                             "the two")


def build_mesh(layout: Layout, device: torch.device) -> DeviceMesh:
    """The DeviceMesh of `layout` over this process group, dims named after the axes; a
    flattened `dp_cp` where cp is on (the ranks that share gradients: dp and cp's)."""
    sizes = layout.sizes()
    if layout.world != dist.get_world_size():
        raise RuntimeError(f"a layout for {layout.world} ranks on {dist.get_world_size()}")
    mesh = init_device_mesh(device.type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    flat = _FLATTENED[mesh] = {}
    if layout.cp > 1:
        flat["dp_cp"] = mesh["dp", "cp"]._flatten("dp_cp")  # private API, as torchtitan's
    if layout.ep > 1:  # the data-reading ranks again, for the data and the dense gradients
        flat["dp"] = mesh["edp", "ep"]._flatten("dp")
    return mesh


# The dims build_mesh flattened, per mesh: DeviceMesh warns that slicing one from the root
# mesh by its name will go ("Users need to bookkeep the flattened mesh", torch 2.14), so every
# axis is looked up through axis(). Keyed by the mesh object itself, not by equality (equal
# meshes of two runs in one process each keep their own).
_FLATTENED = WeakIdKeyDictionary()


def axis(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """mesh[name]: one of the mesh's dims, or one build_mesh flattened (dp_cp; dp under ep)."""
    flat = _FLATTENED.get(mesh, {}).get(name)
    return mesh[name] if flat is None else flat


def grad_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks whose gradients are averaged: dp, and cp's ranks where cp is on."""
    return axis(mesh, "dp_cp" if "cp" in (mesh.mesh_dim_names or ()) else "dp")
