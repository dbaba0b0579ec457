"""Replica groups that survive each other's failures without a restart (torchft): data
parallel across replica groups, any layout of mingpt.parallel inside one (FAULT_TOLERANCE.md;
DILOCO.md: groups that meet every H steps). main.py wraps the optimizer (Replicas.optimizer)
and gives the Trainer Replicas.hooks (its data-parallel rank and size span the groups); nothing
in the training loop knows.
"""
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.tensor import DTensor

from mingpt import faults
from mingpt.log import print0
from mingpt.parallel import diloco
from mingpt.parallel.wrappers import data_parallel, unwrap
from mingpt.trainer import DeviceHooks


def check_config(t: DictConfig, o: DictConfig) -> None:
    """ValueError (one line) unless the ft_ keys name a group and ft_sync fits (diloco.py)."""
    if t.ft_replicas < 0:
        raise ValueError(f"trainer_config.ft_replicas must be an integer >= 0 (0: off), got "
                         f"{t.ft_replicas}")
    if t.ft_replicas and not 0 <= t.ft_replica_group < t.ft_replicas:
        raise ValueError(f"trainer_config.ft_replica_group must be in 0..{t.ft_replicas - 1} "
                         f"(ft_replicas={t.ft_replicas}), got {t.ft_replica_group}")
    if t.ft_replicas and t.precision == "fp16":
        raise ValueError("trainer_config.ft_replicas needs precision fp32 or bf16, got fp16 "
                         "(GradScaler's skipped steps are not agreed across replica groups)")
    if t.ft_replicas and t.distributed_method == "zero":
        raise ValueError("trainer_config.ft_replicas needs distributed_method ddp, fsdp or a "
                         "layout of them, not zero: a rejoining group copies each peer rank's "
                         "whole AdamW state, which ZeRO spreads over the ranks and gathers "
                         "only with a collective")
    if t.ft_replicas and t.distributed_method == "dp":
        raise ValueError("trainer_config.ft_replicas needs a torchrun job per replica group; "
                         "distributed_method=dp runs in one process without one")
    diloco.check_config(t, o)  # how often the groups meet


class Hooks(DeviceHooks):
    """The trainer's data-parallel rank and size over every replica group: group g's ranks
    come after those of groups 0..g-1, so each group reads rows of its own."""

    def __init__(self, group: int, groups: int) -> None:
        self.group, self.groups = group, groups

    def data_parallel(self, model: nn.Module) -> tuple[int, int]:
        rank, size = data_parallel(model)
        return self.group * size + rank, self.groups * size

    def evaluators(self, model: nn.Module) -> tuple[int, int]:
        """The group's own ranks: each group evaluates every validation sequence, so groups
        that hold the same weights log the same val loss, and it compares with a job's."""
        size = data_parallel(model)[1]
        return self.group * size, size


class Optimizer(torch.optim.Optimizer):
    """`inner` with its gradients averaged across the quorum, stepping only where the Manager
    says the step commits. Not torchft's OptimizerWrapper: it averages through torchft's DDP,
    replacing the layout's own, and starts a quorum at every zero_grad, the last one's too."""

    def __init__(self, manager, inner: torch.optim.Optimizer) -> None:
        # No Optimizer.__init__: param_groups and state are the inner optimizer's (below),
        # which GradScaler, the lr scheduler and snapshots read and change.
        self.manager, self.inner = manager, inner
        # None (ft_sync=step): the groups meet here, every step. Else diloco.py's, whose
        # torchft hooks on the inner optimizer's step hold a meeting every ft_sync_every steps.
        self.sync: diloco.Sync | None = None
        # Replicas.start: the step the next quorum is for, None where no step follows.
        self.next_step: Callable[[], int | None] = lambda: None

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        return self.inner.state

    @property
    def defaults(self) -> dict:  # the lr this run was given: optim.resume_scheduler reads it
        return self.inner.defaults

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)

    def extra_state(self) -> dict:
        """What a snapshot keeps besides weights and AdamW (snapshot.save): DiLoCo's state."""
        return self.sync.state_dict() if self.sync is not None else {}

    def load_extra_state(self, state: dict) -> None:
        if self.sync is not None:
            self.sync.load_state_dict(state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)
        step = self.next_step()  # the trainer has not counted this step yet (None: no
        if step is not None:  # step follows, or the groups meet in diloco.py's hooks)
            self.start_quorum(step)

    def start_quorum(self, step: int) -> None:
        """The quorum of `step`, started in the background (the step's all-reduce waits)."""
        faults.hold_quorum(step)  # FAULT_HOLD_QUORUM only: a test's gate
        self.manager.start_quorum()

    def step(self, closure=None) -> None:
        if self.sync is not None:  # the group's own step; torchft's hooks hold any meeting
            self.inner.step()
            return
        # Every local gradient in one flat buffer, one all-reduce: the mean over the groups of
        # the quorum (a group that is healing sends zeros and is not counted).
        grads = [p.grad for group in self.param_groups for p in group["params"]
                 if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        if local:
            flat = torch.cat([g.reshape(-1) for g in local])
            self.manager.allreduce(flat).wait()
            for g, mean in zip(local, flat.split([g.numel() for g in local]), strict=True):
                g.copy_(mean.view_as(g))
        # False where any group's all-reduce failed (a group died during the step): no group
        # steps, so the survivors keep the same weights.
        if self.manager.should_commit():
            self.inner.step()


def replicas_of(optimizer: torch.optim.Optimizer) -> "Replicas | None":
    """The Replicas whose optimizer this is; None for any other optimizer."""
    return getattr(optimizer, "replicas", None)


class Replicas:
    """This replica group's Manager, its optimizer and the trainer's hooks."""

    def __init__(self, cfg: DictConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device) -> None:
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
        t = cfg.trainer_config
        timeout = timedelta(seconds=t.collective_timeout_s)
        pg = (ProcessGroupNCCL(timeout=timeout) if device.type == "cuda"
              else ProcessGroupGloo(timeout=timeout))
        self.trainer = None
        # The replica id ends in the group's number: torchft reads the ranks of its quorum
        # from it. This group's torchrun store and TORCHFT_LIGHTHOUSE come from the environment.
        # init_sync off: every group draws the same initial weights (the same seed); with it
        # on, the groups that copied would sit the first step out (a healing group sends zeros).
        # Async quorum (ft_sync=step): the step's all-reduce waits for it; LocalSGD and DiLoCo
        # need it formed, and a joining group healed, when start_quorum returns.
        self.manager = Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=1,
            timeout=timeout, quorum_timeout=timeout, rank=dist.get_rank(),
            world_size=dist.get_world_size(), replica_id=f"mingpt_{t.ft_replica_group}",
            init_sync=False, use_async_quorum=t.ft_sync == "step")
        # Bytes sent between the groups, and the meetings' gate (diloco.Meetings).
        self.meetings = diloco.Meetings(self.manager, lambda: self.trainer.step + 1,
                                        gate=t.ft_sync != "step")
        self.manager.register_state_dict_fn("model", unwrap(model).load_state_dict,
                                            unwrap(model).state_dict)
        self.optimizer = Optimizer(self.manager, optimizer)
        if t.ft_sync != "step":  # torchft's LocalSGD or DiLoCo on the group's own optimizer
            self.optimizer.sync = diloco.Sync(t, cfg.optimizer_config, self.manager, model,
                                              optimizer, self.meetings)
        self.optimizer.replicas = self  # main.train finds it there (replicas_of)
        self.manager.register_state_dict_fn("optimizer", optimizer.load_state_dict,
                                            optimizer.state_dict)
        # The Trainer's data-parallel rank across the groups: its rows, and its dropout stream
        # (each group draws the masks DDP's rank of the same rows would).
        self.hooks = Hooks(t.ft_replica_group, t.ft_replicas)

    def _trainer_state(self) -> dict:
        """Where the trainer stands, for a group that joins: not Trainer.state_dict, a
        collective (the quorum's thread calls this while the trainer runs its step)."""
        tr = self.trainer
        return {"step": tr.step, "epoch": tr.epoch, "samples_in_epoch": tr.samples_in_epoch,
                "scheduler": tr.scheduler.state_dict(), "last_val": tr.last_val}

    def _load_trainer(self, state: dict) -> None:
        tr = self.trainer
        tr.step, tr.epoch, tr.samples_in_epoch = (state["step"], state["epoch"],
                                                  state["samples_in_epoch"])
        tr.scheduler.load_state_dict(state["scheduler"])
        tr.last_val = state["last_val"]
        print(f"[replica group {self.hooks.group}, rank {dist.get_rank()}] joined at step "
              f"{tr.step}: weights, optimizer state and position from a peer", flush=True)

    def start(self, trainer) -> None:
        """The first step's quorum, once the trainer exists and resumed its own snapshot (a
        peer's state, received in it, replaces that)."""
        self.trainer, self.first_step = trainer, trainer.step
        self.manager.register_state_dict_fn("trainer", self._load_trainer, self._trainer_state)
        if self.optimizer.sync is not None:  # the groups meet in torchft's hooks
            self.optimizer.sync.start(trainer.step, trainer.log.writer)
            return
        # zero_grad ends step `trainer.step`; the next one runs if it is below max_steps.
        self.optimizer.next_step = lambda: trainer.step + 1 \
            if trainer.step + 1 < trainer.cfg.max_steps else None
        if trainer.step < trainer.cfg.max_steps:
            self.optimizer.start_quorum(trainer.step)

    def shutdown(self) -> None:
        if self.optimizer.sync is not None:
            self.optimizer.sync.stop()
        steps = self.trainer.step - self.first_step
        print0(f"replica groups: rank 0 sent {self.meetings.sent:,} bytes in {steps} steps "
               f"({self.meetings.sent / max(steps, 1):,.0f} per step)")
        self.manager.shutdown(wait=False)
