"""XLA devices for the Trainer (xla_main.py): the SPMD mesh, the model sharded over it, and
XlaHooks, the few places where the Trainer meets XLA otherwise than CUDA or a CPU.

    mesh = make_mesh()                              # every XLA device this process drives
    model = shard(GPT(config), mesh, device)        # SPMD FSDP: XLA inserts the collectives
    Trainer(..., device, ..., hooks=XlaHooks(mesh, device))

Imported by xla_main.py only (torch_xla pins torch 2.9: requirements-xla.txt).
"""
import os
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader

from mingpt.optim import own_settings, restore_settings
from mingpt.trainer import DeviceHooks

# XLA's C++ warns once per compiled program that GSPMD is to be replaced by Shardy (torch_xla
# 2.9 has no switch to it): errors only, unless asked otherwise. Read as it loads: set first.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import torch_xla  # noqa: E402
import torch_xla.distributed.parallel_loader as pl  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
from torch_xla.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel,
    _prepare_spmd_partition_spec,
)

# SpmdFullyShardedDataParallel's optimization barrier is a full backward hook; torch warns at
# every backward that the inputs (token ids) need no gradient: true and harmless.
warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
# fp32: precision.autocast's is off, and XLA's autocast says so (for any dtype but bf16).
warnings.filterwarnings("ignore", "In XLA autocast, but the target dtype", UserWarning)


def make_mesh() -> xs.Mesh:
    """A 1-D mesh named "fsdp" over every XLA device this process drives."""
    xr.use_spmd()  # before any tensor is on the device: one program for all devices
    n = xr.global_runtime_device_count()
    return xs.Mesh(np.arange(n), (n,), ("fsdp",))


def shard(model: torch.nn.Module, mesh: xs.Mesh, device: torch.device
          ) -> SpmdFullyShardedDataParallel:
    """`model` (on the CPU) on the devices, every parameter split along its largest dimension
    over the mesh: each device keeps 1/n of the weights, and of AdamW's state, which takes
    each parameter's sharding. The logits come out split along the batch, as the inputs are."""
    # A CPU tensor cannot become an XLA tensor in place, so `to` gives each module a new
    # Parameter: the tied wte/lm_head weight became two (measured: the loss then left eager
    # CPU's from the second step on). Each is tied again after the move.
    holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, name))
    model.to(device)
    for first, *others in holders.values():
        for module, name in others:
            setattr(module, name, getattr(*first))
    return SpmdFullyShardedDataParallel(model, mesh=mesh, shard_output=lambda out, mesh: (
        xs.mark_sharding(out[0], mesh, ("fsdp", None, None))))


def load_optimizer(optimizer: torch.optim.Optimizer, state: dict, mesh: xs.Mesh
                   ) -> list[str]:
    """A snapshot's AdamW state, sharded as the parameters are, with this run's betas and
    weight decay (as snapshot.load keeps them); which of those differ from the saved ones."""
    own = own_settings(optimizer)
    optimizer.load_state_dict(state)
    # The moments arrive whole on every device: shard each as its parameter is.
    for group in optimizer.param_groups:
        for p in group["params"]:
            for value in optimizer.state[p].values():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and p.dim():
                    xs.mark_sharding(value, mesh, _prepare_spmd_partition_spec(
                        value, shard_maximal=True))
    return restore_settings(optimizer, own)


def to_cpu(tree: object, seen: dict) -> object:
    """Every XLA tensor in nested dicts and lists copied to the CPU, whole: the transfer of a
    sharded tensor gathers its shards. A tensor met twice (the tied wte/lm_head weight) gets
    one copy, so the snapshot stores it once, as main.py's does."""
    if isinstance(tree, torch.Tensor):
        return seen.setdefault(id(tree), tree.detach().cpu())
    if isinstance(tree, dict):
        return {key: to_cpu(value, seen) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_cpu(value, seen) for value in tree)
    return tree


class XlaHooks(DeviceHooks):
    """One process feeds every device one global batch; ops are traced, and run at a sync;
    a snapshot gathers the shards to the CPU first (snapshot.save's `gather`)."""

    # Device d gets the rows main.py's rank d would: a step trains on the same sequences.
    feeds_every_rank = True

    def __init__(self, mesh: xs.Mesh, device: torch.device) -> None:
        self.mesh, self.device = mesh, device

    def data_parallel(self, model: torch.nn.Module) -> tuple[int, int]:
        return 0, int(self.mesh.size())  # one process; every device sees different data

    def memory_devices(self, model: torch.nn.Module, device: torch.device
                       ) -> list[torch.device]:
        # The host's peak RSS: no allocator counters to read, and the probe all-gathers
        # every rank's peak, which gloo refuses for an XLA tensor (its all-reduce over one
        # rank, in the nan check and the loss totals, takes one).
        return [torch.device("cpu")]

    def to_device(self, loader: DataLoader) -> pl.MpDeviceLoader:
        """Global batches moved in the background, each split along the batch as it lands
        (and a sync at each batch fetched: the previous batch's program runs)."""
        return pl.MpDeviceLoader(loader, self.device,
                                 input_sharding=xs.ShardingSpec(self.mesh, ("fsdp", None)))

    def step_end(self) -> None:
        # Everything traced since the last sync becomes one XLA program, compiled on the first
        # steps and reused after (the lr is a device scalar, not a constant: no recompiles).
        torch_xla.sync()

    def gather(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
               ) -> tuple[dict, dict]:
        """The whole weights (keep_vars: the tied weight stays one tensor) and AdamW's state,
        on the CPU."""
        seen: dict = {}
        return (to_cpu(model.module.state_dict(keep_vars=True), seen),
                to_cpu(optimizer.state_dict(), seen))

    def sharded(self, model: torch.nn.Module) -> str:
        """How many parameters are split over the devices, from XLA's own sharding specs."""
        params = list(model.parameters())
        n = sum(1 for p in params if torch_xla._XLAC._get_xla_sharding_spec(p)
                not in ("", "{replicated}"))
        return f"{n} of {len(params)} parameter tensors sharded over {self.mesh.size()} devices"
