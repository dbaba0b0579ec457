"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over all ranks;
each block's parameters are all-gathered just before it runs and freed after.

    init_sharded(model, device)     # after parallelize, for a model built on the meta device
"""
import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from mingpt.parallel.layout import Settings
from mingpt.parallel.wrappers import wrap_blocks
from mingpt.precision import fsdp_policy


def builds_on_meta(method: str, tp_size: int, pp_size: int, init_from: str | None) -> bool:
    """Whether main.py builds the GPT on the meta device for init_sharded to draw in shards:
    fsdp alone. Not with init_from: the pretrained weights are copied into a whole model first
    (pretrained.load_pretrained), and FSDP then keeps each rank's shards of it."""
    return method == "fsdp" and tp_size <= 1 and pp_size <= 1 and not init_from


def apply(model: nn.Module, device: torch.device, s: Settings,
          mesh: DeviceMesh | None = None, reshard_after_forward: bool = True) -> nn.Module:
    """Checkpointing and compile per block, then `shard` over `mesh` (None: every rank)."""
    wrap_blocks(model, s.activation_checkpointing, s.compile)  # per block, before sharding
    return shard(model, device, s.precision, s.cpu_offload, mesh, reshard_after_forward)


def shard(model: nn.Module, device: torch.device, precision: str = "fp32",
          cpu_offload: bool = False, mesh: DeviceMesh | None = None,
          reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2, each block on its own, then the root; computes in `precision`, reduces in fp32."""
    # By default a 1-D mesh over all ranks; with other axes parallelize passes the dp dimension.
    if mesh is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
              **policies(precision, cpu_offload, device)}
    for block in model.blocks:  # a pipeline stage's blocks are its own (pipeline.Stage)
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def policies(precision: str, cpu_offload: bool, device: torch.device) -> dict:
    """fully_shard's precision and offload keywords (the blocks, the root, expert.py's experts)."""
    kwargs: dict = {}
    if precision != "fp32":
        kwargs["mp_policy"] = fsdp_policy(precision)
    if cpu_offload:
        # Pinned memory speeds up the copies to and from the CPU but needs an accelerator.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return kwargs


def _replay_constructor_draws(module: nn.Module) -> None:
    """Draw from torch's RNG what building `module` outside the meta device drew, and drop it:
    nn.Linear and nn.Embedding draw their own init when built; GPT-2's init overwrites it, but
    the draws moved the RNG on, and without this replay the weights would differ."""
    params = dict(module.named_parameters(recurse=False))
    if not params or not hasattr(module, "reset_parameters"):
        return
    # A shallow copy keeps the module's class and settings; its parameters become full-size
    # plain CPU tensors, as GPT(config) is built on the CPU (the CPU generator's draws).
    twin = copy.copy(module)
    # (None entries too: a Linear without bias still has `bias`, set to None.)
    twin._parameters = {name: p if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype))
                        for name, p in module._parameters.items()}
    twin.reset_parameters()  # the constructor's own code: the same draws, into scratch memory


def _fill_shard(param: torch.Tensor, init: Callable[[torch.Tensor], object]) -> None:
    """`init` on a full-size CPU tensor, then keep this rank's part of it (model.init_weights)."""
    full = torch.empty(param.shape, dtype=param.dtype)  # one full parameter at a time
    init(full)
    if isinstance(param, DTensor):
        # Cut as the parameter is cut. src_data_rank=None: every rank drew the same tensor,
        # so each takes its chunk locally instead of receiving it from rank 0.
        local = distribute_tensor(full, param.device_mesh, param.placements,
                                  src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


@torch.no_grad()
def init_sharded(model: nn.Module, device: torch.device, cpu_offload: bool = False) -> None:
    """Storage and initial weights for a GPT(config) built under torch.device("meta") and
    parallelized: GPT(config)'s after the same seed, bit for bit, each parameter drawn whole on
    the CPU in the plain path's order, each rank keeping its chunk. Needs `init_weights(fill)`
    (model.GPT) and no buffers (to_empty leaves them uninitialised)."""
    # FSDP keeps its tied parameters tied (wte and lm_head share one sharded tensor after this).
    model.to_empty(device="cpu" if cpu_offload else device)
    for module in model.modules():  # in the order they were built
        _replay_constructor_draws(module)
    model.init_weights(fill=_fill_shard)
