"""The dry run's predicted step time against measured steps, layout by layout, on 4 and 8
gloo ranks of this machine: JSON and a table (bench/README.md, Predicted step time).

    python bench/comm_lab.py                     # first: this machine's profile (comm_lab.json)
    python bench/bench_step_time.py              # every layout below at 4 and 8 ranks
    python bench/bench_step_time.py --worlds 4 --layouts ddp fsdp

For each layout and world size, in one run of this script: the dry run plans it
(mingpt/dry_run.py, as `python main.py trainer_config.dry_run=N` does) and predicts its step
from the profile (mingpt/step_time.py); then bench/bench.py trains it for real (torchrun, the
Trainer, as main.py runs) and times its steps: the figure is the median step. Every layout
trains the same global batch (GLOBAL sequences per step, whatever its data-parallel degree),
so the fastest layout is the one that gets through the same work first.

    python bench/bench_step_time.py --profile ddp_ep2 --worlds 2   # where a real step's time goes

--profile trains the layout with main.py's own profiler (trainer_config.profile_steps=2) and
splits rank 0's profiled steps as the model splits its prediction: matmuls (and attention),
the other ops, collectives, and the time outside any op (Python: the trainer, DTensor's and the
layouts' own code), beside the model's terms for the same step.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import bench  # bench/bench.py: its own folder is on the path when this runs as a script
from mingpt import config, dry_run, step_time  # bench.py put 05_mingpt/ on the path

HERE = bench.HERE
GLOBAL = 48  # sequences per step, over every data-parallel rank
# The layouts compared, one per axis: a name -> main.py's overrides.
LAYOUTS = {
    "ddp": ["trainer_config.distributed_method=ddp"],
    "zero": ["trainer_config.distributed_method=zero"],
    "fsdp": ["trainer_config.distributed_method=fsdp"],
    "fsdp_tp2": ["trainer_config.distributed_method=fsdp", "trainer_config.tp_size=2"],
    "fsdp_pp2": ["trainer_config.distributed_method=fsdp", "trainer_config.pp_size=2"],
    "ddp_cp2": ["trainer_config.distributed_method=ddp", "trainer_config.cp_size=2"],
    "ddp_ep2": ["trainer_config.distributed_method=ddp", "gpt_config.n_expert=4",
                "trainer_config.ep_size=2"],
}
MODEL_SPLIT = {"fsdp_tp2": 2, "fsdp_pp2": 2, "ddp_cp2": 2}  # ranks that share one batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--machine", dest="profile_path", default="bench/comm_lab.json",
                        help="the machine profile (bench/comm_lab.py's JSON)")
    parser.add_argument("--out", default="bench/step_time", help="writes OUT.json")
    parser.add_argument("--profile", choices=list(LAYOUTS),
                        help="profile this layout's real steps instead (at each --worlds)")
    return parser.parse_args(argv)


def bench_args(name: str, world: int, steps: int) -> argparse.Namespace:
    """bench.py's arguments for one layout: its defaults (gpt-micro, block 64), this layout's
    share of the global batch, one round."""
    # Ranks that split the model (tp, pp, cp) share a batch: fewer data-parallel ranks, each
    # with more sequences, so every layout trains GLOBAL per step.
    per_rank = GLOBAL * MODEL_SPLIT.get(name, 1) // world
    return bench.parse_args(["--runs", f"{name.split('_')[0]}:{world}", "--batch_size",
                             str(per_rank), "--steps", str(steps), "--warmup", "5",
                             "--rounds", "1", "--", *LAYOUTS[name][1:]])


def predicted(args: argparse.Namespace, strategy: str, world: int, profile: dict
              ) -> tuple[dict, dict]:
    """The dry run of the run bench.py makes, and its predicted step."""
    cfg = config.load([*bench.overrides(args, strategy, world), "trainer_config.device=cpu",
                       f"trainer_config.dry_run={world}"])
    lay, plans = dry_run.plan(cfg)
    pp, microbatches = lay.pp, cfg.trainer_config.microbatches
    return step_time.predict(world, pp, plans, profile, microbatches), {
        "pp": pp, "microbatches": microbatches, "plans": plans}


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention",
           "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def kind_of(name: str) -> str:
    if name in MATMULS:
        return "matmuls"
    if any(word in name for word in ("c10d", "gloo", "all_reduce", "all_gather",
                                      "reduce_scatter", "all_to_all", "send", "recv")):
        return "collectives"
    return "other ops"


def split_trace(path: Path) -> dict[str, float]:
    """Milliseconds per profiled step of rank 0's trace: each op's self time (its time less
    the ops inside it) by the op's kind (kind_of), and the time outside any op."""
    # Complete events ("X") only: each has its start and duration. The profiler marks each
    # step (ProfilerStep#N) and each op (cat cpu_op); ops nest (aten::linear holds aten::addmm).
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"),
                 key=lambda e: (e["ts"], -e["dur"]))  # a parent before the child it starts with
    out = dict.fromkeys(("matmuls", "collectives", "other ops"), 0.0)
    by_name: dict[str, float] = {}  # self time of each op name
    outermost, stack = 0.0, []  # the ops that hold the current one: (end, kind, name)
    for e in ops:
        while stack and stack[-1][0] <= e["ts"]:
            stack.pop()
        if stack:  # inside its parent: not the parent's own time
            out[stack[-1][1]] -= e["dur"]
            by_name[stack[-1][2]] -= e["dur"]
        else:
            outermost += e["dur"]
        kind = kind_of(e["name"])
        out[kind] += e["dur"]
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"]
        stack.append((e["ts"] + e["dur"], kind, e["name"]))
    wall, n = sum(e["dur"] for e in steps), len(steps)
    out["outside ops"] = wall - outermost
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:6]
    return {"step": wall / n / 1e3, **{k: v / n / 1e3 for k, v in out.items()},
            "top ops": [(name, t / n / 1e3) for name, t in top]}


def profile_run(name: str, world: int, profile: dict) -> None:
    """--profile: rank 0's profiled steps beside the model's terms for them."""
    b = bench_args(name, world, 1)
    with tempfile.TemporaryDirectory(prefix="bench_") as run_dir:
        b.run_dir = run_dir
        strategy = b.runs[0].split(":")[0]
        # main.py as bench.py configures it, for 9 steps: the profiler skips the first 5 (start-
        # up), warms up on 1 and records 2 (mingpt/profiling.py), rank 0's trace read back.
        cfg = [o for o in bench.overrides(b, strategy, world) if "max_steps" not in o]
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        subprocess.run([torchrun, "--standalone", f"--nproc_per_node={world}", "main.py", *cfg,
                        "trainer_config.max_steps=9", "trainer_config.profile_steps=2"],
                       cwd=HERE, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True,
                       capture_output=True)
        measured = split_trace(Path(run_dir) / "profile/rank0.json")
    p, plan = predicted(b, strategy, world, profile)
    r, c = p["ranks"][0], profile["compute"]
    work = plan["plans"][0]["work"]
    print(f"{world} ranks {name}, rank 0, ms per step: measured (profiler) / the model's")
    print(f"  matmuls      {measured['matmuls']:7.1f} / "
          f"{1e3 * work['flops'] / c['matmul_flops_per_s']:7.1f}")
    print(f"  other ops    {measured['other ops']:7.1f} / "
          f"{1e3 * (work['ops'] * c['op_s'] + work['bytes'] / c['bytes_per_s']):7.1f}")
    print(f"  outside ops  {measured['outside ops']:7.1f} / "
          f"{1e3 * work['dtensor_ops'] * c['dtensor_op_s']:7.1f} (the model: DTensor's code)")
    print(f"  collectives  {measured['collectives']:7.1f} / {1e3 * sum(r['comm'].values()):7.1f}")
    print(f"  step         {measured['step']:7.1f} / {1e3 * p['step']:7.1f}")
    print("  the ops of most self time: " + ", ".join(f"{name} {ms:.1f}"
                                                    for name, ms in measured["top ops"]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    profile = step_time.load_profile(HERE / args.profile_path)
    if args.profile:
        for world in args.worlds:
            profile_run(args.profile, world, profile)
        return 0
    rows = []
    # Each layout planned, then run, back to back: prediction and measurement share the
    # machine's state of that minute.
    for world in args.worlds:
        for name in args.layouts:
            b = bench_args(name, world, args.steps)
            b.run_dir = "/unused"  # the dry run writes nothing; bench.launch makes its own
            strategy = b.runs[0].split(":")[0]
            p, plan = predicted(b, strategy, world, profile)
            measured = bench.launch(b, b.runs[0])
            slowest = p["ranks"][p["slowest rank"]]
            row = {"layout": name, "world": world, "batch_per_rank": b.batch_size,
                   "predicted_ms": 1e3 * p["step"],
                   "compute_ms": 1e3 * slowest["compute"], "bubble_ms": 1e3 * slowest["bubble"],
                   "comm_ms": {k: 1e3 * v for k, v in slowest["comm"].items()},
                   "cores_bound": p["cores bound"], "capacity_ms": 1e3 * p["capacity"],
                   "measured_ms": measured and measured["median_step_ms"],
                   "plan": plan}  # what step_time.predict read, besides the profile
            if measured:
                row["error"] = row["predicted_ms"] / row["measured_ms"] - 1
            rows.append(row)
            print(f"{world} ranks {name:9} predicted {row['predicted_ms']:7.1f} ms "
                  f"(compute {row['compute_ms']:.1f}, bubble {row['bubble_ms']:.1f}, comm "
                  f"{sum(row['comm_ms'].values()):.1f}, cores {row['capacity_ms']:.1f}) "
                  f"measured {row['measured_ms'] or float('nan'):7.1f} ms"
                  + (f" ({100 * row['error']:+.0f}%)" if measured else ""), flush=True)
    # The question the prediction is for: which layout to run.
    for world in args.worlds:
        done = [r for r in rows if r["world"] == world and r["measured_ms"]]
        if done:
            fastest = min(done, key=lambda r: r["predicted_ms"])["layout"]
            really = min(done, key=lambda r: r["measured_ms"])["layout"]
            print(f"{world} ranks: predicted fastest {fastest}, measured fastest {really}")
    info = {"command": " ".join(["python", "bench/bench_step_time.py", *(argv or sys.argv[1:])]),
            "machine": bench.machine(), "profile": args.profile_path, "global_batch": GLOBAL,
            "rows": rows}
    out = HERE / args.out
    out.with_suffix(".json").write_text(json.dumps(info, indent=1))
    print(f"wrote {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
