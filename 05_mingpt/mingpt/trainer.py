"""The training loop: steps, gradient accumulation, mixed precision, evaluation, logs.

The Trainer knows nothing about GPT: it gets a wrapped model whose forward returns (logits,
loss), an optimizer, and datasets of (x, y) pairs. Every rank runs the same code; only global
rank 0 prints and writes TensorBoard logs. Its position in training (step, epoch, data position,
schedule, scaler, RNG streams) goes in and out through `state_dict()` and `load_state_dict()`.
"""
import random
import time
from collections.abc import Callable, Iterable
from itertools import islice

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

from mingpt import faults, forensics, savers
from mingpt.log import TrainLog, print0
from mingpt.optim import SCHEDULE_KEYS, base_lrs, build_scheduler, resume_scheduler
from mingpt.parallel import Layout, ddp, describe, runner
from mingpt.parallel.wrappers import data_parallel, local_devices, pipeline_stage, unwrap
from mingpt.precision import grad_scaler


def rank_indices(n: int, epoch: int, seed: int, start: int, rank: int, world_size: int
                 ) -> list[int]:
    """This rank's sample indices for the rest of `epoch`, from global position `start` on: the
    permutation every rank draws (seed + epoch), less the `start` samples trained on (by however
    many ranks ran then), dealt out as DistributedSampler does (the tail dropped). So a resume
    on another number of ranks trains each remaining sample exactly once."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))[start:]
    sampler = DistributedSampler(range(len(order)), num_replicas=world_size, rank=rank,
                                 shuffle=False, drop_last=True)
    return order[list(sampler)].tolist()


class DeviceHooks:
    """How the trainer meets its device, where devices differ. These defaults are CUDA's and
    the CPU's (main.py's); xla_main.py's XlaHooks subclass them for XLA devices."""

    # True: this process loads every data-parallel rank's rows, rank r's r-th in each batch
    # (XLA's SPMD: one process, one global batch); False: its own rank's only.
    feeds_every_rank = False
    # snapshot.save's `gather`: None, or weights gathered to the CPU first (XLA's shards).
    gather: Callable | None = None

    def data_parallel(self, model: torch.nn.Module) -> tuple[int, int]:
        """(rank, size) among the data-parallel ranks: the mesh's dp dimension."""
        return data_parallel(model)

    def evaluators(self, model: torch.nn.Module) -> tuple[int, int]:
        """(first, count): the data-parallel ranks first..first+count-1 split the validation
        sequences among themselves; here all of them (replica groups: each its own)."""
        return 0, self.data_parallel(model)[1]

    def memory_devices(self, model: torch.nn.Module, device: torch.device
                       ) -> list[torch.device]:
        """The devices whose peak memory the logs report (the CPU: the process's RSS)."""
        return local_devices(model, device)

    def to_device(self, loader: DataLoader) -> Iterable:
        """The batches as the runner gets them: on the host here (the runner moves each)."""
        return loader

    def step_end(self) -> None:
        """After the optimizer's step: nothing to do where every op runs as it is called."""


class NonFiniteLoss(ValueError):
    """The loss became nan or inf: training stops before the next snapshot could keep it."""


class Trainer:
    def __init__(self, cfg: DictConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 train_set: Dataset, val_set: Dataset, device: torch.device, run_dir: str,
                 snapshot_meta: dict, flops_per_token: float,
                 hooks: DeviceHooks | None = None) -> None:
        self.cfg, self.device, self.hooks = cfg, device, hooks or DeviceHooks()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.model, self.optimizer = model, optimizer
        self.runner = runner(model, device, cfg.precision)  # the layout's step (parallel.runner)
        self.dp_rank, self.dp_size = self.hooks.data_parallel(model)  # a TP group shares data
        self.eval_first, self.eval_size = self.hooks.evaluators(model)
        # The data-parallel ranks whose rows this process loads (XLA: all, in one batch).
        self.fed = range(self.dp_size) if self.hooks.feeds_every_rank else [self.dp_rank]
        # Dropout's random stream: one per data-parallel rank and pipeline stage (one seed would
        # correlate different layers' masks), shared within a TP or CP group (same activations:
        # other masks would drift apart the weights they hold alike).
        self.stream = self.dp_rank + self.dp_size * pipeline_stage(model)
        torch.manual_seed(cfg.seed + self.stream)
        # The layout the streams belong to ({"pp": 2, "dp": 2, ...}): a snapshot's are restored
        # rank by rank only under the same one.
        lay = getattr(unwrap(model), "layout", None)
        self.rng_layout = {**(lay.sizes() if isinstance(lay, Layout) else {}),
                           "data_parallel": self.dp_size, "world": self.world_size}
        self.train_set, self.val_set, self.snapshot_meta = train_set, val_set, snapshot_meta
        self.log = TrainLog(device, self.hooks.memory_devices(model, device), run_dir,
                            flops_per_token, cfg.precision, self.dp_size, cfg.profile_steps, model)
        self.scheduler = build_scheduler(optimizer, cfg)
        self.scaler = grad_scaler(device, cfg.precision)
        self.saver = savers.build(cfg, self.hooks.gather)  # blocking, or async_save's
        faults.install(self)  # only where a FAULT_* variable asks for one (faults.py)
        # An epoch must fill at least one optimizer step, or training would loop forever.
        per_rank, needed = len(train_set) // self.dp_size, cfg.batch_size * cfg.grad_accum_steps
        if per_rank < needed:
            raise ValueError(f"each rank gets {per_rank} samples per epoch ({len(train_set)} "
                             f"training samples / {self.dp_size} ranks); one step needs "
                             f"batch_size × grad_accum_steps = {cfg.batch_size} × "
                             f"{cfg.grad_accum_steps} = {needed}: lower them, or use more data "
                             "or fewer processes")
        # Validation: the same seeded sequences for any world size (rounded down to a multiple
        # of it), split across the ranks that evaluate together, so val losses of runs on
        # other world sizes, and of replica groups, compare.
        n_val = min(len(val_set), cfg.eval_batches * cfg.batch_size)
        n_val = max(1, n_val // self.dp_size) * self.dp_size
        chosen = torch.randperm(len(val_set), generator=torch.Generator().manual_seed(cfg.seed))
        self.val_subset = Subset(val_set, chosen[:n_val].tolist())
        # Position in training: the next step to run, and where in which epoch its data starts.
        self.step, self.epoch, self.samples_in_epoch = 0, 0, 0
        self.last_val: tuple[int, float] | None = None  # (step, loss) of the newest evaluation
        # The first step whose loss was nan or inf (0: none yet): on the device, no host sync.
        self.first_bad_step = torch.zeros((), dtype=torch.long, device=device)
        self.bar: tqdm | None = None  # the progress bar, while train() runs

    def state_dict(self) -> dict:
        """The trainer's position, to resume exactly: a collective (every rank's RNG states)."""
        rngs: list = [None] * self.world_size
        dist.all_gather_object(rngs, rng_state(self.device))
        return {
            "step": self.step,  # the next step to run
            "epoch": self.epoch,
            "samples_in_epoch": self.samples_in_epoch,  # over all ranks
            "world_size": self.world_size,
            "dp_size": self.dp_size,
            "rng_layout": self.rng_layout,  # the layout the RNG streams belong to
            "scheduler": self.scheduler.state_dict(),
            "base_lrs": base_lrs(self.optimizer),  # by kind: stages' groups differ
            "schedule": {key: self.cfg[key] for key in SCHEDULE_KEYS},
            "last_val": self.last_val,  # a resume at this step need not evaluate it again
            "scaler": self.scaler.state_dict(),
            "rng": rngs,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (as `state_dict()` gave it, on this or another world size)."""
        self._load_schedule(state)
        if state["scaler"] and self.scaler.is_enabled():  # empty when saved without fp16
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch = state["step"], state["epoch"]
        self.samples_in_epoch = state["samples_in_epoch"]
        self.last_val = state["last_val"]
        # Streams restored rank by rank only under the same layout (pp 2 x dp 2 -> dp 2 x tp 2
        # keeps world and dp sizes, but would give a TP group two stages' streams); without a
        # saved rng_layout, under the same world and dp sizes.
        saved = (len(state["rng"]), state.get("dp_size", len(state["rng"])))
        same = state["rng_layout"] == self.rng_layout if "rng_layout" in state else \
            saved == (self.world_size, self.dp_size)
        if same:
            set_rng_state(state["rng"][self.rank], self.device)  # our own streams
        else:  # new but reproducible streams, one per stream index (alike within a TP group)
            torch.manual_seed(self.cfg.seed + 1000 * self.step + self.stream)
            self.last_val = None  # evaluate the resharded weights once more, to show they load
            streams = "dropout draws from new random streams (the same within each " \
                "tensor-parallel group)"
            print0(f"snapshot saved by {saved[0]} ranks, now {self.world_size} (data-parallel "
                   f"size {saved[1]} then, {self.dp_size} now): the rest of the epoch is dealt "
                   f"out anew (each sample still once), {streams}"
                   if saved != (self.world_size, self.dp_size) else
                   f"snapshot saved under another layout: {streams}")
        # DDP's buckets as the uninterrupted run had them from its second step on (ddp.py).
        ddp.settle_buckets(self.model, self.train_set, self.device, self.cfg.precision,
                           self.cfg.batch_size)
        print0(f"resumed from {self.cfg.snapshot_path} at step {self.step} (epoch {self.epoch})")

    def _load_schedule(self, state: dict) -> None:
        """The lr schedule at the saved step; where the config changed it (max_steps, lr) or
        AdamW's betas or weight decay, training follows the new values and says so."""
        self.scheduler, changes = resume_scheduler(self.optimizer, self.cfg, state)
        adamw = state.get("optimizer_changes", [])  # betas, weight decay (snapshot.load)
        if changes or adamw:
            what = " and AdamW follow" if adamw else " follows"
            print0(f"resuming with {', '.join(changes + adamw)}: the lr schedule{what} the new "
                   f"values from step {self.scheduler.last_epoch} on (lr "
                   f"{self.scheduler.get_last_lr()[0]:.2e} now)")

    def _save_snapshot(self) -> None:
        # model_config and data_meta go along: enough to rebuild the model and decode its output.
        self.saver.save(self.model, self.optimizer, {**self.state_dict(), **self.snapshot_meta})
        if not self.cfg.async_save:  # (an asynchronous one says so once it is committed)
            print0(f"step {self.step}: snapshot saved to {self.cfg.snapshot_path}")

    def _run_batch(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One optimizer step over `grad_accum_steps` micro-batches."""
        for loss, tokens in self.runner.forward_backward(micro_batches, self.scaler,
                                                         self.log.timer.mark):
            self.log.add(loss, tokens // len(self.fed))  # tokens per data-parallel rank
            if self.cfg.precision != "fp16":  # fp16: GradScaler skips such a step by design
                bad = ~torch.isfinite(loss) & (self.first_bad_step == 0)
                self.first_bad_step = torch.where(bad, self.step + 1, self.first_bad_step)
        if self.cfg.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
            self.runner.clip_grad_norm(self.cfg.grad_clip)
        self.scaler.step(self.optimizer)  # fp16: skipped if gradients overflowed
        self.scaler.update()
        self.log.count_state(self.model, self.optimizer)  # before zero_grad frees gradients
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.hooks.step_end()  # XLA: the step's traced program runs here
        self.log.timer.end_step()  # the optimizer's part ends the step's breakdown

    def _run_epoch(self) -> None:
        """Optimizer steps over the rest of the current epoch, or until max_steps."""
        cfg = self.cfg
        batches = iter(self._loader(
            self.train_set, lambda r: rank_indices(len(self.train_set), self.epoch, cfg.seed,
                                                   self.samples_in_epoch, r, self.dp_size),
            drop_last=True, workers=cfg.data_loader_workers,
            seed=cfg.seed + self.epoch * 1000 + self.dp_rank))
        while self.step < cfg.max_steps:
            forensics.mark_step(self.step)  # which step a collective belongs to, for a dump
            self.log.timer.start()  # waiting for data is the step's first phase
            micro_batches = list(islice(batches, cfg.grad_accum_steps))
            if len(micro_batches) < cfg.grad_accum_steps:  # epoch used up
                self.epoch, self.samples_in_epoch = self.epoch + 1, 0
                return
            self.log.timer.mark("data")
            self._run_batch(micro_batches)
            self.step += 1
            self.samples_in_epoch += cfg.grad_accum_steps * cfg.batch_size * self.dp_size
            self._after_step()

    def _loader(self, dataset: Dataset, rows: Callable[[int], list[int]], drop_last: bool,
                workers: int, seed: int) -> Iterable:
        """Batches of `rows(r)`, the sample indices of data-parallel rank r, for each rank this
        process feeds (self.fed), on their way to the device (hooks.to_device)."""
        per_rank, b = [rows(r) for r in self.fed], self.cfg.batch_size
        n = min(map(len, per_rank))  # the same for every rank (DistributedSampler's deal)
        batches = [[i for own in per_rank for i in own[start:start + b]]
                   for start in range(0, n - b + 1 if drop_last else n, b)]
        return self.hooks.to_device(DataLoader(
            dataset, batch_sampler=batches, num_workers=workers,
            pin_memory=self.device.type == "cuda",
            # Its own generator: creating the iterator must not draw from the global RNG.
            generator=torch.Generator().manual_seed(seed)))

    def _after_step(self) -> None:
        cfg, step, last = self.cfg, self.step, self.step == self.cfg.max_steps
        self.bar.update(1)
        saving = (cfg.save_every and step % cfg.save_every == 0) or last
        if step % cfg.log_every == 0 or saving:
            self._stop_if_not_finite()  # before a log line shows nan or a snapshot keeps it
        if step % cfg.log_every == 0 or last:
            self.log.train_line(step, cfg.max_steps, self.scheduler.get_last_lr()[0])
        if (cfg.eval_every and step % cfg.eval_every == 0) or last:
            with self.log.paused("evaluation"):  # tokens/s measures training steps only
                self._log_eval()
        if saving:
            with self.log.paused("snapshots"):
                self._save_snapshot()

    def _stop_if_not_finite(self) -> None:
        """NonFiniteLoss if any rank's loss was nan or inf since training (re)started."""
        # The earliest bad step over all ranks; 0 (none) counts as "after the end" in the MIN.
        never = self.cfg.max_steps + 1
        first = torch.where(self.first_bad_step == 0, never, self.first_bad_step)
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        if first.item() != never:
            raise NonFiniteLoss(
                f"the loss became nan or inf at step {first.item()}: training stopped and saved "
                f"nothing after it ({self.cfg.snapshot_path} keeps the last good snapshot, if "
                "any); lower optimizer_config.lr or set trainer_config.grad_clip, then resume")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed validation sequences (the same ones every time)."""
        self.model.eval()  # dropout off
        # Evaluating must leave every RNG stream where it was (XLA's seed moves on with every
        # program), or a resumed run, which may evaluate elsewhere, would draw other masks.
        rng = rng_state(self.device)
        loader = self._loader(self.val_subset, lambda r: list(DistributedSampler(
            self.val_subset, self.eval_size, r - self.eval_first, shuffle=False)),
            drop_last=False, workers=0, seed=self.cfg.seed)
        totals = torch.zeros(2, device=self.device)  # loss sum over tokens, token count
        for x, y in loader:  # every rank runs the same number of batches (FSDP needs that)
            # A pipeline's last stage holds the sums, its other ranks zeros: counted once.
            totals += torch.stack(self.runner.evaluate(x.to(self.device), y.to(self.device),
                                                       self.cfg.batch_size))
        dist.all_reduce(totals)  # sums over ranks: the mean over every evaluated token
        self.model.train()
        loss = (totals[0] / totals[1]).item()
        set_rng_state(rng, self.device)
        return loss

    def _log_eval(self) -> None:
        loss = self.evaluate()
        self.log.val_line(self.step, loss)
        self.last_val = (self.step, loss)

    def train(self) -> float:
        """Train up to max_steps; returns the final validation loss."""
        cfg = self.cfg
        tokens = cfg.batch_size * cfg.grad_accum_steps * self.dp_size
        print0(f"training steps {self.step}..{cfg.max_steps}: {tokens} sequences per step "
               f"(batch_size {cfg.batch_size} x grad_accum_steps {cfg.grad_accum_steps} x "
               + (f"world size {self.world_size}" if self.dp_size == self.world_size else
                  f"{self.dp_size} devices of one process" if self.hooks.feeds_every_rank else
                  # torchft's replica groups (parallel/ft.py): ranks of every group read data
                  f"data-parallel size {self.dp_size} across replica groups, "
                  f"{self.world_size} processes each" if self.dp_size > self.world_size else
                  f"data-parallel size {self.dp_size}; {self.world_size // self.dp_size} "
                  f"processes per model replica: {describe(self.model)}")
               + f"), {len(self.train_set):,} training samples")
        started = time.perf_counter()
        if self.last_val is None or self.last_val[0] != self.step:
            # An untrained model, or a resumed one not evaluated at its step (else logged twice).
            with self.log.paused("evaluation"):
                self._log_eval()
        self.log.start_training()  # the peaks from here on are training's
        # A progress bar on rank 0 only, and only on a terminal (log files get the log lines).
        self.bar = tqdm(total=cfg.max_steps, initial=self.step, disable=True if self.rank
                        else None, dynamic_ncols=True, leave=False)
        try:
            while self.step < cfg.max_steps:
                self._run_epoch()
        except NonFiniteLoss:
            # Every rank stops here together (a collective check); a save in flight holds a step
            # checked finite: committed, so the message's "last good snapshot" is that one.
            with self.log.paused("snapshots"):
                self.saver.finish()
            raise
        with self.log.paused("snapshots"):  # an asynchronous save in flight: committed now
            self.saver.finish()
        self.bar.close()
        self.log.summary(time.perf_counter() - started, self.step)
        return self.last_val[1]


def rng_state(device: torch.device) -> dict:
    """This process's RNG states as tensors and plain types (so weights_only can load them)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if device.type == "xla":  # the devices' dropout stream (xla_main.py); imported only there
        import torch_xla.core.xla_model as xm
        state["xla"] = xm.get_rng_state(device)  # a seed: a plain int
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    if device.type == "xla" and "xla" in state:
        import torch_xla.core.xla_model as xm
        xm.set_rng_state(state["xla"], device)
