"""The communication lab: how long each collective takes on the ranks you have, by message
size; algbw and busbw as nccl-tests defines them, and a fitted link model (latency alpha,
seconds per byte beta) per collective and world size; JSON, a table and a plot.

    python bench/comm_lab.py                               # 2, 4, 8 gloo ranks, 1 KiB .. 64 MiB
    python bench/comm_lab.py --worlds 2 4 --max_bytes 4194304 --out /tmp/lab

Each world is its own group of spawned processes (bench/ranks.py), gloo on a CPU (NCCL with
one GPU per rank where there are enough GPUs). For each collective and size: one untimed
call, then calls back to back, each started together (a barrier) and timed on every rank; a
call's time is the slowest rank's (what the next step waits for), the figure the median call.

nccl-tests' definitions (its performance notes), with S the size and n the ranks: S is the
buffer each rank reduces (all_reduce), sends whole (all_to_all, broadcast, send/recv), or the
whole result (all_gather: each rank gives S / n; reduce_scatter: each rank keeps S / n).
algbw = S / time. busbw = algbw x the share of S each rank's link must carry in a ring:
2(n-1)/n for all_reduce (a reduce-scatter, then an all-gather), (n-1)/n for reduce_scatter,
all_gather and all_to_all, 1 for broadcast and send/recv (a ring: rank r sends to r + 1).
busbw compares collectives and world sizes with the link's own speed: on an ideal ring it is
the same for all of them.

The link model: time = alpha + beta x S, fitted per collective and world size by least
squares on relative error (every size counts alike, 1 KiB as much as 64 MiB). alpha is what a
call costs however small (latency-bound sizes), 1 / beta the algbw a large call tends to
(bandwidth-bound ones); the dry run's time prediction reads them from the JSON's `model`.

It also measures one rank's compute (mingpt/step_time.py, measure_compute: a matmul's FLOP/s,
the cost of one op in a training step, an elementwise op's bytes/s, on one thread), the
JSON's `compute`: the dry run predicts a step's compute from them.
"""
import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import spawn  # bench/ranks.py: run as a script, its own folder is on the path

from bench import machine  # bench/bench.py: what the figures were measured on
from mingpt import step_time  # bench.py put 05_mingpt/ on the path

HERE = Path(__file__).resolve().parent.parent  # 05_mingpt/
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
               "send_recv")
# nccl-tests' bus-bandwidth factors (module docstring), n the number of ranks: the table the
# dry run's time prediction reads too.
BUS_FACTOR = step_time.BUS_FACTOR


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--collectives", nargs="+", default=list(COLLECTIVES),
                        choices=COLLECTIVES)
    parser.add_argument("--min_bytes", type=int, default=2**10)
    parser.add_argument("--max_bytes", type=int, default=2**26)
    parser.add_argument("--seconds", type=float, default=0.3,
                        help="time spent per collective and size, about (at least 3 calls)")
    parser.add_argument("--out", default="bench/comm_lab", help="writes OUT.json and OUT.png")
    return parser.parse_args(argv)


def sizes(low: int, high: int) -> list[int]:
    """Powers of 4 bytes from `low` to `high` (1 KiB, 4 KiB, ... 64 MiB by default)."""
    out, size = [], low
    while size <= high:
        out.append(size)
        size *= 4
    return out


def buffers(name: str, size: int, world: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of one call of `name` at size S (module docstring), float32."""
    n = size // 4  # float32 elements of S
    # The gathers and scatters split S over the ranks: S / n each (sizes are powers of 4, so
    # 1 KiB and up divide by 2, 4 and 8). all_reduce and broadcast work in place.
    full, part = torch.ones(n, device=device), torch.ones(n // world, device=device)
    return {"all_reduce": (full, full), "reduce_scatter": (full, part),
            "all_gather": (part, full), "all_to_all": (full, torch.empty_like(full)),
            "broadcast": (full, full), "send_recv": (full, torch.empty_like(full))}[name]


def call(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """One call of collective `name` on every rank (send_recv: the ring r -> r + 1)."""
    if name == "all_reduce":
        dist.all_reduce(x)
    elif name == "reduce_scatter":
        dist.reduce_scatter_tensor(y, x)
    elif name == "all_gather":
        dist.all_gather_into_tensor(y, x)
    elif name == "all_to_all":
        dist.all_to_all_single(y, x)
    elif name == "broadcast":
        dist.broadcast(x, src=0)
    else:  # send_recv: every rank sends and receives at once, as nccl-tests' sendrecv
        rank, world = dist.get_rank(), dist.get_world_size()
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % world),
               dist.P2POp(dist.irecv, y, (rank - 1) % world)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def timed_calls(name: str, x: torch.Tensor, y: torch.Tensor, seconds: float, device) -> list:
    """The slowest rank's seconds for each of several calls (at least 3, about `seconds`)."""
    def one() -> float:
        dist.barrier()  # every rank starts the call together
        start = time.perf_counter()
        call(name, x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # what every rank waited for
        return took.item()

    call(name, x, y)  # untimed: connections, buffers
    # How many calls: about `seconds` of them, decided from the first (all-reduced: the same
    # number on every rank, or the ranks would wait in different collectives).
    first = one()
    calls = max(3, min(50, int(seconds / max(first, 1e-6))))  # the same on every rank
    return [first] + [one() for _ in range(calls - 1)]


def fit(points: list[tuple[int, float]]) -> dict:
    """time = alpha + beta x size, least squares on relative error; alpha >= 0."""
    import numpy as np

    s = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    a = np.stack([np.ones_like(s), s], axis=1) / t[:, None]  # rows divided by t: relative
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if alpha < 0:  # no latency to speak of: bandwidth alone
        alpha, beta = 0.0, float(np.linalg.lstsq(a[:, 1:], np.ones_like(t), rcond=None)[0][0])
    if beta < 0:  # only small sizes (noise hides the bandwidth term): latency alone
        alpha, beta = float(np.linalg.lstsq(a[:, :1], np.ones_like(t), rcond=None)[0][0]), 0.0
    worst = float(np.max(np.abs(alpha + beta * s - t) / t))
    return {"alpha_s": float(alpha), "beta_s_per_byte": float(beta),
            "large_algbw_GBps": 1e-9 / beta if beta > 0 else None, "worst_relative_error": worst}


def worker(rank: int, store: str, out: str, world: int, args: argparse.Namespace) -> None:
    gpus = torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)  # the ranks share the cores
    dist.init_process_group("nccl" if gpus else "gloo", store=dist.FileStore(store, world),
                            rank=rank, world_size=world, timeout=timedelta(seconds=600))
    rows = []
    # Every collective at every size, in the same order on every rank; rank 0 writes them.
    for name in args.collectives:
        for size in sizes(args.min_bytes, args.max_bytes):
            x, y = buffers(name, size, world, device)
            seconds = statistics.median(timed_calls(name, x, y, args.seconds, device))
            algbw = size / seconds
            rows.append({"collective": name, "world": world, "bytes": size,
                         "seconds": seconds, "algbw_GBps": algbw / 1e9,
                         "busbw_GBps": algbw * BUS_FACTOR[name](world) / 1e9})
            del x, y
    if rank == 0:
        Path(out).write_text(json.dumps({"backend": dist.get_backend(), "rows": rows}))
    dist.destroy_process_group()


def human(size: int) -> str:
    return f"{size // 2**20} MiB" if size >= 2**20 else f"{size // 2**10} KiB"


def plot(info: dict, path: Path) -> None:
    """busbw against size, a panel per collective, a line per world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One panel per collective, in the order measured; spare panels of the grid stay blank.
    names = list(dict.fromkeys(r["collective"] for r in info["rows"]))
    fig, axes = plt.subplots(2, (len(names) + 1) // 2, figsize=(12, 6.5), sharey=True,
                             squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        for world in info["worlds"]:
            rows = [r for r in info["rows"] if r["collective"] == name and r["world"] == world]
            ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], "o-",
                    label=f"{world} ranks")
        ax.set(xscale="log", yscale="log", title=name, xlabel="size (bytes)")
        ax.grid(alpha=0.3)
    axes.flat[0].set_ylabel("busbw (GB/s)")
    axes.flat[0].legend(fontsize=8)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle(f"{info['backend']} on {info['machine']['cpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = HERE / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, backend = [], None
    # One spawned group per world size: each writes its rows to a part file, read back here.
    for world in args.worlds:
        part = out.with_name(f"{out.name}_{world}.part.json")
        info = spawn(worker, world, part, world, args)
        part.unlink()
        rows += info["rows"]
        backend = info["backend"]
        for r in info["rows"]:
            print(f"{world} ranks {r['collective']:15} {human(r['bytes']):>7} "
                  f"{1e6 * r['seconds']:11.1f} us  algbw {r['algbw_GBps']:7.3f} GB/s  "
                  f"busbw {r['busbw_GBps']:7.3f} GB/s", flush=True)
    # The link model per collective and world size, from its rows.
    model: dict = {}
    for name in args.collectives:
        for world in args.worlds:
            points = [(r["bytes"], r["seconds"]) for r in rows
                      if r["collective"] == name and r["world"] == world]
            model.setdefault(name, {})[str(world)] = fit(points)
    compute = step_time.measure_compute()  # alone: no rank of a world runs beside it
    info = {"command": " ".join(["python", "bench/comm_lab.py", *(argv or sys.argv[1:])]),
            "machine": machine(), "backend": backend, "worlds": args.worlds, "rows": rows,
            "model": model, "compute": compute}
    out.with_suffix(".json").write_text(json.dumps(info, indent=1))
    plot(info, out.with_suffix(".png"))
    for name, by_world in model.items():
        for world, m in by_world.items():
            print(f"model {name:15} {world} ranks: alpha {1e6 * m['alpha_s']:8.1f} us, large "
                  f"algbw {m['large_algbw_GBps'] or 0:7.3f} GB/s (worst fit error "
                  f"{100 * m['worst_relative_error']:.0f}%)")
    print(f"compute on one thread: matmul {compute['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, "
          f"{1e6 * compute['op_s']:.2f} us per op, {compute['bytes_per_s'] / 1e9:.1f} GB/s")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
