"""What the logs report, for every module: rank-0 printing, model FLOPs utilisation, memory.

    print0("only global rank 0 prints this")
    mfu(flops_per_token, tokens_per_s, peak_flops(gpu_name, "bf16"), devices=world_size)
    setup = peak_memory_mb(device); reset_peak_memory(device)  # then train: a training peak
    model_state_bytes(model, optimizer)  # this rank's parameters, gradients, optimizer state
"""
import contextlib
import os
import platform
import re
import resource
import sys
import time
from collections.abc import Iterator

import hydra
import omegaconf
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from mingpt.profiling import StepTimer, breakdown

# Dense peak FLOP/s per GPU and precision, from the vendors' datasheets: bf16/fp16 on tensor
# cores (fp32 accumulation), fp32 without TF32 (torch's default for fp32 matmuls). The pattern
# must match the whole of torch.cuda.get_device_name(): "NVIDIA L40" is not an L4 and
# "NVIDIA RTX A1000" not an A100. MFU = achieved model FLOP/s / this peak; none for other GPUs.
PEAK_FLOPS = (
    (r"NVIDIA H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    (r"NVIDIA H200 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}),
    (r"NVIDIA H100 80GB HBM3", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),  # SXM
    (r"NVIDIA H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    (r"NVIDIA H100 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}),
    (r"NVIDIA A100[- ](SXM4-(40|80)GB|PCIE-(40|80)GB|80GB PCIe)",
     {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    (r"NVIDIA L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}),
    (r"NVIDIA L40", {"bf16": 181e12, "fp16": 181e12, "fp32": 90.5e12}),
    (r"NVIDIA L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12}),
    (r"NVIDIA A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),
    (r"NVIDIA GeForce RTX 4090", {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12}),
    (r"Tesla V100-SXM2-(16|32)GB", {"fp16": 125e12, "fp32": 15.7e12}),  # no bf16 on a V100
)


def print0(message: str) -> None:
    """Print on global rank 0 only (tqdm.write keeps a progress bar intact)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        tqdm.write(message)
        sys.stdout.flush()


def peak_flops(name: str | None, precision: str) -> float | None:
    """Peak FLOP/s of the GPU called `name` at `precision`; None on a CPU (name None), on a GPU
    the table does not know, or at a precision it lacks."""
    if name is None:
        return None
    peaks = next((p for pattern, p in PEAK_FLOPS if re.fullmatch(pattern, name)), {})
    return peaks.get(precision)


def device_name(device: torch.device) -> str | None:
    """The GPU's name as CUDA reports it; None for a CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def reset_peak_memory(device: torch.device | list[torch.device]) -> None:
    """Start a new peak, so that training's peak is not the setup's (building, loading).

    CUDA: the allocator's counter, of each device given (nn.DataParallel drives several). CPU
    (Linux): writing 5 to /proc/self/clear_refs resets the kernel's high-water mark of the
    resident set (VmHWM) to the current RSS.
    Elsewhere the CPU peak stays the peak since the process started.
    """
    devices = device if isinstance(device, list) else [device]
    if devices[0].type == "cuda":
        for d in devices:  # the caching allocator's own counter: what tensors used
            torch.cuda.reset_peak_memory_stats(d)
        return
    try:
        # 5: "reset the peak resident set size" (man 5 proc); the process's own file, no root.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux (or /proc not mounted): the peak goes on from the process start


def _peak_rss_kib() -> int:
    """The process's peak resident set since the last reset, in KiB.

    Linux: VmHWM, the high-water mark that /proc/self/clear_refs resets. Not ru_maxrss: the
    kernel also folds the peak into it whenever a thread exits, and a reset cannot undo that.
    Elsewhere ru_maxrss (KiB on Linux, bytes on macOS) is all there is.
    """
    try:
        # "VmHWM:    123456 kB"
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        # macOS reports bytes, Linux KiB.
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss // 1024 if sys.platform == "darwin" else rss


def peak_memory_mb(device: torch.device | list[torch.device]) -> list[float]:
    """Peak memory since the last reset_peak_memory, one value per GPU of every rank (per rank
    on a CPU), a collective: CUDA allocations of each device given (nn.DataParallel drives
    several from one process), or peak RSS on a CPU (what the process touched; see README)."""
    devices = device if isinstance(device, list) else [device]
    if devices[0].type == "cuda":
        mb = [torch.cuda.max_memory_allocated(d) / 2**20 for d in devices]
    else:
        mb = [_peak_rss_kib() / 1024]
    # Every rank's values on every rank: rank 0 logs them all (one TensorBoard curve per GPU).
    mine = torch.tensor(mb, device=devices[0])
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return torch.cat(gathered).tolist()


def mfu(flops_per_token: float, tokens_per_s: float, peak: float, devices: int) -> float:
    """Model FLOPs utilisation: the model's FLOP/s over the peak of all `devices` that worked
    (every GPU of every rank: nn.DataParallel's one process drives several)."""
    return flops_per_token * tokens_per_s / (peak * devices)


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for `tensor`: a DTensor's numel() is the global size, its
    to_local() the rank's own shard."""
    if hasattr(tensor, "to_local"):  # a DTensor (FSDP, TP)
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def saved_activation_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """The bytes autograd keeps for backward in one forward of (x, y), counted from the tensors
    it saves: every storage once (views share one), parameters left out (Linear layers save
    their weight: model state, not activations). model_size.py predicts these."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}  # storage address -> bytes

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    # Every tensor autograd saves passes through pack, including a custom Function's own.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)
    return sum(kept.values())


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                      ) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state, counted from the
    tensors it holds (local shards), not from a formula: model_size.py predicts these.

    Gradients count only while they exist (between backward and zero_grad). ZeRO's optimizer
    keeps the state of this rank's parameters in its local optimizer (`.optim`).
    """
    local_optimizer = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) \
        else optimizer
    # DDP and FSDP wrap the model: their parameters() are the ones the optimizer updates.
    params = list(model.parameters())  # each tied tensor once
    return {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        # AdamW: exp_avg and exp_avg_sq (each the parameter's size) and a scalar step.
        "optimizer": sum(local_bytes(v) for state in local_optimizer.state.values()
                         for v in state.values() if isinstance(v, torch.Tensor)),
    }


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
    evaluating and saving; every rank's memory at the end. Global rank 0 prints and writes.

        log = TrainLog(device, devices, run_dir, flops_per_token, precision, dp_size)
        log.add(loss, tokens)              # every micro-step: on the device, no host sync
        log.timer.mark("forward")          # where the step's time goes (profiling.StepTimer)
        log.train_line(step, max_steps, lr)     # every log_every steps (one all-reduce)
        with log.paused("evaluation"): ...      # not counted in tokens/s
    """

    def __init__(self, device: torch.device, devices: list[torch.device], run_dir: str,
                 flops_per_token: float, precision: str, dp_size: int,
                 profile_steps: int = 0) -> None:
        self.device, self.devices, self.dp_size = device, devices, dp_size
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
        # Memory: this rank's model-state bytes (counted once, at the first step's end, when
        # gradients and optimizer state exist) and every rank's setup peak (start_training).
        self.model_state: dict[str, int] | None = None
        self.setup_peak_mb: list[float] = []
        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard")) \
            if dist.get_rank() == 0 else None

    def add(self, loss: torch.Tensor, tokens: int) -> None:
        """One micro-step's loss (a device tensor: no host sync) and its tokens."""
        self.loss_sum += loss.detach().float()
        self.loss_count += 1
        self.tokens += tokens

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
        print0(" | ".join(filter(None, [line, f"peak memory {max(memory):,.0f} MB",
                                        breakdown(phases)])))
        if self.writer:
            self.writer.add_scalar("train/loss", loss, step)
            self.writer.add_scalar("train/lr", lr, step)
            self.writer.add_scalar("perf/tokens_per_s", tokens_per_s, step)
            if peak:
                self.writer.add_scalar("perf/mfu", utilisation, step)
            for r, mb in enumerate(memory):
                self.writer.add_scalar(f"memory/peak_mb_rank{r}", mb, step)
            for phase, ms in phases.items():
                self.writer.add_scalar(f"time/{phase}_ms", ms, step)
        self.loss_sum.zero_()
        self.loss_count, self.tokens = 0, 0
        self.t_log = time.perf_counter()

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
        print0("memory per rank (MB; peaks: " + ("CUDA allocated, per GPU"
                                                 if self.device.type == "cuda"
                                                 else "resident set size") + "):")
        for name, values in rows.items():
            print0(f"  {name:<14}" + "".join(f"{v:>12,.1f}" for v in values))
        if self.writer:
            for r, mb in enumerate(self.setup_peak_mb):
                self.writer.add_scalar(f"memory/setup_peak_mb_rank{r}", mb, step)
            self.writer.close()
