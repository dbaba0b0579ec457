"""Measure what one rank holds per strategy, next to the dry run's prediction; JSON + a plot.

    python bench/bench_memory.py                                   # gpt2-medium sizes, 2 CPU ranks
    python bench/bench_memory.py --preset gpt-mini --steps 3 --strategies ddp fsdp
    MALLOC_MMAP_THRESHOLD_=131072 python bench/bench_memory.py     # see README: CPU memory

For each strategy it launches `torchrun --nproc_per_node=N bench_memory.py --worker ...`. Every
worker builds data, model and optimizer with main.py's own load_train_objs (so FSDP is built
on the meta device, exactly as in training), runs a few optimizer steps with the Trainer's own
step (`_run_batch`), and reports per rank: the resident set before the model exists, the setup
peak, the training peak (after reset_peak_memory) and the model-state bytes counted from the
local shards. No evaluation, no snapshot: the peaks are building and training only. Beside
them, the dry run's plan of each rank (model_size.predict, mingpt/dry_run.py): the same
layout and one training step on fake tensors, counted; its predicted peak plus the measured
baseline is set against the measured training peak.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# The scripts and the library live one folder up (05_mingpt/), from wherever this is run.
HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
RESULT = "BENCH_MEMORY_RESULT "  # the prefix of the worker's one JSON line (rank 0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-medium", help="model_type (default: "
                        "gpt2-medium, 303M parameters with the 65-character vocabulary)")
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps (the first "
                        "creates AdamW's state, so peaks need at least 2)")
    parser.add_argument("--ranks", type=int, default=2, help="processes (torchrun)")
    parser.add_argument("--tp_size", type=int, default=2, help="tp group size for fsdp_tp")
    parser.add_argument("--strategies", nargs="+",
                        default=["ddp", "zero", "fsdp", "tp", "fsdp_tp", "pp"])
    parser.add_argument("--out", default="bench/memory", help="writes OUT.json and OUT.png")
    parser.add_argument("--replot", metavar="JSON", help="redraw the PNG of a saved JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def overrides(args: argparse.Namespace, strategy: str) -> list[str]:
    """main.py's config for this measurement: the model, one batch size, no dropout noise."""
    # Pure TP puts every rank in one group; fsdp_tp uses groups of tp_size.
    tp_size = args.ranks if strategy == "tp" else args.tp_size
    return [f"gpt_config.model_type={args.preset}", f"gpt_config.block_size={args.block_size}",
            f"trainer_config.distributed_method={strategy}",
            f"trainer_config.batch_size={args.batch_size}",
            f"trainer_config.max_steps={args.steps}", "trainer_config.warmup_steps=1",
            f"trainer_config.tp_size={tp_size if strategy in ('tp', 'fsdp_tp') else 0}",
            # pp: one pipeline over all ranks, each sequence its own micro-batch (they must
            # divide batch_size); the other strategies ignore the key.
            f"trainer_config.microbatches={args.batch_size}",
            "trainer_config.sample_tokens=0", "run_name=bench_memory",
            "optimizer_config.name=adamw"]  # AdamW's state, as bench/README.md's tables


def rss_mb() -> float:
    """This process's resident set right now (Linux), in MiB."""
    # VmRSS: pages resident now (ru_maxrss would give the peak, not the current size).
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def worker(args: argparse.Namespace, strategy: str) -> None:
    """One rank under torchrun: build as main.py does, train `steps` steps, report."""
    # Imported here: the launching process needs none of torch's distributed machinery.
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import main
    from mingpt import config, distributed, errors
    from mingpt.memory import model_state_bytes, peak_memory_mb, reset_peak_memory
    from mingpt.parallel.wrappers import unwrap
    from mingpt.trainer import Trainer, rank_indices

    try:
        cfg = config.load(overrides(args, strategy))
    except ValueError as e:  # e.g. TP over ranks that do not divide the heads
        errors.fail(e)  # one `error:` line, exit 2
    device = distributed.setup(cfg.trainer_config.device)
    try:
        baseline = rss_mb()  # torch, the data module, the process group: before any model
        model, optimizer, train_set, val_set, _, meta, flops = main.load_train_objs(cfg, device)
        # Building (and for FSDP sharding) is over: its peak, then a fresh one for training.
        setup = peak_memory_mb(device)
        reset_peak_memory(device)
        t = cfg.trainer_config
        trainer = Trainer(t, model, optimizer, train_set, val_set, device, cfg.run_dir, meta,
                          flops)
        # The ranks that see different data (under TP, a group shares its batch).
        dp_rank = getattr(trainer, "dp_rank", dist.get_rank())
        dp_size = getattr(trainer, "dp_size", dist.get_world_size())
        indices = rank_indices(len(train_set), 0, t.seed, 0, dp_rank, dp_size)
        # The trainer's sampler order, without its epoch loop, evaluation and snapshots.
        batches = iter(DataLoader(train_set, batch_size=t.batch_size, sampler=indices))
        seconds = []
        for _ in range(args.steps):
            start = time.perf_counter()
            trainer._run_batch([next(batches)])  # the trainer's own step
            seconds.append(time.perf_counter() - start)
        training = peak_memory_mb(device)
        # The trainer counted the local shards at the first step, before zero_grad freed the
        # gradients; counting again now would find no gradients.
        state = trainer.log.model_state or model_state_bytes(model, optimizer)
        states: list = [None] * dist.get_world_size()
        dist.all_gather_object(states, {**state, "baseline": baseline})
        if dist.get_rank() == 0:
            # Steady-state speed: the steps after the first (which allocates AdamW's state).
            tokens = t.batch_size * cfg.gpt_config.block_size * dp_size  # per step, all ranks
            timed = seconds[1:] or seconds
            print(RESULT + json.dumps({
                "strategy": strategy, "setup_peak_mb": setup, "training_peak_mb": training,
                "baseline_mb": [s["baseline"] for s in states],
                **{f"{key}_bytes": [s[key] for s in states]
                   for key in ("parameters", "gradients", "optimizer")},
                "tokens_per_s": tokens * len(timed) / sum(timed),
                "num_params": unwrap(model).num_params(),
            }), flush=True)
        # Drop everything that holds the process group before release_group destroys it.
        del trainer, model, optimizer
    finally:
        distributed.release()


def predict(args: argparse.Namespace, strategies: list[str]) -> dict[str, list[dict]]:
    """The dry run's plan of every rank for each strategy (model_size.predict; a meta model
    and fake tensors: no memory): {strategy: [rank 0's bytes by kind, rank 1's, ...]}. A
    strategy the config refuses gets none (its workers are refused with the same line)."""
    import torch

    import model_size
    from mingpt import config
    from mingpt.model import GPT

    layouts, model = {}, None
    for strategy in strategies:
        try:
            cfg = config.load(overrides(args, strategy))
        except ValueError:
            continue
        # The model the workers build: the config's sizes (dropout included), and the
        # 65-character vocabulary of the character data main.py trains on by default.
        gpt_config = config.model_config(cfg, {"vocab_size": 65,
                                               "block_size": args.block_size})[0]
        if model is None:  # one model for all: the strategies share its sizes
            with torch.device("meta"):
                model = GPT(gpt_config)
        t = cfg.trainer_config
        layouts[strategy] = [f"trainer_config.distributed_method={strategy}",
                             f"trainer_config.tp_size={t.tp_size}"]
    if not layouts:
        return {}
    # pp: one pipeline of all ranks, micro-batches of one sequence (as overrides() sets).
    plans = model_size.predict(model, layouts, args.ranks, args.batch_size,
                               ranks=tuple(range(args.ranks)), microbatches=args.batch_size)
    # Bytes by kind; the communication table is the dry run's own report (DRY_RUN.md).
    return {strategy: [{k: v for k, v in by_rank[rank].items() if k != "comm"}
                       for rank in range(args.ranks)] for strategy, by_rank in plans.items()}


def launch(args: argparse.Namespace, strategy: str) -> dict | None:
    """Run one strategy's workers; their result, or None (with the reason printed)."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--standalone", f"--nproc_per_node={args.ranks}", "bench/bench_memory.py",
           "--worker", "--strategies", strategy, *argv_options(args)]
    # One intra-op thread per rank unless told otherwise (torchrun's default too): the ranks
    # share the cores. MALLOC_MMAP_THRESHOLD_, if set, passes on to the workers unchanged.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    # A strategy that cannot run here (TP on heads that do not split) is skipped, with why.
    if proc.returncode != 0 or not lines:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        print(f"{strategy}: failed (exit {proc.returncode}): "
              f"{(errors or proc.stderr.splitlines() or ['no output'])[-1]}")
        return None
    return json.loads(lines[0].removeprefix(RESULT))


def argv_options(args: argparse.Namespace) -> list[str]:
    """The size options, passed on to the workers unchanged."""
    return ["--preset", args.preset, "--block_size", str(args.block_size), "--batch_size",
            str(args.batch_size), "--steps", str(args.steps), "--ranks", str(args.ranks),
            "--tp_size", str(args.tp_size)]


def plot(results: list[dict], path: Path, title: str) -> None:
    """Per-rank memory (measured peaks, model state, prediction) and tokens/s per strategy."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    names = [r["strategy"] for r in results]
    x = range(len(names))
    fig, (ax_mem, ax_speed) = plt.subplots(1, 2, figsize=(11, 4.2),
                                           gridspec_kw={"width_ratios": [3, 1.3]})
    bars = {  # rank 0's (or the largest rank's) value, MiB
        "setup peak (RSS)": [max(r["setup_peak_mb"]) for r in results],
        "training peak (RSS)": [max(r["training_peak_mb"]) for r in results],
        "model state, counted": [r["model_state_mb"] for r in results],
        # The dry run's peak is what training adds; the process itself (torch, data, the
        # process group) was measured before the model existed: the baseline.
        "predicted peak (dry run + baseline)": [max(predicted_peak_mb(r)) for r in results],
    }
    width = 0.8 / len(bars)  # the bars of one strategy side by side, 0.8 of a slot
    for i, (label, values) in enumerate(bars.items()):
        ax_mem.bar([v + i * width for v in x], values, width, label=label)
    ax_mem.set_xticks([v + 0.4 - width / 2 for v in x], names)
    ax_mem.set(ylabel="MiB per rank (largest rank)", title=title)
    ax_mem.legend(fontsize=8)
    ax_speed.bar(list(x), [r["tokens_per_s"] for r in results], color="gray")
    ax_speed.set_xticks(list(x), names)
    ax_speed.set(ylabel="tokens/s (all ranks)", title="speed (CPU, noisy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def title(info: dict) -> str:
    """The figure's title: model, ranks, batch and the allocator setting of the runs."""
    a = info["args"]
    return (f"{a['preset']}, {a['ranks']} CPU ranks, batch {a['batch_size']} x "
            f"{a['block_size']}, MALLOC_MMAP_THRESHOLD_={info['MALLOC_MMAP_THRESHOLD_']}")


def predicted_peak_mb(result: dict) -> list[float]:
    """Each rank's predicted training peak, MiB: the dry run's (model state + buffers + peak
    activations) on top of the resident set the rank had before its model existed."""
    return [plan["predicted peak"] / 2**20 + baseline
            for plan, baseline in zip(result["predicted"], result["baseline_mb"], strict=True)]


def summary(result: dict) -> str:
    """One line per strategy: measured against predicted, MiB per rank (the largest rank)."""
    measured, predicted = max(result["training_peak_mb"]), max(predicted_peak_mb(result))
    state = max(p["model state"] for p in result["predicted"]) / 2**20
    return (f"{result['strategy']:8} setup peak {max(result['setup_peak_mb']):7,.0f} | training "
            f"peak {measured:7,.0f}, predicted {predicted:7,.0f} ({predicted / measured - 1:+.1%};"
            f" baseline {max(result['baseline_mb']):,.0f}) | model state "
            f"{result['model_state_mb']:7,.1f} (predicted {state:,.1f}) MiB "
            f"| {result['tokens_per_s']:,.0f} tokens/s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:  # one rank of one strategy, under torchrun
        worker(args, args.strategies[0])
        return 0
    if args.replot:  # the figure again, from measurements already made
        info = json.loads(Path(args.replot).read_text())
        plot(info["results"], Path(args.replot).with_suffix(".png"), title(info))
        return 0
    # The dry run first, all strategies at once: its processes are gone before any worker
    # starts, so they take no memory from the measurement.
    plans = predict(args, args.strategies)
    results = []
    for strategy in args.strategies:
        start = time.perf_counter()
        result = launch(args, strategy)
        if result is None:
            continue
        result["wall_s"] = time.perf_counter() - start
        result["predicted"] = plans[strategy]
        result["model_state_mb"] = max(sum(result[f"{k}_bytes"][r] for k in
                                           ("parameters", "gradients", "optimizer"))
                                       for r in range(args.ranks)) / 2**20
        results.append(result)
        print(summary(result), flush=True)
    if not results:
        return 1
    out = HERE / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    # The allocator setting decides whether freed memory leaves the RSS (README): record it.
    malloc = os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default")
    info = {"command": " ".join(["python", "bench/bench_memory.py", *(argv or sys.argv[1:])]),
            "MALLOC_MMAP_THRESHOLD_": malloc, "machine": os.uname().nodename,
            "cpus": os.cpu_count(), "args": vars(args), "results": results}
    out.with_suffix(".json").write_text(json.dumps(info, indent=1))
    plot(results, out.with_suffix(".png"), title(info))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
