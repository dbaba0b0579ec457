"""Step time and all-to-all bytes of a mixture of experts at ep_size 1, 2 and 4, against the
dense model with the same active parameters; JSON.

    python bench/bench_experts.py                  # 4 CPU ranks, gpt-micro vs gpt-micro-moe

Spawns 4 gloo processes and lays each model out as ddp (ep_size 1: every rank holds every
expert; 2, 4: each rank E / ep of them, expert.py) through parallel.parallelize, as main.py
does. Each row: the median wall time of a training step (forward, backward, AdamW) over
--steps steps after 2 warm-up steps, on every rank's own batch of --batch_size sequences,
and the bytes rank 0 sent to other ranks through all_to_all_single per step (the tokens to
their experts and back, forward and backward, plus the counts), counted by wrapping
torch.distributed.all_to_all_single, through which expert.py and the autograd all-to-all of
torch.distributed.nn.functional both send. gpt-micro-moe is gpt-micro with 4 experts of
gpt-micro's MLP and top-1 routing: the same active parameters per token (plus each
router's 4 x 128).
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

# The scripts and the library live one folder up (05_mingpt/), from wherever this is run.
HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
WORLD = 4
ROWS = (("gpt-micro", 0), ("gpt-micro-moe", 1), ("gpt-micro-moe", 2), ("gpt-micro-moe", 4))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row")
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--out", default="bench/experts", help="writes OUT.json")
    return parser.parse_args(argv)


def measure(preset: str, ep: int, args: argparse.Namespace) -> dict:
    """One row: median step time (ms) and all-to-all bytes sent per step on this rank."""
    from mingpt import optim, parallel  # noqa: PLC0415  (path set above)
    from mingpt.model import GPT, GPTConfig  # noqa: PLC0415
    torch.manual_seed(0)
    config = GPTConfig(model_type=preset, vocab_size=65, block_size=args.block_size,
                       dropout=0.0)
    model = parallel.parallelize(GPT(config), torch.device("cpu"), "ddp", ep_size=ep)
    optimizer = optim.build_optimizer(model, "ddp", lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    real, calls = dist.all_to_all_single, []

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                **kwargs):
        """torch's all_to_all_single, recording the bytes this rank sends to other ranks."""
        rows, me = input.size(0), dist.get_rank(group)
        own = input_split_sizes[me] if input_split_sizes else rows // dist.get_world_size(group)
        calls.append((rows - own) * (input.numel() // max(rows, 1)) * input.element_size())
        return real(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

    # Swapped in for the timed rows only: expert.py's exchange and torch's autograd
    # all-to-all look the function up on torch.distributed at each call.
    times = []
    dist.all_to_all_single = counted
    try:
        for step in range(2 + args.steps):
            # Random tokens: an untrained router spreads them about evenly, as a trained
            # one with the balancing loss does; each rank its own batch, as ddp's data.
            x = torch.randint(0, 65, (args.batch_size, args.block_size), generator=generator)
            dist.barrier()  # every rank starts the step together: the slowest sets the pace
            start = time.perf_counter()
            _, loss = model(x, x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= 2:
                times.append(time.perf_counter() - start)
            else:
                calls.clear()  # count the timed steps only
    finally:
        dist.all_to_all_single = real
    unwrapped = parallel.wrappers.unwrap(model)
    return {"model": preset, "ep_size": ep, "parameters": unwrapped.num_params(),
            "active": unwrapped.num_active_params(),
            "step_ms": round(1000 * statistics.median(times), 1),
            "all_to_all_bytes_per_step": sum(calls) // args.steps}


def _worker(rank: int, store: str, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # four processes share the cores: one thread each
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=300))
    # Every row in the same processes, one after the other: the same data and machine state.
    rows = [measure(preset, ep, args) for preset, ep in ROWS]
    if rank == 0:
        Path(out).write_text(json.dumps({
            "ranks": WORLD, "batch_size": args.batch_size, "block_size": args.block_size,
            "steps": args.steps, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "rank0": rows}, indent=1))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for row in spawn(_worker, WORLD, HERE / f"{args.out}.json", args)["rank0"]:
        print(row)


if __name__ == "__main__":
    main()
