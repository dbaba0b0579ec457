"""Model FLOPs utilisation: the GPUs' peak FLOP/s and the share of it a run achieves."""
import re

import torch

# Dense peak FLOP/s per GPU and precision (vendors' datasheets): bf16/fp16 on tensor cores, fp32
# without TF32 (torch's default). A pattern must match the whole of torch.cuda.get_device_name():
# "NVIDIA L40" is not an L4, "NVIDIA RTX A1000" not an A100.
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


def peak_flops(name: str | None, precision: str) -> float | None:
    """Peak FLOP/s of the GPU `name` at `precision`; None on a CPU (None) or where unknown."""
    if name is None:
        return None
    peaks = next((p for pattern, p in PEAK_FLOPS if re.fullmatch(pattern, name)), {})
    return peaks.get(precision)


def device_name(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def mfu(flops_per_token: float, tokens_per_s: float, peak: float, devices: int) -> float:
    """The model's FLOP/s over the peak of all `devices` that worked (every GPU of every rank)."""
    return flops_per_token * tokens_per_s / (peak * devices)
