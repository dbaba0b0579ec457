"""TP's fused q/k/v weights in snapshots: strided shards, gathered whole or handed to DCP as
the row runs each rank holds.

    whole = whole_strided(model.state_dict())        # collective: every rank, whole tensors
    dcp.save(checkpointable(state), ...)             # each rank's own rows, no gathering

tensor.py cuts `attn.c_attn` with `_StridedShard(0, split_factor=3)` (QKVColwiseParallel), so
each rank's slice is three separate row ranges of the global tensor (its q, k and v rows), and
under FSDP a dp chunk of that slice. DTensor's own gather and DCP's one-offset shards do not
describe that layout; this module does, and snapshot.py and the tests use it.
"""
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def is_qkv(value: object) -> bool:
    """A q/k/v tensor of QKVColwiseParallel: strided over the TP (last) mesh dimension.

    (fsdp_tp's other column-wise tensors are strided too, over dp, in the layout FSDP2 + TP
    always has: DCP saves and reshards those itself.)"""
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


def whole_strided(tree: object) -> object:
    """`tree` (a state dict, or one tensor) with every q/k/v DTensor gathered whole.

    Collective, and every rank then holds the whole tensors: for comparing weights (tests)
    and for tools, not for snapshots, which save each rank's own rows (checkpointable)."""
    if isinstance(tree, dict):
        return {key: whole_strided(value) for key, value in tree.items()}
    return _whole(tree) if is_qkv(tree) else tree


def qkv_rows(rows: int, tp_rank: int, tp_size: int, dp_rank: int = 0, dp_size: int = 1
             ) -> list[tuple[int, int, int]]:
    """The row runs of a q/k/v tensor (`rows` = 3 * n_embd global rows) that one rank holds:
    (first local row, first global row, number of rows) per run, in local order.

    TP rank r holds [q_r; k_r; v_r], n_embd / tp rows of each of q, k and v
    (QKVColwiseParallel); under fsdp_tp, FSDP keeps dp chunk d of that slice (dim 0, as
    torch.chunk cuts: ceil-sized chunks, the last ones shorter or empty). A chunk can start
    inside q_r and end inside v_r: up to three runs, each contiguous in the global tensor."""
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
    """qkv_rows of this rank for the q/k/v DTensor `value`."""
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
    tensors on their memory that describe themselves as several pieces of the global tensor.

    TP's fused q/k/v weights are strided shards (QKVColwiseParallel): a rank's slice is
    three separate row ranges of the global tensor, and DCP describes a DTensor's shard by
    one offset, so it cannot save them as they are. Gathering them whole for the save (and
    reading them whole to cut on load) held every layer's q/k/v and both AdamW moments on
    every rank at once: about 4.4 GB more per GPU for gpt2-xl. Instead each rank hands DCP
    its own rows, as up to three runs (CheckpointableTensor: global_offsets, local_offsets,
    local_sizes), which DCP records as chunks of the one global tensor, exactly as it does
    any other shard: no rank ever holds a whole q/k/v. The snapshot keeps GPT-2's layout
    (one global tensor per name), so every strategy, sample.py and another number of ranks
    read it (DCP maps saved chunks onto any requested ones); snapshots that earlier code
    wrote whole load the same way. dcp.load writes into the views, so the DTensors in `tree`
    itself (not changed) hold the loaded values."""
    if isinstance(tree, dict):
        return {key: checkpointable(value) for key, value in tree.items()}
    return _checkpointable(tree) if is_qkv(tree) else tree
