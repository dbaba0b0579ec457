"""Replica groups that meet every H steps (trainer_config.ft_sync=diloco) against groups that
meet every step: the bytes sent between groups, counted, and the validation loss at equal
tokens. JSON, a table and a plot (bench/README.md, DiLoCo).

    python bench/bench_diloco.py                       # 2 and 4 groups, H 1, 10, 50, 100
    python bench/bench_diloco.py --groups 2 --every 10 --seeds 0 1 2
    python bench/bench_diloco.py --test                # the gap test_mingpt_diloco.py bounds

Each run is what FAULT_TOLERANCE.md starts: torchft's lighthouse, then one torchrun job of one
process per replica group, all on this machine's CPU (gloo). Every run of one group count
trains the same steps on the same global batch (each group its own rows), so they end at
equal tokens; ft_sync=step's run is DDP over as many processes, bit for bit
(test_mingpt_torchft.py). The bytes are what rank 0 of group 0 gave torchft's all-reduces
(its log's last line, counted by mingpt/parallel/diloco.py), per step and at the largest
meeting; the loss is group 0's final validation loss (after the last meeting every group
holds the same weights).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # 05_mingpt/

BIN = Path(sys.executable).parent  # torchrun and torchft_lighthouse, beside this Python
# The model and run: small enough for 400 steps on 2 cores in about half a minute per run.
MODEL = ["gpt_config.model_type=null", "gpt_config.n_layer=2", "gpt_config.n_head=2",
         "gpt_config.n_embd=64", "gpt_config.block_size=64", "trainer_config.batch_size=16",
         "trainer_config.max_steps=400", "trainer_config.warmup_steps=20",
         "trainer_config.log_every=100", "trainer_config.eval_every=0",
         "trainer_config.eval_batches=20", "trainer_config.save_every=0",
         "trainer_config.sample_tokens=0", "trainer_config.grad_clip=0",
         # DiLoCo's inner optimizer, and the table's (main.py's default is Muon since)
         "optimizer_config.name=adamw"]
# test_mingpt_diloco.py's run (tests/mingpt_helpers.py TINY, 40 steps), for --test.
TEST = ["gpt_config.model_type=null", "gpt_config.n_layer=2", "gpt_config.n_head=2",
        "gpt_config.n_embd=32", "gpt_config.block_size=32", "trainer_config.batch_size=8",
        "trainer_config.max_steps=40", "trainer_config.warmup_steps=2",
        "trainer_config.log_every=5", "trainer_config.eval_every=0",
        "trainer_config.eval_batches=4", "trainer_config.save_every=0",
        "trainer_config.sample_tokens=0", "trainer_config.grad_clip=0",
        "gpt_config.dropout=0.1", "optimizer_config.name=adamw", "optimizer_config.lr=3e-3",
        "optimizer_config.betas=[0.9,0.95]"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--every", type=int, nargs="+", default=[1, 10, 50, 100],
                        help="H: the steps between meetings")
    parser.add_argument("--fragments", type=int, nargs="+", default=[1, 2],
                        help="diloco's fragments (local_sgd runs one)")
    parser.add_argument("--syncs", nargs="+", default=["diloco", "local_sgd"],
                        choices=["diloco", "local_sgd"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337])
    parser.add_argument("--test", action="store_true",
                        help="test_mingpt_diloco.py's run (2 groups, H 10, 40 steps) instead")
    parser.add_argument("--out", default=None, help="writes OUT.json (and OUT.png)")
    return parser.parse_args(argv)


def train(groups: int, overrides: list[str], folder: Path) -> dict:
    """One run of `groups` replica groups: group 0's loss, bytes and meetings."""
    # min_replicas: every meeting waits for all the groups (none meets alone and copies).
    # Port 0: the OS gives the lighthouse a free one, which its first line names (a port
    # picked here and bound by it later could be taken in between).
    with open(folder / "lighthouse.log", "w") as log:
        lighthouse = subprocess.Popen(
            [BIN / "torchft_lighthouse", "--min_replicas", str(groups), "--join_timeout_ms",
             "1000", "--bind", "[::]:0"], stdout=log, stderr=subprocess.STDOUT)
    try:
        while not (bound := re.search(r"Lighthouse listening on: \S+:(\d+)",
                                      (folder / "lighthouse.log").read_text())):
            if lighthouse.poll() is not None:
                sys.exit(f"error: torchft_lighthouse did not start:\n"
                         f"{(folder / 'lighthouse.log').read_text()[-2000:]}")
            time.sleep(0.05)  # until its line: it listens within a second
        port = bound[1]
        # Every group a torchrun job of one process, all at once (FAULT_TOLERANCE.md's way);
        # each its own run_dir and log file (a pipe read one group after the other would
        # fill up and stop the group whose turn had not come, and so the others' quorum).
        # One thread per process: torchrun sets it only for 2 or more per job, and groups of
        # two threads each on 2 cores spun against each other (a step took 30x as long).
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}",
               "OMP_NUM_THREADS": "1"}
        logs = [folder / f"group{g}.log" for g in range(groups)]
        procs = []
        for g, path in enumerate(logs):
            with open(path, "w") as log:
                procs.append(subprocess.Popen(
                    [BIN / "torchrun", "--standalone", "--nproc_per_node=1", "main.py",
                     *overrides, f"trainer_config.ft_replicas={groups}",
                     f"trainer_config.ft_replica_group={g}", f"run_dir={folder}/group{g}",
                     "trainer_config.collective_timeout_s=120"],
                    cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT))
        for p in procs:
            p.wait()
        outs = [path.read_text() for path in logs]
    finally:
        lighthouse.terminate()
        lighthouse.wait()
    for p, out in zip(procs, outs, strict=True):
        if p.returncode != 0:
            sys.exit(f"error: a replica group failed:\n{out[-3000:]}")
    # Group 0's last lines: its bytes over the run, each meeting's bytes and outer norm.
    out = outs[0]
    total, steps = re.search(r"rank 0 sent ([\d,]+) bytes in (\d+) steps", out).groups()
    meetings = [int(b.replace(",", "")) for b in
                re.findall(r"replica groups met \(\w+\): [\d.]+ ms, rank 0 sent ([\d,]+)", out)]
    return {"val_loss": float(re.search(r"final val loss ([\d.]+)", out)[1]),
            "bytes_per_step": int(total.replace(",", "")) / int(steps),
            "largest_meeting": max(meetings, default=0), "meetings": len(meetings),
            "norms": [float(n) for n in re.findall(r"outer gradient norm ([\d.]+)", out)]}


def runs(args: argparse.Namespace) -> list[tuple[int, str, int, int, int]]:
    """(groups, ft_sync, H, fragments, seed) of every run; ft_sync=step has H 0."""
    if args.test:  # the test's pair: every step against H = 10, per seed
        return [(2, sync, h, 1, seed) for seed in args.seeds
                for sync, h in (("step", 0), ("diloco", 10))]
    # Per group count and seed: the every-step run first, then each H with each fragment
    # count that divides it (torchft: one fragment meets every H / fragments steps).
    out = []
    for groups in args.groups:
        for seed in args.seeds:
            out.append((groups, "step", 0, 1, seed))
            for h in args.every:
                out += [(groups, "diloco", h, f, seed) for f in args.fragments
                        if "diloco" in args.syncs and h % f == 0 and h >= f]
                if "local_sgd" in args.syncs:
                    out.append((groups, "local_sgd", h, 1, seed))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    base = TEST if args.test else MODEL
    results = []
    with tempfile.TemporaryDirectory(prefix="diloco-") as tmp:
        for i, (groups, kind, every, fragments, seed) in enumerate(runs(args)):
            # step: the groups meet at every step, which is DDP over the same processes.
            sync = [f"trainer_config.ft_sync={kind}"] + ([] if kind == "step" else [
                f"trainer_config.ft_sync_every={every}",
                f"trainer_config.ft_fragments={fragments}"])
            folder = Path(tmp) / str(i)
            folder.mkdir()
            row = {"groups": groups, "sync": kind, "every": every, "fragments": fragments,
                   "seed": seed,
                   **train(groups, [*base, *sync, f"trainer_config.seed={seed}"], folder)}
            results.append(row)
            print(json.dumps(row), flush=True)
    for row in results:  # the gap: against ft_sync=step with the same groups and seed
        step = next(r for r in results if (r["groups"], r["seed"], r["sync"]) ==
                    (row["groups"], row["seed"], "step"))
        row["gap"] = row["val_loss"] - step["val_loss"]
        row["bytes_ratio"] = step["bytes_per_step"] / row["bytes_per_step"]
    out = args.out or str(HERE / "bench" / ("diloco_test" if args.test else "diloco"))
    Path(f"{out}.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    if not args.test:
        plot(results, f"{out}.png")


def table(results: list[dict]) -> str:
    """bench/README.md's table: one row per groups, H and fragments (seeds averaged)."""
    lines = ["| groups | ft_sync | H | fragments | bytes/step | vs step | largest meeting "
             "| val loss | gap |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    order = {"step": 0, "local_sgd": 1, "diloco": 2}
    keys = sorted({(r["groups"], order[r["sync"]], r["every"], r["fragments"]) for r in results})
    for groups, kind, every, fragments in keys:
        rows = [r for r in results if (r["groups"], order[r["sync"]], r["every"],
                                       r["fragments"]) == (groups, kind, every, fragments)]
        # Seeds averaged; the bytes are the same for every seed (the model's size and H).
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("val_loss", "gap")}
        r = rows[0]
        lines.append(f"| {groups} | {r['sync']} | {every or 1} | {fragments} | "
                     f"{r['bytes_per_step']:,.0f} | 1/{r['bytes_ratio']:.0f} | "
                     f"{r['largest_meeting']:,} | {mean['val_loss']:.4f} | "
                     f"{mean['gap']:+.4f} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    """The loss gap against H, one line per group count and fragment count."""
    import matplotlib  # noqa: PLC0415 (only the plot needs it)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 4))
    for groups in sorted({r["groups"] for r in results}):
        for fragments in sorted({r["fragments"] for r in results}):
            for kind in ("diloco", "local_sgd"):
                rows = sorted((r["every"], r["gap"]) for r in results
                              if (r["groups"], r["fragments"], r["sync"]) ==
                              (groups, fragments, kind))
                if rows:
                    ax.plot(*zip(*rows, strict=True), marker="o" if kind == "diloco" else "x",
                            ls="-" if kind == "diloco" else ":",
                            label=f"{kind}, {groups} groups, {fragments} fragment(s)")
    # H spans two decades: a log axis; 0 marks the every-step run's loss.
    ax.set_xscale("log")
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_xlabel("H: steps between meetings (bytes per step: 1/H of every step's)")
    ax.set_ylabel("val loss minus every-step's, equal tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
