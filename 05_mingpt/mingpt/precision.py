"""Mixed precision in one place: autocast for the forward pass, loss scaling for fp16, and the
policy FSDP uses to gather parameters and reduce gradients."""
from collections.abc import Callable

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

# bf16 keeps fp32's 8 exponent bits (only the mantissa is shorter), so small gradients do not
# underflow and it needs no loss scaling; fp16 has 5 exponent bits and does (grad_scaler).
PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str) -> torch.autocast:
    """Run the ops autocast lists in `precision` (matmuls, convolutions), the rest in fp32."""
    return torch.autocast(device.type, dtype=DTYPES[precision], enabled=precision != "fp32")


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """fp16 needs loss scaling (its small gradients underflow); a disabled scaler otherwise.
    The device's own type: GradScaler("cuda") silently turns itself off on a CPU."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def fsdp_policy(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP gathers parameters in `precision` and reduces gradients in fp32 (summing many
    low-precision gradients loses bits); None for fp32, FSDP's default."""
    if precision == "fp32":
        return None
    # Only the gathered copies used for compute are cast: the sharded parameters the optimizer
    # updates stay fp32, so small updates are not rounded away.
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)


def keep_autocast(function: Callable, device_type: str) -> Callable:
    """`function`, to be called in another thread under this thread's autocast settings (a new
    thread starts from the device's default: parallel/dataparallel.py's replica threads)."""
    enabled = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type)

    def call(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            return function(*args, **kwargs)
    return call
