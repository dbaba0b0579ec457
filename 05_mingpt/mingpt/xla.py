"""XLA devices for the Trainer (xla_main.py, XLA.md): the SPMD mesh, the model sharded over
it (SPMD FSDP: XLA inserts the collectives), and XlaHooks, the Trainer's XLA-specific seams.
"""
import os
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader

from mingpt.optim import own_settings, restore_settings
from mingpt.trainer import DeviceHooks

# XLA's C++ warns per compiled program that Shardy replaces GSPMD: errors only (read at import).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import torch_xla  # noqa: E402
import torch_xla.distributed.parallel_loader as pl  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
from torch_xla.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel,
    _prepare_spmd_partition_spec,
)

# SpmdFSDP's barrier is a full backward hook: torch warns that token ids need no gradient.
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
    """`model` (on the CPU) on the devices, each parameter split along its largest dimension."""
    # `to` gives each module a new Parameter, untying wte/lm_head (XLA.md: Pitfalls): retied.
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


def load_optimizer(optimizer: torch.optim.Optimizer, state: dict, mesh: xs.Mesh) -> list[str]:
    """A snapshot's AdamW state, sharded as the parameters are, with this run's settings (as
    snapshot.load); returns which of them differ from the saved ones."""
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
    """Every XLA tensor in nested dicts and lists copied whole to the CPU, each tensor once."""
    if isinstance(tree, torch.Tensor):
        return seen.setdefault(id(tree), tree.detach().cpu())
    if isinstance(tree, dict):
        return {key: to_cpu(value, seen) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_cpu(value, seen) for value in tree)
    return tree


class XlaHooks(DeviceHooks):
    """One process feeds every device one global batch; ops are traced, and run at a sync."""

    feeds_every_rank = True  # device d gets main.py's rank d's rows: the same sequences

    def __init__(self, mesh: xs.Mesh, device: torch.device) -> None:
        self.mesh, self.device = mesh, device

    def data_parallel(self, model: torch.nn.Module) -> tuple[int, int]:
        return 0, int(self.mesh.size())  # one process; every device sees different data

    def memory_devices(self, model: torch.nn.Module, device: torch.device
                       ) -> list[torch.device]:
        # The host's peak RSS: no allocator counters, and gloo's all-gather refuses XLA tensors.
        return [torch.device("cpu")]

    def to_device(self, loader: DataLoader) -> pl.MpDeviceLoader:
        """Global batches moved in the background, each split along the batch as it lands."""
        return pl.MpDeviceLoader(loader, self.device,
                                 input_sharding=xs.ShardingSpec(self.mesh, ("fsdp", None)))

    def step_end(self) -> None:
        # The traced step runs as one program, compiled once (the lr is a device scalar).
        torch_xla.sync()

    def gather(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
               ) -> tuple[dict, dict]:
        """The whole weights (keep_vars: tied ones stay one) and AdamW's state, on the CPU."""
        seen: dict = {}
        return (to_cpu(model.module.state_dict(keep_vars=True), seen),
                to_cpu(optimizer.state_dict(), seen))

    def sharded(self, model: torch.nn.Module) -> str:
        """How many parameters are split over the devices, from XLA's own sharding specs."""
        params = list(model.parameters())
        n = sum(1 for p in params if torch_xla._XLAC._get_xla_sharding_spec(p)
                not in ("", "{replicated}"))
        return f"{n} of {len(params)} parameter tensors sharded over {self.mesh.size()} devices"
