"""The run's settings every strategy's `apply` reads (from trainer_config)."""
from typing import NamedTuple


class Settings(NamedTuple):
    precision: str = "fp32"  # fp32, bf16 or fp16 (FSDP's mixed-precision policy)
    cpu_offload: bool = False  # FSDP: shards, gradients and optimizer state in CPU memory
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    compile: bool = False  # torch.compile: per block, or the whole model (ddp, zero)
    tp_size: int = 0  # ranks per tensor-parallel group (0: every rank)
    cp_size: int = 0  # ranks per context-parallel group (0, 1: off; context.py)
