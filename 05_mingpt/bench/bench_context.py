"""Context parallelism at a long context: activations per rank, step time and bytes sent, for
cp_size 1 (no cp, one process), 2 and 4; JSON + a plot.

    python bench/bench_context.py                        # gpt-micro, block 2048, cp 1 2 4
    python bench/bench_context.py --preset gpt-mini --block_size 4096 --cp 1 2
    python bench/bench_context.py --replot bench/context.json

Each cp size runs in its own group of cp processes (spawned, gloo, one dp group): the model is
wrapped as main.py wraps it (`parallelize(..., "ddp", cp_size=cp)`), every rank gets the same
batch and keeps its zig-zag half (or quarter) of each sequence. Per rank it reports:
- activations: the bytes autograd keeps for backward in the warm-up step (one micro-batch),
  counted tensor by tensor as the dry run counts a step (memory.saved_activations: saved-tensor
  hooks, every storage once, parameters left out), next to what the dry run plans for the rank
  (model_size.predict: the same layout and step on fake tensors, DRY_RUN.md);
- the training peak of the resident set above the resident set before the first step (coarse:
  the CPU allocator keeps freed memory; README: CPU memory);
- step time (forward, backward, AdamW), the median of the timed steps after a warm-up one;
- bytes sent per step: the ring's K/V and their gradients, counted at torch's ring exchange,
  next to the count the algorithm predicts, and DDP's gradient all-reduce payload.
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

# The scripts and the library live one folder up (05_mingpt/), from wherever this is run.
HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt-micro", help="model_type (default gpt-micro)")
    parser.add_argument("--block_size", type=int, default=2048)
    parser.add_argument("--batch_size", type=int, default=2, help="sequences per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after a warm-up one")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="cp sizes")
    parser.add_argument("--out", default="bench/context", help="writes OUT.json and OUT.png")
    parser.add_argument("--replot", metavar="JSON", help="redraw the PNG of a saved JSON")
    return parser.parse_args(argv)


def ring_bytes_predicted(cfg, batch_size: int, cp: int) -> int:
    """Bytes one rank sends per step in the ring: forward passes its K and V on cp - 1 times;
    backward passes them on cp - 1 times again and their gradients (fp32) cp times."""
    if cp == 1:  # no ring: attention on the whole sequence
        return 0
    kv = 2 * 4 * batch_size * (cfg.block_size // cp) * cfg.n_embd  # K and V, fp32, per layer
    return cfg.n_layer * kv * (2 * (cp - 1) + cp)


def worker(rank: int, store: str, out: str, cp: int, args: argparse.Namespace) -> None:
    """One rank of a cp group: build, count the warm-up step's saved bytes, time the steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed._functional_collectives import permute_tensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

    from mingpt import distributed
    from mingpt.memory import peak_memory_mb, reset_peak_memory, saved_activations
    from mingpt.model import GPT, GPTConfig
    from mingpt.optim import build_optimizer
    from mingpt.parallel import parallelize

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cp))  # the ranks share the cores
    dist.init_process_group("gloo", store=dist.FileStore(store, cp), rank=rank, world_size=cp,
                            timeout=timedelta(minutes=10))
    sent = [0]  # bytes this rank handed to the ring's exchange in the current step

    def counted(tensor, *a, **kw):  # torch's ring exchange (ALL_TO_ALL: send to the next)
        sent[0] += tensor.numel() * tensor.element_size()
        return permute_tensor(tensor, *a, **kw)

    torch_cp.ft_c.permute_tensor = counted  # the name torch's ring calls, in its module
    torch.manual_seed(0)
    cfg = GPTConfig(model_type=args.preset, vocab_size=65, block_size=args.block_size,
                    dropout=0.0)
    model = parallelize(GPT(cfg), torch.device("cpu"), "ddp", cp_size=cp if cp > 1 else 0)
    inner = model.module if hasattr(model, "module") else model
    optimizer = build_optimizer(model, "ddp", 1e-3)
    # Random tokens: the memory and the bytes do not depend on the text, only on the shapes.
    x = torch.randint(0, 65, (args.batch_size, args.block_size))  # the same on every rank
    y = torch.randint(0, 65, (args.batch_size, args.block_size))
    # RSS before the steps (the model, the process group): the peak is read above it.
    rss_before = peak_memory_mb(torch.device("cpu"))[0]
    reset_peak_memory(torch.device("cpu"))
    seconds = []
    for step in range(args.steps + 1):
        sent[0] = 0  # so the last step's bytes are reported
        dist.barrier()  # the ranks start each step together: its time is the group's
        start = time.perf_counter()
        # The warm-up step (not timed) counts what autograd keeps for backward.
        with saved_activations(model) if step == 0 else contextlib.nullcontext() as kept:
            _, loss = model(x, y)
            loss.backward()
        if step == 0:
            activations = kept["total"]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first step creates AdamW's state: not timed
            seconds.append(time.perf_counter() - start)
    peak = peak_memory_mb(torch.device("cpu"))[0]
    gpt = inner.config
    result = {
        "cp": cp, "rank": rank, "activations_bytes": activations,
        "training_peak_above_start_mb": peak - rss_before, "step_s": statistics.median(seconds),
        "ring_bytes_sent": sent[0],
        "ring_bytes_predicted": ring_bytes_predicted(gpt, args.batch_size, cp),
        "grad_allreduce_bytes": 4 * inner.num_params() if cp > 1 else 0,
        "num_params": inner.num_params(),
    }
    if rank == 0:  # every rank holds the same share: rank 0's figures stand for the group
        Path(out).write_text(json.dumps(result))
    del model, optimizer, inner
    distributed.release()


def planned_activations(args: argparse.Namespace, cp: int) -> int:
    """What the dry run plans for rank 0 of the cp group: the bytes autograd keeps for
    backward per micro-batch (model_size.predict; the model and layout the worker builds, the
    same batch_size sequences on every rank: one data-parallel group). Called here, in the
    parent: the dry run starts a process per rank."""
    import torch

    import model_size
    from mingpt.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(model_type=args.preset, vocab_size=65,
                              block_size=args.block_size, dropout=0.0))
    layout = ["trainer_config.distributed_method=ddp", f"trainer_config.cp_size={cp}"]
    plan = model_size.predict(model, {"cp": layout}, cp, args.batch_size)["cp"][0]
    return plan["activations / micro-batch"]


def machine() -> dict:
    """What the figures were measured on: lscpu's model name, torch's CPU kernels, cores."""
    import torch

    name = "unknown"
    with open("/proc/cpuinfo") as f:  # Linux: what lscpu shows as "Model name"
        name = next((line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name")), name)
    return {"cpu": name, "capability": torch.backends.cpu.get_cpu_capability(),
            "cores": os.cpu_count(), "torch": torch.__version__}


def plot(info: dict, path: Path) -> None:
    """Activations per rank (measured, predicted), step time and bytes sent, against cp."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = info["results"]
    cps = [r["cp"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    axes[0].plot(cps, [r["activations_bytes"] / 2**20 for r in rows], "o-", label="measured")
    axes[0].plot(cps, [r["predicted_bytes"] / 2**20 for r in rows], "x--",
                 label="dry run (model_size.predict)")
    axes[0].plot(cps, [rows[0]["activations_bytes"] / 2**20 / c for c in cps], ":",
                 color="gray", label="1/cp of cp 1")
    axes[0].set(xlabel="cp_size", ylabel="MiB per rank", title="activations kept for backward")
    axes[1].plot(cps, [r["step_s"] for r in rows], "o-")
    axes[1].set(xlabel="cp_size", ylabel="seconds", title="step time (shared CPU: noisy)")
    axes[2].plot(cps, [r["ring_bytes_sent"] / 2**20 for r in rows], "o-", label="ring (K, V)")
    axes[2].plot(cps, [r["grad_allreduce_bytes"] / 2**20 for r in rows], "s--",
                 label="gradient all-reduce payload")
    axes[2].set(xlabel="cp_size", ylabel="MiB per rank per step", title="bytes sent")
    for ax in axes:
        ax.set_xticks(cps)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    a = info["args"]
    fig.suptitle(f"{a['preset']}, block {a['block_size']}, batch {a['batch_size']}: one rank "
                 f"of a cp group ({info['machine']['cpu']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        info = json.loads(Path(args.replot).read_text())
        plot(info, Path(args.replot).with_suffix(".png"))
        return 0
    import tempfile

    from ranks import spawn  # bench/ranks.py: run as a script, its own folder is on the path

    results = []
    # The groups' FileStores and rank 0's JSONs live in a folder removed afterwards.
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cp:
            # One group per cp size, each in its own processes.
            results.append(spawn(worker, cp, Path(tmp, f"cp{cp}.json"), cp, args))
            r = results[-1]
            r["predicted_bytes"] = planned_activations(args, cp)
            print(f"cp {cp}: activations {r['activations_bytes'] / 2**20:.1f} MiB per rank "
                  f"(planned {r['predicted_bytes'] / 2**20:.1f}), step {r['step_s']:.2f} s, "
                  f"ring {r['ring_bytes_sent'] / 2**20:.1f} MiB sent "
                  f"(predicted {r['ring_bytes_predicted'] / 2**20:.1f})", flush=True)
    info = {"command": "python bench/bench_context.py " + " ".join(argv or sys.argv[1:]),
            "args": vars(args), "machine": machine(), "results": results}
    out = Path(args.out)  # relative to where it runs: 05_mingpt/ as the README shows
    out.with_suffix(".json").write_text(json.dumps(info, indent=1) + "\n")
    plot(info, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
