"""Train 05's GPT on XLA devices (TPU, Trainium, or CPU devices) with SPMD FSDP, model unchanged.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python xla_main.py         # 4 XLA CPU devices (CI)
    PJRT_DEVICE=TPU python xla_main.py trainer_config.precision=bf16   # every chip of a TPU VM
    python xla_main.py --cfg job ...                             # print the config, train nothing

One process drives every XLA device (SPMD), the parameters sharded over all of them
(mingpt/xla.py); main.py's config, Trainer and snapshot format, with XLA's hooks (XLA.md).
"""
import platform
import sys
from dataclasses import asdict

import torch
from omegaconf import DictConfig, OmegaConf

from mingpt import config, distributed, errors, shards, snapshot, storage
from mingpt.data import data_module
from mingpt.errors import fail, require
from mingpt.model import GPT
from mingpt.optim import build_optimizer
from mingpt.trainer import Trainer
from mingpt.xla import XlaHooks, load_optimizer, make_mesh, shard, torch_xla, xr, xs
from sample import generate_text

USAGE = """usage: python xla_main.py [--cfg job] [section.key=value ...]

The keys of gpt2_train_cfg.yaml, as for main.py; PJRT_DEVICE picks the XLA device (CPU, TPU,
NEURON), CPU_NUM_DEVICES the number of CPU devices. --cfg job prints the config and exits.
"""
METHOD = "fsdp"  # the only layout here: SPMD FSDP over every device


def load_config(overrides: list[str]) -> DictConfig:
    """main.py's config, with distributed_method=fsdp and AdamW unless given; ValueError (one
    line) for settings only main.py's torch.distributed layouts have."""
    for key, value in (("trainer_config.distributed_method", METHOD),
                       ("optimizer_config.name", "adamw")):
        if not any(o.startswith(f"{key}=") for o in overrides):
            overrides = [*overrides, f"{key}={value}"]
    cfg = config.load(overrides)
    t = cfg.trainer_config
    require(t.distributed_method == METHOD, "trainer_config.distributed_method",
            f"{METHOD} with xla_main.py (SPMD FSDP over every XLA device)", t.distributed_method)
    require(t.device == "auto", "trainer_config.device",
            "auto with xla_main.py (PJRT_DEVICE picks the XLA device)", t.device)
    # fp16 needs a loss scaler (torch's is CUDA's and the CPU's); bf16 needs none.
    require(t.precision in ("fp32", "bf16"), "trainer_config.precision",
            "fp32 or bf16 with xla_main.py", t.precision)
    for key, why in (("cpu_offload", "FSDP2's option"), ("compile", "XLA compiles every step"),
                     ("activation_checkpointing", "main.py's option")):
        require(not t[key], f"trainer_config.{key}", f"False with xla_main.py ({why})", t[key])
    for key in ("tp_size", "pp_size", "cp_size", "ep_size"):  # main.py's degrees: 0, 1 off
        require(t[key] <= 1, f"trainer_config.{key}", "0 or 1 with xla_main.py", t[key])
    for key, why in (("ft_replicas", "torchft's replica groups join main.py's jobs"),
                     ("dry_run", "it plans main.py's layouts")):
        require(not t[key], f"trainer_config.{key}", f"0 with xla_main.py ({why})", t[key])
    require(cfg.optimizer_config.name == "adamw", "optimizer_config.name",
            "adamw with xla_main.py (Muon's gathered matrices are main.py's layouts' code)",
            cfg.optimizer_config.name)
    return cfg


def load_snapshot(url: str, model: GPT, meta: dict, match_keys: tuple) -> dict | None:
    """A snapshot of xla_main.py into the CPU model; the rest of it (AdamW's state whole, as
    load_optimizer takes it), or None."""
    kind = snapshot.snapshot_kind(url)
    if kind is None:
        return None
    state = snapshot.load_train_state(url, kind)  # weights_only=True, on the CPU
    if "xla_rng" in state:  # saved before the Trainer ran here: the devices' seed stood apart
        state["rng"][0]["xla"] = state.pop("xla_rng")
    if "xla" not in state.get("rng", [{}])[0]:  # no stream of the devices: not ours
        raise snapshot.SnapshotError(f"{url} holds a snapshot of main.py, not xla_main.py: use "
                                     "another snapshot_path")
    snapshot.check_compatible(state, meta["model_config"], meta["data_meta"], url, match_keys)
    if kind == "dcp":  # (an older snapshot's one file has both)
        state["model"], state["optimizer"] = shards.read_whole(url, state["model_config"])
    model.load_state_dict(state.pop("model"))
    return state


def build(cfg: DictConfig, mesh: xs.Mesh, device: torch.device) -> tuple[Trainer, object]:
    """The Trainer over the sharded model, resumed where there is a snapshot; the data module."""
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
    model = shard(model, mesh, device)  # SPMD FSDP over every device
    o = cfg.optimizer_config  # built after sharding, which replaces the parameters
    optimizer = build_optimizer(model, METHOD, o.lr, o.betas, o.weight_decay)
    torch_xla.manual_seed(t.seed)  # dropout's stream on the devices (a resume restores it)
    trainer = Trainer(t, model, optimizer, train_set, val_set, device, cfg.run_dir,
                      snapshot_meta, model.flops_per_token(), XlaHooks(mesh, device))
    if state is not None:
        state["optimizer_changes"] = load_optimizer(optimizer, state.pop("optimizer"), mesh)
        trainer.load_state_dict(state)  # step, data position, schedule, RNG streams
    return trainer, data


def train(cfg: DictConfig) -> None:
    mesh, device = make_mesh(), torch_xla.device()
    print(f"torch {torch.__version__} | torch_xla {torch_xla.__version__} | python "
          f"{platform.python_version()}")
    print(f"XLA device {xr.device_type()} x {mesh.size()} (SPMD mesh {mesh.mesh_shape} "
          f"{mesh.axis_names}) | precision {cfg.trainer_config.precision}")
    print(OmegaConf.to_yaml(cfg).rstrip())
    storage.check_writable(cfg.trainer_config.snapshot_path)
    # A group of one (gloo, as main.py's for one CPU process): the Trainer's collectives (the
    # nan check, eval totals, RNG states) then run unchanged, over one rank.
    distributed.setup("cpu")
    try:
        trainer, data = build(cfg, mesh, device)
        print(f"model: {trainer.model.describe()} | {trainer.hooks.sharded(trainer.model)}")
        config.save(cfg)  # only now: a run refused for its data or model leaves no folder
        print(f"final val loss {trainer.train():.4f} (run dir {cfg.run_dir})")
        meta, tokens = trainer.snapshot_meta["data_meta"], cfg.trainer_config.sample_tokens
        if data.TEXT and tokens:
            # On the CPU, from the gathered weights: generation changes shapes at every token,
            # which on XLA would compile a new program per token.
            plain = GPT(trainer.model.module.config)
            plain.load_state_dict(trainer.hooks.gather(trainer.model, trainer.optimizer)[0])
            prompt = "\n" if "\n" in meta.get("itos", "\n") else meta["itos"][0]
            text = generate_text(plain, meta, prompt, tokens, temperature=0.8, top_k=10,
                                 device=torch.device("cpu"))
            print(f"sample:\n{text.strip()}")
    finally:
        distributed.release()


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
    # The config, the data, a snapshot, a non-finite loss (NonFiniteLoss), a failed save.
    except (ValueError, errors.SaveError) as e:
        fail(e)


if __name__ == "__main__":
    main(sys.argv[1:])
