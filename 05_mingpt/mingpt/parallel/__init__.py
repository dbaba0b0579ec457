"""The strategies, one module each, and the one registry that names them.

    model = parallelize(GPT(config).to(device), device, "fsdp", precision="bf16")
    optimizer = optim.build_optimizer(model, "fsdp", lr=3e-3)  # after: FSDP replaces parameters

Each strategy is a module with `apply(model, device, settings)` (ddp.py, fsdp.py, tensor.py,
fsdp_tp.py, dp.py, pipeline.py; zero.py brings an optimizer), and one entry in STRATEGIES
below, which the config check, the snapshots, model_size.py and the docs read. Context
parallelism (context.py, trainer_config.cp_size) is no strategy of its own: it splits the
sequences before ddp, zero or fsdp wraps the model (their `cp` flag). Order inside every
`apply`: TP's plan first (it names the blocks' own submodules), then activation
checkpointing and torch.compile per block (ddp and zero compile the whole model instead),
then the wrapper (DDP, FSDP, DataParallel). Adding a strategy: README, "Extending".
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import nn

from mingpt.parallel import context, ddp, dp, fsdp, fsdp_tp, pipeline, tensor, zero
from mingpt.parallel.settings import Settings


@dataclass(frozen=True)
class Memory:
    """How a strategy splits what a rank holds: model_size.py predicts bytes per rank from it
    (tests/test_mingpt_memory.py checks the predictions against real shards)."""

    shards_over: str | None = None  # dim 0 of every parameter over "world" or the "dp" ranks
    sharded_optimizer: bool = False  # each rank keeps AdamW's state for the parameters it owns
    # DDP's all-reduce buckets hold every gradient a second time ("buckets"); FSDP gathers the
    # root, the running and the next block and one block's gradient ("gathers").
    buffers: str | None = None


@dataclass(frozen=True)
class Strategy:
    """How a strategy wraps the model, how its snapshots are laid out, what else it needs."""

    apply: Callable[[nn.Module, torch.device, Settings], nn.Module]
    # "ddp": every rank holds the whole model, rank 0 writes one file. "fsdp": no rank does,
    # every rank writes its shards (DCP). Strategies of one layout resume each other's.
    layout: str
    summary: str  # one line for the docs and --help
    tp: bool = False  # splits each block's matmuls over a (dp, tp) mesh: tp_size applies
    optimizer: Callable[..., torch.optim.Optimizer] | None = None  # None: AdamW
    # Its own config rules, one-line ValueErrors (config.validate calls it).
    check: Callable[[DictConfig], None] | None = None
    # Built on the meta device, then given storage and weights by this, shard by shard
    # (main.build_local), so no rank ever holds the whole model.
    init_on_meta: Callable[[nn.Module, torch.device, bool], None] | None = None
    cpu_offload: bool = False  # trainer_config.cpu_offload applies
    memory: Memory | None = None  # None: model_size.py does not predict it (dp: one process)
    cp: bool = False  # composes with context parallelism (trainer_config.cp_size, context.py)
    # Splits the blocks into stages over a (pp, dp, tp) mesh (pipeline.py): the pp_* keys
    # and microbatches apply, and the trainer's step runs the pipeline's schedule.
    pipeline: bool = False


STRATEGIES = {
    "ddp": Strategy(ddp.apply, "ddp", "a whole replica per rank, gradients all-reduced",
                    memory=Memory(buffers="buckets"), cp=True),
    "fsdp": Strategy(fsdp.apply, "fsdp",
                     "parameters, gradients and optimizer state sharded over all ranks",
                     init_on_meta=fsdp.init_sharded, cpu_offload=True,
                     memory=Memory(shards_over="world", buffers="gathers"), cp=True),
    "zero": Strategy(ddp.apply, "ddp", "ddp, with AdamW's state sharded over the ranks",
                     optimizer=zero.optimizer,
                     memory=Memory(sharded_optimizer=True, buffers="buckets"), cp=True),
    "tp": Strategy(tensor.apply, "fsdp", "every block's matmuls split over all ranks",
                   tp=True, check=tensor.check_config, memory=Memory()),
    "fsdp_tp": Strategy(fsdp_tp.apply, "fsdp",
                        "TP inside groups of tp_size ranks, FSDP across the groups", tp=True,
                        memory=Memory(shards_over="dp", buffers="gathers")),
    # Pipelines: mesh (pp, dp, tp), pp outermost, tp innermost (pipeline.py).
    "pp": Strategy(pipeline.apply, "fsdp", "the blocks split into stages over all ranks, "
                   "micro-batches pipelined", check=pipeline.check_config, pipeline=True,
                   memory=Memory()),
    "fsdp_pp": Strategy(pipeline.apply_fsdp, "fsdp",
                        "pipelines of pp_size ranks, FSDP across the pipelines",
                        check=pipeline.check_config, pipeline=True,
                        memory=Memory(shards_over="dp", buffers="gathers")),
    "fsdp_tp_pp": Strategy(pipeline.apply_fsdp_tp, "fsdp",
                           "TP inside each stage, pipelines of pp_size stages, FSDP across",
                           tp=True, check=pipeline.check_config, pipeline=True,
                           memory=Memory(shards_over="dp", buffers="gathers")),
    "dp": Strategy(dp.apply, "ddp", "nn.DataParallel: one process drives every GPU",
                   check=dp.check_config),
}


def parallelize(model: nn.Module, device: torch.device, method: str = "ddp",
                **settings) -> nn.Module:
    """`model` wrapped by `method`; its `blocks` (a ModuleList) are the units of wrapping.

    ValueError (one line) where the world size or the model does not fit the method."""
    if method not in STRATEGIES:
        raise ValueError(f"unknown distributed_method {method!r}")
    s = Settings(**settings)
    if s.cp_size > 1:  # before the wrapper: it swaps each block's attention (context.py)
        context.apply(model, device, s.cp_size)
    return STRATEGIES[method].apply(model, device, s)
