"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over all ranks;
each block's parameters are all-gathered just before it runs and freed after.

    model = apply(model, device, settings, mesh["dp"])   # parallel.parallelize, flavour fsdp
    init_sharded(model, device)              # built on the meta device: draw the weights

Built on the meta device (main.build_local), no rank ever holds the whole model: init_sharded
draws each parameter full-size on the CPU, one at a time, and keeps this rank's shard.
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
    """Whether main.py builds the GPT on the meta device (shapes, no memory) for
    init_sharded to draw in shards: fsdp alone, so that no rank ever holds the whole model.
    Not with init_from: the pretrained weights are copied into a whole model first
    (pretrained.load_pretrained), and FSDP then keeps each rank's shards of it."""
    return method == "fsdp" and tp_size <= 1 and pp_size <= 1 and not init_from


def apply(model: nn.Module, device: torch.device, s: Settings,
          mesh: DeviceMesh | None = None, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 over `mesh` (the data-parallel ranks; None: every rank): every block sharded on
    its own, then the root (embeddings, final LayerNorm)."""
    wrap_blocks(model, s.activation_checkpointing, s.compile)  # per block, before sharding
    return shard(model, device, s.precision, s.cpu_offload, mesh, reshard_after_forward)


def shard(model: nn.Module, device: torch.device, precision: str = "fp32",
          cpu_offload: bool = False, mesh: DeviceMesh | None = None,
          reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2: every block sharded on its own, then the root (embeddings, final LayerNorm)."""
    # Each block's parameters are all-gathered just before it runs and freed right after, so
    # only one block is ever whole in memory. Compute in `precision`, reduce gradients in fp32.
    # By default a 1-D mesh over all ranks, on this process's device type: pure data-parallel
    # sharding; with other axes, parallelize passes the mesh's data-parallel dimension.
    if mesh is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
              **policies(precision, cpu_offload, device)}
    for block in model.blocks:  # a pipeline stage's blocks are its own (pipeline.Stage)
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def policies(precision: str, cpu_offload: bool, device: torch.device) -> dict:
    """fully_shard's precision and offload keywords, for every module FSDP wraps (the blocks,
    the root, expert.py's experts)."""
    kwargs: dict = {}
    if precision != "fp32":
        kwargs["mp_policy"] = fsdp_policy(precision)
    if cpu_offload:
        # Shards, gradients and optimizer state live in CPU memory and are copied over for each
        # use. Pinned memory speeds up those copies but needs an accelerator to exist.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return kwargs


# --- FSDP from the meta device: no rank ever holds the whole model --------------------------

def _replay_constructor_draws(module: nn.Module) -> None:
    """Draw from torch's RNG what building `module` outside the meta device drew, and drop it.

    nn.Linear and nn.Embedding initialise themselves when built (reset_parameters: Kaiming-
    uniform weights, uniform biases, N(0, 1) embeddings). GPT-2's init overwrites those values,
    but the draws moved the RNG on: on the meta device nothing is drawn, so without this replay
    the init would start from another RNG state and give other weights than the plain path.
    """
    params = dict(module.named_parameters(recurse=False))
    if not params or not hasattr(module, "reset_parameters"):
        return
    # A shallow copy keeps the module's class and settings (in/out features, padding_idx);
    # its parameters become full-size plain CPU tensors (a DTensor's shape is the global one),
    # on the CPU because GPT(config) is built on the CPU: its draws come from the CPU generator.
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
        # Cut it as the parameter is cut (FSDP: dim 0 in world-size chunks, the last one
        # shorter). src_data_rank=None: every rank drew the same tensor, so each takes its
        # chunk locally instead of receiving it from rank 0.
        local = distribute_tensor(full, param.device_mesh, param.placements,
                                  src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


@torch.no_grad()
def init_sharded(model: nn.Module, device: torch.device, cpu_offload: bool = False) -> None:
    """Storage and initial weights for a model built on the meta device and sharded there.

        torch.manual_seed(seed)
        with torch.device("meta"):
            model = GPT(config)          # shapes only, no memory, no RNG draws
        model = parallelize(model, device, "fsdp")
        init_sharded(model, device)      # == GPT(config) after the same seed, sharded

    `to_empty` gives each rank memory for its own shards only (uninitialised); then every
    parameter is drawn full-size on the CPU, in the plain path's order, and each rank keeps its
    chunk. So the weights equal the plain path's bit for bit (DDP and FSDP runs stay
    comparable), and at most one full parameter (the largest: GPT-2's embedding, or c_fc's
    weight with a small vocabulary) exists at a time.
    The model needs `init_weights(fill)` (model.GPT) and no buffers (to_empty leaves them
    uninitialised too).
    """
    # FSDP keeps its tied parameters tied (wte and lm_head share one sharded tensor after this).
    model.to_empty(device="cpu" if cpu_offload else device)
    for module in model.modules():  # in the order they were built
        _replay_constructor_draws(module)
    model.init_weights(fill=_fill_shard)
