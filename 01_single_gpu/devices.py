"""Pick the device and the matching collective backend in one place.

A GPU machine gets `cuda:<local_rank>` and NCCL; anything else gets the CPU and gloo, so every
step of the series also runs (slowly, but correctly) on a laptop or a CI machine.
"""
import torch


def pick_device(local_rank: int = 0) -> torch.device:
    """The device this process trains on: its own GPU when there are GPUs, else the CPU."""
    if torch.cuda.is_available():
        # One process per GPU: the local rank (rank within this machine) indexes the GPU.
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """NCCL only talks to CUDA tensors; gloo handles CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"
