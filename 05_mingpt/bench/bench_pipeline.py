"""Measure the pipeline bubble per schedule against (p - 1) / (m + p - 1), and each rank's model
state against the dry run's prediction; JSON + a plot.

    python bench/bench_pipeline.py                          # 2 CPU ranks, m = 2, 4, 8, 16
    python bench/bench_pipeline.py --microbatches 4 8 16 --schedules 1f1b interleaved_zb

Spawns --ranks gloo processes (one pipeline, pp = ranks). Each builds the model, splits it with
parallel.parallelize(..., "pp") and, per schedule and micro-batch count m, times --steps
optimizer steps after a warm-up step through the pipeline's own entry points (as the
trainer's step calls them). A rank's idle time is its step time less its busy time: its
stages' forward and backward of the m micro-batches run alone, without communication. (The
time in point-to-point waits, torch's `_wait_batch_p2p` timed, is recorded too: waiting for
the previous stage's activations or the next one's gradients.) Its share of the step is set
beside the schedule's ideal: (p - 1) / (m + p - 1) for gpipe and 1f1b, (p - 1) / (v m + p - 1)
for the looped schedules with v stages per rank (Narayanan et al. 2021), 0 for a perfect
zero-bubble one. For gpipe and 1f1b, each rank's model state after a step is set beside the
dry run's plan of that rank (model_size.predict, made by this script's main process after
the ranks are done: the dry run's own processes are no gloo rank's).
"""
import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import spawn  # bench/ranks.py: run as a script, its own folder is on the path

# The scripts and the library live one folder up (05_mingpt/), from wherever this is run.
HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="pipeline stages (processes)")
    parser.add_argument("--schedules", nargs="+",
                        default=["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb"])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--batch_size", type=int, default=16, help="sequences per step")
    parser.add_argument("--n_layer", type=int, default=8)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--out", default="bench/pipeline", help="writes OUT.json and OUT.png")
    return parser.parse_args(argv)


def ideal_bubble(schedule: str, p: int, m: int, per_rank: int = 2) -> float:
    """The schedule's idle share of a step with equal stages and free communication."""
    from mingpt.parallel import pipeline  # noqa: PLC0415  (path set above)
    v = pipeline.stages_per_rank(schedule, per_rank)
    if schedule == "interleaved_zb":
        return 0.0  # its backward's weight half fills the bubble, in the ideal
    return (p - 1) / (v * m + p - 1)


def busy_seconds(stages: list[torch.nn.Module], x: torch.Tensor, m: int, n_embd: int) -> float:
    """The compute of this rank's stages alone: forward and backward of each of the m
    micro-batches, no communication (inputs of the shape the previous stage sends)."""
    start = time.perf_counter()
    for chunk in x.tensor_split(m):
        for stage in stages:
            given = chunk if stage.first else torch.randn(*chunk.shape, n_embd,
                                                          requires_grad=True)
            stage(given).float().square().mean().backward()
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def gpt_config(args: argparse.Namespace):
    """The model every rank builds: n_layer blocks of width n_embd, 4 heads, no dropout."""
    from mingpt.model import GPTConfig  # noqa: PLC0415  (path set above)
    return GPTConfig(model_type=None, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd,
                     vocab_size=65, block_size=args.block_size, dropout=0.0)


def predict(args: argparse.Namespace, rows: list[dict]) -> None:
    """Each gpipe and 1f1b row gets the dry run's model state of its rank (model_size.predict:
    the same pipeline of --ranks stages, planned on fake tensors) as predicted_model_state;
    the looped schedules get None (the dry run plans the config's schedules of one stage
    per rank)."""
    import model_size  # noqa: PLC0415
    from mingpt.model import GPT  # noqa: PLC0415
    with torch.device("meta"):
        model = GPT(gpt_config(args))  # shapes only
    for schedule in ("gpipe", "1f1b"):
        for m in sorted({r["microbatches"] for r in rows if r["schedule"] == schedule
                         and "refused" not in r}):
            plans = model_size.predict(
                model, {schedule: ["trainer_config.distributed_method=pp",
                                   f"trainer_config.pp_schedule={schedule}"]},
                args.ranks, args.batch_size, ranks=tuple(range(args.ranks)), microbatches=m)
            for row in rows:
                if (row["schedule"], row["microbatches"]) == (schedule, m):
                    plan = plans[schedule][row["rank"]]
                    row["predicted_model_state"] = {k: plan[k] for k in row["model_state"]}
    for row in rows:
        if "refused" not in row:
            row.setdefault("predicted_model_state", None)


def worker(rank: int, store: str, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # one core per stage: the ranks share the machine's cores
    from torch.distributed.pipelining import schedules  # noqa: PLC0415

    from mingpt import distributed, memory, optim, parallel  # noqa: PLC0415
    from mingpt.model import GPT  # noqa: PLC0415
    dist.init_process_group("gloo", store=dist.FileStore(store, args.ranks), rank=rank,
                            world_size=args.ranks, timeout=timedelta(seconds=600))
    waited = [0.0]  # seconds in point-to-point waits (the bubble), this rank
    wait = schedules._wait_batch_p2p  # private: the one place every schedule waits

    def timed_wait(work: object) -> None:
        start = time.perf_counter()
        wait(work)
        waited[0] += time.perf_counter() - start
    schedules._wait_batch_p2p = timed_wait
    config = gpt_config(args)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 65, (args.batch_size, args.block_size), generator=g)
    rows = []
    for schedule in args.schedules:
        for m in args.microbatches:
            torch.manual_seed(0)
            try:
                model = parallel.parallelize(GPT(config), torch.device("cpu"), "pp",
                                             pp_schedule=schedule, microbatches=m)
            except ValueError as e:  # torch's own rule, e.g. 1f1b needs m >= stages
                rows.append({"schedule": schedule, "microbatches": m, "rank": rank,
                             "refused": str(e)})
                continue
            optimizer = optim.build_optimizer(model, "pp", lr=1e-4)
            pipe = model.pipeline
            times, idle = [], []
            for step in range(args.steps + 1):  # step 0: warm-up (shape inference, allocator)
                dist.barrier()
                waited[0], start = 0.0, time.perf_counter()
                pipe.start_step(1)
                pipe.train_step(x, x)
                pipe.finish_step()
                optimizer.step()
                if step == 0:  # the model state, while the gradients exist
                    state = memory.model_state_bytes(model, optimizer)
                optimizer.zero_grad(set_to_none=True)
                if step:
                    times.append(time.perf_counter() - start)
                    idle.append(waited[0])
            busy = sorted(busy_seconds([s.submod for s in pipe.stages], x, m, args.n_embd)
                          for _ in range(args.steps))[args.steps // 2]
            rows.append({"schedule": schedule, "microbatches": m, "rank": rank,
                         "step_s": sorted(times)[len(times) // 2],  # the median
                         # Idle: the step less this rank's own compute; and the time in
                         # point-to-point waits (sends that block on gloo are not in it).
                         "idle_share": max(0.0, 1 - busy / sorted(times)[len(times) // 2]),
                         "wait_share": sum(idle) / sum(times),
                         "ideal_bubble": ideal_bubble(schedule, args.ranks, m),
                         "model_state": state})
            del model, optimizer, pipe
    gathered: list = [None] * args.ranks
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(out).write_text(json.dumps([r for rank_rows in gathered for r in rank_rows]))
    distributed.release()


def plot(rows: list[dict], path: str, ranks: int) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for schedule in dict.fromkeys(r["schedule"] for r in rows):
        mine = [r for r in rows if r["schedule"] == schedule and r["rank"] == 0
                and "refused" not in r]
        ms = [r["microbatches"] for r in mine]
        line, = ax.plot(ms, [r["idle_share"] for r in mine], "o-", label=f"{schedule} (rank 0)")
        ax.plot(ms, [r["ideal_bubble"] for r in mine], "--", color=line.get_color())
        bx.plot(ms, [r["step_s"] for r in mine], "o-", label=schedule)
    ax.set_xscale("log", base=2)
    bx.set_xscale("log", base=2)
    ax.set(xlabel="micro-batches m", ylabel="idle share of a step",
           title=f"bubble, {ranks} stages (dashed: ideal)")
    bx.set(xlabel="micro-batches m", ylabel="seconds per step (median)",
           title="time per step")
    ax.legend(fontsize=8)
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = spawn(worker, args.ranks, out.with_suffix(".json"), args)
    predict(args, rows)
    info = {"args": vars(args), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(info, indent=1))
    plot(rows, str(out.with_suffix(".png")), args.ranks)
    print("schedule          m  rank  step s  idle  waits  ideal")
    for r in rows:
        if "refused" in r:
            print(f"{r['schedule']:<16}{r['microbatches']:>3}  refused: {r['refused']}")
            continue
        print(f"{r['schedule']:<16}{r['microbatches']:>3}{r['rank']:>6}{r['step_s']:>8.3f}"
              f"{r['idle_share']:>6.2f}{r['wait_share']:>7.2f}{r['ideal_bubble']:>7.2f}")


if __name__ == "__main__":
    main()
