"""TP's fused q/k/v weights in snapshots: strided shards, gathered whole or handed to DCP as
the row runs each rank holds.

    whole = whole_strided(model.state_dict())        # collective: every rank, whole tensors
    dcp.save(checkpointable(state), ...)             # each rank's own rows, no gathering

tensor.py cuts `attn.c_attn` with `_StridedShard(0, split_factor=3)`, so each rank's slice is
three row ranges of the global tensor (its q, k and v rows), under FSDP a dp chunk of that
slice: a layout that neither DTensor's own gather nor DCP's one-offset shards describe.
"""
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def is_qkv(value: object) -> bool:
    """A q/k/v tensor of QKVColwiseParallel: strided over the TP (last) mesh dimension (not
    fsdp_tp's other strided tensors, which DCP saves and reshards itself)."""
    return isinstance(value, DTensor) and isinstance(value.placements[-1], _StridedShard) \
        and value.placements[-1].split_factor == 3


def _meshes(value: DTensor) -> tuple[DeviceMesh | None, DeviceMesh]:
    """(dp mesh or None, tp mesh) of a q/k/v tensor: 1-D under tp, (dp, tp) under fsdp_tp
    (sharded over dp) or ddp's replicate (whole on every dp rank: no dp mesh to gather over)."""
    mesh = value.device_mesh
    if mesh.ndim == 1 or value.placements[0].is_replicate():  # tp alone, or replicated
        return None, mesh[mesh.mesh_dim_names[-1]] if mesh.ndim > 1 else mesh
    dp, tp = mesh.mesh_dim_names
    return mesh[dp], mesh[tp]


def _whole(value: DTensor) -> torch.Tensor:
    """The global tensor of a q/k/v DTensor, gathered on every rank."""
    # FSDP cut this rank's TP slice [q_r; k_r; v_r] into dp chunks, a layout no DTensor
    # placement describes: gather as it was cut, the chunks into the slice, then the slices.
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


def whole_strided(tree: object) -> object:
    """`tree` (a state dict, or one tensor) with every q/k/v DTensor gathered whole on every
    rank (collective): for tests and tools; snapshots save each rank's rows (checkpointable)."""
    if isinstance(tree, dict):
        return {key: whole_strided(value) for key, value in tree.items()}
    return _whole(tree) if is_qkv(tree) else tree


def qkv_rows(rows: int, tp_rank: int, tp_size: int, dp_rank: int = 0, dp_size: int = 1
             ) -> list[tuple[int, int, int]]:
    """The row runs of a q/k/v tensor (`rows` = 3 * n_embd global rows) that one rank holds:
    (first local row, first global row, number of rows) per run, in local order. TP rank r
    holds [q_r; k_r; v_r]; under fsdp_tp FSDP keeps dp chunk d of that (torch.chunk's cut), which
    can start inside q_r and end inside v_r: up to three runs, each contiguous globally."""
    part = rows // 3 // tp_size  # rows of q (and of k, of v) per TP rank
    chunk = -(-3 * part // dp_size)  # FSDP's chunk of the TP slice, rounded up
    start, end = min(dp_rank * chunk, 3 * part), min((dp_rank + 1) * chunk, 3 * part)
    runs = []
    while start < end:
        which, within = divmod(start, part)  # 0, 1, 2: q, k, v
        length = min(end, (which + 1) * part) - start
        runs.append((start - dp_rank * chunk, which * rows // 3 + tp_rank * part + within,
                     length))
        start += length
    return runs


def _runs(value: DTensor) -> list[tuple[int, int, int]]:
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()  # (tp,) under tp, (dp, tp) under fsdp_tp
    sharded = mesh.ndim == 2 and not value.placements[0].is_replicate()  # not ddp's replicate
    dp_rank, dp_size = (coordinate[0], mesh.size(0)) if sharded else (0, 1)
    return qkv_rows(value.shape[0], coordinate[-1], mesh.size(-1), dp_rank, dp_size)


def own_rows(value: DTensor, whole: torch.Tensor) -> DTensor:
    """The inverse of whole_strided for one q/k/v DTensor: `whole`, a tensor of its global
    shape, cut to this rank's rows, as a DTensor laid out as `value` is (no communication)."""
    local = torch.cat([whole[first:first + length] for _, first, length in _runs(value)])
    return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def _checkpointable(value: DTensor) -> torch.Tensor:
    """This rank's rows of a q/k/v DTensor as a plain tensor on the same memory, marked with
    where its row runs lie in the global tensor (DCP's CheckpointableTensor protocol)."""
    runs = _runs(value)
    mesh = value.device_mesh
    local = value.to_local().detach()  # a new tensor object: the attributes stay off the param
    if sum(length for *_, length in runs) != local.shape[0]:  # FSDP cut it some other way
        raise RuntimeError(f"a q/k/v shard of {local.shape[0]} rows where {runs} was expected"
                           f" ({mesh}, {value.placements})")
    rest = tuple(value.shape[1:])  # the bias has no second dimension
    zeros = (0,) * len(rest)
    local.global_shape = tuple(value.shape)
    local.global_offsets = tuple((first, *zeros) for _, first, _ in runs)
    local.local_offsets = tuple((first, *zeros) for first, _, _ in runs)
    local.local_sizes = tuple((length, *rest) for *_, length in runs)
    return local


def checkpointable(tree: object) -> object:
    """`tree` (a state dict) for dcp.save and dcp.load, q/k/v DTensors replaced by plain
    tensors on their memory that describe themselves as up to three row runs of the global
    tensor (CheckpointableTensor), which DCP records as chunks of it: no rank ever holds a
    whole q/k/v. dcp.load writes into the views, so the DTensors in `tree` get the values."""
    if isinstance(tree, dict):
        return {key: checkpointable(value) for key, value in tree.items()}
    return _checkpointable(tree) if is_qkv(tree) else tree
