"""The optimizer (AdamW, or Muon for the blocks' matrices: mingpt/muon.py) and the lr schedule,
a linear warmup then cosine decay, rebuilt at the saved step on a resume."""
import math
from collections.abc import Iterable
from functools import partial

import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from mingpt.muon import MuonAdamW
from mingpt.parallel import zero
from mingpt.parallel.layout import grad_mesh
from mingpt.parallel.wrappers import unwrap

# The settings that shape the lr schedule besides the base lr (LambdaLR saves none of them).
SCHEDULE_KEYS = ("max_steps", "warmup_steps", "min_lr_ratio")


def build_optimizer(model: nn.Module, method: str, lr: float, betas: Iterable[float] = (0.9, 0.95),
                    weight_decay: float = 0.1, name: str = "adamw", muon_lr: float = 0.02
                    ) -> torch.optim.Optimizer:
    """AdamW over the wrapped model's parameters (built after wrapping: FSDP replaces them), or
    with name="muon" Muon for the blocks' matrices; zero brings its own."""
    muon = name == "muon"
    groups = unwrap(model).optim_groups(weight_decay, muon=muon)
    for group in (g for g in groups if g.get("muon")):  # ZeRO gives a group without one its lr
        group["lr"] = muon_lr
    kind, extra = (MuonAdamW, {"muon_lr": muon_lr}) if muon else (torch.optim.AdamW, {})
    # Fused: one pass over every parameter, where foreach loops per op on a CPU (bench/README.md).
    fused = can_fuse([p for g in groups for p in g["params"]])
    if method == "zero":  # each data-parallel rank keeps the state of the parameters it owns
        mesh = getattr(unwrap(model), "mesh", None)
        group = grad_mesh(mesh).get_group() if mesh is not None else None
        return zero.optimizer(groups, group, kind, lr=lr, betas=tuple(betas), fused=fused,
                              **extra)
    return kind(groups, lr=lr, betas=tuple(betas), fused=fused, **extra)


def can_fuse(params: list[torch.Tensor]) -> bool:
    """AdamW's fused kernel takes these parameters: plain tensors or DTensors of one mesh."""
    meshes = {p.device_mesh if isinstance(p, DTensor) else None for p in params}
    return len(meshes) == 1 and all(p.device.type in ("cpu", "cuda") for p in params)


def inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state a snapshot holds: `optimizer`, or the one inside torchft's
    wrapper (parallel/ft.py), whose step (DCP takes one) would start a cross-group all-reduce."""
    return getattr(optimizer, "inner", optimizer)


def extra_state(optimizer: torch.optim.Optimizer) -> dict:
    """What a snapshot keeps of `optimizer` besides its state_dict: the replica groups'
    meetings (parallel/diloco.py, behind ft.py's wrapper); {} for any other optimizer."""
    return getattr(optimizer, "extra_state", dict)()


def load_extra_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    getattr(optimizer, "load_extra_state", lambda _: None)(state)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's AdamW state: ZeRO's local one, else the inner one."""
    optimizer = inner(optimizer)
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def keep_own_optimizer_settings(optimizer: torch.optim.Optimizer) -> None:
    """After `optimizer.load_state_dict`: this run's `fused` (the saver's may not fit), and
    AdamW's `step` counts on their parameter's device (ZeRO's load leaves them on the CPU,
    which CUDA's fused kernel refuses)."""
    local = local_optimizer(optimizer)
    # build_optimizer's choice, made again from this run's parameters (ZeRO: all of them).
    fused = can_fuse([p for g in optimizer.param_groups for p in g["params"]])
    for group in [*optimizer.param_groups, *local.param_groups]:  # ZeRO: both copies
        group["fused"], group["foreach"] = fused, None
    for param, state in local.state.items():
        step = state.get("step")
        if fused and isinstance(step, torch.Tensor) and step.device != param.device:
            state["step"] = step.to(param.device)  # what AdamW's own load does when fused


# AdamW's settings besides the lr (which the schedule owns) that a resume takes from this run.
HYPER_KEYS = ("betas", "weight_decay")


def own_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """This run's betas and weight decay per param group, for restore_settings."""
    return [{key: group[key] for key in HYPER_KEYS} for group in optimizer.param_groups]


def restore_settings(optimizer: torch.optim.Optimizer, own: list[dict]) -> list[str]:
    """After `optimizer.load_state_dict` (which restores the saved groups whole): this run's
    betas and weight decay again, as config.yaml records them; the changes, for the log."""
    local = local_optimizer(optimizer)
    changes: list[str] = []
    for group, mine in zip(optimizer.param_groups, own, strict=True):
        for key, value in mine.items():
            saved = tuple(group[key]) if key == "betas" else group[key]
            if saved != value:
                shown = (list(saved), list(value)) if key == "betas" else (saved, value)
                change = f"optimizer_config.{key} {shown[0]} -> {shown[1]}"
                changes += [change] if change not in changes else []
            group[key] = value
    for group, mine in zip(local.param_groups, own, strict=False):  # ZeRO's local copy
        group.update(mine)
    return changes


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base lr at `step`: linear warmup, then cosine decay to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps  # never 0: the first step already learns a little
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: DictConfig, steps_taken: int = 0
                    ) -> LambdaLR:
    """The schedule from trainer_config after `steps_taken` steps: exactly the saved run's lrs."""
    factor = partial(lr_factor, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps,
                     min_lr_ratio=cfg.min_lr_ratio)
    if steps_taken:  # LambdaLR's own start: it steps once more, to steps_taken, when built
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
    return LambdaLR(optimizer, factor, last_epoch=steps_taken - 1)


def lr_key(group: dict) -> str:
    """The optimizer_config key a param group's base lr comes from."""
    return "muon_lr" if group.get("muon") else "lr"


def base_lrs(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The base lr of each kind of param group (lr_key), as a snapshot keeps them."""
    return {lr_key(group): optimizer.defaults[lr_key(group)] for group in optimizer.param_groups}


def resume_scheduler(optimizer: torch.optim.Optimizer, cfg: DictConfig, state: dict
                     ) -> tuple[LambdaLR, list[str]]:
    """The schedule at a snapshot's step, with THIS run's settings (a longer max_steps, a new
    lr: followed from the saved step on); and what changed, for the log."""
    saved, steps = state["schedule"], state["scheduler"]["last_epoch"]
    changes = [f"trainer_config.{key} {saved[key]} -> {cfg[key]}"
               for key in SCHEDULE_KEYS if saved[key] != cfg[key]]
    # The saved lrs by key (lr_key): rank 0's groups, which another pipeline stage's may not
    # match. A snapshot without base_lrs: its scheduler's list, group by group.
    saved_lrs = state.get("base_lrs") or {
        lr_key(group): lr for group, lr in zip(optimizer.param_groups,
                                               state["scheduler"]["base_lrs"], strict=True)}
    for group in optimizer.param_groups:
        key = lr_key(group)
        base, saved_lr = optimizer.defaults[key], saved_lrs[key]
        change = f"optimizer_config.{key} {saved_lr:g} -> {base:g}"
        if saved_lr != base and change not in changes:
            changes.append(change)
        group["initial_lr"] = base
    scheduler = build_scheduler(optimizer, cfg, steps)
    # LambdaLR's count of step() calls too: the next snapshot equals an uninterrupted run's.
    scheduler.load_state_dict({**scheduler.state_dict(),
                               "_step_count": state["scheduler"]["_step_count"]})
    return scheduler, changes
