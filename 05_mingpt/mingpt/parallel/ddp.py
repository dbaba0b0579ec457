"""DistributedDataParallel: every data-parallel rank holds the whole model (or its whole part:
its TP shard, its pipeline stage) and trains on its own batches; gradients are averaged by
all-reduce during backward, bucket by bucket, overlapped with it.

    model = apply(model, device, settings, mesh["dp"])   # parallel.parallelize, flavour ddp
"""
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, default_collate

from mingpt.errors import require
from mingpt.parallel.fsdp import policies
from mingpt.parallel.layout import SHORTHANDS, Settings
from mingpt.parallel.wrappers import wrap_blocks
from mingpt.precision import autocast

# trainer_config.comm_hook: how DDP all-reduces each gradient bucket. torch's own hooks
# (torch.distributed.algorithms.ddp_comm_hooks): the bucket divided by the ranks, cast to
# fp16 or bf16, all-reduced (half the bytes), cast back. The hook runs on the bucket only:
# weights, AdamW and its state stay fp32. Stateless, so a resume is exact as without one.
COMPRESSED = {"fp16": torch.float16, "bf16": torch.bfloat16}  # name -> the dtype sent
HOOKS = {"none": None, **{name: getattr(default_hooks, f"{name}_compress_hook")
                          for name in COMPRESSED}}


# PowerSGD (torch's powerSGD_hook) is not one of them, though notebooks/comm_lab.ipynb runs it:
# its state (each rank's error feedback and warm-start factors) is kept per bucket index, and
# DDP lays its buckets out anew after the first backward (settle_buckets). A resumed run gets
# that layout back only through a backward, which would go through the hook and change the
# saved state, so a resume could not be exact; and on gloo two buckets in flight fail.
NOT_HOOKS = {"powersgd": "per-bucket state cannot resume exactly, as mingpt/parallel/ddp.py "
                         "says; notebooks/comm_lab.ipynb runs it"}


def check_config(t: DictConfig) -> None:
    """trainer_config.comm_hook: a name of HOOKS, and only where DDP's wrapper all-reduces
    the gradients (ddp or zero with no tp, pp or ep degree: the others reduce through FSDP2)."""
    require(t.comm_hook not in NOT_HOOKS, "trainer_config.comm_hook",
            f"one of {', '.join(HOOKS)} ({t.comm_hook}'s {NOT_HOOKS.get(t.comm_hook)})",
            t.comm_hook)
    require(t.comm_hook in HOOKS, "trainer_config.comm_hook", f"one of {', '.join(HOOKS)}",
            t.comm_hook)
    flavour, on = SHORTHANDS.get(t.distributed_method, (t.distributed_method, ()))
    require(t.comm_hook == "none" or (flavour in ("ddp", "zero") and not on
                                      and max(t.tp_size, t.pp_size, t.ep_size) <= 1),
            "trainer_config.comm_hook", "none unless distributed_method=ddp or zero without "
            "tp_size, pp_size or ep_size (a hook of DDP's own all-reduce)", t.comm_hook)


def apply(model: nn.Module, device: torch.device, s: Settings, mesh: DeviceMesh,
          pipeline: bool = False) -> nn.Module:
    """DDP over the data-parallel ranks `mesh`: a whole replica each, gradients all-reduced.
    `pipeline`: `model` is a pipeline stage."""
    if pipeline or any(isinstance(p, DTensor) for p in model.parameters()):
        # FSDP2's replicate does DDP's job (an all-reduce of every gradient, no sharding)
        # where DDP cannot, as torchtitan does: tensor parallelism's weights are DTensors,
        # which DDP cannot broadcast ("no sharding strategy registered" for c10d.broadcast_);
        # and a pipeline runs several micro-batches' forwards before their backwards, while
        # DDP's no_sync must cover the forward too (torch's stages wrap only the backward, and
        # DDP's reducer then fails on its second step: "rebuilt parameter indices size is not
        # same as original model parameters size").
        return _replicate(model, s, mesh)
    # Blocks checkpointed one by one; compiled as ONE graph, so inductor also takes the output
    # layer and the loss (faster than block by block on a GPU: bench/README.md). In place:
    # parameter names (and snapshots) do not change.
    wrap_blocks(model, s.activation_checkpointing, compile=False)
    if s.compile:
        model.compile()
    if mesh.size() == 1:
        # One replica has no gradients to average, but DDP would still copy each one into
        # its buckets and all-reduce them over a group of one: a share of a small model's
        # step that bench/README.md measures. Snapshots hold unwrap(model) anyway.
        return model
    return wrap(model, device, mesh.get_group(), s.comm_hook)


def wrap(model: nn.Module, device: torch.device, group: dist.ProcessGroup | None = None,
         comm_hook: str = "none") -> DDP:
    """The DDP wrapper itself, over `group` (None: every rank), all-reducing through
    `comm_hook` (HOOKS)."""
    # DDP broadcasts the group's first rank's weights at construction and all-reduces
    # gradients in backward. device_ids only for a GPU: on the CPU DDP must get none.
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              process_group=group)
    if HOOKS[comm_hook] is not None:
        ddp.register_comm_hook(group or dist.group.WORLD, HOOKS[comm_hook])
    return ddp


def settle_buckets(model: nn.Module, dataset: Dataset, device: torch.device,
                   precision: str) -> None:
    """Before a resumed run's first step: one forward and backward of `dataset`'s first
    sample through DDP, whose gradients are dropped and whose random draws are undone. A
    no-op for any other wrapper.

    DDP lays its gradient buckets out twice: in the parameters' order when it is built, and in
    the order backward made the gradients ready once its first backward has run. A run's
    first step is its only one in the first layout, so a run resumed at step k would add the
    ranks' gradients of step k + 1 in other buckets than the uninterrupted run did. gloo's
    ring sums an element in an order set by its place in its bucket: bit for bit the same on
    2 ranks (a + b is b + a), a few ulps apart on more. This backward lets DDP lay its
    buckets out as the uninterrupted run had them: the resume is exact on any number of
    ranks. (DDP offers no public way to build them in backward's order, and
    find_unused_parameters, which keeps the first layout for good, warns on every rank.)"""
    if not isinstance(model, DDP):
        return
    x, y = (t.to(device) for t in default_collate([dataset[0]]))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with autocast(device, precision):
            _, loss = model(x, y)
        loss.float().mean().backward()  # the gradients' ready order is what DDP records
    model.zero_grad(set_to_none=True)


def _replicate(model: nn.Module, s: Settings, mesh: DeviceMesh) -> nn.Module:
    """FSDP2's replicate, per block then the root (FSDP's units): gradients all-reduced over
    `mesh` block by block during backward, each rank keeping its whole (TP-sharded) weights."""
    # Imported here: xla_main.py imports this package under torch_xla's older torch.
    from torch.distributed._composable.replicate_with_fsdp import replicate  # noqa: PLC0415
    wrap_blocks(model, s.activation_checkpointing, s.compile)
    kwargs = {"mesh": mesh, **policies(s.precision, False, torch.device(mesh.device_type))}
    for block in model.blocks:
        replicate(block, **kwargs)
    replicate(model, **kwargs)
    return model
