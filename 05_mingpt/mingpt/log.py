"""What the logs report: print0 (rank 0 only), the versions line, TrainLog's lines and scalars."""
import contextlib
import os
import platform
import sys
import time
from collections.abc import Iterator

import hydra
import omegaconf
import torch
import torch.distributed as dist
from tqdm import tqdm

from mingpt.memory import model_state_bytes, peak_memory_mb, reset_peak_memory
from mingpt.mfu import device_name, mfu, peak_flops
from mingpt.model import MoE
from mingpt.profiling import StepTimer, breakdown


def print0(message: str) -> None:
    """Print on global rank 0 only (tqdm.write keeps a progress bar intact)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        tqdm.write(message)
        sys.stdout.flush()


def print_versions(device: torch.device) -> None:
    """The library versions, the device and the world size, first in every log."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print0(f"torch {torch.__version__} | python {platform.python_version()} | hydra "
           f"{hydra.__version__} | omegaconf {omegaconf.__version__}")
    print0(f"device {device} ({name or 'cpu'}) | backend {dist.get_backend()} | world size "
           f"{dist.get_world_size()}")


class TrainLog:
    """The trainer's log lines and TensorBoard scalars: train loss (all-reduced over ranks),
    lr, tokens/s, MFU and peak memory per interval; validation losses; the time spent
    evaluating and saving; every rank's memory at the end. Global rank 0 prints and writes."""

    def __init__(self, device: torch.device, devices: list[torch.device], run_dir: str,
                 flops_per_token: float, precision: str, dp_size: int,
                 profile_steps: int = 0, model: torch.nn.Module | None = None) -> None:
        self.device, self.devices, self.dp_size = device, devices, dp_size
        # A mixture of experts: this rank's MoE layers (a pipeline stage: its own blocks'),
        # their load-balancing loss and tokens per expert, summed over the interval.
        self.moe = [m for m in model.modules() if isinstance(m, MoE)] if model else []
        self.aux_sum = torch.zeros((), device=device)
        self.expert_tokens: torch.Tensor | None = None  # (layers, experts)
        # Time per phase of a step (this rank's), and a profile of profile_steps steps.
        self.timer = StepTimer(device, profile_steps, run_dir)
        self.flops_per_token, self.precision = flops_per_token, precision
        self.world_size = dist.get_world_size()
        # The train loss is summed on the device and synced once per log interval.
        self.loss_sum = torch.zeros((), device=device)
        self.loss_count, self.tokens = 0, 0
        self.t_log = time.perf_counter()  # start of the current log interval
        # Seconds spent evaluating and saving snapshots (summary() reports their share).
        self.paused_s = {"evaluation": 0.0, "snapshots": 0.0}
        # Memory: this rank's model-state bytes (counted once, when gradients and optimizer
        # state exist) and every rank's setup peak (start_training).
        self.model_state: dict[str, int] | None = None
        self.setup_peak_mb: list[float] = []
        self.writer = None  # TensorBoard's, on rank 0 only: the other ranks never import it
        if dist.get_rank() == 0:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415
            self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def add(self, loss: torch.Tensor, tokens: int) -> None:
        """One micro-step's loss (a device tensor: no host sync) and its tokens."""
        self.loss_sum += loss.detach().float()
        self.loss_count += 1
        self.tokens += tokens
        if self.moe and self.moe[0].aux_loss is not None:
            # The layers' mean balancing loss (a device tensor: summed there, no sync) and
            # the rows each expert of each layer got (host lists: MoE.route synced them).
            self.aux_sum += torch.stack([m.aux_loss.detach() for m in self.moe]).mean()
            counts = torch.tensor([m.counts for m in self.moe])  # (layers, experts)
            self.expert_tokens = counts if self.expert_tokens is None \
                else self.expert_tokens + counts

    def count_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """This rank's parameter, gradient and optimizer bytes, once (call before zero_grad)."""
        if self.model_state is None:
            self.model_state = model_state_bytes(model, optimizer)

    @contextlib.contextmanager
    def paused(self, name: str) -> Iterator[None]:
        """Time spent on `name` (evaluation, snapshots): reported, and not in tokens/s."""
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.paused_s[name] += seconds
            self.t_log += seconds

    def start_training(self) -> None:
        """The peak so far is the setup's (model, snapshot, first evaluation); from here on the
        peaks logged are training's, so DDP and FSDP compare on what training needs."""
        self.setup_peak_mb = peak_memory_mb(self.devices)
        reset_peak_memory(self.devices)
        self.t_log = time.perf_counter()

    def train_line(self, step: int, max_steps: int, lr: float) -> None:
        # Each rank saw different data: sum losses and counts over all ranks, then average.
        totals = torch.stack([self.loss_sum, torch.tensor(float(self.loss_count),
                                                          device=self.device)])
        dist.all_reduce(totals)  # the one host sync of the train loss per log interval
        loss = (totals[0] / totals[1]).item()
        elapsed = time.perf_counter() - self.t_log
        tokens_per_s = self.tokens * self.dp_size / elapsed  # TP ranks share their tokens
        memory = peak_memory_mb(self.devices)
        line = (f"step {step}/{max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
                f"{tokens_per_s:,.0f} tokens/s")
        peak = peak_flops(device_name(self.device), self.precision)
        if peak:
            utilisation = mfu(self.flops_per_token, tokens_per_s, peak,
                              self.world_size * len(self.devices))
            line += f" | MFU {100 * utilisation:.1f}%"
        phases = self.timer.report()  # rank 0's own; on a GPU, waits for its events
        experts = self._experts_line()
        print0(" | ".join(filter(None, [line, experts, f"peak memory {max(memory):,.0f} MB",
                                        breakdown(phases)])))
        if self.writer:
            scalars = {"train/loss": loss, "train/lr": lr, "perf/tokens_per_s": tokens_per_s}
            if peak:
                scalars["perf/mfu"] = utilisation
            scalars |= {f"memory/peak_mb_rank{r}": mb for r, mb in enumerate(memory)}
            scalars |= {f"time/{phase}_ms": ms for phase, ms in phases.items()}
            if experts:
                scalars |= {f"experts/{name}": v for name, v in self.expert_values.items()}
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, step)
        self.aux_sum.zero_()
        self.expert_tokens = None
        self.loss_sum.zero_()
        self.loss_count, self.tokens = 0, 0
        self.t_log = time.perf_counter()

    def _experts_line(self) -> str:
        """`aux 1.012 | tokens/expert 28-61`: the interval's mean load-balancing loss (1: even)
        and the fewest and most tokens any expert of any layer got per micro-step, as global
        rank 0 routed them (its own tokens and layers: no collective)."""
        if self.expert_tokens is None or not self.loss_count:
            return ""
        # Per micro-step; the extremes over every layer and expert show one starved or swamped.
        per_step = self.expert_tokens / self.loss_count  # (layers, experts)
        v = self.expert_values = {"aux_loss": self.aux_sum.item() / self.loss_count,
                                  "tokens_min": per_step.min().item(),
                                  "tokens_max": per_step.max().item()}
        return (f"aux {v['aux_loss']:.3f} | tokens/expert "
                f"{v['tokens_min']:.0f}-{v['tokens_max']:.0f}")

    def val_line(self, step: int, loss: float) -> None:
        print0(f"step {step} | val loss {loss:.4f}")
        if self.writer:
            self.writer.add_scalar("val/loss", loss, step)
            self.writer.flush()

    def summary(self, total: float, step: int) -> None:
        """The time in training and its pauses; every rank's memory, one column each (MB)."""
        self.timer.close()
        print0(f"{total:.1f} s in training: " + ", ".join(
            f"{name} {seconds:.1f} s ({100 * seconds / total:.1f}%)"
            for name, seconds in self.paused_s.items()))
        states: list = [None] * self.world_size
        dist.all_gather_object(states, self.model_state)  # None where no step ran
        rows = {"setup peak": self.setup_peak_mb, "training peak": peak_memory_mb(self.devices)}
        for key in ("parameters", "gradients", "optimizer"):
            rows[key] = [s[key] / 2**20 if s else 0.0 for s in states]
        kind = "CUDA allocated, per GPU" if self.device.type == "cuda" else "resident set size"
        print0(f"memory per rank (MB; peaks: {kind}):")
        for name, values in rows.items():
            print0(f"  {name:<14}" + "".join(f"{v:>12,.1f}" for v in values))
        if self.writer:
            for r, mb in enumerate(self.setup_peak_mb):
                self.writer.add_scalar(f"memory/setup_peak_mb_rank{r}", mb, step)
            self.writer.close()
