"""Train 05's GPT on XLA devices (TPU, Trainium, or CPU devices) with SPMD FSDP, model unchanged.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python xla_main.py         # 4 XLA CPU devices (CI)
    PJRT_DEVICE=TPU python xla_main.py trainer_config.precision=bf16   # every chip of a TPU VM
    python xla_main.py --cfg job ...                             # print the config, train nothing

One process drives every XLA device (SPMD: torch_xla's recommended way to scale, and the only
one that works on CPU devices, where multi-process all-reduce times out). The parameters are
sharded over a 1-D mesh of all devices (SpmdFullyShardedDataParallel), each global batch is
split along the batch dimension, and XLA's compiler inserts the all-gathers and
reduce-scatters. The config is gpt2_train_cfg.yaml with the same overrides as main.py; the
snapshot is the ddp layout's one file (weights gathered to the CPU), so sample.py reads it.
Needs the environment of requirements-xla.txt (XLA.md).
"""
import os
import platform
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from mingpt import config, snapshot, storage
from mingpt.data import data_module
from mingpt.errors import fail, require
from mingpt.model import GPT
from mingpt.optim import build_optimizer, build_scheduler, resume_scheduler
from mingpt.trainer import rank_indices
from sample import generate_text

# XLA's C++ warns once per compiled program that GSPMD is to be replaced by Shardy (JAX's
# partitioner; torch_xla 2.9 has no switch to it): errors only, unless asked otherwise. It
# reads the variable as it loads, so before the import.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.distributed.parallel_loader as pl  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
from torch_xla.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel,
    _prepare_spmd_partition_spec,
)

USAGE = """usage: python xla_main.py [--cfg job] [section.key=value ...]

The keys of gpt2_train_cfg.yaml, as for main.py; PJRT_DEVICE picks the XLA device (CPU, TPU,
NEURON), CPU_NUM_DEVICES the number of CPU devices. --cfg job prints the config and exits.
"""
METHOD = "fsdp"  # the only strategy here: SPMD FSDP over every device


def autocast(precision: str) -> torch.autocast | nullcontext:
    """bf16 matmuls under XLA's autocast (TPUs and Trainium compute bf16 natively; XLA's CPU
    backend emulates it); fp32: no autocast at all (XLA's only takes bf16 and warns otherwise)."""
    return torch.autocast("xla", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


def check_xla(cfg: DictConfig) -> None:
    """ValueError (one line) for settings only main.py's torch.distributed strategies have."""
    t = cfg.trainer_config
    require(t.distributed_method == METHOD, "trainer_config.distributed_method",
            f"{METHOD} with xla_main.py (SPMD FSDP over every XLA device)", t.distributed_method)
    require(t.device == "auto", "trainer_config.device",
            "auto with xla_main.py (PJRT_DEVICE picks the XLA device)", t.device)
    # fp16 needs a loss scaler, which this loop does not have; bf16 (what TPUs and Trainium
    # compute fast) needs none.
    require(t.precision in ("fp32", "bf16"), "trainer_config.precision",
            "fp32 or bf16 with xla_main.py", t.precision)
    for key, why in (("cpu_offload", "FSDP2's option"), ("compile", "XLA compiles every step"),
                     ("activation_checkpointing", "main.py's option")):
        require(not t[key], f"trainer_config.{key}", f"False with xla_main.py ({why})", t[key])


def load_config(overrides: list[str]) -> DictConfig:
    """main.py's config, with distributed_method=fsdp unless given (and then it must be)."""
    if not any(o.startswith("trainer_config.distributed_method=") for o in overrides):
        overrides = [*overrides, f"trainer_config.distributed_method={METHOD}"]
    cfg = config.load(overrides)
    check_xla(cfg)
    return cfg


def make_mesh() -> xs.Mesh:
    """A 1-D mesh named "fsdp" over every XLA device this process drives."""
    xr.use_spmd()  # before any tensor is on the device: one program for all devices
    n = xr.global_runtime_device_count()
    return xs.Mesh(np.arange(n), (n,), ("fsdp",))


def shard_logits(output: tuple, mesh: xs.Mesh) -> None:
    """The logits (B, T, vocab) split along the batch, as the inputs are: the FSDP pattern
    (SpmdFullyShardedDataParallel's default does the same, with a warning for tuples)."""
    xs.mark_sharding(output[0], mesh, ("fsdp", None, None))


def build(cfg: DictConfig, mesh: xs.Mesh, device: torch.device) -> tuple:
    """Data, the sharded model, AdamW, the schedule and the snapshot's state (None: fresh)."""
    t = cfg.trainer_config
    data = data_module(cfg.data_config.name)
    train_set, val_set, meta = data.build_datasets(cfg.data_config, cfg.gpt_config.block_size,
                                                   t.seed)
    gpt_config, init_from = config.model_config(cfg, meta)
    torch.manual_seed(t.seed)  # the initial weights main.py draws, on the CPU
    model = GPT(gpt_config)
    if init_from and not snapshot.committed(t.snapshot_path):
        from mingpt import pretrained  # transformers only for GPT-2's weights
        pretrained.load_pretrained(model, init_from)
    snapshot_meta = {"model_config": asdict(model.config), "data_meta": meta}
    state = load_snapshot(t.snapshot_path, model, snapshot_meta, data.MATCH_KEYS)
    to_device_keeping_ties(model, device)
    # Shards every parameter along its largest dimension over the mesh: each device keeps 1/n
    # of the weights (and of AdamW's state, which takes each parameter's sharding).
    model = SpmdFullyShardedDataParallel(model, mesh=mesh, shard_output=shard_logits)
    o = cfg.optimizer_config
    optimizer = build_optimizer(model, METHOD, o.lr, o.betas, o.weight_decay)
    if state is None:
        scheduler = build_scheduler(optimizer, t)
        xm.set_rng_state(t.seed, device)  # dropout's stream on the device
    else:
        optimizer.load_state_dict(state.pop("optimizer"))
        shard_like_params(optimizer, mesh)
        scheduler, changes = resume_scheduler(optimizer, t, state)
        if changes:
            print(f"resuming with {', '.join(changes)}: the lr schedule follows the new values")
        xm.set_rng_state(state["xla_rng"], device)
        print(f"resumed from {t.snapshot_path} at step {state['step']} (epoch {state['epoch']})")
    return data, train_set, val_set, model, optimizer, scheduler, snapshot_meta, state


def to_device_keeping_ties(model: torch.nn.Module, device: torch.device) -> None:
    """model.to(device), and every parameter that two modules shared shared again.

    A CPU tensor cannot become an XLA tensor in place, so `to` gives each module a new
    Parameter of its own: the tied wte/lm_head weight became two (measured: the embedding's
    gradient then misses the head's, and the loss leaves eager CPU's from the second step on).
    """
    holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, name))
    model.to(device)
    for places in holders.values():
        first = getattr(*places[0])
        for module, name in places[1:]:
            setattr(module, name, first)


def load_snapshot(url: str, model: GPT, meta: dict, match_keys: tuple) -> dict | None:
    """A ddp-layout snapshot file into the CPU model; the rest of its state, or None."""
    kind = snapshot.snapshot_kind(url)
    if kind is None:
        return None
    if kind != "ddp":
        raise snapshot.SnapshotError(f"{url} holds a {kind} snapshot; xla_main.py reads the ddp "
                                     "layout's one file: use another snapshot_path")
    state = snapshot.load_file(url)  # weights_only=True, on the CPU
    snapshot.check_compatible(state, meta["model_config"], meta["data_meta"], url, match_keys)
    if "xla_rng" not in state:
        raise snapshot.SnapshotError(f"{url} was saved by main.py, not xla_main.py; use another "
                                     "snapshot_path")
    model.load_state_dict(state.pop("model"))
    return state


def shard_like_params(optimizer: torch.optim.Optimizer, mesh: xs.Mesh) -> None:
    """AdamW's loaded moments arrive whole on every device: shard each as its parameter is."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for value in optimizer.state[p].values():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and p.dim():
                    xs.mark_sharding(value, mesh, _prepare_spmd_partition_spec(
                        value, shard_maximal=True))


def to_cpu(tree: object, seen: dict) -> object:
    """Every XLA tensor in nested dicts and lists copied to the CPU, whole: the transfer of a
    sharded tensor gathers its shards. A tensor met twice (the tied wte/lm_head weight) gets
    one copy, so the file stores it once, as main.py's does."""
    if isinstance(tree, torch.Tensor):
        if id(tree) not in seen:
            seen[id(tree)] = tree.detach().cpu()
        return seen[id(tree)]
    if isinstance(tree, dict):
        return {key: to_cpu(value, seen) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_cpu(value, seen) for value in tree)
    return tree


def train_batches(train_set: Dataset, epoch: int, start: int, n: int, cfg: DictConfig
                  ) -> list[list[int]]:
    """The rest of `epoch`'s global batches: device d's rows are what main.py's rank d would
    train on with n ranks (trainer.rank_indices), so a step trains on the same sequences."""
    per_device = [rank_indices(len(train_set), epoch, cfg.seed, start, d, n) for d in range(n)]
    b = cfg.batch_size
    return [[i for rows in per_device for i in rows[k * b:(k + 1) * b]]
            for k in range(len(per_device[0]) // b)]


def val_batches(val_set: Dataset, n: int, cfg: DictConfig) -> tuple[Subset, list[list[int]]]:
    """The trainer's validation sequences for n ranks, as global batches (device d's rows
    are rank d's): the same seeded choice main.py makes, so val losses compare."""
    n_val = min(len(val_set), cfg.eval_batches * cfg.batch_size)
    n_val = max(1, n_val // n) * n
    chosen = torch.randperm(len(val_set), generator=torch.Generator().manual_seed(cfg.seed))
    subset = Subset(val_set, chosen[:n_val].tolist())
    per_device = [list(DistributedSampler(subset, n, d, shuffle=False)) for d in range(n)]
    b = cfg.batch_size
    return subset, [[i for rows in per_device for i in rows[k:k + b]]
                    for k in range(0, len(per_device[0]), b)]


class XlaTrainer:
    """The loop of mingpt/trainer.py for one SPMD process: steps, accumulation, logs,
    evaluation and snapshots. Host syncs only where a number is printed or saved."""

    def __init__(self, cfg: DictConfig, built: tuple, mesh: xs.Mesh, device: torch.device,
                 run_dir: str) -> None:
        (self.data, self.train_set, self.val_set, self.model, self.optimizer, self.scheduler,
         self.snapshot_meta, state) = built
        self.cfg, self.mesh, self.device, self.n = cfg, mesh, device, int(mesh.size())
        # Inputs land on the devices already split along the batch (device d: rows of d).
        self.input_sharding = xs.ShardingSpec(mesh, ("fsdp", None))
        self.val_subset, self.val_order = val_batches(self.val_set, self.n, cfg)
        self.step, self.epoch, self.samples_in_epoch = 0, 0, 0
        self.last_val: tuple[int, float] | None = None
        if state is not None:
            self.step, self.epoch = state["step"], state["epoch"]
            self.samples_in_epoch, self.last_val = state["samples_in_epoch"], state["last_val"]
        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        self.loss_sum = torch.zeros((), device=device)  # summed on the device, read per log
        self.loss_count, self.t_log = 0, time.perf_counter()
        self.block_size = self.train_set[0][0].numel()  # tokens per sequence

    def loader(self, dataset: Dataset, batches: list[list[int]]) -> pl.MpDeviceLoader:
        """Global batches moved to the devices in the background, each split along the batch."""
        return pl.MpDeviceLoader(
            DataLoader(dataset, batch_sampler=batches, num_workers=self.cfg.data_loader_workers),
            self.device, input_sharding=self.input_sharding)

    def run_batch(self, micro_batches: list) -> None:
        """One optimizer step over grad_accum_steps micro-batches, then one compiled program."""
        n = len(micro_batches)
        for x, y in micro_batches:
            with autocast(self.cfg.precision):
                _, loss = self.model(x, y)
            (loss / n).backward()  # mean over the micro-steps
            self.loss_sum += loss.detach().float()
            self.loss_count += 1
        if self.cfg.grad_clip > 0:  # the norm over all shards: XLA reduces it
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        # Everything traced since the last sync becomes one XLA program, compiled on the first
        # step and reused after (the lr is a device scalar, not a constant: no recompiles).
        torch_xla.sync()

    def run_epoch(self) -> None:
        cfg = self.cfg
        batches = iter(self.loader(self.train_set, train_batches(
            self.train_set, self.epoch, self.samples_in_epoch, self.n, cfg)))
        while self.step < cfg.max_steps:
            micro = [b for _, b in zip(range(cfg.grad_accum_steps), batches, strict=False)]
            if len(micro) < cfg.grad_accum_steps:  # epoch used up
                self.epoch, self.samples_in_epoch = self.epoch + 1, 0
                return
            self.run_batch(micro)
            self.step += 1
            self.samples_in_epoch += cfg.grad_accum_steps * cfg.batch_size * self.n
            self.after_step()

    def after_step(self) -> None:
        cfg, step, last = self.cfg, self.step, self.step == self.cfg.max_steps
        if step % cfg.log_every == 0 or last:
            self.train_line()
        if (cfg.eval_every and step % cfg.eval_every == 0) or last:
            self.log_eval()
        if (cfg.save_every and step % cfg.save_every == 0) or last:
            self.save()

    def train_line(self) -> None:
        loss = (self.loss_sum / self.loss_count).item()  # the host sync of the train loss
        if not np.isfinite(loss):
            raise ValueError(f"the loss became nan or inf by step {self.step}: training "
                             f"stopped and saved nothing after it; lower optimizer_config.lr")
        tokens = self.loss_count * self.cfg.batch_size * self.n * self.block_size
        lr = self.scheduler.get_last_lr()[0]
        print(f"step {self.step}/{self.cfg.max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
              f"{tokens / (time.perf_counter() - self.t_log):,.0f} tokens/s", flush=True)
        self.writer.add_scalar("train/loss", loss, self.step)
        self.writer.add_scalar("train/lr", lr, self.step)
        self.loss_sum.zero_()
        self.loss_count, self.t_log = 0, time.perf_counter()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed validation sequences, weighted by their tokens."""
        self.model.eval()
        totals = torch.zeros(2, device=self.device)  # loss sum over tokens, token count
        for x, y in self.loader(self.val_subset, self.val_order):
            with autocast(self.cfg.precision):
                _, loss = self.model(x, y)
            totals += torch.stack([loss.float() * y.numel(),
                                   torch.tensor(float(y.numel()), device=self.device)])
            torch_xla.sync()  # one program per batch, not one graph of every batch
        self.model.train()
        return (totals[0] / totals[1]).item()

    def log_eval(self) -> None:
        started = time.perf_counter()
        # Every sync (each batch here) advances the device's RNG seed: evaluating must not, or
        # a resumed run, which evaluates where the saved one did not, would draw other dropout.
        rng = xm.get_rng_state(self.device)
        loss = self.evaluate()
        xm.set_rng_state(rng, self.device)
        print(f"step {self.step} | val loss {loss:.4f}", flush=True)
        self.writer.add_scalar("val/loss", loss, self.step)
        self.writer.flush()
        self.last_val = (self.step, loss)
        self.t_log += time.perf_counter() - started  # tokens/s measures training only

    def weights(self) -> dict:
        """The whole model's weights on the CPU (keep_vars: the tied weight is one tensor)."""
        return to_cpu(self.model.module.state_dict(keep_vars=True), {})

    def save(self) -> None:
        """The ddp layout: one file, written atomically by this process, the only writer."""
        started = time.perf_counter()
        cfg = self.cfg
        state = {
            "step": self.step, "epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch,
            "world_size": 1, "dp_size": self.n,  # one process; n devices see different data
            "scheduler": self.scheduler.state_dict(),
            "schedule": {key: cfg[key] for key in ("max_steps", "warmup_steps", "min_lr_ratio")},
            "last_val": self.last_val, "scaler": {},
            "rng": [snapshot.rng_state(torch.device("cpu"))],
            "xla_rng": xm.get_rng_state(self.device),  # dropout's stream on the devices
            "model": self.weights(), "optimizer": to_cpu(self.optimizer.state_dict(), {}),
            **self.snapshot_meta}
        try:
            snapshot.keep_previous(cfg.snapshot_path, cfg.keep_last)
            snapshot.save_file(cfg.snapshot_path, state)  # atomic: complete, or not there
        except OSError as e:  # a full disk, a read-only folder: main.py's one line
            raise snapshot.SaveError(f"cannot save the snapshot to {cfg.snapshot_path} "
                                     f"({e.strerror or e}); the previous snapshot, if any, is "
                                     "unchanged: free some space or set "
                                     "trainer_config.snapshot_path, then run again to resume"
                                     ) from None
        print(f"step {self.step}: snapshot saved to {cfg.snapshot_path}", flush=True)
        self.t_log += time.perf_counter() - started

    def train(self) -> float:
        cfg = self.cfg
        sequences = cfg.batch_size * cfg.grad_accum_steps * self.n
        print(f"training steps {self.step}..{cfg.max_steps}: {sequences} sequences per step "
              f"(batch_size {cfg.batch_size} x grad_accum_steps "
              f"{cfg.grad_accum_steps} x {self.n} devices), {len(self.train_set):,} training "
              "samples", flush=True)
        if self.last_val is None or self.last_val[0] != self.step:
            self.log_eval()
        self.t_log = time.perf_counter()
        while self.step < cfg.max_steps:
            self.run_epoch()
        self.writer.close()
        return self.last_val[1]


def sharding_report(model: torch.nn.Module, n: int) -> str:
    """How many parameters are split over the n devices, from XLA's own sharding specs."""
    params = list(model.parameters())
    sharded = sum(1 for p in params if torch_xla._XLAC._get_xla_sharding_spec(p)
                  not in ("", "{replicated}"))
    return f"{sharded} of {len(params)} parameter tensors sharded over {n} devices"


def train(cfg: DictConfig) -> None:
    # SpmdFullyShardedDataParallel puts an optimization barrier in the model's backward through
    # a full backward hook; torch warns that the model's inputs (token ids) need no gradient,
    # which is true and harmless, at every backward.
    warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
    mesh = make_mesh()
    device = torch_xla.device()
    print(f"torch {torch.__version__} | torch_xla {torch_xla.__version__} | python "
          f"{platform.python_version()}")
    print(f"XLA device {xr.device_type()} x {mesh.size()} (SPMD mesh {mesh.mesh_shape} "
          f"{mesh.axis_names}) | precision {cfg.trainer_config.precision}")
    print(OmegaConf.to_yaml(cfg).rstrip())
    storage.check_writable(cfg.trainer_config.snapshot_path)
    built = build(cfg, mesh, device)
    model = built[3]
    print(f"model: {model.describe()} | {sharding_report(model, mesh.size())}")
    os.makedirs(cfg.run_dir, exist_ok=True)  # one process: the only writer of the run dir
    OmegaConf.save(cfg, os.path.join(cfg.run_dir, "config.yaml"))
    trainer = XlaTrainer(cfg.trainer_config, built, mesh, device, cfg.run_dir)
    val_loss = trainer.train()
    print(f"final val loss {val_loss:.4f} (run dir {cfg.run_dir})")
    meta = built[6]["data_meta"]
    tokens = cfg.trainer_config.sample_tokens
    if trainer.data.TEXT and tokens:
        # On the CPU, from the gathered weights: token-by-token generation changes shapes at
        # every step, which on XLA would compile a new program per token.
        plain = GPT(model.module.config)
        plain.load_state_dict(trainer.weights())
        prompt = "\n" if "\n" in meta.get("itos", "\n") else meta["itos"][0]
        text = generate_text(plain, meta, prompt, tokens, temperature=0.8, top_k=10,
                             device=torch.device("cpu"))
        print(f"sample:\n{text.strip()}")


def main(argv: list[str]) -> None:
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE)
        return
    try:
        show, overrides = config.command_line(argv, "xla_main.py")
        cfg = load_config(overrides)
        if show:
            print(OmegaConf.to_yaml(cfg).rstrip())
            return
        train(cfg)
    except (ValueError, snapshot.SaveError) as e:  # config, data, snapshot, a non-finite loss
        fail(e)


if __name__ == "__main__":
    main(sys.argv[1:])
