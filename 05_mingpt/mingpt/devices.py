"""Pick the device and the matching collective backend in one place.

A GPU machine gets `cuda:<local_rank>` and NCCL; anything else gets the CPU and gloo, so every
step of the series also runs (slowly, but correctly) on a laptop or a CI machine.
"""
import os
import socket

import torch


def pick_device(local_rank: int = 0, requested: str = "auto") -> torch.device:
    """The device this process trains on: its own GPU when there are GPUs, else the CPU.

    `requested` is "auto", "cpu" or "cuda"; asking for CUDA on a machine without it is an error
    rather than a silent fall back to the CPU.
    """
    # A CPU-only torch wheel or a mistyped CUDA_VISIBLE_DEVICES would otherwise train on the
    # CPU, many times slower, with nothing to say so.
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA GPU is available")
    if requested != "cpu" and torch.cuda.is_available():
        # One process per GPU: the local rank (rank within this machine) indexes the GPU.
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device, cpu_tensors_too: bool = False) -> str:
    """NCCL only talks to CUDA tensors; gloo handles CPU tensors.

    `cpu_tensors_too`: on a GPU, collectives also run on tensors in CPU memory (FSDP's CPU
    offload keeps gradients there: clipping and fp16 loss scaling reduce them), so each device
    type gets its own backend.
    """
    if device.type != "cuda":
        return "gloo"  # NCCL cannot move CPU tensors; gloo can, and ships with every torch build
    # One backend per device type: each collective goes to the backend of its tensors' device.
    return "cuda:nccl,cpu:gloo" if cpu_tensors_too else "nccl"


def spawn_count(nproc: int | None) -> int:
    """How many processes `python train.py` spawns: --nproc, else one per GPU, else 2 on CPU."""
    world_size = nproc or torch.cuda.device_count() or 2
    # One process per GPU; on CPU one per core, but at least 4, so the examples' `--nproc 4`
    # also runs (slowly) on a two-core laptop.
    if world_size > (limit := torch.cuda.device_count() or max(4, os.cpu_count() or 1)):
        raise ValueError(f"--nproc {world_size} is more than this machine can run "
                         f"(at most {limit}: one process per GPU, or per CPU core)")
    return world_size


def free_port() -> int:
    """Ask the OS for an unused TCP port, so two jobs on one machine never clash."""
    with socket.socket() as s:
        # Port 0: the OS picks one that is free now. Nothing reserves it once this socket
        # closes, so the caller hands it to the process group at once.
        s.bind(("", 0))
        return s.getsockname()[1]
