"""The workers of comm_lab.ipynb: collectives timed and counted, and a GPT's DDP step under
bucket sizes and communication hooks, each in a small gloo group (pitfalls_helpers.launch).

    import comm_lab_helpers as ch
    run = ch.launch(ch.sizes_sweep, 2, [1024, 2**20])   # rank 0's rows in run.results[0]
    ch.shutdown()

What each rank sends is counted by 05_mingpt's own counter (the dry run's CommCounter, which
sees every collective through torch's dispatcher, DDP's buckets and its hooks included); a
call's time is the slowest rank's, the median of a few calls.
"""
import statistics
import time

import pitfalls_helpers as ph  # the fork server, launch() and 05_mingpt on the path
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt.dry_run import CommCounter
from mingpt.model import GPT, GPTConfig
from mingpt.step_time import BUS_FACTOR

launch, shutdown = ph.launch, ph.shutdown
# This module's workers run in forks of a server that imported it (and pitfalls_helpers).
ph.CONTEXT.set_forkserver_preload([__name__, *ph.SERVER_IMPORTS])
# Tiny Shakespeare's characters, as 05's char data reads them: the runs below learn real
# text, so their validation losses mean something. The first 200,000 characters are plenty.
TEXT = (ph.MINGPT / "data/input.txt").read_text()
VOCAB = sorted(set(TEXT))
IDS = torch.tensor([VOCAB.index(c) for c in TEXT[:200_000]])
BLOCK = 64  # tokens per window


def _slowest(fn, calls: int) -> float:
    """Seconds of one call of fn on every rank: the slowest rank's, the median of `calls`."""
    fn()  # untimed: buffers, connections
    times = []
    for _ in range(calls):
        dist.barrier()  # every rank starts together
        start = time.perf_counter()
        fn()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(took.item())
    return statistics.median(times)


def _sent(fn) -> dict:
    """What one rank sent in one call of fn, by kind: CommCounter's {"world": {...}}."""
    with CommCounter({}) as counter:
        fn()
    return counter.table().get("world", {})


def sizes_sweep(rank: int, world_size: int, sizes: list[int], calls: int = 5) -> list[dict]:
    """all_reduce of each size (bytes of float32): its time, algbw and busbw (nccl-tests'
    bus factor, 2(n-1)/n)."""
    rows = []
    for size in sizes:
        x = torch.ones(size // 4)
        seconds = _slowest(lambda x=x: dist.all_reduce(x), calls)
        algbw = size / seconds
        rows.append({"bytes": size, "seconds": seconds, "algbw": algbw,
                     "busbw": algbw * BUS_FACTOR["all_reduce"](world_size)})
    return rows


def all_reduce_in_two(rank: int, world_size: int, size: int, calls: int = 5) -> dict:
    """all_reduce of `size` bytes against reduce_scatter then all_gather of the same buffer:
    the times, and the bytes each rank sent (counted)."""
    # float32: size / 4 elements; each rank keeps 1 / world_size of them after the scatter.
    x, part = torch.ones(size // 4), torch.empty(size // 4 // world_size)

    def in_two() -> None:
        dist.reduce_scatter_tensor(part, x)
        dist.all_gather_into_tensor(x, part)

    return {"all_reduce s": _slowest(lambda: dist.all_reduce(x), calls),
            "reduce_scatter + all_gather s": _slowest(in_two, calls),
            "all_reduce sent": _sent(lambda: dist.all_reduce(x))["all-reduce sent"],
            "in two sent": sum(v for k, v in _sent(in_two).items() if k.endswith(" sent"))}


def _gpt(n_embd: int, n_layer: int) -> GPT:
    torch.manual_seed(0)  # the same weights on every rank and in every run
    return GPT(GPTConfig(model_type=None, n_layer=n_layer, n_head=4, n_embd=n_embd,
                         vocab_size=len(VOCAB), block_size=BLOCK, dropout=0.0))


def _batch(seed: int, size: int, val: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` windows of the text (the last tenth for validation), from a seed of its own."""
    g = torch.Generator().manual_seed(seed)
    low, high = (len(IDS) * 9 // 10, len(IDS) - BLOCK - 1) if val else \
        (0, len(IDS) * 9 // 10 - BLOCK - 1)
    starts = torch.randint(low, high, (size,), generator=g)
    windows = torch.stack([IDS[s:s + BLOCK + 1] for s in starts.tolist()])
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _train(model: DDP, steps: int, batch: int, rank: int) -> list[float]:
    """`steps` AdamW steps on this rank's own windows; each step's seconds."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seconds = []
    # Each rank reads its own windows (seeded by step and rank), as a data-parallel run does.
    for step in range(steps):
        start = time.perf_counter()
        x, y = _batch(1000 * step + rank, batch)
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
    return seconds


def bucket_sweep(rank: int, world_size: int, caps: list[float], steps: int = 4,
                 n_embd: int = 256) -> list[dict]:
    """DDP with each bucket_cap_mb: all-reduce calls and bytes in one step (counted), and the
    median step time."""
    rows = []
    for cap in caps:
        # A fresh model per cap: DDP lays its buckets out once, at construction (and again
        # after the first step, in the order backward produced the gradients).
        model = DDP(_gpt(n_embd, 4), bucket_cap_mb=cap)
        seconds = _train(model, steps, 8, rank)
        x, y = _batch(rank, 8)
        comm = _sent(lambda model=model, x=x, y=y: model(x, y)[1].backward())
        rows.append({"bucket_cap_mb": cap, "calls": comm["all-reduce calls"],
                     "sent": comm["all-reduce sent"], "step s": statistics.median(seconds[1:]),
                     "params": sum(p.numel() for p in model.parameters())})
    return rows


def _hook(model: DDP, name: str):
    """Register communication hook `name` on `model`; PowerSGD's state, or None."""
    if name in ("fp16", "bf16"):
        model.register_comm_hook(None, getattr(default_hooks, f"{name}_compress_hook"))
    elif name.startswith("powersgd"):
        # Vanilla all-reduce for the first 2 steps (error feedback and warm start need them),
        # then each matrix as P (rows x rank) and Q (cols x rank); vectors stay uncompressed.
        state = powersgd.PowerSGDState(process_group=None,
                                       matrix_approximation_rank=int(name[len("powersgd"):]),
                                       start_powerSGD_iter=2)
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        return state
    return None


@torch.no_grad()
def _val_loss(model: torch.nn.Module, rank: int, world_size: int) -> float:
    """The mean loss of 8 validation windows per rank, averaged over the ranks."""
    losses = torch.stack([model(*_batch(10**6 + 100 * rank + i, 8, val=True))[1]
                          for i in range(4)])
    loss = losses.mean()
    dist.all_reduce(loss)
    return loss.item() / world_size


def powersgd_floats(model: torch.nn.Module, state: powersgd.PowerSGDState) -> int:
    """The floats PowerSGD all-reduces in one step, from the parameters' shapes alone: each
    gradient seen as a matrix of its first dimension's rows; with r = min(rows, cols, the
    state's rank), P (rows x r) and Q (cols x r) where that is fewer than the matrix by the
    state's min_compression_rate, else the matrix itself (vectors, small matrices)."""
    floats = 0
    for p in model.parameters():
        n = p.shape[0]
        m = p.numel() // n
        r = min(n, m, state.matrix_approximation_rank)
        floats += (n + m) * r if (n + m) * r * state.min_compression_rate < n * m else n * m
    return floats


def hooks(rank: int, world_size: int, names: list[str], steps: int = 40,
          n_embd: int = 128) -> list[dict]:
    """Each hook's run of `steps` from the same weights: the bytes of a step after PowerSGD's
    warm-up (counted), PowerSGD's compression ratio from its own counters, the validation
    loss at the end, the median step time."""
    rows = []
    for name in names:
        # One bucket (the whole model's 3 MB of gradients under a cap of 100 MB): PowerSGD
        # issues its second all-reduce of a bucket from a callback thread, and with two
        # buckets in flight the ranks' threads can issue them in different orders, which gloo
        # cannot match (measured: "Received data size doesn't match expected size").
        model = DDP(_gpt(n_embd, 4), bucket_cap_mb=100)
        state = _hook(model, name)
        seconds = _train(model, steps, 8, rank)
        x, y = _batch(rank, 8)
        before = state.total_numel_after_compression if state is not None else 0
        sent = _sent(lambda model=model, x=x, y=y: model(x, y)[1].backward())["all-reduce sent"]
        ratio = None
        if state is not None:
            # PowerSGD all-reduces P and Q in callbacks on another thread, which the counter
            # (this thread's dispatch mode) does not see: its bytes come from its own counter
            # of the floats it all-reduced in that step, as a ring share, 2 (n - 1) / n. That
            # count is the one the shapes give (powersgd_floats), to the float.
            floats = state.total_numel_after_compression - before
            expected = powersgd_floats(model.module, state)
            assert floats == expected, (floats, expected)
            sent = int(floats * 4 * BUS_FACTOR["all_reduce"](world_size))
            # floats before / after compression, summed over the steps since it began
            ratio = state.total_numel_before_compression / state.total_numel_after_compression
        rows.append({"hook": name, "sent": sent, "ratio": ratio,
                     "val loss": _val_loss(model.module, rank, world_size),
                     "step s": statistics.median(seconds[1:])})
    return rows


def _under_backward(model: DDP, rank: int) -> tuple[float, float, float, float]:
    """One profiled backward: (all-reduce ms, the share of it under the backward, backward
    ms, where in the backward the first all-reduce started: 0 at its start, 1 at its end).
    gloo runs each all-reduce on a thread of its own (its `gloo:all_reduce` events); the
    backward spans its first to its last autograd function."""
    x, y = _batch(rank, 8)
    with torch.profiler.profile() as profile:
        model(x, y)[1].backward()
    events = list(profile.events())
    backward = [e.time_range for e in events
                if e.name.startswith("autograd::engine::evaluate_function")]
    start, end = min(r.start for r in backward), max(r.end for r in backward)
    # The threads' intervals (in us), merged where they overlap each other.
    merged: list[list[float]] = []
    for lo, hi in sorted((e.time_range.start, e.time_range.end) for e in events
                         if e.name == "gloo:all_reduce"):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    total = sum(hi - lo for lo, hi in merged)
    under = sum(max(0.0, min(hi, end) - max(lo, start)) for lo, hi in merged)
    return total / 1e3, under / total, (end - start) / 1e3, (merged[0][0] - start) / (end - start)


def overlap(rank: int, world_size: int, caps: list[float], n_embd: int = 256,
            profiles: int = 5) -> list[dict]:
    """For each bucket_cap_mb, DDP's backward profiled `profiles` times (the median
    profile's figures): how long gloo's threads spent in all-reduces, how much of that lay
    under the backward pass rather than after it, and how far into the backward the first
    all-reduce started. The first two are times, which other processes on the machine's
    cores stretch (a rank kept waiting holds its peer's all-reduces open; a backward
    preempted in its last function seems to cover the all-reduce that started there); where
    the first all-reduce starts is the buckets' doing: the backward has produced the
    gradients of a first bucket (small buckets: early) or of every parameter (one: at its
    end)."""
    rows = []
    for cap in caps:
        model = DDP(_gpt(n_embd, 4), bucket_cap_mb=cap)
        _train(model, 2, 8, rank)  # past DDP's first step, which lays its buckets out again
        runs = sorted((_under_backward(model, rank) for _ in range(profiles)),
                      key=lambda run: run[3])
        total, share, backward, first = runs[len(runs) // 2]
        rows.append({"bucket_cap_mb": cap, "all-reduce ms": total, "under backward": share,
                     "backward ms": backward, "first starts": first})
    return rows
