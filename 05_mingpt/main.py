"""Train a GPT with DDP or FSDP on one CPU, one GPU, or many nodes; configured by hydra.

    python main.py                                          # one process (CPU or one GPU)
    torchrun --standalone --nproc_per_node=4 main.py        # 4 processes: 4 GPUs, or 4 on a CPU
    python main.py trainer_config.distributed_method=fsdp trainer_config.precision=bf16
    python main.py --cfg job ...                            # print the config, train nothing
    python launch.py                                        # torchrun, one process per GPU

Every key of gpt2_train_cfg.yaml can be overridden as `section.key=value`. Each run writes
into runs/<run_name>/ (config.yaml, TensorBoard logs, snapshot); a relaunch with the same
run_name resumes from its snapshot.
"""
import gc
import os
import platform
import re
import sys
import tempfile
import traceback
import warnings
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import hydra
import omegaconf
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh

from mingpt import config, errors, snapshot
from mingpt.data import data_module
from mingpt.devices import backend_for, pick_device
from mingpt.errors import fail
from mingpt.metrics import print0
from mingpt.model import GPT, GPTConfig
from mingpt.optim import build_optimizer
from mingpt.parallel import parallelize
from mingpt.parallel.common import data_parallel, unwrap
from mingpt.parallel.fsdp import init_sharded
from mingpt.trainer import NonFiniteLoss, Trainer
from sample import generate_text

USAGE = """usage: python main.py [--cfg job] [section.key=value ...]

Overrides change any key of gpt2_train_cfg.yaml (e.g. trainer_config.max_steps=2000);
data_config=NAME picks data_config/NAME.yaml. --cfg job prints the composed config and exits.
"""


def ddp_setup(requested: str, cpu_offload: bool = False) -> torch.device:
    """Join the process group: torchrun's when launched by it, else a group of one."""
    device = pick_device(int(os.environ.get("LOCAL_RANK", 0)), requested)
    if device.type == "cuda":
        # Before init_process_group: NCCL binds each process to the current GPU.
        torch.cuda.set_device(device)
    # CPU offload keeps FSDP's gradients in CPU memory: they need gloo beside NCCL.
    backend = backend_for(device, cpu_tensors_too=cpu_offload)
    if "RANK" in os.environ:  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        dist.init_process_group(backend)
    else:
        # `python main.py`: a one-process group (an in-memory store, no port), so DDP and
        # FSDP run exactly the code they run under torchrun.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def print_versions(device: torch.device) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print0(f"torch {torch.__version__} | python {platform.python_version()} | hydra "
           f"{hydra.__version__} | omegaconf {omegaconf.__version__}")
    print0(f"device {device} ({name or 'cpu'}) | backend {dist.get_backend()} | world size "
           f"{dist.get_world_size()}")


def build_local(cfg: DictConfig, device: torch.device) -> tuple:
    """Data and the plain model, from this node's own files; ValueError for bad data or config."""
    data = data_module(cfg.data_config.name)
    train_set, val_set, meta = data.build_datasets(cfg.data_config, cfg.gpt_config.block_size,
                                                   cfg.trainer_config.seed)
    # The vocabulary (and block size) come from the data, the rest from gpt_config.
    settings = OmegaConf.to_container(cfg.gpt_config, resolve=True)
    init_from = settings.pop("init_from", None)
    if init_from:  # GPT-2 weights: transformers is imported only for them
        from mingpt import pretrained
        gpt_config = pretrained.gpt_config_from(init_from, settings, meta["vocab_size"],
                                                meta["block_size"], cfg.data_config.name)
    else:
        gpt_config = GPTConfig(**{**settings, "vocab_size": meta["vocab_size"],
                                  "block_size": meta["block_size"]})
    t = cfg.trainer_config
    # FSDP without pretrained weights: build on the meta device (shapes, no memory), shard,
    # then give each rank storage for its shards only and draw the weights into them
    # (init_sharded), so no rank ever holds the whole model. The pretrained weights are
    # copied into a whole model first (pretrained.load_pretrained), so init_from does not.
    on_meta = t.distributed_method == "fsdp" and not init_from
    # The same seed on every rank: FSDP shards each rank's own copy of the initial weights,
    # so all copies must be equal (DDP would broadcast rank 0's, FSDP does not).
    torch.manual_seed(t.seed)
    with torch.device("meta") if on_meta else nullcontext():
        model = GPT(gpt_config)
    if not on_meta:
        model = model.to(device)
    if init_from and not has_snapshot(t.snapshot_path):
        # Into the plain model, before wrapping: every rank reads the whole checkpoint (on the
        # CPU) and copies it in; FSDP then keeps each rank's shards (README: FSDP and memory).
        # Not on a resume: the snapshot replaces every weight, and reading GPT-2's (on every
        # rank: 6 GB for gpt2-xl, and transformers' model code) would only delay the restart.
        pretrained.load_pretrained(model, init_from)
        print0(f"weights from {init_from}")
    return data, train_set, val_set, meta, model, on_meta


def load_train_objs(cfg: DictConfig, device: torch.device) -> tuple:
    """Data, model (wrapped for DDP/FSDP) and optimizer; ValueError for bad data or config."""
    # Each node reads its own files: every rank hears of any rank's failure before the first
    # collective (DDP's broadcast, FSDP's sharding), instead of waiting in it (errors.py).
    data, train_set, val_set, meta, model, on_meta = errors.agreed(build_local, cfg, device)
    t = cfg.trainer_config
    print0(f"model: {model.num_params():,} parameters ({model.config.n_layer} layers, "
           f"{model.config.n_head} heads, {model.config.n_embd} wide, vocab "
           f"{model.config.vocab_size}, block {model.config.block_size})")
    snapshot_meta = {"model_config": asdict(model.config), "data_meta": meta}
    flops_per_token = model.flops_per_token()
    model = parallelize(model, device, t.distributed_method, precision=t.precision,
                        cpu_offload=t.cpu_offload, compile=t.compile, tp_size=t.tp_size,
                        activation_checkpointing=t.activation_checkpointing)
    if on_meta:  # the weights GPT(gpt_config) would have drawn, bit for bit, in shards
        init_sharded(model, device, t.cpu_offload)
    # Built after wrapping: FSDP has replaced every parameter with its sharded version.
    o = cfg.optimizer_config
    optimizer = build_optimizer(model, t.distributed_method, o.lr, o.betas, o.weight_decay)
    # From here on each rank draws its own dropout masks (a resume restores these streams),
    # except that one tensor-parallel group's ranks draw the same: they hold the same activations.
    torch.manual_seed(cfg.trainer_config.seed + data_parallel(model)[0])
    return model, optimizer, train_set, val_set, data, snapshot_meta, flops_per_token


def has_snapshot(url: str) -> bool:
    """A committed snapshot is there to resume from (snapshot.load reads and checks it later,
    on every rank; a foreign or unreadable one is refused there, never trained over)."""
    with warnings.catch_warnings():  # an interrupted first save: load says so, once
        warnings.simplefilter("ignore")
        return snapshot.snapshot_kind(url) is not None


def save_config(cfg: DictConfig) -> None:
    """runs/<run_name>/config.yaml, the resolved config of this run, from global rank 0 only."""
    if dist.get_rank() == 0:
        os.makedirs(cfg.run_dir, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.run_dir, "config.yaml"))


def train(cfg: DictConfig, device: torch.device) -> str | None:
    """Build, resume and train; the message of a data, config or snapshot error, else None.

    Everything that holds the process group (DDP or FSDP, the optimizer, the trainer) lives in
    this frame only, so it is gone once this returns, on either path (see release_group)."""
    print_versions(device)
    print0(OmegaConf.to_yaml(cfg).rstrip())
    try:
        model, optimizer, train_set, val_set, data, snapshot_meta, flops = \
            load_train_objs(cfg, device)
        save_config(cfg)  # only now: a run refused for its data or model leaves no folder
        trainer = Trainer(cfg.trainer_config, model, optimizer, train_set, val_set, device,
                          cfg.run_dir, snapshot_meta, flops)
        # Every rank reads the snapshot, if there is one (only rank 0 ever writes files).
        t = cfg.trainer_config
        state = snapshot.load(t.snapshot_path, t.distributed_method, model, optimizer,
                              snapshot_meta, data.MATCH_KEYS)
        if state is not None:
            trainer.load_state_dict(state)
    except ValueError as e:  # bad data, model config, or an unusable snapshot
        return str(e)  # the text only: the exception's traceback would keep this frame alive
    try:
        val_loss = trainer.train()
    except NonFiniteLoss as e:  # stopped before a snapshot could keep nan weights
        return str(e)
    # A save failed: the disk filled up, or the folder became read-only. DCP (the sharded
    # layouts) raises CheckpointException, a BaseException that holds each rank's error.
    except (OSError, CheckpointException) as e:
        if not any(Path(frame.filename) == Path(snapshot.__file__)
                   for frame in traceback.extract_tb(e.__traceback__)):
            raise  # not a save (a data file gone, say): unexpected, so with its traceback
        error = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
        reason = error.strerror if isinstance(error, OSError) and error.strerror else \
            (str(error).strip().splitlines() or [type(error).__name__])[0]
        # snapshot.py commits by a rename (file) or by rewriting `latest` (directory) only once
        # everything is written, so the snapshot from before, if any, is intact.
        url = cfg.trainer_config.snapshot_path
        # A local disk fills up; an object store's own line already says what to check.
        fix = "free some space" if "://" not in url else "fix what it says"
        return (f"cannot save the snapshot to {url} ({reason}); the previous snapshot, if any, "
                f"is unchanged: {fix} or set trainer_config.snapshot_path, then run again to "
                "resume")
    print0(f"final val loss {val_loss:.4f} (run dir {cfg.run_dir})")
    meta = snapshot_meta["data_meta"]
    if data.TEXT and cfg.trainer_config.sample_tokens:
        # Every rank generates (FSDP needs all of them for each forward); rank 0 prints.
        # A newline: any BPE encodes it, a char vocabulary may lack it.
        prompt = "\n" if "\n" in meta.get("itos", "\n") else meta["itos"][0]
        text = generate_text(unwrap(model), meta, prompt, cfg.trainer_config.sample_tokens,
                             temperature=0.8, top_k=10, device=device)
        print0(f"sample:\n{text.strip()}")
    return None


def release_group() -> None:
    """Drop every reference to the process group, then destroy it.

    destroy_process_group joins gloo's worker threads only when it drops the group's last
    reference, and a worker still freeing a collective's tensors as Python exits aborts the
    finished run. train() has returned, so DDP or FSDP are unreachable; FSDP's modules form
    reference cycles (freed by gc.collect), and torch's DTensor caches keep every DeviceMesh,
    whose registry holds the group, alive after the model is gone."""
    # (type(), not isinstance: gc also finds dead weakref proxies, which isinstance reads)
    for mesh in [o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)]:
        getattr(mesh, "_pg_registry", {}).clear()  # private: the mesh's own group references
    gc.collect()
    dist.destroy_process_group()


def group_error(error: Exception) -> str:
    """torchrun's worker could not open the store at MASTER_ADDR:MASTER_PORT, as one line."""
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    # torch's bind failure spells out port, IPv6 flag and errno: its last words say it all.
    first = re.sub(r"^.*name: (\w+), message: ", r"\1: ", first)
    # Rank 0 binds MASTER_PORT (EADDRINUSE: another program has it); other ranks connect to it
    # (refused or timed out: rank 0's node is unreachable from here, a firewall, a wrong host).
    return (f"cannot start the process group at MASTER_ADDR:MASTER_PORT {where} ({first}); "
            "free that port or give torchrun another --rdzv-endpoint / --master-port, and let "
            "every node reach that host and port")


def check_writable(url: str) -> None:
    """ValueError (one line) unless a local snapshot_path can be written: found before training
    rather than at the first save, hours in. (s3:// is checked by its first save.)"""
    if "://" in url:
        return
    folder = os.path.dirname(os.path.abspath(url))
    while not os.path.exists(folder):  # the run directory is created later, by rank 0
        folder = os.path.dirname(folder)
    try:
        # A real file rather than os.access: root passes every permission check but still
        # cannot write to a read-only filesystem.
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ValueError(f"trainer_config.snapshot_path {url} cannot be written ({folder}: "
                         f"{e.strerror or e}); set trainer_config.snapshot_path to a writable "
                         "path") from None


def run(cfg: DictConfig) -> None:
    try:
        device = ddp_setup(cfg.trainer_config.device, cfg.trainer_config.cpu_offload)
    except ValueError as e:
        fail(e)
    except (dist.DistNetworkError, dist.DistStoreError) as e:  # no traceback for a busy port
        fail(group_error(e))
    try:
        try:  # each node's own disk: every rank hears of it, before any work (errors.agreed)
            errors.agreed(check_writable, cfg.trainer_config.snapshot_path)
        except ValueError as e:
            error = str(e)
        else:
            error = train(cfg, device)
    finally:
        release_group()
    if error is not None:
        fail(error)


def main(argv: list[str]) -> None:
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE)
        return
    show = argv[:2] == ["--cfg", "job"]
    overrides = argv[2:] if show else argv
    options = [arg for arg in overrides if arg.startswith("-")]
    try:
        if options:
            raise ValueError(f"unknown option {options[0]}; main.py takes key=value overrides, "
                             "--cfg job or --help")
        cfg = config.load(overrides)  # composed and checked once, before anything is created
    except ValueError as e:
        fail(e)
    if show:
        print(OmegaConf.to_yaml(cfg).rstrip())
        return
    run(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
