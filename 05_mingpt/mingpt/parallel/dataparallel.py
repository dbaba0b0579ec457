"""nn.DataParallel: ONE process drives every visible GPU (the legacy contrast to DDP).

    model = apply(model, device, settings)   # parallel.STRATEGIES["dp"]; python main.py only
"""
import os

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from mingpt.errors import require
from mingpt.parallel.layout import Settings
from mingpt.parallel.wrappers import wrap_blocks
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


def check_config(t: DictConfig) -> None:
    """nn.DataParallel needs CUDA GPUs and exactly one process; say so before anything starts."""
    # Before the GPU check, so that a CPU machine (and its tests) sees this line too.
    # Module.compile() binds the compiled call to the module it compiled; DataParallel's
    # replicas copy each module's __dict__, so every replica would run GPU 0's block.
    require(not t.compile, "trainer_config.compile", "False with distributed_method=dp (each "
            "GPU's replica would run the first GPU's compiled blocks); use ddp to compile",
            t.compile)
    if t.device == "cpu" or not torch.cuda.is_available():
        raise ValueError("distributed_method=dp (nn.DataParallel) splits each batch across CUDA "
                         "GPUs from one process, and this run has none (device=cpu or no GPU); "
                         "use ddp, which runs on CPUs and GPUs")
    # torchrun sets WORLD_SIZE; here, before the process group exists, it is the only source.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ValueError(f"distributed_method=dp runs in ONE process that drives every GPU, but "
                         f"{world} processes were started: use python main.py, not torchrun "
                         "(or use ddp, one process per GPU)")
