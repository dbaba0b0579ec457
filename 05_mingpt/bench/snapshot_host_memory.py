"""Host memory of saving and resuming a ddp run's snapshot: the peak RSS of fresh processes.

    python bench/snapshot_host_memory.py                    # gpt2-medium, 65-character vocab
    python bench/snapshot_host_memory.py --preset gpt2 --dir /tmp/snapbench
    python bench/snapshot_host_memory.py --mingpt OTHER/05_mingpt   # another snapshot.py

Builds model.GPT (--preset, random weights) and AdamW with a full state (exp_avg and exp_avg_sq
random, as after training), and saves them with snapshot.save, as a one-rank ddp run does.
Then a fresh process builds a fresh model and optimizer and resumes with snapshot.load, as
main.py does (a one-rank gloo group). Each phase runs in its own process, which resets the
kernel's high-water mark first (writing 5 to /proc/self/clear_refs) and reports, from
/proc/self/status, how far the peak resident set (VmHWM) rose above what it held before
the phase, and the anonymous (RssAnon: the process's own memory) and file-backed (RssFile:
mapped pages of the page cache, which processes mapping one file share and the kernel can
drop) parts: at the end, and anonymous at its peak (sampled every millisecond or so).
Linux only. Needs about 7x the weights' size free (the code before the change). "file" in the
figures is the snapshot's size on disk: its shards and train_state.pt.
"""
import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 2**20


def status() -> dict[str, int]:
    """This process's memory counters from /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        return {key: int(value.split()[0]) * 1024 for key, value in
                (line.split(":", 1) for line in f) if key in
                ("VmHWM", "VmRSS", "RssAnon", "RssFile")}


class AnonPeak(threading.Thread):
    """The highest RssAnon seen while running (the kernel keeps no peak of it)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = status()["RssAnon"], True

    def run(self) -> None:
        # Polled every millisecond: a short-lived peak between two polls is missed, so the
        # figure is a lower bound (VmHWM, which the kernel keeps, bounds it from above).
        while self.running:
            self.peak = max(self.peak, status()["RssAnon"])
            time.sleep(0.001)

    def stop(self) -> int:
        self.running = False
        self.join()
        return max(self.peak, status()["RssAnon"])


def phase(args: argparse.Namespace) -> dict:
    """One phase (save or load) in this process; its figures."""
    sys.path.insert(0, str(Path(args.mingpt).resolve()))
    import torch  # noqa: PLC0415  (after the path: the chosen folder's modules)
    import torch.distributed as dist  # noqa: PLC0415

    from mingpt import optim, snapshot, trainer  # noqa: PLC0415
    from mingpt.model import GPT, GPTConfig  # noqa: PLC0415

    torch.manual_seed(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    config = dict(model_type=args.preset, vocab_size=65, block_size=args.block_size)
    model = GPT(GPTConfig(**config))
    optimizer = optim.build_optimizer(model, "ddp", lr=1e-4)
    meta = {"model_config": config, "data_meta": {"kind": "char"}}
    path = str(Path(args.dir) / "snapshot")
    if args.phase == "save":
        for p in model.parameters():  # as after a step: both moments, the step count
            optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(p),
                                  "exp_avg_sq": torch.rand_like(p)}
        run = lambda: snapshot.save(path, model, optimizer,  # noqa: E731
                                    {"step": 1, "rng": [trainer.rng_state(torch.device("cpu"))],
                                     **meta})
    else:
        run = lambda: snapshot.load(path, model, optimizer, meta, ())  # noqa: E731
    # The weights' own bytes: the figures are read against them (and against the file size).
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS, from here on
    before, anon = status(), AnonPeak()
    anon.start()
    start = time.perf_counter()
    state = run()
    seconds = time.perf_counter() - start
    anon_peak, after = anon.stop(), status()
    # peak_growth: VmHWM, which counts mapped file pages (page cache, shared by the ranks of a
    # node and droppable); anon_*: the process's own memory, which a mapped load avoids.
    if args.phase == "load":  # what came back is what was saved (the file's last tensor)
        assert state["step"] == 1 and all(len(s) == 3 for s in optimizer.state.values())
    dist.destroy_process_group()
    size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    return {"phase": args.phase, "weights": weights, "file": size,
            "seconds": round(seconds, 2), "peak_growth": after["VmHWM"] - before["VmRSS"],
            "anon_peak_growth": anon_peak - before["RssAnon"],
            "anon_growth": after["RssAnon"] - before["RssAnon"],
            "file_backed_growth": after["RssFile"] - before["RssFile"]}


def machine() -> str:
    import torch  # noqa: PLC0415
    # The model name as lscpu prints it: figures name the machine they come from.
    cpu = platform.processor() or "?"
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), cpu)
    return (f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__} "
            f"(CPU capability {torch.backends.cpu.get_cpu_capability()})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-medium")
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--dir", default="/tmp/snapshot_host_memory",
                        help="where the snapshot is written (and removed afterwards)")
    parser.add_argument("--mingpt", default=str(HERE.parent),
                        help="the 05_mingpt folder whose snapshot.py to measure")
    parser.add_argument("--phase", choices=["save", "load"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:  # a worker: one JSON line
        print(json.dumps(phase(args)))
        return
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    print(f"{machine()}\nsnapshot.py of {Path(args.mingpt).resolve()}, model {args.preset}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        for name in ("save", "load"):
            proc = subprocess.run([sys.executable, __file__, *(argv or sys.argv[1:]),
                                   "--phase", name], capture_output=True, text=True, env=env)
            if proc.returncode:
                sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.splitlines()[-1])
            if name == "save":
                print(f"weights {r['weights'] / MiB:,.0f} MiB, snapshot "
                      f"{r['file'] / MiB:,.0f} MiB (weights + AdamW's two moments)")
            print(f"{name}: peak RSS +{r['peak_growth'] / MiB:,.0f} MiB "
                  f"({r['peak_growth'] / r['file']:.2f}x the file); anonymous at its peak "
                  f"+{r['anon_peak_growth'] / MiB:,.0f} MiB; after: anonymous "
                  f"+{r['anon_growth'] / MiB:,.0f} MiB, file-backed "
                  f"+{r['file_backed_growth'] / MiB:,.0f} MiB; {r['seconds']} s")
            print(f"BENCH_SNAPSHOT_HOST_MEMORY {json.dumps(r)}")
    finally:
        shutil.rmtree(Path(args.dir) / "snapshot", ignore_errors=True)


if __name__ == "__main__":
    main()
