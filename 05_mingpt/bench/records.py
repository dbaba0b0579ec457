"""The CPU speedrun's record table: each change to `python main.py`, timed from the command's
start on tiny Shakespeare characters, seed by seed (RECORDS.md shows the tables).

    python bench/records.py                           # every row of target 1.88, 3 seeds each
    python bench/records.py --rows adamw muon --seeds 1337
    python bench/records.py --target 10min            # the lowest val loss within 10 minutes
    python bench/records.py --table bench/records.json   # the markdown tables of a saved run
    python bench/records.py --rows adamw -- trainer_config.max_steps=500   # main.py's, last

Two targets. "1.88": the seconds until a validation loss at or below 1.88 (where nanoGPT's CPU
recipe ends; bench.py's QUALITY), evaluating every 100 steps (each evaluation's time counts).
"10min": the lowest validation loss printed within 600 s of the start (the run is stopped there
if it has not ended). Each run is bench.py's timed_main, in a scratch run directory; the rows
run one after the other, so their figures share one machine and one load.
"""
import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import HERE, QUALITY, machine, timed_main  # noqa: E402 (bench/ is not a package)

OPTIONS = ["gpt_config.rotary=true", "gpt_config.qk_norm=true", "gpt_config.relu2=true",
           "gpt_config.untied_head=true"]
MUON = ["optimizer_config.name=muon"]
# 300 steps: the cosine anneals by then; a shorter warmup, AdamW's lr (embeddings, head)
# doubled. Found by single-seed sweeps of steps, warmup, both lrs and depth (RECORDS.md).
SHORT = ["trainer_config.max_steps=300", "trainer_config.warmup_steps=50",
         "optimizer_config.lr=2e-2"]
TWO_LAYERS = ["gpt_config.model_type=null", "gpt_config.n_layer=2", "gpt_config.n_head=4",
              "gpt_config.n_embd=128"]
RECORD = [*OPTIONS, *MUON, *SHORT, *TWO_LAYERS]
# The 10-minute rows' recipe (ROWS["10min"] says why).
MICRO_128 = [*OPTIONS, *MUON, "gpt_config.block_size=128", "trainer_config.max_steps=3400",
             "trainer_config.eval_every=400"]
# The recipe every row starts from: main.py's defaults before Muon became one (AdamW, 1500
# steps), so the rows measured then stay the same commands now.
BEFORE_MUON = ["optimizer_config.name=adamw", "trainer_config.max_steps=1500"]
# name -> (the change, main.py's overrides). Each record row adds one change to the row above;
# the without_* rows take one option out of the record. Rows that did not help stay.
ROWS = {
    "1.88": {
        # nanoGPT's shakespeare_char on a CPU (its README's command): batch 12, lr 1e-3, beta2
        # 0.99, 100 warmup steps, cosine to 1e-4 over 2000 steps, no dropout.
        "nanogpt": ("nanoGPT's CPU recipe through main.py", [
            "trainer_config.batch_size=12", "optimizer_config.lr=1e-3",
            "optimizer_config.betas=[0.9,0.99]", "trainer_config.max_steps=2000"]),
        "adamw": ("`python main.py` before Muon (AdamW, batch 16, lr 1e-2, 1500 steps)", []),
        "options": ("+ rotary, qk_norm, relu2, untied_head", OPTIONS),
        "muon": ("+ Muon on the blocks' matrices", [*OPTIONS, *MUON]),
        "short": ("+ 300 steps, warmup 50, AdamW lr 2e-2", [*OPTIONS, *MUON, *SHORT]),
        "two_layers": ("+ 2 layers instead of 4: the record", RECORD),
        **{f"without_{o}": (f"the record without {o}", [x for x in RECORD if o not in x])
           for o in ("rotary", "qk_norm", "relu2", "untied_head")},
        # The two whose removal cost nothing above, both out.
        "lean": ("the record without qk_norm and relu2",
                 [x for x in RECORD if "qk_norm" not in x and "relu2" not in x]),
        # What main.py took from the rows above: Muon, on half of adamw's steps (its cosine
        # ends sooner). No model option: GPT-2's weights cannot hold them (init_from, export).
        "default": ("`python main.py` as it ships: `adamw` + Muon, 750 steps",
                    [*MUON, "trainer_config.max_steps=750"]),
    },
    "10min": {
        # The record's changes on gpt-micro at twice the context, as many steps as fit (about
        # 152 ms a step and 1.8 s an evaluation on EPYC: 540 s, with room for a slower run),
        # evaluating every 400 steps. 3000 steps ended at 1.4996 after 489 s (seed 1337).
        "micro_128": ("gpt-micro, block 128, options and Muon, 3400 steps", MICRO_128),
        # Both lrs annealed to 0 rather than to a tenth: the last steps settle further (seed
        # 1339 went on past 1.50 where a tenth left it at 1.5058).
        "micro_128_to_zero": ("+ the cosine down to 0 (min_lr_ratio=0)",
                              [*MICRO_128, "trainer_config.min_lr_ratio=0.0"]),
    },
}
# How long a run of each target may go on (None: to its own end).
BUDGET_S = {"1.88": None, "10min": 600.0}
# Every row alike: an evaluation every 100 steps (the crossing's resolution: 100 steps, a few
# seconds), no sample at the end (it comes after the last evaluation and moves no figure).
EVERY = ["trainer_config.eval_every=100", "trainer_config.sample_tokens=0"]


def run_row(target: str, name: str, seed: int, scratch: Path, extra: list[str]) -> dict:
    """One row, one seed: timed_main with the row's overrides, its seed and run directory;
    `extra` (main.py's, after `--`) win over both, key by key (hydra takes a key once)."""
    change, overrides = ROWS[target][name]
    given = dict(arg.split("=", 1) for arg in [*EVERY, *BEFORE_MUON, *overrides,
                                               f"trainer_config.seed={seed}", *extra])
    args = [*(f"{key}={value}" for key, value in given.items()),
            f"run_dir={scratch / f'{target}_{name}_{seed}'}"]
    # The printed val losses, timed from the start; the 1.88 runs stop once they get there.
    info = timed_main(args, BUDGET_S[target], QUALITY if target == "1.88" else None)
    # What a reader types: the overrides without the scratch folder.
    info["command"] = " ".join(["python", "main.py", *args[:-1]])
    # The 10-minute target counts the evaluations printed by then (a stopped run's are all).
    within = [v for t, _, v in info["curve"] if BUDGET_S[target] is None
              or t <= BUDGET_S[target]]
    info.update(target=target, row=name, change=change, seed=seed,
                best_val=min(within) if within else None)
    return info


def spread(values: list[float], digits: int) -> str:
    """The median of the seeds, and their range where there are several."""
    if not values:
        return "never"
    middle = f"{statistics.median(values):.{digits}f}"
    return middle if len(values) == 1 else \
        f"{middle} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def table(runs: list[dict], target: str) -> str:
    """Markdown: one line per row, its seeds summarised (median, and min–max)."""
    rows = [r for r in runs if r["target"] == target]
    names = list(dict.fromkeys(r["row"] for r in rows))
    # Each cell the seeds' median (and range): one seed's luck is not a record.
    if target == "1.88":
        head = ["row", "change", "seeds", f"s to val ≤ {QUALITY}", "step", "tokens seen",
                "val there", "wall s"]
    else:
        head = ["row", "change", "seeds", "lowest val within 600 s", "steps done", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        mine = [r for r in rows if r["row"] == name]
        reached = [r for r in mine if r["time_to_quality_s"] is not None]
        cells = [f"`{name}`", mine[0]["change"], str(len(mine))]
        if target == "1.88":  # only the seeds that got there count toward time, step, tokens
            steps = [r["step_to_quality"] for r in reached]
            tokens = [r["step_to_quality"] * r["tokens_per_step"] for r in reached]
            cells += [spread([r["time_to_quality_s"] for r in reached], 1)
                      + ("" if len(reached) in (0, len(mine)) else
                         f" ({len(reached)} of {len(mine)} seeds)"),
                      spread(steps, 0), spread([t / 1e6 for t in tokens], 2) + "M"
                      if tokens else "—",
                      spread([r["curve"][-1][2] for r in mine], 4)]
        else:
            cells += [spread([r["best_val"] for r in mine], 4),
                      spread([r["curve"][-1][1] for r in mine], 0)]
        cells.append(spread([r["wall_s"] for r in mine], 1))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # main.py's overrides
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=list(ROWS), default="1.88")
    parser.add_argument("--rows", nargs="+", help="rows of the target (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1337, 1338, 1339])
    parser.add_argument("--out", default="bench/records", help="writes OUT.json")
    parser.add_argument("--table", metavar="JSON", help="print a saved run's tables")
    args = parser.parse_args(argv)
    if args.table:
        runs = json.loads(Path(args.table).read_text())["runs"]
        for target in dict.fromkeys(r["target"] for r in runs):
            print(f"target {target}:\n{table(runs, target)}\n")
        return 0
    rows = args.rows or list(ROWS[args.target])
    unknown = [row for row in rows if row not in ROWS[args.target]]
    if unknown:
        print(f"error: no row {unknown[0]} for target {args.target}; rows: "
              f"{', '.join(ROWS[args.target])}", file=sys.stderr)
        return 2
    out = HERE / args.out
    # The runs saved before: rows not run this time keep theirs.
    saved = json.loads(out.with_suffix(".json").read_text())["runs"] \
        if out.with_suffix(".json").exists() else []
    runs = []
    with tempfile.TemporaryDirectory() as scratch:  # runs/ stays the reader's
        for name in rows:  # row by row, the seeds of a row together
            for seed in args.seeds:
                print(f"== {args.target} {name} seed {seed}", flush=True)
                info = run_row(args.target, name, seed, Path(scratch), extra)
                if info.pop("returncode") not in (0, -15):  # -15: stopped at the budget
                    print(f"error: {info['command']} failed", file=sys.stderr)
                    return 1
                runs.append(info)
    # A later run of some rows replaces those rows' runs and keeps the others.
    done = {(r["target"], r["row"]) for r in runs}
    runs = [r for r in saved if (r["target"], r["row"]) not in done] + runs
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"machine": machine(), "runs": runs}, indent=1))
    print(table(runs, args.target))
    print(f"wrote {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
