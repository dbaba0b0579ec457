"""How long a snapshot save blocks the training loop: blocking saves against asynchronous ones.

    python bench/bench_async_save.py                         # gpt2-medium, fsdp on 2 ranks
    python bench/bench_async_save.py --preset gpt-nano --saves 2 --out bench/tiny_async

For each of trainer_config.async_save=false and true, torchrun starts 2 ranks of this script;
they build the model, optimizer and Trainer as main.py does (fsdp), then alternate --every
training steps (the trainer's own `_run_batch`) and a save (the trainer's own `_save_snapshot`),
and time each save call: the time the training loop is blocked by it (an asynchronous save
also waits there for the one before, if its write is still going on). The asynchronous
saver's finish() (the wait for the last write and its commit, once, at the end of a run) is
timed apart. The first asynchronous save also starts DCP's staging process: reported apart.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MINGPT = HERE.parent
RESULT = "RESULT "


def overrides(args: argparse.Namespace, async_save: bool) -> list[str]:
    # Dropout off and keep_last=1: the two runs differ in async_save only, and each save
    # removes the one before (gpt2-medium's shards and AdamW state: ~4 GB a snapshot).
    return [f"gpt_config.model_type={args.preset}", f"gpt_config.block_size={args.block_size}",
            "gpt_config.dropout=0.0", f"trainer_config.batch_size={args.batch_size}",
            "trainer_config.distributed_method=fsdp", f"trainer_config.async_save={async_save}",
            "trainer_config.keep_last=1", "trainer_config.sample_tokens=0",
            f"trainer_config.snapshot_path={args.dir}/{'async' if async_save else 'sync'}",
            f"run_name=bench_async_save_{async_save}".lower(),
            "optimizer_config.name=adamw"]  # AdamW's state, as bench/README.md's figures


def worker(args: argparse.Namespace) -> None:
    """One rank: steps and saves, each save timed; rank 0 prints the result."""
    sys.path.insert(0, str(MINGPT))
    import torch.distributed as dist  # noqa: PLC0415 (the launcher needs none of this)
    from torch.utils.data import DataLoader  # noqa: PLC0415

    import main  # noqa: PLC0415
    from mingpt import config, distributed  # noqa: PLC0415
    from mingpt.parallel.wrappers import unwrap  # noqa: PLC0415
    from mingpt.trainer import Trainer, rank_indices  # noqa: PLC0415

    cfg = config.load(overrides(args, args.worker == "async"))
    # gloo beside NCCL on a GPU where async: DCP plans an asynchronous save over a CPU backend.
    device = distributed.setup(cfg.trainer_config.device, cfg.trainer_config.async_save)
    try:
        model, optimizer, train_set, val_set, _, meta, flops = main.load_train_objs(cfg, device)
        t = cfg.trainer_config
        trainer = Trainer(t, model, optimizer, train_set, val_set, device, cfg.run_dir, meta,
                          flops)
        indices = rank_indices(len(train_set), 0, t.seed, 0, trainer.dp_rank, trainer.dp_size)
        batches = iter(DataLoader(train_set, batch_size=t.batch_size, sampler=indices))
        steps, saves = [], []
        for _ in range(args.saves):
            for _ in range(args.every):  # the steps between two saves
                start = time.perf_counter()
                trainer._run_batch([next(batches)])
                trainer.step += 1
                steps.append(time.perf_counter() - start)
            start = time.perf_counter()
            trainer._save_snapshot()  # what the loop waits for at a save_every step
            saves.append(time.perf_counter() - start)
        # The end of a run: the last asynchronous write waited for, then committed.
        start = time.perf_counter()
        trainer.saver.finish()
        finish = time.perf_counter() - start
        timings: list = [None] * dist.get_world_size()
        dist.all_gather_object(timings, {"steps": steps, "saves": saves, "finish": finish})
        if dist.get_rank() == 0:
            print(RESULT + json.dumps({
                "async_save": t.async_save, "num_params": unwrap(model).num_params(),
                # The slower rank's time: the loop goes on when both have.
                "every": args.every,
                "step_s": [max(r["steps"][i] for r in timings) for i in range(len(steps))],
                "save_s": [max(r["saves"][i] for r in timings) for i in range(args.saves)],
                "finish_s": max(r["finish"] for r in timings)}), flush=True)
        del trainer, model, optimizer
    finally:
        distributed.release()


def launch(args: argparse.Namespace, mode: str) -> dict:
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone",
           "--nproc_per_node=2", __file__, "--worker", mode, "--preset", args.preset,
           "--block_size", str(args.block_size), "--batch_size", str(args.batch_size),
           "--saves", str(args.saves), "--every", str(args.every), "--dir", args.dir]
    proc = subprocess.run(cmd, cwd=MINGPT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{mode} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-3000:]}")
    return json.loads(lines[0][len(RESULT):])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-medium")
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--saves", type=int, default=3, help="how many saves")
    parser.add_argument("--every", type=int, default=2, help="training steps before each save")
    parser.add_argument("--dir", default="/tmp/bench_async_save", help="snapshots go here")
    parser.add_argument("--out", help="JSON of the results (bench/NAME.json)")
    parser.add_argument("--worker", choices=("sync", "async"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    import torch  # noqa: PLC0415
    # One after the other, never at once: each run has the machine (and its disk) alone.
    runs = [launch(args, mode) for mode in ("sync", "async")]
    for run in runs:
        first, later = run["save_s"][0], run["save_s"][1:]
        mean = sum(later) / max(len(later), 1)
        print(f"async_save={run['async_save']!s:5}: save blocks the loop {first:.2f} s (first), "
              f"{mean:.2f} s (later, mean); finish {run['finish_s']:.2f} s; step "
              f"{sum(run['step_s']) / len(run['step_s']):.2f} s")
    if args.out:
        info = {"command": " ".join(["python", "bench/bench_async_save.py", *argv]),
                "machine": platform.processor() or platform.machine(),
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "torch": torch.__version__, "runs": runs}
        Path(MINGPT / f"{args.out}.json").write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":  # DCP's staging process imports this file again: nothing may run
    main(sys.argv[1:])
