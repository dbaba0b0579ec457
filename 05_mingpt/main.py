"""Train a GPT on one CPU, one GPU, or many nodes, with any layout of mingpt.parallel.

    python main.py                                          # one process (CPU or one GPU)
    torchrun --standalone --nproc_per_node=4 main.py        # 4 processes: 4 GPUs, or 4 on a CPU
    python main.py trainer_config.distributed_method=fsdp trainer_config.precision=bf16
    python main.py --cfg job ...                            # print the config, train nothing
    python launch.py                                        # torchrun, one process per GPU

Every key of gpt2_train_cfg.yaml can be overridden as `section.key=value`. Each run writes
into runs/<run_name>/ (config.yaml, TensorBoard logs, snapshot); a relaunch with the same
run_name resumes from its snapshot.
"""
import sys
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

import sample
from mingpt import config, distributed, errors, forensics, profiling, snapshot, storage
from mingpt.data import data_module
from mingpt.errors import fail
from mingpt.log import print0, print_versions
from mingpt.model import GPT
from mingpt.optim import build_optimizer
from mingpt.parallel import Settings, fsdp, ft, parallelize
from mingpt.pretrained import load_pretrained
from mingpt.trainer import NonFiniteLoss, Trainer

USAGE = """usage: python main.py [--cfg job] [section.key=value ...]

Overrides change any key of gpt2_train_cfg.yaml (e.g. trainer_config.max_steps=2000);
data_config=NAME picks data_config/NAME.yaml. --cfg job prints the composed config and exits.
"""


def build_local(cfg: DictConfig, device: torch.device) -> tuple:
    """Data and the plain model, from this node's own files; ValueError for bad data or config."""
    data = data_module(cfg.data_config.name)
    train_set, val_set, meta = data.build_datasets(cfg.data_config, cfg.gpt_config.block_size,
                                                   cfg.trainer_config.seed)
    gpt_config, init_from = config.model_config(cfg, meta)
    t = cfg.trainer_config
    # fsdp: built on the meta device, each rank then draws only its own shards (init_sharded)
    on_meta = fsdp.builds_on_meta(t.distributed_method, t.tp_size, t.pp_size, init_from)
    # One seed on every rank: FSDP shards each rank's own copy (DDP broadcasts rank 0's).
    torch.manual_seed(t.seed)
    with torch.device("meta") if on_meta else nullcontext():
        model = GPT(gpt_config)
    if not on_meta:
        model = model.to(device)
    if init_from and not snapshot.committed(t.snapshot_path):  # a resume has its weights
        # Into the plain model, before wrapping: FSDP then keeps each rank's shards.
        load_pretrained(model, init_from)
        print0(f"weights from {init_from}")
    return data, train_set, val_set, meta, model, fsdp.init_sharded if on_meta else None


def load_train_objs(cfg: DictConfig, device: torch.device) -> tuple:
    """Data, model (wrapped for DDP/FSDP) and optimizer; ValueError for bad data or config."""
    # Each node reads its own files: every rank hears of any rank's failure before the first
    # collective (DDP's broadcast, FSDP's sharding), instead of waiting in it (errors.py).
    data, train_set, val_set, meta, model, init = errors.together(build_local, cfg, device)
    t = cfg.trainer_config
    print0(f"model: {model.describe()}")
    # What a resume must match: the model, the data, and the optimizer (its state's kind).
    snapshot_meta = {"model_config": asdict(model.config), "data_meta": meta,
                     "optimizer_name": cfg.optimizer_config.name}
    flops_per_token = model.flops_per_token()
    # The layout: the flavour and every Settings key (degrees, precision, ...) of trainer_config.
    model = parallelize(model, device, t.distributed_method,
                        **{key: t[key] for key in Settings._fields})
    if init:  # the weights GPT(gpt_config) would have drawn, bit for bit, in shards
        init(model, device, t.cpu_offload)
    o = cfg.optimizer_config  # the optimizer after wrapping: FSDP replaced the parameters
    optimizer = build_optimizer(model, t.distributed_method, o.lr, o.betas, o.weight_decay,
                                o.name, o.muon_lr)
    if t.ft_replicas:  # replica groups (torchft): gradients averaged over those alive
        optimizer = ft.Replicas(cfg, model, optimizer, device).optimizer
    return model, optimizer, train_set, val_set, data, snapshot_meta, flops_per_token


def train(cfg: DictConfig, device: torch.device) -> str | None:
    """Build, resume and train; the message of a data, config or snapshot error, else None.

    Everything that holds the process group (DDP or FSDP, the optimizer, the trainer) lives in
    this frame only, so it is gone once this returns, on either path (distributed.release)."""
    print_versions(device)  # and the config: a log says what ran
    print0(OmegaConf.to_yaml(cfg).rstrip())
    try:
        model, optimizer, train_set, val_set, data, snapshot_meta, flops = \
            load_train_objs(cfg, device)
        replicas = ft.replicas_of(optimizer)  # None unless trainer_config.ft_replicas
        config.save(cfg)  # only now: a run refused for its data or model leaves no folder
        forensics.arm(cfg.run_dir)  # the run folder exists: a stopped rank dumps its trace
        trainer = Trainer(cfg.trainer_config, model, optimizer, train_set, val_set, device,
                          cfg.run_dir, snapshot_meta, flops,
                          replicas.hooks if replicas is not None else None)
        # Every rank reads the snapshot, if there is one (only rank 0 ever writes files).
        t = cfg.trainer_config
        state = snapshot.load(t.snapshot_path, model, optimizer, snapshot_meta, data.MATCH_KEYS)
        if state is not None:
            trainer.load_state_dict(state)
        if replicas is not None:  # the first step's quorum: a peer's state replaces ours
            replicas.start(trainer)
    except ValueError as e:  # bad data, model config, or an unusable snapshot
        return str(e)  # the text only: the exception's traceback would keep this frame alive
    try:
        with profiling.memory_history(t.memory_snapshot, cfg.run_dir, device):
            val_loss = trainer.train()
        if replicas is not None:
            replicas.shutdown()
    # A nan loss stops before a snapshot keeps it; a save fails (a full disk, say) in one line.
    except (NonFiniteLoss, errors.SaveError) as e:
        return str(e)
    print0(f"final val loss {val_loss:.4f} (run dir {cfg.run_dir})")
    if data.TEXT and cfg.trainer_config.sample_tokens:  # a few tokens, printed by rank 0
        sample.after_training(cfg, model, snapshot_meta["data_meta"], device)
    return None


def run(cfg: DictConfig) -> None:
    try:
        t = cfg.trainer_config
        # (DCP's asynchronous save plans over a CPU backend: gloo beside NCCL, as offloading)
        device = distributed.setup(t.device, t.cpu_offload or t.async_save,
                                   t.collective_timeout_s, cfg.run_dir,
                                   t.flight_recorder_entries)
    except ValueError as e:
        fail(e)
    except (dist.DistNetworkError, dist.DistStoreError) as e:  # no traceback for a busy port
        fail(distributed.group_error(e))
    try:
        try:  # each node's own disk: every rank hears of it, before any work (errors.together)
            errors.together(storage.check_writable, cfg.trainer_config.snapshot_path)
        except ValueError as e:
            error = str(e)
        else:
            # A collective that fails (times out) is one line naming every rank's trace.
            error = forensics.watch(train, cfg.run_dir, cfg, device)
    finally:
        distributed.release()
    if error is not None:
        fail(error)


def main(argv: list[str]) -> None:
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE)
        return
    try:
        show, overrides = config.command_line(argv, "main.py")
        cfg = config.load(overrides)  # composed and checked once, before anything is created
        if show:
            print(OmegaConf.to_yaml(cfg).rstrip())
            return
        if cfg.trainer_config.dry_run:  # plan N ranks in this process on a fake group, and
            from mingpt import dry_run  # noqa: PLC0415 (train nothing; imported only here)
            dry_run.run(cfg)
            return
    except ValueError as e:
        fail(e)
    run(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
