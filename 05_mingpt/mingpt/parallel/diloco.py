"""Replica groups that meet every H steps instead of every step (trainer_config.ft_sync):
torchft's LocalSGD and DiLoCo, for groups joined by a slow network (DILOCO.md teaches both).

torchft does the work (torchft.local_sgd: its hooks on the inner optimizer's step hold the
meeting); this module cuts Streaming DiLoCo's fragments, keeps their state in snapshots
(Sync.state_dict) and says in the log what each meeting cost.
"""
import time

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.tensor import DTensor

from mingpt import faults
from mingpt.errors import require
from mingpt.log import print0
from mingpt.parallel.layout import SHORTHANDS
from mingpt.parallel.wrappers import unwrap

SYNCS = ("step", "local_sgd", "diloco")  # trainer_config.ft_sync


def check_config(t: DictConfig, o: DictConfig) -> None:
    """ValueError (one line) for values of ft_sync and its settings that cannot work."""
    require(t.ft_sync in SYNCS, "trainer_config.ft_sync", f"one of {', '.join(SYNCS)}",
            t.ft_sync)
    require(t.ft_sync_every >= 1, "trainer_config.ft_sync_every", "a positive integer",
            t.ft_sync_every)
    require(t.ft_fragments >= 1, "trainer_config.ft_fragments", "a positive integer",
            t.ft_fragments)
    require(o.outer_lr > 0, "optimizer_config.outer_lr", "> 0", o.outer_lr)
    require(0 <= o.outer_momentum < 1, "optimizer_config.outer_momentum", "in [0, 1)",
            o.outer_momentum)
    require(t.ft_sync == "step" or t.ft_replicas > 0, "trainer_config.ft_sync", "step unless "
            "ft_replicas > 0 (it says how replica groups meet)", t.ft_sync)
    require(t.ft_fragments == 1 or t.ft_sync == "diloco", "trainer_config.ft_fragments",
            "1 unless ft_sync=diloco (fragments of the weights meet in turn)", t.ft_fragments)
    if t.ft_sync == "step":
        return
    # torchft's DiLoCo: each fragment meets every ft_sync_every steps, one at a time.
    require(t.ft_sync_every % t.ft_fragments == 0, "trainer_config.ft_sync_every",
            f"a multiple of ft_fragments={t.ft_fragments} (one fragment meets every "
            "ft_sync_every / ft_fragments steps)", t.ft_sync_every)
    # Built for groups that are ddp or fsdp (whole tensors or FSDP's shards): under tp, pp, cp
    # or ep the outer gradient's norm would need the parameters' other meshes.
    flavour, on = SHORTHANDS.get(t.distributed_method, (t.distributed_method, ()))
    axes = [f"{axis}_size={t[f'{axis}_size']}" for axis in ("tp", "pp", "cp", "ep")
            if t[f"{axis}_size"] > 1] or [f"distributed_method={t.distributed_method}"] * bool(on)
    require(flavour in ("ddp", "fsdp") and not axes, "trainer_config.ft_sync",
            f"step with {(axes or [f'distributed_method={flavour}'])[0]} (local_sgd and diloco "
            "are built for groups that are ddp or fsdp without other axes)", t.ft_sync)


def fragments(model: nn.Module, n: int) -> list[nn.Module]:
    """`model`'s parameters in `n` modules of consecutive ones (the model's order: embeddings,
    then the blocks, then the head), each about 1/n of the elements. torchft's DiLoCo takes
    modules; these hold the model's own parameters (a tied weight once, in its first place)."""
    named = list(unwrap(model).named_parameters())
    total = sum(p.numel() for _, p in named)
    parts = [nn.Module() for _ in range(n)]
    done = 0
    for name, p in named:  # by where the parameter starts in the model's elements
        parts[min(n - 1, done * n // total)].register_parameter(name.replace(".", "/"), p)
        done += p.numel()
    empty = [i for i, part in enumerate(parts) if not list(part.parameters())]
    if empty:
        raise ValueError(f"trainer_config.ft_fragments={n} leaves fragment {empty[0]} without "
                         f"a parameter (this rank holds {len(named)}); use fewer fragments")
    return parts


class Sync:
    """This group's LocalSGD or DiLoCo (torchft) on `inner`, the group's own optimizer; its
    hooks run once start() is called (after the snapshot's load, which steps an optimizer
    that has no state yet: a meeting then would start a quorum no peer joins)."""

    def __init__(self, t: DictConfig, o: DictConfig, manager, model: nn.Module,
                 inner: torch.optim.Optimizer, meetings: "Meetings") -> None:
        from torchft.local_sgd import DiLoCo, LocalSGD
        self.manager, self.kind, self.model = manager, t.ft_sync, unwrap(model)
        self.inner, self.meetings = inner, meetings
        self.writer = None  # TensorBoard's (rank 0), once start() has the trainer's log
        self.outer: list[torch.optim.SGD] = []
        self.norm: torch.Tensor | None = None  # the last meeting's outer gradient norm
        self.loaded = False  # whether a snapshot gave the state of the last meeting
        if t.ft_sync == "local_sgd":
            self.algorithm = LocalSGD(manager, self.model, inner, t.ft_sync_every)
            return
        parts = fragments(model, t.ft_fragments)
        nesterov = o.outer_momentum > 0  # DiLoCo's outer optimizer: SGD with Nesterov momentum
        for part in parts:
            sgd = torch.optim.SGD(part.parameters(), lr=o.outer_lr, momentum=o.outer_momentum,
                                  nesterov=nesterov)
            if nesterov:  # zeros now, so a snapshot always has them: SGD's first step gives
                # 0 x momentum + g = g, the clone of g it would otherwise start from
                for p in part.parameters():
                    sgd.state[p]["momentum_buffer"] = torch.zeros_like(p)
            sgd.register_step_pre_hook(self._measure)
            self.outer.append(sgd)
        # Saves the weights of "the last meeting": now, the initial (or resumed) weights.
        self.algorithm = DiLoCo(manager, parts, inner, self.outer, t.ft_sync_every)

    def _held(self):
        """(name in the model, parameter, torchft's copy of its weights at the last meeting,
        its outer SGD's state) for every parameter, in the order its SGD holds them."""
        for fragment, sgd in zip(self.algorithm._fragments, self.outer, strict=True):
            for (key, kept), p in zip(fragment.original_parameters.items(),
                                      sgd.param_groups[0]["params"], strict=True):
                yield key.replace("/", "."), p, kept, sgd.state[p]

    def _measure(self, sgd: torch.optim.Optimizer, *_) -> None:
        """Before the outer step: the norm of the averaged outer gradient (how far the groups
        had moved since the last meeting), over the whole model where FSDP shards it."""
        squares = torch.zeros((), device=next(self.model.parameters()).device)
        grads = [p.grad for g in sgd.param_groups for p in g["params"] if p.grad is not None]
        for grad in grads:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            squares += local.float().square().sum()
        if any(isinstance(g, DTensor) for g in grads):  # FSDP: every rank holds a shard
            dist.all_reduce(squares)
        self.norm = squares.sqrt()

    def start(self, step: int, writer) -> None:
        """Hooks on from here, with training at `step` (torchft counts steps since it was built:
        a resumed run tells it where the interval stands); `writer`: TensorBoard's, on rank 0."""
        if not self.loaded and self.outer:  # a new run, or a snapshot without this state
            self.algorithm._save_parameters()  # the resumed weights are the last meeting's
        every = self.algorithm._sync_every  # DiLoCo's: steps between two fragments' meetings
        self.algorithm._local_step = step % every
        self.algorithm.__enter__()  # torchft's hooks on the inner step: they hold the meeting
        self.writer = writer
        self.handle = self.inner.register_step_post_hook(self._after)  # after torchft's

    def stop(self) -> None:
        self.algorithm.__exit__(None, None, None)
        self.handle.remove()

    def _after(self, *_) -> None:
        """After the inner step and torchft's hook: a meeting's report, where one was held."""
        if self.meetings.started is None:
            return
        seconds = time.perf_counter() - self.meetings.started
        self.meetings.started = None
        sent, self.meetings.at_last = (self.meetings.sent - self.meetings.at_last,
                                       self.meetings.sent)
        self.report(self.meetings.step(), seconds, sent)

    def report(self, step: int, seconds: float, sent: int) -> None:
        """The meeting's log line (rank 0 of each group prints it) and its TensorBoard
        scalars: when, how long, how many bytes this rank sent, and the drift."""
        drift = f", outer gradient norm {self.norm.item():.4f}" if self.norm is not None else ""
        print0(f"step {step}: replica groups met ({self.kind}): {seconds * 1e3:.1f} ms, "
               f"rank 0 sent {sent:,} bytes{drift}")
        if self.writer is not None:
            self.writer.add_scalar("replicas/sync_ms", seconds * 1e3, step)
            self.writer.add_scalar("replicas/sent_mib", sent / 2**20, step)
            if self.norm is not None:
                self.writer.add_scalar("replicas/outer_grad_norm", self.norm.item(), step)
        self.norm = None

    def state_dict(self) -> dict:
        """The last meeting's weights and the outer momentum by parameter name (as DTensors
        like the parameters where FSDP shards them: DCP writes each rank's shard), and the
        Manager's count of meetings. Empty for local_sgd, whose weights are all its state."""
        if not self.outer:
            return {}
        # A tensor, not the Manager's dict of ints: DCP reads tensors in place, into the
        # dict given to it (its other values it replaces in a copy of that dict).
        meetings = self.manager.state_dict()
        state: dict = {"meetings": torch.tensor([meetings["step"],
                                                 meetings["batches_committed"]])}
        for name, p, kept, outer in self._held():
            kept = kept.to(p.device)
            state[f"original/{name}"] = DTensor.from_local(
                kept, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()) \
                if isinstance(p, DTensor) else kept
            if "momentum_buffer" in outer:
                state[f"momentum/{name}"] = outer["momentum_buffer"]
        return state

    def load_state_dict(self, state: dict) -> None:
        """A snapshot's state_dict(), into torchft's copies (before start())."""
        if not self.outer or not state:
            return
        step, committed = state["meetings"].tolist()
        self.manager.load_state_dict({"step": step, "batches_committed": committed})
        for name, _, kept, outer in self._held():
            saved = state[f"original/{name}"]
            kept.copy_(saved.to_local() if isinstance(saved, DTensor) else saved)
            if f"momentum/{name}" in state:
                outer["momentum_buffer"].copy_(state[f"momentum/{name}"])
        self.loaded = True


class Meetings:
    """The Manager's calls that a meeting makes, counted: the bytes this rank sends through
    its all-reduces, and the time from the quorum's start to the end of the inner step."""

    def __init__(self, manager, step, gate: bool) -> None:
        self.sent = 0  # bytes this rank gave torchft's all-reduces, over the run
        self.at_last = 0  # self.sent at the last meeting's report
        self.started: float | None = None  # when the meeting in progress started its quorum
        self.step = step  # the steps done, at a meeting (faults.hold_quorum's gate)
        allreduce, start_quorum = manager.allreduce, manager.start_quorum

        def counted(tensor: torch.Tensor, *args, **kwargs):
            self.sent += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *args, **kwargs)

        def gated(*args, **kwargs) -> None:
            if gate:  # (ft_sync=step: ft.Optimizer's gate, with the step it starts)
                faults.hold_quorum(self.step())  # FAULT_HOLD_QUORUM only: a test's gate
            self.started = time.perf_counter()
            start_quorum(*args, **kwargs)
        manager.allreduce, manager.start_quorum = counted, gated
