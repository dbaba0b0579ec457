"""What the logs report, for every module: rank-0 printing, model FLOPs utilisation, memory.

    print0("only global rank 0 prints this")
    mfu(flops_per_token, tokens_per_s, peak_flops(gpu_name, "bf16"), devices=world_size)
    setup = peak_memory_mb(device); reset_peak_memory(device)  # then train: a training peak
    model_state_bytes(model, optimizer)  # this rank's parameters, gradients, optimizer state
"""
import platform
import re
import resource
import sys

import hydra
import omegaconf
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from tqdm import tqdm

# Dense peak FLOP/s per GPU and precision, from the vendors' datasheets: bf16/fp16 on tensor
# cores (fp32 accumulation), fp32 without TF32 (torch's default for fp32 matmuls). The pattern
# must match the whole of torch.cuda.get_device_name(): "NVIDIA L40" is not an L4 and
# "NVIDIA RTX A1000" not an A100. MFU = achieved model FLOP/s / this peak; none for other GPUs.
PEAK_FLOPS = (
    (r"NVIDIA H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    (r"NVIDIA H200 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}),
    (r"NVIDIA H100 80GB HBM3", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),  # SXM
    (r"NVIDIA H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    (r"NVIDIA H100 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}),
    (r"NVIDIA A100[- ](SXM4-(40|80)GB|PCIE-(40|80)GB|80GB PCIe)",
     {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    (r"NVIDIA L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}),
    (r"NVIDIA L40", {"bf16": 181e12, "fp16": 181e12, "fp32": 90.5e12}),
    (r"NVIDIA L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12}),
    (r"NVIDIA A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),
    (r"NVIDIA GeForce RTX 4090", {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12}),
    (r"Tesla V100-SXM2-(16|32)GB", {"fp16": 125e12, "fp32": 15.7e12}),  # no bf16 on a V100
)


def print0(message: str) -> None:
    """Print on global rank 0 only (tqdm.write keeps a progress bar intact)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        tqdm.write(message)
        sys.stdout.flush()


def peak_flops(name: str | None, precision: str) -> float | None:
    """Peak FLOP/s of the GPU called `name` at `precision`; None on a CPU (name None), on a GPU
    the table does not know, or at a precision it lacks."""
    if name is None:
        return None
    peaks = next((p for pattern, p in PEAK_FLOPS if re.fullmatch(pattern, name)), {})
    return peaks.get(precision)


def device_name(device: torch.device) -> str | None:
    """The GPU's name as CUDA reports it; None for a CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def reset_peak_memory(device: torch.device | list[torch.device]) -> None:
    """Start a new peak, so that training's peak is not the setup's (building, loading).

    CUDA: the allocator's counter, of each device given (nn.DataParallel drives several). CPU
    (Linux): writing 5 to /proc/self/clear_refs resets the kernel's high-water mark of the
    resident set (VmHWM) to the current RSS.
    Elsewhere the CPU peak stays the peak since the process started.
    """
    devices = device if isinstance(device, list) else [device]
    if devices[0].type == "cuda":
        for d in devices:  # the caching allocator's own counter: what tensors used
            torch.cuda.reset_peak_memory_stats(d)
        return
    try:
        # 5: "reset the peak resident set size" (man 5 proc); the process's own file, no root.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux (or /proc not mounted): the peak goes on from the process start


def _peak_rss_kib() -> int:
    """The process's peak resident set since the last reset, in KiB.

    Linux: VmHWM, the high-water mark that /proc/self/clear_refs resets. Not ru_maxrss: the
    kernel also folds the peak into it whenever a thread exits, and a reset cannot undo that.
    Elsewhere ru_maxrss (KiB on Linux, bytes on macOS) is all there is.
    """
    try:
        # "VmHWM:    123456 kB"
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        # macOS reports bytes, Linux KiB.
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss // 1024 if sys.platform == "darwin" else rss


def peak_memory_mb(device: torch.device | list[torch.device]) -> list[float]:
    """Peak memory since the last reset_peak_memory, one value per GPU of every rank (per rank
    on a CPU), a collective: CUDA allocations of each device given (nn.DataParallel drives
    several from one process), or peak RSS on a CPU (what the process touched; see README)."""
    devices = device if isinstance(device, list) else [device]
    if devices[0].type == "cuda":
        mb = [torch.cuda.max_memory_allocated(d) / 2**20 for d in devices]
    else:
        mb = [_peak_rss_kib() / 1024]
    # Every rank's values on every rank: rank 0 logs them all (one TensorBoard curve per GPU).
    mine = torch.tensor(mb, device=devices[0])
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return torch.cat(gathered).tolist()


def mfu(flops_per_token: float, tokens_per_s: float, peak: float, devices: int) -> float:
    """Model FLOPs utilisation: the model's FLOP/s over the peak of all `devices` that worked
    (every GPU of every rank: nn.DataParallel's one process drives several)."""
    return flops_per_token * tokens_per_s / (peak * devices)


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for `tensor`: a DTensor's numel() is the global size, its
    to_local() the rank's own shard."""
    if hasattr(tensor, "to_local"):  # a DTensor (FSDP, TP)
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                      ) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state, counted from the
    tensors it holds (local shards), not from a formula: model_size.py predicts these.

    Gradients count only while they exist (between backward and zero_grad). ZeRO's optimizer
    keeps the state of this rank's parameters in its local optimizer (`.optim`).
    """
    local_optimizer = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) \
        else optimizer
    # DDP and FSDP wrap the model: their parameters() are the ones the optimizer updates.
    params = list(model.parameters())  # each tied tensor once
    return {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        # AdamW: exp_avg and exp_avg_sq (each the parameter's size) and a scalar step.
        "optimizer": sum(local_bytes(v) for state in local_optimizer.state.values()
                         for v in state.values() if isinstance(v, torch.Tensor)),
    }


def print_versions(device: torch.device) -> None:
    """The library versions, the device and the world size, first in every log."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print0(f"torch {torch.__version__} | python {platform.python_version()} | hydra "
           f"{hydra.__version__} | omegaconf {omegaconf.__version__}")
    print0(f"device {device} ({name or 'cpu'}) | backend {dist.get_backend()} | world size "
           f"{dist.get_world_size()}")
