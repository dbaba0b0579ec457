"""The configuration: composed once, checked once, every mistake one line that says what is allowed.

`load(overrides)` composes `gpt2_train_cfg.yaml` with the overrides (hydra's compose API), then
checks each section against its schema: the dataclasses below, the model's `GPTConfig`, and the
checks of the data module that `data_config.name` names. Not `@hydra.main`: its errors span
several lines, and it writes files from every rank; here only global rank 0 writes (main.py).
"""
import os
from dataclasses import dataclass, field, fields, make_dataclass

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra import errors as hydra_errors
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from mingpt import ROOT, parallel
from mingpt.data import KINDS, data_module
from mingpt.errors import require
from mingpt.model import GPTConfig, resolve_config
from mingpt.parallel import context, dataparallel, ddp, expert, ft, layout, pipeline, tensor
from mingpt.precision import PRECISIONS

CONFIG_NAME = "gpt2_train_cfg"
# The flavours and the shorthands for degrees (parallel/layout.py).
DISTRIBUTED_METHODS = tuple(parallel.STRATEGIES)
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainerKeys:
    """Types of `trainer_config` beyond the layout's (values and meaning: gpt2_train_cfg.yaml)."""

    max_steps: int = MISSING
    batch_size: int = MISSING
    grad_accum_steps: int = MISSING
    distributed_method: str = MISSING
    grad_clip: float = MISSING
    warmup_steps: int = MISSING
    min_lr_ratio: float = MISSING
    log_every: int = MISSING
    eval_every: int = MISSING
    eval_batches: int = MISSING
    save_every: int = MISSING
    keep_last: int = MISSING
    async_save: bool = MISSING
    snapshot_path: str = MISSING
    seed: int = MISSING
    data_loader_workers: int = MISSING
    sample_tokens: int = MISSING
    device: str = MISSING
    # Hangs and profiles (DEBUGGING.md)
    collective_timeout_s: float = MISSING
    flight_recorder_entries: int = MISSING
    profile_steps: int = MISSING
    memory_snapshot: bool = MISSING
    # Replica groups that survive each other (FAULT_TOLERANCE.md)
    ft_replicas: int = MISSING
    ft_replica_group: int = MISSING
    ft_sync: str = MISSING  # step, local_sgd or diloco: how often the groups meet (diloco.py)
    ft_sync_every: int = MISSING
    ft_fragments: int = MISSING
    dry_run: int = MISSING  # > 0: plan a run of that many ranks in one process (dry_run.py)
    dry_run_profile: str = MISSING  # its machine: bench/comm_lab.py's JSON (step_time.py)


# The layout's keys (tp_size, pp_size, ..., precision, compile) are parallel.layout.Settings'
# fields, where each axis declares its degree: here each becomes a typed trainer_config key.
TrainerConfig = make_dataclass(
    "TrainerConfig", [(name, hint, field(default=MISSING))
                      for name, hint in layout.Settings.__annotations__.items()
                      if name not in TrainerKeys.__annotations__],
    bases=(TrainerKeys,))
TrainerConfig.__module__ = __name__  # where pickle finds it (a dry run sends configs to ranks)


@dataclass
class OptimizerConfig:
    name: str = MISSING
    lr: float = MISSING
    weight_decay: float = MISSING
    betas: list[float] = MISSING
    muon_lr: float = MISSING
    outer_lr: float = MISSING  # DiLoCo's outer SGD (trainer_config.ft_sync=diloco)
    outer_momentum: float = MISSING


# gpt_config: GPTConfig's fields less vocab_size (from the data), plus init_from (pretrained.py).
GPT_KEYS = (*(f.name for f in fields(GPTConfig) if f.name != "vocab_size"), "init_from")
# optimizer_config.name: AdamW alone, or Muon for the blocks' matrices (mingpt/muon.py).
OPTIMIZERS = ("adamw", "muon")
SECTIONS = {"trainer_config": TrainerConfig, "optimizer_config": OptimizerConfig}
# Each section's schema as OmegaConf's typed config, built once: OmegaConf.merge copies it.
_TYPED: dict[str, DictConfig] = {}
TOP_LEVEL = ("run_name", "run_dir", "gpt_config", "data_config", "trainer_config",
             "optimizer_config")


def _allowed(key: str) -> str:
    """What may stand at a key's level, for 'unknown key' messages."""
    parent = key.rpartition(".")[0]
    if not parent:
        return f"allowed at the top level: {', '.join(TOP_LEVEL)}"
    names = ([f.name for f in fields(SECTIONS[parent])] if parent in SECTIONS
             else GPT_KEYS if parent == "gpt_config" else None)
    return f"allowed in {parent}: {', '.join(names)}" if names else f"not a key of {parent}"


def _compose(overrides: list[str]) -> DictConfig:
    """hydra's composition; its errors become one ValueError line each, from their fields."""
    hydra_keys = [o for o in overrides if o.lstrip("+~").startswith("hydra.")]
    if hydra_keys:  # compose would drop them silently
        raise ValueError(f"{hydra_keys[0]}: hydra's own settings are not used here; the run "
                         "directory is run_dir=PATH (default runs/<run_name>)")
    # Paths in the config are relative to 05_mingpt/ (ROOT); version_base=None: no warning.
    with initialize_config_dir(config_dir=str(ROOT), version_base=None):
        try:
            return compose(CONFIG_NAME, overrides=overrides)
        except hydra_errors.MissingConfigException as e:  # no such config group option
            options = ", ".join(e.options or [])
            group = (e.missing_cfg_file or "").rpartition("/")[0]
            raise ValueError(f"no config {e.missing_cfg_file}.yaml; {group} options: "
                             f"{options}") from None
        except hydra_errors.OverrideParseException as e:  # bad override syntax
            raise ValueError(f"cannot parse the overrides: {str(e).splitlines()[0]}") from None
        except hydra_errors.HydraException as e:
            key = getattr(e.__cause__, "full_key", None)
            if key and isinstance(e, hydra_errors.ConfigCompositionException):  # unknown key
                raise ValueError(f"unknown key {key}; {_allowed(key)}") from None
            raise ValueError(" ".join(str(e).split())) from None


def validate(cfg: DictConfig) -> None:
    """Raise ValueError (one line) unless every key is known and every value is allowed."""
    unknown = sorted(set(cfg.keys()) - set(TOP_LEVEL))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]}; {_allowed(unknown[0])}")
    for name, schema in SECTIONS.items():
        if not isinstance(cfg.get(name), DictConfig):
            raise ValueError(f"{name} must be a group of keys, got {cfg.get(name)!r}")
        try:  # type check: '3' -> 3 is fine, 'abc' for an int is not; unknown keys are rejected
            if name not in _TYPED:
                _TYPED[name] = OmegaConf.structured(schema)
            typed = OmegaConf.merge(_TYPED[name], OmegaConf.to_container(cfg[name],
                                                                         resolve=False))
        except ConfigKeyError as e:  # `+trainer_config.foo=1` got past hydra
            key = f"{name}.{e.key}"
            raise ValueError(f"unknown key {key}; {_allowed(key)}") from None
        except OmegaConfBaseException as e:  # a value of the wrong type
            key = f"{name}.{e.full_key}" if getattr(e, "full_key", None) else name
            raise ValueError(f"{key}: {str(e).splitlines()[0]}") from None
        missing = sorted(OmegaConf.missing_keys(typed))
        if missing:  # deleted with `~key` (or set to ???): the yaml's value is the one to give
            key = f"{name}.{missing[0]}"
            raise ValueError(f"{key} has no value (deleted with ~ or set to ???); give it one: "
                             f"{key}=VALUE (gpt2_train_cfg.yaml has the default)")
        cfg[name] = typed  # the typed values (grad_clip=1 -> 1.0) for the checks and the run
    t, o = cfg.trainer_config, cfg.optimizer_config
    for key in ("max_steps", "batch_size", "grad_accum_steps", "log_every", "eval_batches",
                "keep_last"):
        require(t[key] >= 1, f"trainer_config.{key}", "a positive integer", t[key])
    for key in ("warmup_steps", "eval_every", "save_every", "data_loader_workers",
                "sample_tokens"):
        require(t[key] >= 0, f"trainer_config.{key}", "an integer >= 0", t[key])
    require(t.distributed_method in DISTRIBUTED_METHODS, "trainer_config.distributed_method",
           f"one of {', '.join(DISTRIBUTED_METHODS)}", t.distributed_method)
    _check_layout(t)
    require(t.precision in PRECISIONS, "trainer_config.precision",
           f"one of {', '.join(PRECISIONS)}", t.precision)
    require(t.device in DEVICES, "trainer_config.device", f"one of {', '.join(DEVICES)}", t.device)
    # Here rather than when the device is picked: before any process group or file exists.
    require(t.device != "cuda" or torch.cuda.is_available(), "trainer_config.device",
           "auto or cpu on a machine without a CUDA GPU", t.device)
    require(not t.cpu_offload or (t.distributed_method == "fsdp" and t.tp_size <= 1
                                  and t.pp_size <= 1), "trainer_config.cpu_offload",
            "False unless distributed_method=fsdp without tp_size or pp_size (it offloads FSDP "
            "shards)", t.cpu_offload)
    _check_debugging(t)
    require(not t.async_save or t.tp_size <= 1, "trainer_config.async_save",
            "False with tp_size > 1 (its staging copy loses how TP's q/k/v shards lie in the "
            "global tensor: SNAPSHOTS.md)", t.async_save)
    ft.check_config(t, o)  # replica groups (parallel/ft.py, diloco.py)
    require(t.grad_clip >= 0, "trainer_config.grad_clip", ">= 0 (0 turns clipping off)",
           t.grad_clip)
    require(0 <= t.min_lr_ratio <= 1, "trainer_config.min_lr_ratio", "between 0 and 1",
           t.min_lr_ratio)
    require(o.name in OPTIMIZERS, "optimizer_config.name", f"one of {', '.join(OPTIMIZERS)}",
            o.name)
    require(o.lr > 0, "optimizer_config.lr", "> 0", o.lr)
    require(o.muon_lr > 0, "optimizer_config.muon_lr", "> 0", o.muon_lr)
    require(o.weight_decay >= 0, "optimizer_config.weight_decay", ">= 0", o.weight_decay)
    require(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optimizer_config.betas",
           "two numbers in [0, 1)", list(o.betas))
    data_name = cfg.data_config.get("name") if isinstance(cfg.data_config, DictConfig) else None
    require(data_name in KINDS, "data_config.name", f"one of {', '.join(KINDS)}", data_name)
    data_module(data_name).check_config(cfg.data_config)  # the data module's own keys
    gpt = cfg.gpt_config
    unknown = sorted(set(gpt.keys()) - set(GPT_KEYS))
    if unknown:
        key = f"gpt_config.{unknown[0]}"
        raise ValueError(f"unknown key {key}; {_allowed(key)}")
    settings = OmegaConf.to_container(gpt)
    init_from = settings.pop("init_from", None)
    require(init_from is None or isinstance(init_from, str) and init_from.strip() != "",
           "gpt_config.init_from", "null, gpt2, gpt2-medium, gpt2-large, gpt2-xl or a directory",
           init_from)
    if init_from is not None:  # the pretrained model's sizes: pretrained.gpt_config_from
        from mingpt import pretrained  # noqa: PLC0415 (as model_config below)
        pretrained.check_architecture(init_from, settings)  # before a stand-in size fails it
        settings.update(model_type=None, n_layer=1, n_head=1, n_embd=1)  # checks them later
    # The model's own check (presets, n_embd % n_head, ...); vocab_size is known only later.
    try:
        sizes = resolve_config(GPTConfig(**settings, vocab_size=1))
    except (TypeError, ValueError) as e:  # TypeError: e.g. a list where a number belongs
        raise ValueError(f"gpt_config: {e}") from None
    if t.tp_size and init_from is None:  # tp_size 0 (every rank): checked once ranks exist
        # Every TP rank computes n_head / tp_size heads and n_embd / tp_size MLP columns.
        tensor.check_tp(sizes.n_head, sizes.n_embd, t.tp_size)
    context.check_config(t, sizes.block_size, sizes.dropout)  # cp_size's (context.py)
    expert.check_config(t, sizes.n_expert)  # ep_size divides n_expert, ... (expert.py)


def _check_layout(t: DictConfig) -> None:
    """The layout: a flavour plus degrees (parallel/layout.py), each axis's own rules, and,
    where torchrun has set WORLD_SIZE, the degrees against it: before any process group exists."""
    for key in ("tp_size", "pp_size", "ep_size"):
        require(t[key] >= 0, f"trainer_config.{key}", "an integer >= 0 (0: every rank)", t[key])
    method = t.distributed_method
    layout.check_axes(method, **layout.degrees(t))
    flavour, on = layout.SHORTHANDS.get(method, (method, ()))
    if flavour == "dp":  # CUDA GPUs, one process
        dataparallel.check_config(t)
    if (t.tp_size > 1 or "tp" in on) and flavour != "fsdp":  # fp16 and TP's mixed gradients
        tensor.check_config(t)
    if t.pp_size > 1 or "pp" in on:  # schedules, micro-batches, no fp16
        pipeline.check_config(t)
    ddp.check_config(t)  # a communication hook only where DDP's wrapper runs
    require(t.dry_run >= 0, "trainer_config.dry_run", "an integer >= 0 (0: off, N: plan N ranks)",
            t.dry_run)
    require(not t.dry_run or flavour != "dp", "trainer_config.dry_run", "0 with "
            "distributed_method=dp (one process drives every GPU: nothing to plan)", t.dry_run)
    # A dry run's world is dry_run ranks; a real one's torchrun's WORLD_SIZE.
    world = t.dry_run or int(os.environ.get("WORLD_SIZE", 0))
    if world and t.cp_size >= 0:
        layout.resolve(method, world, **layout.degrees(t))


def _check_debugging(t: DictConfig) -> None:
    """The keys of hangs and profiles (DEBUGGING.md)."""
    require(t.collective_timeout_s > 0, "trainer_config.collective_timeout_s",
            "> 0 (seconds a collective may wait for the other ranks)", t.collective_timeout_s)
    for key in ("flight_recorder_entries", "profile_steps"):
        require(t[key] >= 0, f"trainer_config.{key}", "an integer >= 0 (0: off)", t[key])
    # torch.cuda.memory records the CUDA caching allocator: a CPU run has nothing to record.
    require(not t.memory_snapshot or (t.device != "cpu" and torch.cuda.is_available()),
            "trainer_config.memory_snapshot", "False without a CUDA GPU (it records CUDA "
            "allocations; on a CPU, profile_steps shows where time goes)", t.memory_snapshot)


def command_line(argv: list[str], script: str) -> tuple[bool, list[str]]:
    """(whether `--cfg job` leads, the key=value overrides) of main.py's or xla_main.py's
    arguments; ValueError (one line) for any other option."""
    show = argv[:2] == ["--cfg", "job"]
    overrides = argv[2:] if show else argv
    options = [arg for arg in overrides if arg.startswith("-")]
    if options:
        raise ValueError(f"unknown option {options[0]}; {script} takes key=value overrides, "
                         "--cfg job or --help")
    return show, overrides


def load(overrides: list[str]) -> DictConfig:
    """The run's config from the command-line overrides, checked and with every value resolved;
    run_dir (and the default snapshot_path in it) absolute, so every rank means one folder."""
    cfg = _compose(overrides)
    try:
        cfg.run_dir = os.path.abspath(os.path.expanduser(str(cfg.run_dir)))
        OmegaConf.resolve(cfg)  # run_name's start time is read once, here
    except OmegaConfBaseException as e:
        raise ValueError(" ".join(str(e).split())) from None
    validate(cfg)
    return cfg


def model_config(cfg: DictConfig, meta: dict) -> tuple[GPTConfig, str | None]:
    """The model's config (vocabulary and block size from the data's meta; with init_from, the
    pretrained model's sizes) and where its weights come from (gpt_config.init_from, or None)."""
    settings = OmegaConf.to_container(cfg.gpt_config, resolve=True)
    init_from = settings.pop("init_from", None)
    if init_from:  # GPT-2 weights: transformers is imported only for them
        from mingpt import pretrained
        return pretrained.gpt_config_from(init_from, settings, meta["vocab_size"],
                                          meta["block_size"], cfg.data_config.name), init_from
    return GPTConfig(**{**settings, "vocab_size": meta["vocab_size"],
                        "block_size": meta["block_size"]}), None


def save(cfg: DictConfig) -> None:
    """runs/<run_name>/config.yaml, the resolved config of this run, from global rank 0 only."""
    if dist.get_rank() == 0:
        os.makedirs(cfg.run_dir, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.run_dir, "config.yaml"))
