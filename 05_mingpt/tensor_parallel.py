"""Tensor parallelism (TP) for the GPT blocks, with DTensor's `parallelize_module`.

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    apply_tp(model, mesh["tp"])  # then, for fsdp_tp, fully_shard over mesh["dp"]

Each block's matmuls are split across the `tp` ranks of a group (Megatron-LM's layout):
- attention: q, k and v column-wise, so every rank computes its own n_head / tp heads; the
  output projection row-wise, so the partial results are summed by one all-reduce.
- MLP: the widening matmul column-wise (4 * n_embd / tp columns each), GELU on the local
  columns, the projection row-wise (one more all-reduce).
Two all-reduces per block forward (and two in backward), so TP belongs on fast links (inside
a node). The embeddings, LayerNorms and lm_head stay whole on every rank of the group: with a
65-character vocabulary, sharding them would save nothing and add communication.

All ranks of one TP group must see the same batch and draw the same dropout masks outside
attention: the trainer deals data out over the `dp` mesh dimension only (data_parallel()).
model.py knows nothing of this: its attention derives the local head count from the width of
the q/k/v projection it gets (n_embd / tp under TP, n_embd otherwise).
"""
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard


class QKVColwiseParallel(ColwiseParallel):
    """Column-wise for the fused q/k/v projection `c_attn` (weight (3 * C, C), GPT-2's layout).

    A plain column-wise split would give rank 0 of 2 all of q and half of k. Instead each of
    q, k and v is split on its own and every rank gets its slice of all three: the placement
    `_StridedShard(0, split_factor=3)` ("cut into 3 chunks, then shard each chunk") says so,
    so the parameter names, the saved (global) weights and GPT-2 checkpoints stay as they are.
    """

    def __init__(self) -> None:
        # The matmul's output keeps the same interleaving: locally (B, T, 3 * C / tp) = the
        # rank's q, k and v side by side, which the attention splits in three.
        super().__init__(output_layouts=_StridedShard(2, split_factor=3))

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh
                             ) -> None:
        # The weight (3C, C) and the bias (3C,) get the same cut of their rows (dim 0).
        for pname, param in module.named_parameters():
            placement = [_StridedShard(0, split_factor=3)]
            # src_data_rank: rank 0 sends each rank its slice, so all start from its weights.
            dist_param = nn.Parameter(distribute_tensor(param, device_mesh, placement,
                                                        src_data_rank=self.src_data_rank),
                                      requires_grad=param.requires_grad)
            module.register_parameter(pname, dist_param)


def check_tp(n_head: int, n_embd: int, tp_size: int) -> None:
    """ValueError (one line) unless the heads and the width split evenly over `tp_size` ranks."""
    # Whole heads per rank (attention never mixes heads); n_embd / tp_size MLP columns.
    if n_head % tp_size or n_embd % tp_size:
        raise ValueError(f"tensor parallelism over tp_size={tp_size} ranks needs n_head and "
                         f"n_embd divisible by {tp_size}, got n_head={n_head}, n_embd={n_embd}; "
                         "change the model or trainer_config.tp_size")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard every block's attention and MLP over `tp_mesh`, in place."""
    check_tp(model.config.n_head, model.config.n_embd, tp_mesh.size())
    # Keys name submodules of each block. Column-wise: the input whole (Replicate) on every
    # rank, the output sharded on its last dim and returned as a plain local tensor.
    plan = {
        "attn.c_attn": QKVColwiseParallel(),
        # Row-wise: the input arrives sharded on its last dim (the local heads, or the local
        # MLP columns); the output is summed over the group and comes back whole (Replicate).
        "attn.c_proj": RowwiseParallel(),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(),
    }
    for block in model.blocks:  # per block: the plan's keys are relative to it
        parallelize_module(block, tp_mesh, plan)


def _is_qkv(value: object) -> bool:
    """A q/k/v tensor of QKVColwiseParallel: strided over the TP (last) mesh dimension.

    (fsdp_tp's other column-wise tensors are strided too, over dp, in the layout FSDP2 + TP
    always has: DCP saves and reshards those itself.)"""
    return isinstance(value, DTensor) and isinstance(value.placements[-1], _StridedShard) \
        and value.placements[-1].split_factor == 3


def _meshes(value: DTensor) -> tuple[DeviceMesh | None, DeviceMesh]:
    """(dp mesh or None, tp mesh) of a q/k/v tensor: 1-D under tp, (dp, tp) under fsdp_tp."""
    mesh = value.device_mesh
    if mesh.ndim == 1:  # tp: the TP mesh alone
        return None, mesh
    dp, tp = mesh.mesh_dim_names
    return mesh[dp], mesh[tp]


def _whole(value: DTensor) -> torch.Tensor:
    """The global tensor of a q/k/v DTensor, gathered on every rank."""
    # FSDP over the q/k/v slice: FSDP cut this rank's TP slice ([q_r; k_r; v_r]) into dp
    # chunks along dim 0, a layout DTensor's nested strided placement does not describe. So
    # gather in two steps, as it was cut: the dp chunks into the TP slice, then the slices.
    dp_mesh, tp_mesh = _meshes(value)
    local = value.to_local()
    rows = value.shape[0] // tp_mesh.size()  # the TP slice's rows (3 * n_embd / tp)
    if dp_mesh is not None:
        local = DTensor.from_local(local, dp_mesh, [Shard(0)], run_check=False,
                                   shape=(rows, *value.shape[1:]),
                                   stride=value.stride()).full_tensor()
    return DTensor.from_local(local, tp_mesh, [_StridedShard(0, split_factor=3)],
                              run_check=False, shape=value.shape,
                              stride=value.stride()).full_tensor()


def _cut(whole: torch.Tensor, value: DTensor) -> torch.Tensor:
    """This rank's part of `whole`, laid out as `value` holds it (the inverse of _whole)."""
    dp_mesh, tp_mesh = _meshes(value)
    # src_data_rank=None: every rank holds the whole tensor, each keeps its own slice.
    mine = distribute_tensor(whole, tp_mesh, [_StridedShard(0, split_factor=3)],
                             src_data_rank=None).to_local()
    if dp_mesh is not None:  # FSDP's dim-0 chunk of the TP slice
        mine = distribute_tensor(mine, dp_mesh, [Shard(0)], src_data_rank=None).to_local()
    return mine


def whole_strided(tree: object) -> object:
    """`tree` (a state dict) with every q/k/v DTensor gathered into a whole tensor.

    TP's fused q/k/v weights are strided shards (QKVColwiseParallel): a rank's slice is three
    separate row ranges of the global tensor, and DCP describes a shard by one offset, so it
    cannot save them as they are. They are saved whole instead (gathered on every rank for
    the save; DCP writes identical tensors once): a quarter of each block's weights, and the
    snapshot keeps GPT-2's layout, so any strategy and sample.py read it."""
    if isinstance(tree, dict):
        return {key: whole_strided(value) for key, value in tree.items()}
    return _whole(tree) if _is_qkv(tree) else tree


def load_strided(tree: dict, load: Callable[[dict], None]) -> None:
    """`load(tree)` with every q/k/v DTensor read whole, then cut into this rank's slice."""
    strided: list[tuple[dict, str, DTensor]] = []

    def swap(node: dict) -> None:  # q/k/v DTensors -> whole-size plain tensors, to read into
        for key, value in node.items():
            if isinstance(value, dict):
                swap(value)
            elif _is_qkv(value):
                strided.append((node, key, value))
                node[key] = torch.empty(value.shape, dtype=value.dtype,
                                        device=value.to_local().device)
    swap(tree)
    load(tree)
    for node, key, value in strided:
        value.to_local().copy_(_cut(node[key], value))
        node[key] = value

