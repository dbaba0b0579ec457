"""How big is each GPT preset: parameters, training FLOPs per token, and snapshot size on disk;
with --memory, what one rank holds in training under each layout.

    python model_size.py                      # every preset, GPT-2 vocabulary and context
    python model_size.py --preset gpt2-xl --vocab_size 65 --block_size 256
    python model_size.py --memory --preset gpt2-medium --vocab_size 65 --block_size 256 \
        --world_size 2 --tp_size 2 --batch_size 4   # rank 0's bytes per layout

The models are built on the `meta` device: shapes but no storage, so gpt2-xl costs no memory.
--memory keeps no formulas of its own: the dry run (mingpt/dry_run.py, DRY_RUN.md) plans rank 0
of each layout with the real layout code and one training step on fake tensors.
"""
import argparse
import sys

import torch
from omegaconf import DictConfig

from mingpt.errors import one_line_errors
from mingpt.model import GPT, PRESETS, GPTConfig
from mingpt.parallel import STRATEGIES as REGISTRY

# Bytes per parameter. A training snapshot keeps fp32 weights plus AdamW's two fp32 moments
# (exp_avg, exp_avg_sq): 3 x 4 bytes. Mixed precision does not change this: the optimizer
# still updates fp32 master weights.
BYTES_TRAIN_SNAPSHOT = 12
BYTES_FP32 = 4
BYTES_BF16 = 2


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # A bad argument: one `error:` line and exit status 2; a bad model config exits 1.
    parser = one_line_errors(argparse.ArgumentParser(
        description="Parameter count and snapshot size of the GPT presets."))
    parser.add_argument("--vocab_size", type=positive_int, default=50257,
                        help="vocabulary size (default: GPT-2's BPE, 50257)")
    parser.add_argument("--block_size", type=positive_int, default=1024,
                        help="context length (default: 1024)")
    parser.add_argument("--preset", default=None,
                        help=f"show one preset only: {', '.join(PRESETS)}")
    parser.add_argument("--memory", action="store_true",
                        help="per-rank training memory of each strategy instead")
    parser.add_argument("--world_size", type=positive_int, default=2,
                        help="--memory: number of ranks (default: 2)")
    parser.add_argument("--tp_size", type=positive_int, default=2,
                        help="--memory: tensor-parallel group size for tp, fsdp_tp (default: 2)")
    parser.add_argument("--pp_size", type=positive_int, default=2,
                        help="--memory: ranks per pipeline for pp, fsdp_pp, fsdp_tp_pp "
                        "(default: 2; one stage each, 1f1b, microbatches 4)")
    parser.add_argument("--batch_size", type=positive_int, default=4,
                        help="--memory: sequences per rank per micro-step (default: 4)")
    parser.add_argument("--cp_size", type=positive_int, default=2,
                        help="--memory: largest context-parallel group to show (default: 2)")
    parser.add_argument("--machine", default="bench/comm_lab.json",
                        help="--memory: the machine profile a step's time is predicted for "
                        "(bench/comm_lab.py's JSON; default: %(default)s)")
    args = parser.parse_args(argv)
    if args.memory and args.preset is None:
        parser.error("--memory needs --preset (it plans one model at a time)")
    if args.memory and args.world_size % args.tp_size:
        parser.error(f"--world_size {args.world_size} must be divisible by --tp_size "
                     f"{args.tp_size}")
    # Checked here rather than with `choices=` so the message lists the presets on one line.
    if args.preset is not None and args.preset not in PRESETS:
        parser.error(f"unknown preset {args.preset!r}; allowed: {', '.join(PRESETS)}")
    return args


def build_on_meta(preset: str, vocab_size: int, block_size: int) -> GPT:
    """The real GPT module for a preset, with meta tensors (shapes only, no memory)."""
    config = GPTConfig(model_type=preset, vocab_size=vocab_size, block_size=block_size)
    # Every tensor created inside this block lands on `meta`; init calls (normal_) are no-ops.
    with torch.device("meta"):
        return GPT(config)


def human_count(n: float) -> str:
    """1234567 -> '1.23M' (k, M, B: thousand, million, billion)."""
    for suffix, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"


def human_bytes(n: float) -> str:
    """1610612736 -> '1.50 GiB' (binary prefixes, as file managers and `du -h` use)."""
    for prefix in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {prefix}" if prefix == "B" else f"{n:.2f} {prefix}"
        n /= 1024
    return f"{n:.2f} TiB"


def size_row(preset: str, vocab_size: int, block_size: int) -> dict[str, object]:
    """One table row: shape of the preset, parameter counts, FLOPs/token and sizes in bytes."""
    # Count from the module itself, not a formula: the table cannot drift from model.py.
    model = build_on_meta(preset, vocab_size, block_size)
    cfg, n_params = model.config, model.num_params()
    return {
        "preset": preset,
        "L/H/C": f"{cfg.n_layer}/{cfg.n_head}/{cfg.n_embd}",
        "params": f"{n_params:,}",
        "non-emb": human_count(model.num_params(non_embedding=True)),
        # A MoE model computes each token with expert_top_k of its experts (model.py).
        "active": human_count(model.num_active_params()),
        "GFLOP/tok": f"{model.flops_per_token() / 1e9:.3f}",
        # bf16: what a bf16 copy for inference needs; fp32: the master weights training keeps.
        "bf16": human_bytes(n_params * BYTES_BF16),
        "fp32": human_bytes(n_params * BYTES_FP32),
        "train snapshot": human_bytes(n_params * BYTES_TRAIN_SNAPSHOT),
    }


def print_table(rows: list[dict[str, object]]) -> None:
    """Print rows as aligned columns: text left, numbers right."""
    headers = list(rows[0])  # dicts keep insertion order: columns as size_row lists them
    widths = [max(len(h), *(len(str(row[h])) for row in rows)) for h in headers]

    def line(cells: list[object]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    print(line(headers))
    print(line(["-" * w for w in widths]))
    for row in rows:
        print(line([row[h] for h in headers]))


# --- per-rank training memory (--memory): the dry run's counts --------------------------------

def model_overrides(model: GPT) -> list[str]:
    """main.py's gpt_config keys for `model`'s sizes (model_type null: the sizes themselves)."""
    c = model.config  # resolved: a preset's sizes are filled in
    # Every key that changes what a rank holds; vocab_size is not a key (it comes from the data).
    keys = ("n_layer", "n_head", "n_embd", "block_size", "dropout", "bias", "n_expert",
            "expert_top_k", "aux_loss_coef")
    return ["gpt_config.model_type=null", *(f"gpt_config.{key}={getattr(c, key)}"
                                            for key in keys)]


def layout_config(model: GPT, overrides: list[str], world_size: int, batch_size: int,
                  microbatches: int | None = None) -> DictConfig:
    """main.py's checked config for `model` under `overrides` on world_size ranks, one micro-step
    of batch_size sequences per data-parallel rank, AdamW unless the overrides name another;
    ValueError (one line) where a real run of it would be refused."""
    from mingpt import config  # noqa: PLC0415
    # Micro-batches for a pipeline: 4 where they divide the batch (1f1b), fewer otherwise.
    microbatches = microbatches or next(m for m in (4, 2, 1) if batch_size % m == 0)
    return config.load([*model_overrides(model), f"trainer_config.dry_run={world_size}",
                        f"trainer_config.batch_size={batch_size}",
                        "trainer_config.grad_accum_steps=1",
                        f"trainer_config.microbatches={microbatches}",
                        "optimizer_config.name=adamw", *overrides])


def predict(model: GPT, layouts: dict[str, list[str]], world_size: int, batch_size: int,
            ranks: tuple[int, ...] = (0,), microbatches: int | None = None,
            keep_refusals: bool = False, configs: dict[str, DictConfig] | None = None
            ) -> dict[str, dict[int, dict | ValueError]]:
    """What `ranks` hold and send in a training step of `model` (on the meta device) under each
    layout (name -> main.py overrides): the dry run's plans, all layouts at once. ValueError
    (one line) where a layout does not fit; with keep_refusals, that ValueError in the plan's
    place. `configs`, where given, receives each planned layout's config."""
    # The import is here: the size table needs none of the distributed machinery.
    from mingpt import config, dry_run  # noqa: PLC0415
    # Every (layout, rank) is one job for the dry run's pool: all of them planned at once, two
    # processes at a time, rather than one pool per layout.
    jobs, names = [], []
    plans: dict[str, dict[int, dict | ValueError]] = {name: {} for name in layouts}
    for name, overrides in layouts.items():
        try:
            cfg = layout_config(model, overrides, world_size, batch_size, microbatches)
        except ValueError as err:  # refused by the config's checks, before any planning
            if not keep_refusals:
                raise
            plans[name] = dict.fromkeys(ranks, err)
            continue
        # The model as the layout's config has it (cp sets dropout 0), the vocabulary as given.
        gpt_config = config.model_config(cfg, {"vocab_size": model.config.vocab_size,
                                               "block_size": model.config.block_size})[0]
        jobs += [(cfg, gpt_config, world_size, rank) for rank in ranks]
        names += [(name, rank) for rank in ranks]
        if configs is not None:
            configs[name] = cfg
    # The pool returns the plans in the jobs' order: file each under its layout and rank.
    for (name, rank), plan in zip(names, dry_run.plan_ranks(jobs, keep_refusals), strict=True):
        plans[name][rank] = plan
    return plans


def memory_layouts(model: GPT, args: argparse.Namespace) -> dict[str, list[str]]:
    """The layouts --memory shows: each strategy name (tp_size, pp_size as given), ddp with
    cp_size 2, 4, ... up to --cp_size, and a MoE model's experts over ep_size 2, 4, ..."""
    method = "trainer_config.distributed_method="
    layouts = {}
    for name, strategy in REGISTRY.items():
        if name == "dp":  # one process: nothing to plan
            continue
        layouts[name] = [method + name]
        # fsdp_tp, fsdp_pp, fsdp_tp_pp take the degrees given; tp and pp take every rank.
        if strategy.tp and name != "tp":
            layouts[name].append(f"trainer_config.tp_size={args.tp_size}")
        if strategy.pipeline and name != "pp":
            layouts[name].append(f"trainer_config.pp_size={args.pp_size}")
    cp = 2
    while cp <= args.cp_size:
        layouts[f"ddp cp {cp}"] = [method + "ddp", f"trainer_config.cp_size={cp}",
                                   "gpt_config.dropout=0.0"]  # cp refuses dropout
        cp *= 2
    ep = 2
    while model.config.n_expert and ep <= args.world_size:
        layouts[f"fsdp ep {ep}"] = [method + "fsdp", f"trainer_config.ep_size={ep}"]
        ep *= 2
    return layouts


MEMORY_KEYS = ("parameters", "gradients", "optimizer", "model state", "buffers",
               "activations / micro-batch", "peak activations", "predicted peak")


def step_rate(cfg: DictConfig, args: argparse.Namespace, plan: dict, profile: dict
              ) -> tuple[float, float]:
    """(predicted step in seconds, tokens per second) of a layout's config from rank 0's plan
    (mingpt/step_time.py): tokens/s compares layouts whose ranks share a batch with others."""
    from mingpt import step_time  # noqa: PLC0415
    from mingpt.parallel import layout  # noqa: PLC0415
    t = cfg.trainer_config
    lay = layout.resolve(t.distributed_method, args.world_size, **layout.degrees(t))
    step = step_time.predict(args.world_size, lay.pp, {0: plan}, profile, t.microbatches)
    return step["step"], args.batch_size * lay.dp * args.block_size / step["step"]


def memory_rows(model: GPT, args: argparse.Namespace) -> tuple[list[dict[str, object]],
                                                                 list[str]]:
    """Rank 0's bytes under every layout that fits (one row each), and a line for each that
    does not; with a machine profile (--machine), each one's predicted step and tokens/s too,
    the fastest first."""
    from mingpt import ROOT, step_time  # noqa: PLC0415
    configs: dict[str, DictConfig] = {}
    plans = predict(model, memory_layouts(model, args), args.world_size, args.batch_size,
                    keep_refusals=True, configs=configs)
    try:
        profile = step_time.load_profile(ROOT / args.machine)
        step_time.check_world(profile, args.world_size)
    except ValueError as err:
        profile, refused = None, [f"predicted step: none ({err})"]
    else:
        refused = []
    # Human-readable sizes for the table; predict() keeps the exact bytes for tests.
    rows, speeds = [], []
    for name, by_rank in plans.items():
        plan = by_rank[0]
        if isinstance(plan, ValueError):
            refused.append(f"not shown: {name}: {plan}")
            continue
        row = {"layout": name, **{key: human_bytes(plan[key]) for key in MEMORY_KEYS}}
        if profile is not None:
            step, tokens = step_rate(configs[name], args, plan, profile)
            row.update({"predicted step": f"{1e3 * step:.1f} ms", "tokens/s": f"{tokens:,.0f}"})
            speeds.append(tokens)
        rows.append(row)
    if profile is not None:  # the fastest first
        rows = [row for _, row in sorted(zip(speeds, rows, strict=True), key=lambda x: -x[0])]
    return rows, refused


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    presets = [args.preset] if args.preset else list(PRESETS)
    try:
        if args.memory:
            model = build_on_meta(args.preset, args.vocab_size, args.block_size)
            print(f"{args.preset}: {model.num_params():,} parameters, vocab_size="
                  f"{args.vocab_size}, block_size={args.block_size}, batch_size="
                  f"{args.batch_size} per data-parallel rank, {args.world_size} ranks, fp32, "
                  "AdamW; rank 0's bytes, planned by the dry run (DRY_RUN.md), and with "
                  f"the machine of {args.machine}, each layout's predicted step, the fastest "
                  "first")
            rows, refused = memory_rows(model, args)
            print_table(rows)
            for line in refused:
                print(line)
            print("model state = parameters + gradients + AdamW's state; buffers: DDP's "
                  "gradient buckets, FSDP's gathered blocks; activations: what autograd "
                  "keeps for backward; predicted peak = model state + buffers + peak "
                  "activations")
            return 0
        rows = [size_row(p, args.vocab_size, args.block_size) for p in presets]
    except ValueError as err:  # an invalid model config: one line, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 1
    # vocab_size and block_size change the embedding tables, so print what the counts assume.
    print(f"vocab_size={args.vocab_size}  block_size={args.block_size}")
    print_table(rows)
    print("L/H/C: layers / heads / embedding width; params: tied wte/lm_head counted once")
    print("non-emb: params without the position embedding; active: of those, what one token "
          "computes with (MoE: expert_top_k experts per block; N below)")
    print("GFLOP/tok: training FLOPs per token, forward + backward: 6*N + 12*L*C*block_size")
    print("bf16, fp32: weights only; train snapshot: fp32 weights + AdamW's two fp32 moments "
          f"= {BYTES_TRAIN_SNAPSHOT} bytes/param")
    return 0


if __name__ == "__main__":
    sys.exit(main())
