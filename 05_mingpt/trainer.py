"""The training loop: steps, gradient accumulation, mixed precision, evaluation, logs, snapshots.

The Trainer knows nothing about GPT: it gets a wrapped model whose forward returns
(logits, loss), an optimizer, and datasets of (x, y) pairs. Every rank runs the same code;
only global rank 0 prints, writes TensorBoard logs and writes (non-sharded) snapshot files.
"""
import math
import os
import resource
import signal
import sys
import time
from functools import partial
from itertools import islice

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

import snapshot
from parallelize import DTYPES, set_grad_sync, unwrap

# Dense bf16 peak FLOP/s per GPU, matched against torch.cuda.get_device_name() in this order
# (more specific names first). MFU = achieved model FLOP/s / this peak.
PEAK_FLOPS = (
    ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12),
    ("L40S", 362e12), ("L4", 121e12), ("A10", 125e12), ("RTX 4090", 165e12),
    ("V100", 125e12),  # fp16: V100 has no bf16
)


def print0(message: str) -> None:
    """Print on global rank 0 only (tqdm.write keeps a progress bar intact)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        tqdm.write(message)
        sys.stdout.flush()


def peak_flops(device: torch.device) -> float | None:
    """This GPU's peak FLOP/s from the table; None on the CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS if key in name), None)


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base lr at `step`: linear warmup, then cosine decay to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps  # never 0: the first step already learns a little
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def inject_fault(step: int) -> None:
    """FAULT_AT_STEP=N: the last rank SIGKILLs itself before step N, on torchrun's first attempt.

    A demo and test hook for torchrun's restarts: TORCHELASTIC_RESTART_COUNT is 0 only on the
    first attempt, so the restarted workers resume from the snapshot and get past step N.
    """
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    last_rank = dist.get_rank() == dist.get_world_size() - 1
    if first_attempt and last_rank and os.environ.get("FAULT_AT_STEP") == str(step):
        print(f"[rank {dist.get_rank()}] FAULT_AT_STEP={step}: killing this worker", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class Trainer:
    def __init__(self, cfg: DictConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 train_set: Dataset, val_set: Dataset, device: torch.device, run_dir: str,
                 snapshot_meta: dict, flops_per_token: float) -> None:
        self.cfg, self.device = cfg, device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.model, self.optimizer = model, optimizer
        self.train_set, self.val_set = train_set, val_set
        self.snapshot_meta, self.flops_per_token = snapshot_meta, flops_per_token
        self.scheduler = LambdaLR(optimizer, partial(
            lr_factor, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps,
            min_lr_ratio=cfg.min_lr_ratio))
        # fp16 needs loss scaling (its small gradients underflow); the scaler is a no-op
        # otherwise. The device's own type: GradScaler("cuda") turns itself off on a CPU.
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
        # Same seed on every rank: the samplers agree on one permutation and each rank takes
        # its own slice of it (rank, rank + world_size, ...).
        self.train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed,
                                                drop_last=True)
        # Validation: the same seeded choice of eval_batches * batch_size sequences for any
        # world size (rounded down to a multiple of it), split evenly across the ranks, so val
        # losses of runs on different numbers of processes compare.
        n_val = min(len(val_set), cfg.eval_batches * cfg.batch_size)
        n_val = max(1, n_val // self.world_size) * self.world_size
        chosen = torch.randperm(len(val_set), generator=torch.Generator().manual_seed(cfg.seed))
        self.val_subset = Subset(val_set, chosen[:n_val].tolist())
        self.val_sampler = DistributedSampler(self.val_subset, shuffle=False)
        # Position in training: the next step to run, and where in which epoch its data starts.
        self.step, self.epoch, self.samples_in_epoch = 0, 0, 0
        # The train loss is summed on the device and synced once per log interval.
        self.loss_sum = torch.zeros((), device=device)
        self.loss_count, self.tokens_since_log = 0, 0
        kind = snapshot.snapshot_kind(cfg.snapshot_path)
        if kind is not None:  # every rank reads the snapshot (only rank 0 ever writes one)
            self._load_snapshot(kind)
        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard")) if self.rank == 0 \
            else None

    def _autocast(self) -> torch.autocast:
        # Matmuls run in bf16/fp16, precision-sensitive ops (softmax, losses) stay in fp32.
        return torch.autocast(self.device.type, dtype=DTYPES[self.cfg.precision],
                              enabled=self.cfg.precision != "fp32")

    def _load_snapshot(self, kind: str) -> None:
        path, method = self.cfg.snapshot_path, self.cfg.distributed_method
        if kind != method:
            raise snapshot.SnapshotError(f"{path} holds a {kind} snapshot, but distributed_method"
                                         f"={method}; use {kind} or another snapshot_path")
        state = snapshot.load_train_state(path, kind, self.device)
        # Before touching any weights: a different model is an error, never a silent restart.
        snapshot.check_compatible(state, **self.snapshot_meta, url=path)
        if kind == "ddp":
            unwrap(self.model).load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            snapshot.load_sharded(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"] and self.scaler.is_enabled():  # empty when saved without fp16
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch = state["step"], state["epoch"]
        self.samples_in_epoch = state["samples_in_epoch"]
        if len(state["rng"]) == self.world_size:
            snapshot.set_rng_state(state["rng"][self.rank], self.device)  # our own streams
        else:  # a different number of ranks: new (but still reproducible) dropout streams
            torch.manual_seed(self.cfg.seed + 1000 * self.step + self.rank)
            print0(f"snapshot saved by {len(state['rng'])} ranks, now {self.world_size}: the "
                   "data position carries over, dropout draws from new random streams")
        print0(f"resumed from {path} at step {self.step} (epoch {self.epoch})")

    def _save_snapshot(self) -> None:
        # Every rank's RNG state goes into the snapshot, so every rank resumes its own stream.
        rngs: list = [None] * self.world_size
        dist.all_gather_object(rngs, snapshot.rng_state(self.device))
        state = {
            "step": self.step,  # the next step to run
            "epoch": self.epoch,
            "samples_in_epoch": self.samples_in_epoch,  # over all ranks
            "world_size": self.world_size,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rngs,
            **self.snapshot_meta,  # model_config and data_meta: enough to rebuild and decode
        }
        if self.cfg.distributed_method == "fsdp":
            snapshot.save_sharded(self.cfg.snapshot_path, self.step, self.model, self.optimizer,
                                  state)
        elif self.rank == 0:  # DDP: every rank holds the same weights, one writer is enough
            state["model"] = unwrap(self.model).state_dict()  # without DDP's "module." prefix
            state["optimizer"] = self.optimizer.state_dict()
            snapshot.save_file(self.cfg.snapshot_path, state)
        print0(f"step {self.step}: snapshot saved to {self.cfg.snapshot_path}")

    def _run_batch(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One optimizer step over `grad_accum_steps` micro-batches."""
        n = len(micro_batches)
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            # Gradients are all-reduced only in the last micro-step's backward; the others
            # just accumulate locally.
            with set_grad_sync(self.model, sync=i == n - 1):
                with self._autocast():
                    _, loss = self.model(x, y)
                self.scaler.scale(loss / n).backward()  # mean over the micro-steps
            self.loss_sum += loss.detach().float()
            self.loss_count += 1
            self.tokens_since_log += x.numel()
        if self.cfg.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
            # Works on FSDP's sharded (DTensor) gradients too: the norm covers all shards.
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.optimizer)  # fp16: skipped if gradients overflowed
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _run_epoch(self) -> None:
        """Optimizer steps over the rest of the current epoch, or until max_steps."""
        cfg = self.cfg
        # A new shuffle each epoch: the sampler seeds its permutation with (seed + epoch).
        self.train_sampler.set_epoch(self.epoch)
        # The samples of this epoch before samples_in_epoch were all trained on (ranks take
        # interleaved slices of one permutation), so this rank skips its share of them.
        indices = list(self.train_sampler)[self.samples_in_epoch // self.world_size:]
        loader = DataLoader(
            self.train_set, batch_size=cfg.batch_size, sampler=indices, drop_last=True,
            num_workers=cfg.data_loader_workers, pin_memory=self.device.type == "cuda",
            # Its own generator: creating the iterator must not draw from the global RNG.
            generator=torch.Generator().manual_seed(cfg.seed + self.epoch * 1000 + self.rank))
        batches = iter(loader)
        while self.step < cfg.max_steps:
            micro_batches = list(islice(batches, cfg.grad_accum_steps))
            if len(micro_batches) < cfg.grad_accum_steps:  # epoch used up
                self.epoch, self.samples_in_epoch = self.epoch + 1, 0
                return
            inject_fault(self.step)
            self._run_batch(micro_batches)
            self.step += 1
            self.samples_in_epoch += cfg.grad_accum_steps * cfg.batch_size * self.world_size
            self._after_step()

    def _after_step(self) -> None:
        cfg, step, last = self.cfg, self.step, self.step == self.cfg.max_steps
        self.bar.update(1)
        if step % cfg.log_every == 0 or last:
            self._log_train()
        paused = time.perf_counter()
        if (cfg.eval_every and step % cfg.eval_every == 0) or last:
            self._log_eval()
        if (cfg.save_every and step % cfg.save_every == 0) or last:
            self._save_snapshot()
        self.t_log += time.perf_counter() - paused  # tokens/s measures training steps only

    def _peak_memory_mb(self) -> list[float]:
        """Peak memory of every rank: CUDA allocations, or the process's peak RSS on a CPU."""
        if self.device.type == "cuda":
            mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        gathered = [torch.zeros(1, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(gathered, torch.tensor([mb], device=self.device))
        return [t.item() for t in gathered]

    def _log_train(self) -> None:
        # Each rank saw different data: sum losses and counts over all ranks, then average.
        totals = torch.stack([self.loss_sum, torch.tensor(float(self.loss_count),
                                                          device=self.device)])
        dist.all_reduce(totals)  # the one host sync of the train loss per log interval
        loss = (totals[0] / totals[1]).item()
        elapsed = time.perf_counter() - self.t_log
        tokens_per_s = self.tokens_since_log * self.world_size / elapsed
        memory = self._peak_memory_mb()
        lr = self.scheduler.get_last_lr()[0]
        line = (f"step {self.step}/{self.cfg.max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
                f"{tokens_per_s:,.0f} tokens/s")
        peak = peak_flops(self.device)
        if peak:
            mfu = self.flops_per_token * tokens_per_s / (peak * self.world_size)
            line += f" | MFU {100 * mfu:.1f}%"
        print0(line + f" | peak memory {max(memory):,.0f} MB")
        if self.writer:
            self.writer.add_scalar("train/loss", loss, self.step)
            self.writer.add_scalar("train/lr", lr, self.step)
            self.writer.add_scalar("perf/tokens_per_s", tokens_per_s, self.step)
            if peak:
                self.writer.add_scalar("perf/mfu", mfu, self.step)
            for r, mb in enumerate(memory):
                self.writer.add_scalar(f"memory/peak_mb_rank{r}", mb, self.step)
        self.loss_sum.zero_()
        self.loss_count, self.tokens_since_log = 0, 0
        self.t_log = time.perf_counter()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed validation sequences (the same ones every time)."""
        self.model.eval()  # dropout off
        loader = DataLoader(self.val_subset, batch_size=self.cfg.batch_size,
                            sampler=self.val_sampler,
                            generator=torch.Generator().manual_seed(self.cfg.seed))
        totals = torch.zeros(2, device=self.device)  # loss sum over tokens, token count
        for x, y in loader:  # every rank runs the same number of batches (FSDP needs that)
            x, y = x.to(self.device), y.to(self.device)
            with self._autocast():
                _, loss = self.model(x, y)
            totals += torch.stack([loss.float() * y.numel(), torch.tensor(y.numel(),
                                                                          device=self.device)])
        dist.all_reduce(totals)  # sums over ranks: the mean over every evaluated token
        self.model.train()
        return (totals[0] / totals[1]).item()

    def _log_eval(self) -> float:
        loss = self.evaluate()
        print0(f"step {self.step} | val loss {loss:.4f}")
        self.last_val_loss = loss
        if self.writer:
            self.writer.add_scalar("val/loss", loss, self.step)
            self.writer.flush()
        return loss

    def train(self) -> float:
        """Train up to max_steps; returns the final validation loss."""
        cfg = self.cfg
        tokens = cfg.batch_size * cfg.grad_accum_steps * self.world_size
        print0(f"training steps {self.step}..{cfg.max_steps}: {tokens} sequences per step "
               f"(batch_size {cfg.batch_size} x grad_accum_steps {cfg.grad_accum_steps} x world "
               f"size {self.world_size}), {len(self.train_set):,} training samples")
        self._log_eval()  # where we start from: an untrained model, or the resumed one
        # A progress bar on rank 0 only, and only on a terminal (log files get the log lines).
        self.bar = tqdm(total=cfg.max_steps, initial=self.step, disable=True if self.rank
                        else None, dynamic_ncols=True, leave=False)
        self.t_log = time.perf_counter()
        while self.step < cfg.max_steps:
            self._run_epoch()
        self.bar.close()
        if self.writer:
            self.writer.close()
        return self.last_val_loss
