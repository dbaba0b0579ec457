"""The features a 05_mingpt run can combine, read from its config schema, and what each pair of
them does on 4 ranks: taken by the config, or refused before any process group in one line.

    python tests/feature_matrix.py          # print the grid tests/README.md holds

Every key of trainer_config, gpt_config and optimizer_config is a feature or a setting. A
boolean key is a feature by itself (turned on: true); any other new key must be named below, in
FEATURES with the overrides that turn it on, or in SETTINGS with why it is none:
test_feature_matrix.py fails until it is. So a new key joins the grid the day it is added, and
the grid in tests/README.md is this module's output (a test compares them), so it cannot drift.

A cell says what the config does with the two features on together: "✔" where a warm world of
gloo ranks trains them together, stops, resumes and ends bit for bit as a run that never
stopped (test_feature_matrix.py, RUNNABLE), or, for the replica groups' features (REPLICAS),
two groups of GROUP ranks do (test_feature_matrix_groups.py), or, for dry_run, where the dry
run of a covering run with the other feature on plans what its real step holds and sends
(test_mingpt_dry_run.py, dry_runs); "◐" for dry_run with a feature that a test runs with it
(DRY_PARTLY: the test, what it holds, and what the plan cannot hold to the byte); "·" where
the config takes the pair but no test runs the two together yet; "Rn" where it is refused, the
one `error:` line (n: its number below the grid); "—" for two values of one key. The diagonal
is the feature alone.
"""
import os
import sys
from dataclasses import fields
from pathlib import Path

import yaml
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parent.parent

# Features whose "on" is not `true`: the overrides that turn each one on, beside the
# defaults of gpt2_train_cfg.yaml.
FEATURES = {
    "distributed_method": {"zero": ["trainer_config.distributed_method=zero"],
                           "fsdp": ["trainer_config.distributed_method=fsdp"],
                           "dp": ["trainer_config.distributed_method=dp"]},
    "tp_size": {"tp_size": ["trainer_config.tp_size=2"]},
    "pp_size": {"pp_size": ["trainer_config.pp_size=2"]},
    "cp_size": {"cp_size": ["trainer_config.cp_size=2"]},
    "ep_size": {"ep_size": ["trainer_config.ep_size=2"]},
    "n_expert": {"experts": ["gpt_config.n_expert=4"]},
    "precision": {"bf16": ["trainer_config.precision=bf16"],
                  "fp16": ["trainer_config.precision=fp16"]},
    "grad_accum_steps": {"grad_accum": ["trainer_config.grad_accum_steps=2"]},
    "dropout": {"dropout": ["gpt_config.dropout=0.1"]},
    "ft_replicas": {"ft_replicas": ["trainer_config.ft_replicas=2"]},
    "ft_sync": {"local_sgd": ["trainer_config.ft_sync=local_sgd"],
                "diloco": ["trainer_config.ft_sync=diloco"]},
    "profile_steps": {"profile": ["trainer_config.profile_steps=2"]},
    "dry_run": {"dry_run": ["trainer_config.dry_run=4"]},
    "init_from": {"init_from": ["gpt_config.init_from=gpt2"]},
    "snapshot_path": {"s3": ["trainer_config.snapshot_path=s3://bucket/run/snapshot"]},
    "name": {"muon": ["optimizer_config.name=muon"]},
    "comm_hook": {"fp16_hook": ["trainer_config.comm_hook=fp16"]},
}
# What a feature needs besides itself, where the defaults lack it; in a pair, the other
# feature's own overrides win over these (cpu_offload with zero is cpu_offload under zero).
NEEDS = {
    "ep_size": ["gpt_config.n_expert=4"],
    "cpu_offload": ["trainer_config.distributed_method=fsdp"],
    "async_save": ["trainer_config.distributed_method=fsdp"],
    "local_sgd": ["trainer_config.ft_replicas=2"],
    "diloco": ["trainer_config.ft_replicas=2"],
}
# Every verdict is a CPU machine's (CI's): dp and memory_snapshot need CUDA GPUs.
BASE = ["trainer_config.device=cpu", "optimizer_config.name=adamw"]  # muon: a feature
# Keys that are no feature to combine, and why.
SETTINGS = {
    "max_steps": "how long", "batch_size": "how much per step", "warmup_steps": "the schedule",
    "min_lr_ratio": "the schedule", "grad_clip": "a bound every layout applies (runner)",
    "log_every": "logging", "eval_every": "logging", "eval_batches": "logging",
    "save_every": "when snapshots are written (every run saves)",
    "keep_last": "how many snapshots stay", "seed": "the draws",
    "data_loader_workers": "data loading", "sample_tokens": "the end-of-run sample",
    "device": "chosen by the machine (a CPU here)",
    "collective_timeout_s": "hang detection (test_mingpt_hang.py)",
    "flight_recorder_entries": "hang detection (test_mingpt_hang.py)",
    "ft_replica_group": "which group (with ft_replicas)",
    "ft_sync_every": "how often replica groups meet (with ft_sync)",
    "ft_fragments": "how much of the model meets at once (with diloco)",
    "outer_lr": "the outer optimizer's settings (with diloco)",
    "outer_momentum": "the outer optimizer's settings (with diloco)",
    "pp_schedule": "a pipeline's settings (test_mingpt_pipeline.py)",
    "microbatches": "a pipeline's settings", "pp_stages_per_rank": "a pipeline's settings",
    "pp_split": "a pipeline's settings", "model_type": "the model's size",
    "n_layer": "the model's size", "n_head": "the model's size", "n_embd": "the model's size",
    "block_size": "the model's size", "expert_top_k": "an experts' setting (with n_expert)",
    "aux_loss_coef": "an experts' setting (with n_expert)",
    "bias": "what GPT-2 can hold (export_hf.py's refusals)",
    "lr": "the optimizer's step size", "muon_lr": "the optimizer's step size (with muon)",
    "betas": "AdamW's settings", "weight_decay": "the optimizer's settings",
    "dry_run_profile": "the machine a dry run predicts step time for (with dry_run)",
}
WORLD = 4  # torchrun's WORLD_SIZE for the checks that need one
# Replica groups are separate jobs (torchrun's, one per group), each with its own WORLD_SIZE:
# their pairs run as GROUPS groups of GROUP ranks, the same WORLD ranks in all, and the config
# judges them at a group's size.
REPLICAS = ("ft_replicas", "local_sgd", "diloco")
GROUPS, GROUP = 2, 2
# The features a warm world of WORLD gloo ranks trains in this process's tests: each accepted
# pair of them runs there (in one of runs()), stops, resumes and ends bit for bit
# (test_feature_matrix.py; s3 against a moto server, init_from with a stand-in GPT-2); each
# accepted pair of one of them with one of REPLICAS runs in replica groups (runs(groups=True)).
# The others plan rather than train (dry_run: dry_runs below) or need what a CPU lacks (dp,
# memory_snapshot). compile: the ranks (the world's, the replica groups') trace with dynamo
# and AOTAutograd and run the traced graphs with torch's aot_eager backend, not inductor's
# C++ kernels (mingpt_helpers.compile_with).
RUNNABLE = ("grad_accum", "zero", "fsdp", "bf16", "activation_checkpointing", "tp_size",
            "cp_size", "ep_size", "pp_size", "dropout", "experts", "cpu_offload", "muon",
            "rotary", "qk_norm", "relu2", "untied_head", "fp16", "profile", "async_save", "s3",
            "init_from", "fp16_hook", "compile")

# dry_run's pairs: the dry run of a covering run (dry_runs) plans, on every rank it plans,
# what the real step holds and sends with the same features on: model state, activations and
# bytes per axis, to the byte (test_mingpt_dry_run.py; init_from with the stand-in GPT-2). But
# for these, which the dry run takes and plans without that check: a MoE model's experts
# (n_expert, ep_size), whose routing, and so the bytes each expert's rank receives and keeps
# for backward, depends on the tokens and weights (DRY_RUN.md, Open); compile, whose graphs
# keep for backward what AOTAutograd's partitioner chooses, not what eager autograd saves.
DRY_UNCHECKED = ("experts", "ep_size", "compile")

# dry_run with the features whose real step it cannot plan to the byte (DRY_UNCHECKED, and
# REPLICAS: the plan is one group's step, the meetings a line under it): the test that runs
# each with dry_run, what it holds, and what the plan does not (DRY_RUN.md, Open). The grid
# marks these "◐" and lists them below it.
_EXPERTS = ("test_mingpt_experts.py::test_model_size_predicts_every_ranks_expert_bytes",
            "the plans of ddp with ep_size 1 and 2 and of fsdp with ep_size 4 hold every "
            "rank's parameters, gradients and AdamW state as the trained runs do, to the byte; "
            "the all-to-all's bytes and the experts' activations follow the routing, so the "
            "tokens and weights")
_REPLICAS = ("test_mingpt_dry_run.py::"
             "test_a_dry_run_of_replica_groups_plans_one_group_and_what_it_sends",
             "the plan is one group's step, and a line says what each rank sends the other "
             "groups per interval (a real fsdp run's count: test_mingpt_diloco.py); the "
             "meetings' time is not planned")
DRY_PARTLY = {
    "experts": _EXPERTS,
    "ep_size": _EXPERTS,
    "compile": ("test_mingpt_dry_run.py::"
                "test_a_dry_run_with_compile_plans_the_eager_step_and_says_so",
                "the plan is the eager step's, the same as without compile, and a line says "
                "so; a compiled step keeps for backward what AOTAutograd's partitioner "
                "chooses"),
    **dict.fromkeys(REPLICAS, _REPLICAS),
}


def checked_runs(config) -> list[tuple[str, ...]]:
    """The covering runs (runs()) without DRY_UNCHECKED: what a dry run's plan holds to the
    byte."""
    return [tuple(n for n in names if n not in DRY_UNCHECKED) for names in runs(config)]


def dry_runs(config) -> list[tuple[str, ...]]:
    """The runs that test_mingpt_dry_run.py plans dry and measures for real: of checked_runs,
    the fewest that hold every feature they hold between them, picked greedily (the run that
    brings the most features none holds yet, the earlier on a tie). dry_run's pairs are
    dry_run with one feature each, so one run with the feature on proves its cell; the other
    covering runs would plan the same features again in other company."""
    kept = checked_runs(config)
    left = {n for names in kept for n in names}
    chosen: list[tuple[str, ...]] = []
    while left:
        best = max(kept, key=lambda names: len(left & set(names)))  # the first of the best
        chosen.append(best)
        left -= set(best)
    return chosen


def dry_pairs(config) -> list[tuple[str, str]]:
    """dry_run with each feature of dry_runs(), where the config takes the two together, and
    alone (test_mingpt_dry_run.py's layouts)."""
    names, cells = grid(config)
    pairs = [tuple(sorted(("dry_run", n), key=names.index))
             for n in dict.fromkeys(["dry_run", *(n for run in dry_runs(config) for n in run)])]
    return [pair for pair in pairs if cells.get(pair, "") is None]


def schema_keys(config) -> dict[str, tuple[str, object]]:
    """Every key of trainer_config, gpt_config and optimizer_config (`config`: mingpt/config.py,
    imported): its section and its type, from the config's own schema."""
    keys = {f.name: ("optimizer_config", f.type) for f in fields(config.OptimizerConfig)}
    keys.update({f.name: ("trainer_config", f.type) for f in fields(config.TrainerConfig)})
    keys.update({f.name: ("gpt_config", f.type) for f in fields(config.GPTConfig)
                 if f.name in config.GPT_KEYS})
    keys["init_from"] = ("gpt_config", str)
    return keys


def same_key(a: str, b: str) -> bool:
    """Two values of one key (zero and fsdp, bf16 and fp16): no pair, the later would win."""
    return a != b and any(a in values and b in values for values in FEATURES.values())


def features(config) -> dict[str, list[str]]:
    """Feature name -> the overrides that turn it on; ValueError for a key in neither list."""
    out: dict[str, list[str]] = {}
    for key, (section, kind) in schema_keys(config).items():
        if key in FEATURES:
            out.update(FEATURES[key])
        elif key in SETTINGS:
            continue
        elif kind in (bool, "bool"):
            out[key] = [f"{section}.{key}=true"]
        else:
            raise ValueError(f"{key} is a new config key: name it in tests/feature_matrix.py, in "
                             "FEATURES (the overrides that turn it on) or SETTINGS (why it is "
                             "no feature)")
    return out


def base_config(config, cache: dict = {}):  # noqa: B006 (a cache)
    """main.py's config of BASE (config: mingpt/config.py, imported), composed once."""
    if key(config) not in cache:
        cache[key(config)] = config.load(BASE)
    return cache[key(config)]


def key(config) -> str:
    """What the caches here are kept by: the config module's file. Each test file imports
    mingpt afresh (mingpt_helpers.mingpt_imported), the same files, so the grid (460 config
    checks, about 7 s of CPU) is computed once per test process, not once per file."""
    return config.__file__


def world(*names: str) -> int:
    """The WORLD_SIZE the config sees with the features `names` on: a replica group's with
    any of REPLICAS, else WORLD."""
    return GROUP if set(names) & set(REPLICAS) else WORLD


def verdict(config, overrides: list[str], size: int = WORLD) -> str | None:
    """None where main.py's config takes `overrides` on `size` ranks, else its one line:
    config.load's checks (validate) on its composition of BASE, done once, with the overrides
    put in (test_mingpt_strategies.configure's way: hydra's composition is the slow part)."""
    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(size)
    try:
        cfg = base_config(config).copy()
        for override in overrides:
            key, value = override.split("=", 1)
            OmegaConf.update(cfg, key, yaml.safe_load(value))
        config.validate(cfg)
        return None
    except ValueError as e:
        return str(e)
    finally:
        if old is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = old


def overrides(on: dict[str, list[str]], *names: str) -> list[str]:
    """The overrides of the features `names` together: BASE, their needs, then their own (a
    later value of a key wins: the features' own over the needs)."""
    given: dict[str, str] = {}
    needs = [arg for name in names for arg in NEEDS.get(name, [])]
    for override in [*BASE, *needs, *(arg for name in names for arg in on[name])]:
        key, _, value = override.partition("=")
        given[key] = value
    return [f"{key}={value}" for key, value in given.items()]


def grid(config, cache: dict = {}) -> tuple[list[str], dict[tuple[str, str], str | None]]:  # noqa: B006
    """The features, and every pair's verdict (the pair with itself: the feature alone);
    computed once per config module's file (`cache`)."""
    if key(config) not in cache:
        on = features(config)
        names = list(on)
        cache[key(config)] = names, {(a, b): verdict(config, overrides(on, a, b), world(a, b))
                                    for i, a in enumerate(names) for b in names[i:]
                                    if not same_key(a, b)}
    return cache[key(config)]


def method(config, *names: str) -> tuple[str, str]:
    """trainer_config.distributed_method and how replica groups meet (ft_sync) with the
    features `names` on: what a run must share with a pair it holds."""
    given = dict(arg.split("=", 1) for arg in overrides(features(config), *names))
    t = base_config(config).trainer_config
    return (given.get("trainer_config.distributed_method", t.distributed_method),
            given.get("trainer_config.ft_sync", t.ft_sync))


def proven_pairs(config, groups: bool = False) -> list[tuple[str, str]]:
    """The pairs of RUNNABLE features the config takes (what the warm world runs), or with
    `groups` those of one of REPLICAS with one of RUNNABLE or REPLICAS (what the replica
    groups run)."""
    names, cells = grid(config)
    if not groups:
        return [(a, b) for (a, b), line in cells.items()
                if line is None and a in RUNNABLE and b in RUNNABLE]
    return [(a, b) for (a, b), line in cells.items() if line is None
            and {a, b} & set(REPLICAS) and {a, b} <= set(RUNNABLE) | set(REPLICAS)]


def runs(config, groups: bool = False,
         cache: dict = {}) -> list[tuple[str, ...]]:  # noqa: B006 (a cache)
    """Runs that together train every proven pair (and so every feature of them), each run
    turning several features on at once: all-pairs testing's covering runs, built greedily.
    Seeded by the first pair no run holds yet, a run takes, one at a time, the feature that
    brings it the most pairs no run holds yet, while one brings any and the config still
    takes the whole run on WORLD ranks under the seed's flavour: every pair lies in a run,
    under the flavour it has alone (plain ddp stays plain ddp), and a feature leaves the runs
    once its pairs are held (so BASE's AdamW trains in the later runs, muon in the first).
    With `groups`: the replica groups' runs (proven_pairs(groups=True)), each with one of
    REPLICAS, judged at a group's size. Computed once per config module's file (`cache`): the
    worlds and the covering test read them."""
    if (key(config), groups) not in cache:
        cache[key(config), groups] = _cover(config, groups)
    return cache[key(config), groups]


def _cover(config, groups: bool) -> list[tuple[str, ...]]:
    """runs(), computed."""
    names, cells = grid(config)
    on = features(config)
    pairs = set(proven_pairs(config, groups))
    among = RUNNABLE + REPLICAS if groups else RUNNABLE
    flavour = {pair: method(config, *pair) for pair in pairs}  # what a run must share with it
    left = [pair for pair in cells if pair in pairs]  # the grid's order

    def pair(a: str, b: str) -> tuple[str, str]:
        return tuple(sorted((a, b), key=names.index))

    chosen: list[tuple[str, ...]] = []
    while left:
        seed = left[0]
        run, kind = sorted(set(seed), key=names.index), flavour[seed]
        held = {p for p in left if flavour[p] == kind}
        while True:
            gains = {n: sum(pair(n, r) in held for r in run) for n in among if n not in run
                     and all(cells.get(pair(n, r), "") is None for r in run)}
            for name in sorted(gains, key=lambda n: -gains[n]):
                trial = [*run, name]
                if gains[name] and method(config, *trial) == kind \
                        and verdict(config, overrides(on, *trial), world(*trial)) is None:
                    run = trial
                    break
            else:
                break
        run = sorted(run, key=names.index)
        chosen.append(tuple(run))
        covered = {(a, b) for i, a in enumerate(run) for b in run[i:]}
        left = [p for p in left if not (p in covered and flavour[p] == kind)]
    return chosen


def markdown(config) -> str:
    """The grid as tests/README.md shows it: a row per feature, the refusals numbered below."""
    names, cells = grid(config)
    held = {*proven_pairs(config), *proven_pairs(config, groups=True), *dry_pairs(config)}
    reasons: list[str] = []
    partly: set[str] = set()  # the features of the "◐" cells, listed below the grid
    rows = ["| | " + " | ".join(f"`{n}`" for n in names) + " |",
            "|---" * (len(names) + 1) + "|"]
    for a in names:
        row = []
        for b in names:
            if same_key(a, b):
                row.append("—")
                continue
            line = cells.get((a, b), cells.get((b, a)))
            if line is None:
                other = b if a == "dry_run" else a if b == "dry_run" else None
                if (a, b) in held or (b, a) in held:
                    row.append("✔")
                elif other in DRY_PARTLY:
                    row.append("◐")
                    partly.add(other)
                else:
                    row.append("·")
                continue
            if line not in reasons:
                reasons.append(line)
            row.append(f"R{reasons.index(line) + 1}")
        rows.append(f"| `{a}` | " + " | ".join(row) + " |")
    notes = [f"{i}. R{i}: `error: {line}`" for i, line in enumerate(reasons, 1)]
    by_test: dict[tuple[str, str], list[str]] = {}  # each test once, with its features
    for name in (n for n in DRY_PARTLY if n in partly):
        by_test.setdefault(DRY_PARTLY[name], []).append(f"`{name}`")
    notes += [f"- ◐ {', '.join(features)}: {holds} (`{test}`)"
              for (test, holds), features in by_test.items()]
    return "\n".join(rows + [""] + notes) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "05_mingpt"))
    from mingpt import config

    print(markdown(config), end="")
