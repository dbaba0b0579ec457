"""Wrap a freshly built model for distributed training; the model itself knows nothing of it.

    model = parallelize(GPT(config).to(device), device, method="fsdp", precision="bf16")
    optimizer = build_optimizer(model, "fsdp", lr=3e-3)  # only now: FSDP replaces parameters

Order matters: activation checkpointing and torch.compile wrap each block first (after TP,
whose plan names the blocks' own submodules; ddp and zero compile the whole model instead),
then DDP or FSDP wraps the result, and the optimizer is built last, from the wrapped model's
parameters. One function per strategy;
`parallelize` picks one by name (README: Strategies):
- ddp: a whole replica per rank, gradients all-reduced.   zero: ddp + sharded optimizer state.
- fsdp: parameters, gradients and optimizer state sharded over all ranks (FSDP2).
- tp: every block's matmuls split over all ranks (tensor_parallel.py).
- fsdp_tp: a 2-D mesh, dp x tp: TP inside each group of tp_size ranks, FSDP across groups.
- dp: nn.DataParallel, one process driving every GPU (the legacy contrast to ddp).
"""
import copy
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from precision import fsdp_policy, keep_autocast
from tensor_parallel import apply_tp

# The strategies that split each block's matmuls: they keep a (dp, tp) mesh on the model.
TP_METHODS = ("tp", "fsdp_tp")


def wrap_blocks(model: nn.Module, activation_checkpointing: bool, compile: bool) -> None:
    """Activation checkpointing and compile, per block and in place, before any strategy."""
    blocks = model.blocks
    for i, block in enumerate(blocks):
        if activation_checkpointing:
            # Keep only each block's input; recompute its activations during backward. The
            # non-reentrant implementation works with DDP's and FSDP's backward hooks, and the
            # wrapper hides itself from state_dict keys, so snapshots stay interchangeable.
            block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        if compile:
            block.compile()  # in place: parameter names (and snapshots) do not change
        blocks[i] = block


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """DDP (and zero): a whole replica per rank, gradients all-reduced in backward."""
    # DDP broadcasts rank 0's weights at construction and all-reduces gradients in backward.
    # device_ids only for a GPU: on the CPU DDP must get none.
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def apply_fsdp(model: nn.Module, device: torch.device, precision: str = "fp32",
               cpu_offload: bool = False, mesh: DeviceMesh | None = None) -> nn.Module:
    """FSDP2: every block sharded on its own, then the root (embeddings, final LayerNorm)."""
    # Each block's parameters are all-gathered just before it runs and freed right after, so
    # only one block is ever whole in memory. Compute in `precision`, reduce gradients in fp32.
    # By default a 1-D mesh over all ranks, on this process's device type: pure data-parallel
    # sharding; fsdp_tp passes the mesh's dp dimension instead.
    if mesh is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict = {"mesh": mesh}
    if precision != "fp32":
        kwargs["mp_policy"] = fsdp_policy(precision)
    if cpu_offload:
        # Shards, gradients and optimizer state live in CPU memory and are copied over for each
        # use. Pinned memory speeds up those copies but needs an accelerator to exist.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def tp_mesh(device: torch.device, tp_size: int) -> DeviceMesh:
    """A (dp, tp) mesh: consecutive ranks form a TP group (on one node, the fast links)."""
    world = dist.get_world_size()
    tp = tp_size or world  # 0: every rank in one TP group
    if world % tp:
        raise ValueError(f"trainer_config.tp_size={tp} must divide the world size {world} "
                         "(the ranks form world_size / tp_size tensor-parallel groups)")
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    # A flat view over both dimensions (its own process group): a value partial over both,
    # such as the gradient norm, is then summed by one all-reduce, not one per dimension
    # (DTensor warns otherwise). Private API, as torchtitan uses it.
    mesh["dp", "tp"]._flatten("dp_tp")
    return mesh


def apply_tensor_parallel(model: nn.Module, device: torch.device, method: str,
                          tp_size: int = 0, precision: str = "fp32",
                          activation_checkpointing: bool = False, compile: bool = False
                          ) -> nn.Module:
    """tp: all ranks in one TP group. fsdp_tp: TP in groups of tp_size, FSDP across them."""
    mesh = tp_mesh(device, tp_size)
    if method == "tp" and mesh["dp"].size() > 1:
        # Pure TP has nothing that would average gradients across TP groups.
        raise ValueError(f"distributed_method=tp puts every rank in one tensor-parallel group, "
                         f"so tp_size must be 0 or the world size ({dist.get_world_size()}), "
                         f"got {tp_size}; use fsdp_tp for data parallelism across TP groups")
    apply_tp(model, mesh["tp"])
    # Only now: the TP plan names each block's own submodules (attn.c_attn, ...), which the
    # checkpoint wrapper would hide one level down.
    wrap_blocks(model, activation_checkpointing, compile)
    if method == "fsdp_tp":
        # FSDP over the dp dimension only: each parameter's TP shard is sharded once more.
        apply_fsdp(model, device, precision, mesh=mesh["dp"])
    model.dp_tp_mesh = mesh  # data_parallel() reads it: the trainer deals data out over dp
    return model


def apply_dp(model: nn.Module, device: torch.device) -> nn.Module:
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


def local_devices(model: nn.Module, device: torch.device) -> list[torch.device]:
    """The devices this process computes on: every GPU of nn.DataParallel, else `device`.

    MFU and peak memory count these: one dp process keeps N GPUs busy."""
    if isinstance(model, nn.DataParallel) and model.device_ids:
        return [torch.device(device.type, index) for index in model.device_ids]
    return [device]


def parallelize(model: nn.Module, device: torch.device, method: str = "ddp",
                precision: str = "fp32", cpu_offload: bool = False,
                activation_checkpointing: bool = False, compile: bool = False,
                tp_size: int = 0) -> nn.Module:
    """`model` wrapped by `method`; its `blocks` (a ModuleList) are the units of wrapping.

    ValueError (one line) where the world size or the model does not fit the method."""
    if method in TP_METHODS:  # TP comes before activation checkpointing and compile
        return apply_tensor_parallel(model, device, method, tp_size, precision,
                                     activation_checkpointing, compile)
    # FSDP (and dp's per-GPU replicas) compile block by block; ddp and zero compile the whole
    # model as one graph, so inductor also takes the output layer and the loss: on an H100,
    # GPT-2's step went from 72.2 ms (blocks) to 41.3 ms (README: Speed). In place, as per
    # block: parameter names (and snapshots) do not change.
    whole = compile and method in ("ddp", "zero")
    wrap_blocks(model, activation_checkpointing, compile and not whole)
    if whole:
        model.compile()
    if method in ("ddp", "zero"):  # zero differs only in its optimizer (build_optimizer)
        if dist.get_world_size() == 1:
            # One process has no gradients to average, but DDP would still copy each one into
            # its buckets and all-reduce them over a group of one: about 10 % of a small
            # model's step on a CPU (README: Speed). Snapshots hold unwrap(model) anyway.
            return model
        return apply_ddp(model, device)
    if method == "fsdp":
        return apply_fsdp(model, device, precision, cpu_offload)
    if method == "dp":
        return apply_dp(model, device)
    raise ValueError(f"unknown distributed_method {method!r}")


def build_optimizer(model: nn.Module, method: str, lr: float, betas: Iterable[float] = (0.9, 0.95),
                    weight_decay: float = 0.1) -> torch.optim.Optimizer:
    """AdamW over the wrapped model's parameters; for zero, each rank keeps 1/world of its state.

    ZeroRedundancyOptimizer gives every parameter an owner rank: only the owner keeps its
    AdamW moments and updates it, then broadcasts the new values. Gradients are still
    all-reduced whole by DDP (ZeRO stage 1: optimizer state sharded, nothing else)."""
    groups = unwrap(model).optim_groups(weight_decay)
    # The fused kernel updates every parameter in one pass: 0.5 ms instead of 2.3 ms per step
    # for gpt-micro on a CPU, where foreach still loops per op. It takes plain tensors or
    # DTensors of one mesh (FSDP), not a mix of them (TP), and only on CPUs and CUDA GPUs.
    fused = can_fuse([p for g in groups for p in g["params"]])
    if method == "zero":
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=lr,
                                       betas=tuple(betas), fused=fused)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), fused=fused)


def can_fuse(params: list[torch.Tensor]) -> bool:
    """AdamW's fused kernel takes these parameters: plain tensors or DTensors of one mesh."""
    meshes = {p.device_mesh if isinstance(p, DTensor) else None for p in params}
    return len(meshes) == 1 and all(p.device.type in ("cpu", "cuda") for p in params)


def keep_own_optimizer_settings(optimizer: torch.optim.Optimizer) -> None:
    """After `optimizer.load_state_dict`: this run's kernel choice and devices, not the saver's.

    load_state_dict restores the saved param groups whole, `fused` included: an fsdp snapshot
    (fused) resumed under tp (whose mix of DTensors and plain tensors the fused kernel refuses)
    crashed at its first step, and tp -> fsdp lost the fused kernel silently. And ZeRO's
    load_state_dict leaves AdamW's 0-dim `step` counts on the CPU, which CUDA's fused kernel
    refuses ("Expected all tensors to be on the same device ... state_steps"; an open torch
    issue, 124133): they go where their parameter lives, as AdamW's own load puts them."""
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    # build_optimizer's choice, made again from this run's parameters (ZeRO: all of them).
    fused = can_fuse([p for g in optimizer.param_groups for p in g["params"]])
    for group in [*optimizer.param_groups, *local.param_groups]:  # ZeRO: both copies
        group["fused"], group["foreach"] = fused, None
    for param, state in local.state.items():
        step = state.get("step")
        if fused and isinstance(step, torch.Tensor) and step.device != param.device:
            state["step"] = step.to(param.device)  # what AdamW's own load does when fused


def unwrap(model: nn.Module) -> nn.Module:
    """The model whose methods (generate, optim_groups) to call: DDP and DataParallel hide it
    in `.module`.

    An FSDP2 model is its own root (fully_shard changes the class in place), and must be called
    through it: its forward hooks gather the sharded parameters. So is a TP model.
    """
    return model.module if isinstance(model, DDP | nn.DataParallel) else model


def data_parallel(model: nn.Module) -> tuple[int, int]:
    """(rank, size) among the ranks that see different data: the dp dimension of a TP mesh.

    Every rank of one TP group computes on the same batch (each with its slice of the weights),
    so samplers, seeds and tokens/s count data-parallel ranks, not processes."""
    mesh = getattr(unwrap(model), "dp_tp_mesh", None)
    if mesh is None:
        return dist.get_rank(), dist.get_world_size()
    return mesh["dp"].get_local_rank(), mesh["dp"].size()


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_, also for gradients that live on different meshes (TP).

    Under TP some gradients are DTensors (sharded over the TP or the 2-D mesh), others plain
    replicated tensors (LayerNorms, embeddings), and torch's version refuses to mix them. So
    the norm is taken per kind, each made global (`full_tensor()` sums a sharded norm over its
    mesh), and the squares added up."""
    params = [p for p in parameters if p.grad is not None]
    kinds: dict = {}  # mesh (None: plain tensors) -> its gradients, in parameter order
    for p in params:
        kinds.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None,
                         []).append(p.grad)
    if len(kinds) <= 1:  # DDP, FSDP: one kind, torch's own (fused) version
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = []
    for grads in kinds.values():  # the same order on every rank: the collectives match
        norm = torch.nn.utils.get_total_norm(grads)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    # As torch computes it, and as a tensor: reading it on the host would sync a GPU per step.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for mesh, grads in kinds.items():
        # DTensor gradients take the factor as a DTensor replicated over their own mesh.
        factor = coef if mesh is None else DTensor.from_local(
            coef, mesh, [Replicate()] * mesh.ndim, run_check=False)
        torch._foreach_mul_(grads, factor)
    return total


def set_grad_sync(model: nn.Module, sync: bool) -> AbstractContextManager:
    """A context for one micro-step: skip the gradient all-reduce unless `sync`.

    DDP has the `no_sync()` context; FSDP2 has a switch that stays set until changed.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    if isinstance(model, DDP) and not sync:
        return model.no_sync()
    return nullcontext()


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
