"""nn.DataParallel: ONE process drives every visible GPU (the legacy contrast to DDP).

    model = apply(model, device, settings)   # parallel.STRATEGIES["dp"]; python main.py only
"""
import torch
import torch.distributed as dist
from torch import nn

from mingpt.parallel.common import wrap_blocks
from mingpt.parallel.settings import Settings
from mingpt.precision import keep_autocast


def apply(model: nn.Module, device: torch.device, s: Settings) -> nn.Module:
    """nn.DataParallel: ONE process drives all visible GPUs (the legacy way, README)."""
    # Each forward copies the weights from the first GPU to every other one, splits the batch
    # across them, runs the replicas in threads (under Python's GIL) and gathers the outputs
    # back on the first GPU. DDP replaced it: one process per GPU, no per-step weight copies.
    if device.type != "cuda":
        raise ValueError("distributed_method=dp (nn.DataParallel) splits each batch across "
                         "CUDA GPUs and needs at least one; on the CPU use ddp")
    if dist.get_world_size() > 1:
        raise ValueError(f"distributed_method=dp runs in ONE process that drives every GPU, "
                         f"got {dist.get_world_size()} processes: start it with python main.py, "
                         "not torchrun (or use ddp)")
    wrap_blocks(model, s.activation_checkpointing, s.compile)  # compile: refused in config
    return DataParallel(model)


class DataParallel(nn.DataParallel):
    """nn.DataParallel whose replicas compute in this run's autocast dtype.

    torch's parallel_apply re-enters autocast in each replica's thread with `enabled` only, and
    a new thread starts from the default dtype, fp16 on CUDA: a bf16 run would compute every
    replica in fp16, with no loss scaling. So each replica is called under the dtype of the
    thread that calls the model (precision.keep_autocast)."""

    def parallel_apply(self, replicas: list[nn.Module], inputs: list, kwargs: list) -> list:
        calls = [keep_autocast(replica, self.src_device_obj.type) for replica in replicas]
        return super().parallel_apply(calls, inputs, kwargs)
