"""DistributedDataParallel: every data-parallel rank holds the whole model (or its whole part:
its TP shard, its pipeline stage) and trains on its own batches; gradients are averaged by
all-reduce during backward, bucket by bucket, overlapped with it.
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
from mingpt.parallel.wrappers import compile_in_place, wrap_blocks
from mingpt.precision import autocast

# trainer_config.comm_hook: torch's own hooks, each bucket cast to fp16 or bf16, all-reduced
# (half the bytes) and cast back; weights and AdamW stay fp32. Stateless: a resume is exact.
COMPRESSED = {"fp16": torch.float16, "bf16": torch.bfloat16}  # name -> the dtype sent
HOOKS = {"none": None, **{name: getattr(default_hooks, f"{name}_compress_hook")
                          for name in COMPRESSED}}

# PowerSGD (notebooks/comm_lab.ipynb runs it) is not one: its per-bucket state would change in
# the backward that restores DDP's buckets on a resume (settle_buckets); gloo fails two in flight.
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
    """DDP over the data-parallel ranks `mesh`; `pipeline`: `model` is a pipeline stage."""
    if pipeline or any(isinstance(p, DTensor) for p in model.parameters()):
        # FSDP2's replicate does DDP's job where DDP cannot (as torchtitan does): DDP cannot
        # broadcast TP's DTensors, and its no_sync would have to cover a pipeline's forwards too
        # (torch's stages wrap only the backward: "rebuilt parameter indices size is not ...").
        return _replicate(model, s, mesh)
    # Blocks checkpointed one by one; compiled as ONE graph, so inductor also takes the output
    # layer and the loss. In place: parameter names (and snapshots) do not change.
    wrap_blocks(model, s.activation_checkpointing, compile=False)
    if s.compile:
        compile_in_place(model)
    if mesh.size() == 1:
        # One replica has no gradients to average, but DDP would still copy each one into
        # its buckets and all-reduce them over a group of one.
        return model
    return wrap(model, device, mesh.get_group(), s.comm_hook)


def wrap(model: nn.Module, device: torch.device, group: dist.ProcessGroup | None = None,
         comm_hook: str = "none") -> DDP:
    """The DDP wrapper over `group` (None: every rank), all-reducing through `comm_hook`."""
    # device_ids only for a GPU: on the CPU DDP must get none.
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              process_group=group)
    if HOOKS[comm_hook] is not None:
        ddp.register_comm_hook(group or dist.group.WORLD, HOOKS[comm_hook])
    return ddp


def settle_buckets(model: nn.Module, dataset: Dataset, device: torch.device,
                   precision: str, batch_size: int) -> None:
    """Before a resumed run's first step: one forward and backward of `dataset`'s first
    `batch_size` samples through DDP (gradients dropped, random draws undone; a no-op for other
    wrappers), so that DDP lays its buckets out in backward's ready order, as the uninterrupted
    run had them: gloo sums an element in an order set by its place in its bucket (the last
    bits, on over 2 ranks). A training step's shape: a compiled model compiles here the graph
    the steps then run (one sample would compile a throwaway graph, and the steps a second
    one with the batch dimension dynamic, which the uninterrupted run never ran)."""
    if not isinstance(model, DDP):
        return
    x, y = (t.to(device) for t in default_collate([dataset[i] for i in range(batch_size)]))
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
