"""Measure what each strategy costs: step time, tokens/s, MFU, memory, snapshot save and load,
and the trainer against a bare training loop; JSON, a table and a plot.

    python bench/bench.py                         # CPU: nanoGPT's CPU configuration, 1-2 ranks
    python bench/bench.py --runs ddp:1 fsdp:2 zero:2 --steps 300
    python bench/bench.py --preset gpt2 --precision bf16 --compile --block_size 1024 --batch_size 8
    python bench/bench.py --quality               # `python main.py` end to end: time to val 1.88
    python bench/bench.py ... -- gpt_config.dropout=0.1   # main.py overrides after --

Each run (strategy:ranks) has its own processes: `python bench.py --worker` for one rank, as
`python main.py` runs, or `torchrun --nproc_per_node=N bench.py --worker` for N. A worker builds
data, model and optimizer with main.py's load_train_objs and trains with the Trainer itself,
at the default logging interval, timing every step. For ddp on one rank it also times a bare
loop (forward, backward, clip, AdamW step, nothing else) on the same model, data and optimizer,
one bare step before each trainer step, so the trainer's overhead is a ratio measured under the
same load.
"""
import argparse
import itertools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

# The scripts and the library live one folder up (05_mingpt/), from wherever this is run.
HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
RESULT = "BENCH_RESULT "  # the prefix of the worker's one JSON line (rank 0)
QUALITY = 1.88  # the val loss of nanoGPT's CPU recipe (README: Speed)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # argparse would take main.py's overrides for its own options: split them off first.
    argv = sys.argv[1:] if argv is None else argv
    # main.py overrides (section.key=value) come after `--`, for every run.
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The defaults are nanoGPT's CPU recipe (4 layers, 128 wide, block 64, batch 12), so the
    # figures compare with its published 39 ms/iteration on the same machine.
    parser.add_argument("--runs", nargs="+", default=["ddp:1", "ddp:2", "zero:2", "fsdp:2",
                                                      "tp:2"],
                        help="strategy:ranks pairs (default: %(default)s)")
    parser.add_argument("--preset", default="gpt-micro", help="gpt_config.model_type")
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=12, help="sequences per rank per step")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--compile", action="store_true", help="torch.compile every block")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="trainer (and bare) rounds")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads per rank "
                        "(0: the cores this process may use, divided by the ranks)")
    parser.add_argument("--out", default="bench/perf", help="writes OUT.json and OUT.png")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="ddp:1 on a GPU: profile STEPS bare steps after the rounds and "
                        "report where the GPU time went (kernel kinds, busy share)")
    parser.add_argument("--quality", action="store_true",
                        help="time `python main.py` (with the overrides after --) to val 1.88")
    parser.add_argument("--replot", metavar="JSON", help="redraw the PNG of a saved JSON")
    # Set by launch() for the processes it starts; a user never types them.
    parser.add_argument("--worker", metavar="STRATEGY", help=argparse.SUPPRESS)
    parser.add_argument("--run_dir", help=argparse.SUPPRESS)  # the run's scratch folder
    args = parser.parse_args(argv)
    args.overrides = extra
    return args


def overrides(args: argparse.Namespace, strategy: str, ranks: int) -> list[str]:
    """main.py's config for one run: nanoGPT's CPU configuration by default (no dropout, so
    every strategy computes the same steps), evaluation and snapshots only at each round's end."""
    # tp_size: tensor parallelism spans every rank of the run (other strategies: none),
    # unless the overrides after -- set it (hydra takes a key once).
    tp = [] if any(o.startswith("trainer_config.tp_size=") for o in args.overrides) else \
        [f"trainer_config.tp_size={ranks if strategy in ('tp', 'fsdp_tp') else 0}"]
    # AdamW, which every strategy's figure in bench/README.md was measured with, unless given.
    adamw = [] if any(o.startswith("optimizer_config.name=") for o in args.overrides) else \
        ["optimizer_config.name=adamw"]
    return [f"gpt_config.model_type={args.preset}", f"gpt_config.block_size={args.block_size}",
            "gpt_config.dropout=0.0", f"trainer_config.distributed_method={strategy}", *tp,
            f"trainer_config.batch_size={args.batch_size}",
            f"trainer_config.precision={args.precision}", f"trainer_config.compile={args.compile}",
            f"trainer_config.max_steps={args.warmup + args.steps}",
            "trainer_config.eval_every=0", "trainer_config.save_every=0",
            "trainer_config.eval_batches=2", "trainer_config.sample_tokens=0",
            "trainer_config.keep_last=1", "run_name=bench", f"run_dir={args.run_dir}",
            *adamw, *args.overrides]


def step_times(stamps: list[float], warmup: int) -> list[float]:
    """Seconds per step from the start times of consecutive steps, without the warm-up."""
    # The first steps pay for allocator growth, lazy init and (with compile) compilation.
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)][warmup:]


def bare_steps(model, optimizer, train_set, t, device, seed: int) -> Iterator[float]:
    """A generator: each next() runs one step of forward, backward, clip, AdamW step and
    zero_grad, and gives its seconds. Nothing else: no loss bookkeeping, no schedule, no logs."""
    import torch
    from torch.utils.data import default_collate

    from mingpt.precision import autocast

    # A shuffled order as the trainer's sampler draws one: the same gather cost per batch.
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(seed))
    b = t.batch_size
    for i in itertools.count():
        start = time.perf_counter()
        # The trainer's DataLoader collates the same way (default_collate of the samples).
        x, y = default_collate([train_set[j] for j in order[i * b:(i + 1) * b].tolist()])
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device, t.precision):
            _, loss = model(x, y)
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # GPU work is asynchronous: wait for the step before reading the clock.
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        yield time.perf_counter() - start


# Kernel kinds by name, first match wins: what a GPU step's time is spent on. Attention first
# (cuDNN's attention kernels have "wgmma" in their names too), compiled code before copies
# (inductor names its kernels after the ops they fuse, "_to_copy" among them).
KERNEL_KINDS = (("attention", r"flash|fmha|attention|sdpa"),
                ("compiled (triton)", r"^triton"),
                ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|wgmma"),
                ("optimizer", r"adam|multi_tensor"),
                ("communication", r"nccl"),
                ("copy/fill", r"memcpy|memset|copy|fill"))


def kind_of(kernel: str) -> str:
    """The kind (KERNEL_KINDS) of a kernel, by its name; "other" if none matches."""
    return next((k for k, pattern in KERNEL_KINDS if re.search(pattern, kernel, re.I)), "other")


def profile_steps(steps: Iterator[float], n: int) -> dict:
    """Where a GPU step's time goes: n steps of `steps` under torch.profiler, their kernels'
    time per kind (KERNEL_KINDS) and per kernel, and the GPU's busy share of the wall time
    (below 1: the GPU waits for the CPU to launch work)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    next(steps)  # a step outside the profile, so its first step is a warm one
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = sum(next(steps) for _ in range(n))
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        # A user annotation (Optimizer.step#AdamW.step) spans kernels: not one of them.
        if (e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0
                and not e.is_user_annotation):
            kernels[e.key] = kernels.get(e.key, 0.0) + e.self_device_time_total / 1e3 / n
    kinds: dict[str, float] = {}
    for name, ms in kernels.items():
        kind = kind_of(name)
        kinds[kind] = kinds.get(kind, 0.0) + ms
    busy = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    return {"steps": n, "wall_ms_per_step": 1000 * wall / n, "gpu_ms_per_step": busy,
            "gpu_busy": busy / (1000 * wall / n),
            "kinds_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": [(name[:120], ms) for name, ms in top]}


def trainer_round(trainer, device, bare: Iterator[float] | None = None,
                  sync_at: tuple[int, ...] | None = None
                  ) -> tuple[list[float], list[float], float]:
    """Train with trainer.train(), stamping the start of every step; with `bare`, one bare step
    runs just before each trainer step. On a GPU each stamp waits for the work before it, or,
    with `sync_at`, only the stamps of those steps do: between them the CPU queues steps ahead
    of the GPU, as training does. (stamps, bare seconds, save seconds)."""
    import torch

    # Wrap the trainer's own methods rather than add timers to it: the trainer stays as users
    # run it, and what is timed is exactly its step, data loading and logging included.
    stamps, bare_s, saves = [], [], []
    run_batch, save = trainer._run_batch, trainer._save_snapshot

    def timed_batch(micro_batches):
        if device.type == "cuda" and (sync_at is None or len(stamps) in sync_at):
            torch.cuda.synchronize(device)
        if bare is not None:
            bare_s.append(next(bare))
        stamps.append(time.perf_counter())
        run_batch(micro_batches)

    def timed_save():
        start = time.perf_counter()
        save()
        saves.append(time.perf_counter() - start)

    trainer._run_batch, trainer._save_snapshot = timed_batch, timed_save
    trainer.train()  # its last step is not timed: it ends in the final evaluation and save
    return stamps, bare_s, sum(saves)


def worker(args: argparse.Namespace) -> None:
    """One rank of one run: rounds of the trainer (and the bare loop), then a timed load."""
    # Imported here: the launching process needs none of torch's distributed machinery.
    import torch
    import torch.distributed as dist

    import main
    from mingpt import config, distributed, errors, snapshot
    from mingpt.memory import peak_memory_mb
    from mingpt.mfu import device_name, peak_flops
    from mingpt.parallel.wrappers import unwrap
    from mingpt.trainer import Trainer

    strategy = args.worker
    # torchrun sets WORLD_SIZE; a plain `python bench.py --worker` is one rank.
    ranks = int(os.environ.get("WORLD_SIZE", 1))
    try:
        cfg = config.load(overrides(args, strategy, ranks))
    except ValueError as e:
        errors.fail(e)  # one `error:` line, exit 2
    t = cfg.trainer_config
    device = distributed.setup(t.device, t.cpu_offload)
    try:
        model, optimizer, train_set, val_set, data, meta, flops = main.load_train_objs(cfg, device)
        # The bare loop needs the model as it is: DDP on one rank is (mingpt/parallel/ddp.py).
        bare = strategy == "ddp" and ranks == 1
        trainer_tps, bare_tps, trainer_steps, save_s = [], [], [], []
        for r in range(args.rounds):
            # A fresh Trainer per round on the same model: each round starts at step 0 and
            # keeps the weights and optimizer state the earlier rounds left (warm caches).
            trainer = Trainer(t, model, optimizer, train_set, val_set, device, cfg.run_dir,
                              meta, flops)
            # The bare loop and the trainer take turns step by step, so both see the machine
            # as it is that second (other jobs make minutes differ by 10 %, more than the gap
            # being measured).
            steps = bare_steps(model, optimizer, train_set, t, device, seed=r) if bare else None
            stamps, bare_s, saved = trainer_round(trainer, device, steps)
            seconds = step_times(stamps, args.warmup)
            if bare:
                # Between two trainer stamps ran a trainer step and the next bare step.
                kept = bare_s[args.warmup + 1:]
                seconds = [s - b for s, b in zip(seconds, kept, strict=True)]
                bare_tps.append(t.batch_size * args.block_size * len(kept) / sum(kept))
            tokens = t.batch_size * args.block_size * trainer.dp_size  # per step, all ranks
            trainer_tps.append(tokens * len(seconds) / sum(seconds))
            trainer_steps.extend(seconds)
            save_s.append(saved)
        unsynced = None
        if device.type == "cuda":
            # Every timed step above waited for the GPU (to time it alone); a training run
            # does not, so the CPU prepares the next step while the GPU runs this one.
            trainer = Trainer(t, model, optimizer, train_set, val_set, device, cfg.run_dir,
                              meta, flops)
            last = args.warmup + args.steps - 1
            stamps, _, _ = trainer_round(trainer, device, sync_at=(args.warmup, last))
            tokens = t.batch_size * args.block_size * trainer.dp_size
            unsynced = tokens * (last - args.warmup) / (stamps[last] - stamps[args.warmup])
        training_peak = peak_memory_mb(device)  # since the last round's train() reset it
        setup_peak = trainer.log.setup_peak_mb
        # Load time is the slowest rank's: start and stop together.
        dist.barrier()
        start = time.perf_counter()
        snapshot.load(t.snapshot_path, model, optimizer, meta, data.MATCH_KEYS)
        dist.barrier()
        load_s = time.perf_counter() - start
        # Each rank's own bytes of model state (a shard under FSDP/ZeRO/TP), gathered on rank 0.
        states: list = [None] * dist.get_world_size()
        dist.all_gather_object(states, trainer.log.model_state)
        # Only rank 0 prints the result line: launch() reads the first one it sees.
        if dist.get_rank() == 0:
            # The median round: one round disturbed by the machine's other load moves it least.
            tps = statistics.median(trainer_tps)
            peak = peak_flops(device_name(device), t.precision)
            result = {
                "strategy": strategy, "ranks": ranks, "threads": torch.get_num_threads(),
                "device": device_name(device) or platform.processor() or "cpu",
                "median_step_ms": 1000 * statistics.median(trainer_steps),
                "tokens_per_s": tps, "tokens_per_s_per_rank": tps / ranks,
                "tokens_per_s_rounds": trainer_tps,
                "mfu": flops * tps / (peak * ranks) if peak else None,
                "setup_peak_mb": setup_peak, "training_peak_mb": training_peak,
                "model_state_mb": [sum(s.values()) / 2**20 for s in states],
                "save_s": statistics.median(save_s), "load_s": load_s,
                "num_params": unwrap(model).num_params(),
            }
            if unsynced is not None:
                result["unsynced_tokens_per_s"] = unsynced
                result["unsynced_mfu"] = flops * unsynced / (peak * ranks) if peak else None
            if args.profile and bare and device.type == "cuda":
                result["profile"] = profile_steps(
                    bare_steps(model, optimizer, train_set, t, device, seed=args.rounds),
                    args.profile)
            if bare:
                result["bare_tokens_per_s"] = statistics.median(bare_tps)
                result["bare_tokens_per_s_rounds"] = bare_tps
                # Each trainer round against the bare round just before it: a pair shares the
                # machine's speed of that minute (other jobs come and go), so the median of the
                # pairs' ratios is steadier than a ratio of medians.
                result["overhead_ratio"] = statistics.median(
                    tr / br for tr, br in zip(trainer_tps, bare_tps, strict=True))
            print(RESULT + json.dumps(result), flush=True)
        del trainer, model, optimizer  # all that holds the group, before distributed.release
    finally:
        distributed.release()


def launch(args: argparse.Namespace, run: str) -> dict | None:
    """One run's workers; their result, or None (with the reason printed)."""
    strategy, _, ranks = run.partition(":")
    ranks = int(ranks or 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # As torchrun does by default (OMP_NUM_THREADS=1 on a machine of several workers), but
    # sharing every core the process may use, so 1 rank x 2 threads compares with 2 x 1.
    threads = args.threads or max(1, cores // ranks)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    # Logs and snapshots of a benchmark are scratch: a fresh folder per run, removed after.
    with tempfile.TemporaryDirectory(prefix="bench_") as run_dir:
        script = ["bench/bench.py", "--worker", strategy, "--run_dir", run_dir,
                  *worker_options(args)]
        if ranks == 1:  # as `python main.py` runs: one process, no torchrun
            cmd = [sys.executable, *script]
        else:
            torchrun = str(Path(sys.executable).with_name("torchrun"))
            cmd = [torchrun, "--standalone", f"--nproc_per_node={ranks}", *script]
        proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True)
    # A run that fails is reported and skipped: the others still give their figures.
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        print(f"{run}: failed (exit {proc.returncode}): "
              f"{(errors or proc.stderr.splitlines() or ['no output'])[-1]}", flush=True)
        if not errors:  # a crash, not a refused config: its traceback says where
            print("\n".join(proc.stderr.splitlines()[-40:]), file=sys.stderr, flush=True)
        return None
    return json.loads(lines[0].removeprefix(RESULT))


def worker_options(args: argparse.Namespace) -> list[str]:
    """The options that shape a run, passed on to its workers, and the overrides after --."""
    return ["--preset", args.preset, "--block_size", str(args.block_size), "--batch_size",
            str(args.batch_size), "--precision", args.precision, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--rounds", str(args.rounds),
            "--profile", str(args.profile), *(["--compile"] if args.compile else []), "--",
            *args.overrides]


def row(r: dict) -> str:
    """One line of the table."""
    line = (f"{r['strategy'] + ':' + str(r['ranks']):9} {r['threads']:>3} thr | "
            f"{r['median_step_ms']:8.1f} ms/step | {r['tokens_per_s']:9,.0f} tokens/s "
            f"({r['tokens_per_s_per_rank']:,.0f}/rank) | ")
    # MFU only where the device's peak is known (mfu.py); CPUs have none.
    line += f"MFU {100 * r['mfu']:.1f}% | " if r["mfu"] is not None else ""
    line += (f"peak {max(r['training_peak_mb']):,.0f} MB | state "
             f"{max(r['model_state_mb']):,.1f} MB | save {r['save_s']:.2f} s | load "
             f"{r['load_s']:.2f} s")
    if r.get("unsynced_tokens_per_s"):
        line += (f"\n{'':9} not waiting for the GPU at each step: "
                 f"{r['unsynced_tokens_per_s']:,.0f} tokens/s" +
                 (f", MFU {100 * r['unsynced_mfu']:.1f}%" if r["unsynced_mfu"] else ""))
    if "profile" in r:
        p = r["profile"]
        line += (f"\n{'':9} profile: GPU busy {100 * p['gpu_busy']:.0f}% of "
                 f"{p['wall_ms_per_step']:.1f} ms/step; " +
                 ", ".join(f"{k} {ms:.1f} ms" for k, ms in p["kinds_ms"].items()))
    if "overhead_ratio" in r:
        line += (f"\n{'':9} bare loop {r['bare_tokens_per_s']:,.0f} tokens/s: the trainer runs "
                 f"at {r['overhead_ratio']:.3f}x of it")
    return line


def plot(info: dict, path: Path) -> None:
    """tokens/s (with the bare loop beside ddp on one rank) and peak memory per run."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    results = info["results"]
    names = [f"{r['strategy']}:{r['ranks']}" for r in results]
    x = list(range(len(names)))
    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    # Left: throughput, the bare loop as a thin gray bar beside the run it was measured in.
    ax_speed.bar(x, [r["tokens_per_s"] for r in results], 0.6, label="trainer")
    bare = [(i, r["bare_tokens_per_s"]) for i, r in enumerate(results) if "bare_tokens_per_s" in r]
    if bare:
        ax_speed.bar([i + 0.3 for i, _ in bare], [v for _, v in bare], 0.3, color="gray",
                     label="bare loop")
    ax_speed.set_xticks(x, names)
    ax_speed.set(ylabel="tokens/s (all ranks)", title=info["title"])
    ax_speed.legend(fontsize=8)
    # Right: the largest rank's memory (sharding shows as a lower model-state bar).
    ax_mem.bar([i - 0.2 for i in x], [max(r["training_peak_mb"]) for r in results], 0.4,
               label="training peak")
    ax_mem.bar([i + 0.2 for i in x], [max(r["model_state_mb"]) for r in results], 0.4,
               label="model state")
    ax_mem.set_xticks(x, names)
    ax_mem.set(ylabel="MB per rank (largest rank)", title="memory")
    ax_mem.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def machine() -> dict:
    """What the figures were measured on."""
    import torch

    # platform.processor() is often empty or just the architecture on Linux.
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:  # Linux: the CPU's marketing name
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    # The kernel set torch picks by instruction set (ATEN_CPU_CAPABILITY forces another).
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def timed_main(overrides: list[str], budget_s: float | None = None,
               stop_at: float | None = None) -> dict:
    """`python main.py` with `overrides`, timed from before its start to every val loss it
    prints; stopped (SIGTERM) after `budget_s` seconds, or at the first val loss at or below
    `stop_at`, where given. Returns what it saw."""
    # Unbuffered output: each val line is timed when main.py prints it, not at a flush.
    cmd = [sys.executable, "main.py", *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # From before the child starts, so imports and data preparation count as the user waits.
    start = time.perf_counter()
    curve, lines = [], []
    with subprocess.Popen(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, text=True) as proc:
        timer = None
        if budget_s is not None:  # the line reader below blocks: a timer stops the run
            timer = threading.Timer(budget_s, proc.terminate)
            timer.start()
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            found = re.match(r"step (\d+) \| val loss ([0-9.]+)", line)
            if found:
                curve.append((time.perf_counter() - start, int(found[1]), float(found[2])))
                print(f"{curve[-1][0]:6.1f} s  step {found[1]:>5}  val {found[2]}", flush=True)
                if stop_at is not None and curve[-1][2] <= stop_at:
                    proc.terminate()  # the figure is in: the rest of the run moves none
        if timer is not None:
            timer.cancel()
    wall = time.perf_counter() - start
    # The first val loss at or below the target, the figure the default recipe is held to.
    reached = next(((s, step) for s, step, v in curve if v <= QUALITY), None)
    # Sequences per step and tokens per sequence (main.py's start lines): the tokens a run
    # has seen by a step.
    per_step = next((int(m[1]) for line in lines
                     if (m := re.search(r"(\d+) sequences per step", line))), 0)
    block = next((int(m[1]) for line in lines if (m := re.search(r"block (\d+)\)", line))), 0)
    return {"command": " ".join(["python", "main.py", *overrides]), "machine": machine(),
            "returncode": proc.returncode, "curve": curve, "wall_s": wall,
            "final_val": curve[-1][2] if curve else None, "tokens_per_step": per_step * block,
            "time_to_quality_s": reached[0] if reached else None,
            "step_to_quality": reached[1] if reached else None,
            # The trainer's own summary of evaluation and snapshot time (trainer.py).
            "paused": next((line for line in lines if " s in training: " in line), "")}


def quality(args: argparse.Namespace) -> int:
    """`python main.py` with the overrides, timed from process start to every val loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    info = timed_main(args.overrides)
    curve, reached = info.pop("curve"), info["time_to_quality_s"]
    if info.pop("returncode") != 0 or not curve:
        print("error: main.py failed", file=sys.stderr)
        return 1
    info["curve"] = curve
    print(f"val <= {QUALITY} at " + (f"{reached:.1f} s (step {info['step_to_quality']})"
                                     if reached else "never") +
          f"; final val {curve[-1][2]:.4f} after {info['wall_s']:.1f} s; {info['paused']}")
    out = HERE / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(info, indent=1))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([c[0] for c in curve], [c[2] for c in curve], "o-", label="python main.py")
    ax.axhline(QUALITY, color="gray", ls="--", lw=1, label=f"val {QUALITY}")
    ax.set(xlabel="seconds since the process started", ylabel="val loss",
           ylim=(min(c[2] for c in curve) - 0.05, 2.6), title=info["command"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Three modes: a worker (started by launch), the end-to-end quality run, and redrawing.
    if args.worker:
        worker(args)
        return 0
    if args.quality:
        return quality(args)
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return 0
    results = []
    for run in args.runs:
        result = launch(args, run)
        if result is not None:
            results.append(result)
            print(row(result), flush=True)
    # Scaling: ddp on N ranks (one thread each) against ddp on one rank using all N cores.
    one = next((r for r in results if r["strategy"] == "ddp" and r["ranks"] == 1), None)
    for r in results:
        if one and r["strategy"] == "ddp" and r["ranks"] > 1:
            r["scaling"] = r["tokens_per_s"] / one["tokens_per_s"]
            print(f"ddp:{r['ranks']} ({r['threads']} thread each) vs ddp:1 ({one['threads']} "
                  f"threads): {r['scaling']:.3f}x the tokens/s")
    if not results:
        return 1
    out = HERE / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    info = {"command": " ".join(["python", "bench/bench.py", *(argv or sys.argv[1:])]),
            "machine": machine(), "args": vars(args),
            "title": f"{args.preset}, batch {args.batch_size} x {args.block_size}, "
                     f"{args.precision}" + (", compiled" if args.compile else ""),
            "results": results}
    out.with_suffix(".json").write_text(json.dumps(info, indent=1))
    plot(info, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
