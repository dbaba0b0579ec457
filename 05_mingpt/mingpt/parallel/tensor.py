"""Tensor parallelism (TP) for the GPT blocks, with DTensor's `parallelize_module`.

Megatron-LM's layout over the `tp` ranks of a group: q, k, v and the MLP's widening matmul
column-wise (each rank its own n_head / tp heads, 4 * n_embd / tp columns), both output
projections row-wise, their partial results summed by one all-reduce each: two per block
forward, two in backward, so TP belongs on fast links (inside a node). The embeddings,
LayerNorms and lm_head stay whole on every rank. model.py knows nothing of this: its attention
derives the local head count from the width of the q/k/v projection it gets.
"""
import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from mingpt.errors import require


class QKVColwiseParallel(ColwiseParallel):
    """Column-wise for the fused q/k/v projection `c_attn` (weight (3 * C, C), GPT-2's layout):
    where a plain split would give rank 0 of 2 all of q and half of k, every rank gets its slice
    of each of q, k and v (`_StridedShard(0, split_factor=3)`), the global weights unchanged."""

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


class HeadDropoutStream:
    """CausalSelfAttention.attend under TP: the dropout of this rank's heads from a stream of
    its own, as Megatron-LM's TP regions (from the group's shared one, head h would get the same
    mask on every rank). Each call draws a seed from the shared stream (which checkpointing's
    recompute and a resume restore) and seeds a fork of the RNG with it plus the TP rank."""

    def __init__(self, attend, tp_rank: int, device: torch.device) -> None:
        self.attend, self.tp_rank = attend, tp_rank
        self.devices = [device] if device.type == "cuda" else []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float
                 ) -> torch.Tensor:
        if not dropout_p:  # evaluation and generation: no masks, nothing drawn
            return self.attend(q, k, v, dropout_p)
        seed = int(torch.randint(2**62, (1,)))  # from the shared (CPU) stream, alike in the group
        with torch.random.fork_rng(devices=self.devices):
            torch.manual_seed(seed + self.tp_rank)  # CPU and CUDA streams of this rank's own
            return self.attend(q, k, v, dropout_p)


def apply(part: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Every block of `part` (the GPT, or a pipeline stage) split over the ranks of `tp_mesh`,
    in place; each rank's heads draw their own attention dropout (HeadDropoutStream)."""
    check_tp(part.config.n_head, part.config.n_embd, tp_mesh.size())
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
    device = torch.device(tp_mesh.device_type, torch.cuda.current_device()) \
        if tp_mesh.device_type == "cuda" else torch.device("cpu")
    for block in part.blocks:  # per block: the plan's keys are relative to it
        parallelize_module(block, tp_mesh, plan)
        block.attn.attend = HeadDropoutStream(block.attn.attend, tp_mesh.get_local_rank(),
                                              device)
    return part


def check_config(t: DictConfig) -> None:
    """TP's own rule without FSDP: fp16's loss scaler unscales all gradients in one foreach
    pass, which torch refuses for DTensors mixed with plain tensors or of two meshes (FSDP
    makes every parameter a DTensor of one mesh, and fp16 works)."""
    method = t.distributed_method if t.distributed_method == "tp" else \
        f"{t.distributed_method} and tp_size"
    require(t.precision != "fp16", "trainer_config.precision",
            f"fp32 or bf16 with distributed_method={method} (fp16's GradScaler cannot unscale "
            "its sharded and plain gradients together; fsdp_tp takes fp16)", t.precision)
