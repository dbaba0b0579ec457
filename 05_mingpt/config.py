"""The configuration's schema and checks: every mistake becomes one line that says what is allowed.

hydra composes `gpt2_train_cfg.yaml` with the command-line overrides. Its own errors span several
lines and end with a hint about stack traces, so `check_command_line` composes the same config
once more through hydra's compose API before the real run starts and turns any error (unknown
key, bad syntax, missing config group option, invalid value) into one `ValueError` line.
"""
import re
from dataclasses import dataclass, field, fields

import torch
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from model import GPTConfig, resolve_config

DISTRIBUTED_METHODS = ("ddp", "fsdp")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
DATA_KINDS = ("char", "cifar10")


@dataclass
class TrainerConfig:
    """Types of `trainer_config`; the values and their meaning live in gpt2_train_cfg.yaml."""

    max_steps: int = MISSING
    batch_size: int = MISSING
    grad_accum_steps: int = MISSING
    distributed_method: str = MISSING
    precision: str = MISSING
    cpu_offload: bool = MISSING
    activation_checkpointing: bool = MISSING
    compile: bool = MISSING
    grad_clip: float = MISSING
    warmup_steps: int = MISSING
    min_lr_ratio: float = MISSING
    log_every: int = MISSING
    eval_every: int = MISSING
    eval_batches: int = MISSING
    save_every: int = MISSING
    snapshot_path: str = MISSING
    seed: int = MISSING
    data_loader_workers: int = MISSING
    sample_tokens: int = MISSING
    device: str = MISSING


@dataclass
class OptimizerConfig:
    lr: float = MISSING
    weight_decay: float = MISSING
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])


# gpt_config: the model's own dataclass, less vocab_size (that always comes from the data).
GPT_KEYS = tuple(f.name for f in fields(GPTConfig) if f.name != "vocab_size")
SECTIONS = {"trainer_config": TrainerConfig, "optimizer_config": OptimizerConfig}
TOP_LEVEL = ("run_name", "gpt_config", "data_config", "trainer_config", "optimizer_config")


def _check(ok: bool, key: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{key} must be {allowed}, got {value!r}")


def validate(cfg: DictConfig) -> None:
    """Raise ValueError (one line) unless every key is known and every value is allowed."""
    unknown = sorted(set(cfg.keys()) - set(TOP_LEVEL))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]}; allowed at the top level: "
                         f"{', '.join(TOP_LEVEL)}")
    for name, schema in SECTIONS.items():
        if not isinstance(cfg.get(name), DictConfig):
            raise ValueError(f"{name} must be a group of keys, got {cfg.get(name)!r}")
        try:  # type check: '3' -> 3 is fine, 'abc' for an int is not; unknown keys are rejected
            typed = OmegaConf.merge(OmegaConf.structured(schema),
                                    OmegaConf.to_container(cfg[name], resolve=False))
        except ConfigKeyError as e:  # `+trainer_config.foo=1` got past hydra
            allowed = ", ".join(f.name for f in fields(schema))
            raise ValueError(f"unknown key {name}.{e.key}; allowed in {name}: {allowed}") from None
        except OmegaConfBaseException as e:  # a value of the wrong type
            key = f"{name}.{e.full_key}" if getattr(e, "full_key", None) else name
            raise ValueError(f"{key}: {str(e).splitlines()[0]}") from None
        cfg[name] = typed
    t, o = cfg.trainer_config, cfg.optimizer_config
    for key in ("max_steps", "batch_size", "grad_accum_steps", "log_every", "eval_batches"):
        _check(t[key] >= 1, f"trainer_config.{key}", "a positive integer", t[key])
    for key in ("warmup_steps", "eval_every", "save_every", "data_loader_workers",
                "sample_tokens"):
        _check(t[key] >= 0, f"trainer_config.{key}", "an integer >= 0", t[key])
    _check(t.distributed_method in DISTRIBUTED_METHODS, "trainer_config.distributed_method",
           f"one of {', '.join(DISTRIBUTED_METHODS)}", t.distributed_method)
    _check(t.precision in PRECISIONS, "trainer_config.precision",
           f"one of {', '.join(PRECISIONS)}", t.precision)
    _check(t.device in DEVICES, "trainer_config.device", f"one of {', '.join(DEVICES)}", t.device)
    _check(t.device != "cuda" or torch.cuda.is_available(), "trainer_config.device",
           "auto or cpu on a machine without a CUDA GPU", t.device)
    _check(not t.cpu_offload or t.distributed_method == "fsdp", "trainer_config.cpu_offload",
           "False unless distributed_method=fsdp (it offloads FSDP shards)", t.cpu_offload)
    _check(t.grad_clip >= 0, "trainer_config.grad_clip", ">= 0 (0 turns clipping off)",
           t.grad_clip)
    _check(0 <= t.min_lr_ratio <= 1, "trainer_config.min_lr_ratio", "between 0 and 1",
           t.min_lr_ratio)
    _check(o.lr > 0, "optimizer_config.lr", "> 0", o.lr)
    _check(o.weight_decay >= 0, "optimizer_config.weight_decay", ">= 0", o.weight_decay)
    _check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optimizer_config.betas",
           "two numbers in [0, 1)", list(o.betas))
    data_name = cfg.data_config.get("name") if isinstance(cfg.data_config, DictConfig) else None
    _check(data_name in DATA_KINDS, "data_config.name", f"one of {', '.join(DATA_KINDS)}",
           data_name)
    gpt = cfg.gpt_config
    unknown = sorted(set(gpt.keys()) - set(GPT_KEYS))
    if unknown:
        raise ValueError(f"unknown key gpt_config.{unknown[0]}; allowed: {', '.join(GPT_KEYS)}")
    # The model's own check (presets, n_embd % n_head, dropout, ...); vocab_size is a stand-in
    # here because it is only known once the data is read.
    try:
        resolve_config(GPTConfig(**OmegaConf.to_container(gpt), vocab_size=1))
    except TypeError as e:  # e.g. a list where a number belongs
        raise ValueError(f"gpt_config: {e}") from None
    except ValueError as e:
        raise ValueError(f"gpt_config: {e}") from None


def _one_line(error: Exception, defaults: DictConfig) -> str:
    """hydra's multi-line composition error as one line, with what is allowed where it can."""
    text = str(error)
    match = re.match(r"Could not override '([^']+)'", text)
    if match:
        key = match.group(1)
        parent, _, _ = key.rpartition(".")
        node = OmegaConf.select(defaults, parent) if parent else defaults
        if isinstance(node, DictConfig):
            where = f"in {parent}" if parent else "at the top level"
            return f"unknown key {key}; allowed {where}: {', '.join(str(k) for k in node)}"
    match = re.search(r"Could not find '([^']+)'\n+Available options in '([^']+)':\n((?:\t.*\n?)*)",
                      text)
    if match:  # a config group option that does not exist, e.g. data_config=nope
        options = ", ".join(line.strip() for line in match.group(3).splitlines())
        return f"no config {match.group(1)}.yaml; {match.group(2)} options: {options}"
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def check_command_line(overrides: list[str], config_dir: str, config_name: str) -> None:
    """Compose and validate the config as hydra will; ValueError (one line) on any problem.

    hydra's own flags (--multirun, --cfg, --help, ...) are left to hydra.
    """
    if any(arg.startswith("-") for arg in overrides):
        return
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        try:
            cfg = compose(config_name, overrides=overrides)
        except HydraException as e:
            raise ValueError(_one_line(e, compose(config_name))) from None
    validate(cfg)
