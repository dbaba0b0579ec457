"""Join and leave the process group: torchrun's when launched by it, else a group of one.

    device = setup(cfg.trainer_config.device)   # cuda:<LOCAL_RANK> + NCCL, or the CPU + gloo
    release()                                   # after training: every reference dropped
"""
import gc
import os
import re
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from mingpt import forensics, restarts
from mingpt.devices import backend_for, pick_device
from mingpt.parallel import context

# torch's default timeouts for new groups, while later_groups_wait has replaced them.
_torch_timeouts: dict[str, timedelta] = {}


def setup(requested: str, cpu_offload: bool = False, collective_timeout_s: float | None = None,
          run_dir: str | None = None, flight_recorder_entries: int = 0) -> torch.device:
    """Join the process group. A collective that waits longer than `collective_timeout_s`
    (None: torch's default) raises; with `flight_recorder_entries`, torch's Flight Recorder
    keeps that many collectives per rank for the dumps under `run_dir` (DEBUGGING.md)."""
    if run_dir is not None:
        forensics.configure(run_dir, flight_recorder_entries)  # read as the group is created
    timeout = timedelta(seconds=collective_timeout_s) if collective_timeout_s else None
    device = pick_device(int(os.environ.get("LOCAL_RANK", 0)), requested)
    if device.type == "cuda":
        # Before init_process_group: NCCL binds each process to the current GPU.
        torch.cuda.set_device(device)
    # CPU offload keeps FSDP's gradients in CPU memory: they need gloo beside NCCL.
    backend = backend_for(device, cpu_tensors_too=cpu_offload)
    if "RANK" in os.environ:  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        # On this attempt's own keys: a restarted worker must not find the killed attempt's.
        restarts.join_group(backend, timeout)
    else:
        # `python main.py`: a one-process group (no port), so DDP and FSDP run as under torchrun.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    if timeout is not None:
        later_groups_wait(timeout)
    return device


def later_groups_wait(timeout: timedelta) -> None:
    """Groups made after the default one (each DeviceMesh dimension, new_group) wait `timeout`
    too, not torch's default for a new group (30 min on gloo): torch reads it from
    distributed_c10d's module variables at each new group. release() puts torch's back."""
    _torch_timeouts.setdefault("gloo", c10d.default_pg_timeout)
    _torch_timeouts.setdefault("nccl", c10d.default_pg_nccl_timeout)
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout


def release() -> None:
    """Drop every reference to the process group, then destroy it (once main.train returned):
    destroy_process_group joins gloo's threads only with the group's last reference, and one
    still at work as Python exits aborts the finished run. FSDP's modules form cycles (freed by
    gc.collect), and DTensor's caches keep every DeviceMesh, whose registry holds the group."""
    forensics.disarm()  # the run is over: torch's own send/recv and SIGTERM again
    context.end_run()  # torch's context-parallel dispatch off (GPUs), its options restored
    if _torch_timeouts:  # what later_groups_wait changed
        c10d.default_pg_timeout = _torch_timeouts.pop("gloo")
        c10d.default_pg_nccl_timeout = _torch_timeouts.pop("nccl")
    # type(), not isinstance: gc also finds dead weakref proxies, which isinstance reads.
    for mesh in [o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)]:
        getattr(mesh, "_pg_registry", {}).clear()  # private: the mesh's own group references
    gc.collect()
    dist.destroy_process_group()


def group_error(error: Exception) -> str:
    """torchrun's worker could not open the store at MASTER_ADDR:MASTER_PORT, as one line."""
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    # torch's bind failure spells out port, IPv6 flag and errno: its last words say it all.
    first = re.sub(r"^.*name: (\w+), message: ", r"\1: ", first)
    # Rank 0 binds MASTER_PORT (EADDRINUSE: another program has it); other ranks connect to it
    # (refused or timed out: rank 0's node is unreachable from here, a firewall, a wrong host).
    return (f"cannot start the process group at MASTER_ADDR:MASTER_PORT {where} ({first}); "
            "free that port or give torchrun another --rdzv-endpoint / --master-port, and let "
            "every node reach that host and port")
