"""nn.DataParallel: ONE process drives every visible GPU (the legacy contrast to DDP)."""
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
    # Each forward copies the weights from the first GPU to every other one, splits the batch,
    # runs the replicas in threads (under the GIL) and gathers the outputs on the first GPU.
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
    """nn.DataParallel whose replicas compute in this run's autocast dtype: torch's
    parallel_apply re-enters autocast in each new thread with `enabled` only, whose default
    dtype on CUDA is fp16, so a bf16 run would compute its replicas in fp16."""

    def parallel_apply(self, replicas: list[nn.Module], inputs: list, kwargs: list) -> list:
        calls = [keep_autocast(replica, self.src_device_obj.type) for replica in replicas]
        return super().parallel_apply(calls, inputs, kwargs)


def check_config(t: DictConfig) -> None:
    """nn.DataParallel needs CUDA GPUs and exactly one process; say so before anything starts."""
    # Before the GPU check, so that a CPU machine sees it too. Module.compile() binds the call
    # to its module, and DataParallel's replicas copy each module's __dict__.
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
