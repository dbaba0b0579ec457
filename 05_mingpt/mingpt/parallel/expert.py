"""Expert parallelism (EP): each MoE block's experts split over the ranks of an ep group, the
tokens sent to the ranks holding their experts and back with two all-to-alls. MOE.md teaches
the layout (ep groups of data-parallel ranks, the experts sharded on dim 0) and the gradients.
"""
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from mingpt.errors import require
from mingpt.model import Experts, expert_mlp
from mingpt.parallel import layout
from mingpt.parallel.fsdp import policies
from mingpt.parallel.layout import Settings


class ShardedExperts(Experts):
    """Experts whose weights are this rank's E / ep experts (DTensors over the ep group):
    forward takes and returns what Experts.forward does, all E experts' rows."""

    group: dist.ProcessGroup  # the ep group (set by apply)
    ep: int

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        local = len(counts) // self.ep  # experts per rank
        # 1. rows per (source rank, local expert): recv[j, e] from rank j for my expert e.
        send = torch.tensor(counts, device=x.device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # no gradient: integers
        recv = recv.view(self.ep, local)
        send_splits = send.view(self.ep, local).sum(1).tolist()  # rows to each rank
        recv_splits = recv.sum(1).tolist()  # rows from each rank
        # 2. the rows, rank by rank (each rank's own rows for my experts, expert by expert),
        # by the all-to-all whose backward is the reverse all-to-all (torchtitan's call too;
        # torch.distributed.nn.functional's, used before, is deprecated in torch 2.14).
        got = all_to_all_single_autograd(x, recv_splits, send_splits, self.group)
        # 3. regroup expert by expert (stable: reproducible), run them, restore arrival order.
        expert_of_row = torch.arange(local, device=x.device).repeat(self.ep) \
            .repeat_interleave(recv.flatten())  # (rows received,)
        order = expert_of_row.argsort(stable=True)
        weights = [(m.weight.to_local(), m.bias.to_local() if m.bias is not None else None)
                   for m in (self.c_fc, self.c_proj)]
        y = expert_mlp(got[order], recv.sum(0).tolist(), *weights, self.relu2)
        y = y[order.argsort()]  # (rows received, C), in arrival order
        # 4. back to where each row came from, in the order it was sent.
        return all_to_all_single_autograd(y, send_splits, recv_splits, self.group)


def check_config(t: DictConfig, n_expert: int) -> None:
    """The experts against the layout: ep_size needs experts and must divide their number;
    TP's plan names the dense MLP's matmuls (no plan for experts); compile with activation
    checkpointing would compile no block."""
    if t.ep_size > 1:
        require(n_expert > 0, "trainer_config.ep_size",
                "0 or 1 for a dense model (gpt_config.n_expert=0)", t.ep_size)
        require(n_expert % t.ep_size == 0, "trainer_config.ep_size",
                f"a divisor of gpt_config.n_expert={n_expert} (each rank holds n_expert / "
                "ep_size experts)", t.ep_size)
    if n_expert:
        require(t.tp_size <= 1 and t.distributed_method not in ("tp", "fsdp_tp", "fsdp_tp_pp"),
                "trainer_config.distributed_method",
                "a layout without tensor parallelism for a MoE model (TP's plan splits the "
                "dense MLP; experts have none)", t.distributed_method)
        # torch.compile traces a checkpointed block as one region, which cannot break its
        # graph; the routing's shapes depend on the data (tokens per expert), so it breaks it
        # (it runs eagerly: wrappers.compile_in_place), and the whole block ran uncompiled: a
        # run with ep_size compiled nothing.
        require(not (t.compile and t.activation_checkpointing), "trainer_config.compile",
                "False with activation_checkpointing for a MoE model (a checkpointed block "
                "cannot break its graph at the router's data-dependent shapes, so no block "
                "would compile)", t.compile)


def apply(part: nn.Module, mesh: DeviceMesh, flavour: str, s: Settings) -> nn.Module:
    """Every MoE block of `part` (the GPT, or a pipeline stage) with its experts split over
    mesh["ep"] and wrapped by the flavour over mesh["edp"], in place; the flavour's apply then
    wraps the rest over mesh["dp"] (FSDP and replicate leave modules already wrapped alone)."""
    ep, edp = mesh["ep"], mesh["edp"]
    for block in part.blocks:
        experts = getattr(getattr(block, "mlp", None), "experts", None)  # an Identity: none
        if experts is None:
            continue
        n_expert = experts.c_fc.weight.size(0)
        if n_expert % ep.size():
            raise ValueError(f"trainer_config.ep_size={ep.size()} must divide "
                             f"gpt_config.n_expert={n_expert}")
        for module in (experts.c_fc, experts.c_proj):
            for name, param in list(module.named_parameters(recurse=False)):
                # src_data_rank=None: every rank built the same weights from the same seed (or
                # none yet, on the meta device), so each keeps its own experts, no traffic.
                module.register_parameter(name, nn.Parameter(distribute_tensor(
                    param.data, ep, [Shard(0)], src_data_rank=None)))
        experts.__class__ = ShardedExperts  # forward: the exchange (the class FSDP will wrap)
        experts.group, experts.ep = ep.get_group(), ep.size()
        _wrap(experts, flavour, s, edp, divide=layout.axis(mesh, "dp").size())
    return part


def _wrap(experts: nn.Module, flavour: str, s: Settings, edp: DeviceMesh, divide: int) -> None:
    """The flavour on one block's experts over the ranks holding the same ones: FSDP2's fully_shard
    (fsdp) or replicate (ddp: DDP cannot take DTensors), the gradient sum divided by dp."""
    from torch.distributed._composable.replicate_with_fsdp import replicate  # noqa: PLC0415
    device = torch.device(edp.device_type)
    if flavour == "fsdp":  # offloaded with the rest where cpu_offload asks (fsdp.policies)
        fully_shard(experts, mesh=edp, reshard_after_forward=s.pp_size <= 1,
                    **policies(s.precision, s.cpu_offload, device))
    else:
        replicate(experts, mesh=edp, **policies(s.precision, False, device))
    experts.set_gradient_divide_factor(float(divide))
    if flavour == "fsdp" and edp.device_type == "cpu" and edp.size() > 1:
        # A divide factor other than the group's size makes FSDP reduce-scatter with NCCL's
        # PREMUL_SUM, which gloo has not: a plain sum, then the division (edp > 1 only).
        experts.set_force_sum_reduction_for_comms(True)
