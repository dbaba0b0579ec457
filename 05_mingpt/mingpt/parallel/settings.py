"""The run's settings every strategy's `apply` reads (from trainer_config)."""
from typing import NamedTuple


class Settings(NamedTuple):
    precision: str = "fp32"  # fp32, bf16 or fp16 (FSDP's mixed-precision policy)
    cpu_offload: bool = False  # FSDP: shards, gradients and optimizer state in CPU memory
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    compile: bool = False  # torch.compile: per block, or the whole model (ddp, zero)
    tp_size: int = 0  # ranks per tensor-parallel group (0: every rank)
    cp_size: int = 0  # ranks per context-parallel group (0, 1: off; context.py)
    # Pipeline parallelism (pipeline.py): stages, schedule, micro-batches per round.
    pp_size: int = 0  # ranks per pipeline (0: every rank, or every rank of a TP group)
    pp_schedule: str = "1f1b"  # gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zb, ...
    microbatches: int = 1  # micro-batches each micro-step's batch is cut into
    pp_stages_per_rank: int = 2  # the looped schedules' stages per rank
    pp_split: list[int] | None = None  # blocks per stage; None: as even as possible
