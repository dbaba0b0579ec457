"""Memory per rank and bytes per step by axis, from dry runs (mingpt/dry_run.py) of one model at
8, 64 and 1,024 ranks under several layouts: plan_memory.png, plan_comm.png and plan.json.

    cd 05_mingpt && python bench/plan_pictures.py        # a few minutes on a 2-core CPU

Each bar is the rank that holds the most (the largest predicted peak) of its layout; the
numbers are dry_run.plan's, the table main.py prints with trainer_config.dry_run=N.
"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from mingpt import config, dry_run  # noqa: E402  (after the path: run from anywhere)

# gpt-mini's depth with heads and width that split 8 ways; the char data's vocabulary. AdamW,
# as plan.json was drawn with (Muon's gathers of whole matrices: DRY_RUN.md).
MODEL = ["gpt_config.model_type=null", "gpt_config.n_layer=8", "gpt_config.n_head=8",
         "gpt_config.n_embd=256", "gpt_config.block_size=128", "gpt_config.dropout=0.0",
         "trainer_config.batch_size=8", "trainer_config.microbatches=4",
         "optimizer_config.name=adamw"]
LAYOUTS = {
    "ddp": ["trainer_config.distributed_method=ddp"],
    "fsdp": ["trainer_config.distributed_method=fsdp"],
    "fsdp x tp 8": ["trainer_config.distributed_method=fsdp", "trainer_config.tp_size=8"],
    "fsdp x tp 2 x pp 4": ["trainer_config.distributed_method=fsdp", "trainer_config.tp_size=2",
                           "trainer_config.pp_size=4"],
}
WORLDS = (8, 64, 1024)
MEMORY = ("parameters", "gradients", "optimizer", "buffers", "peak activations")


def measure() -> dict:
    """{world: {layout: the largest rank's plan}}."""
    out: dict = {}
    for world in WORLDS:
        for name, overrides in LAYOUTS.items():
            cfg = config.load([*MODEL, *overrides, f"trainer_config.dry_run={world}"])
            _, plans = dry_run.plan(cfg)
            rank, plan = max(plans.items(), key=lambda item: item[1]["predicted peak"])
            out.setdefault(str(world), {})[name] = {"rank": rank, **plan}
            print(f"{world} ranks, {name}: rank {rank} peak {plan['predicted peak']:,} B",
                  flush=True)
    return out


def draw(results: dict) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    names = list(LAYOUTS)
    # Memory: one panel per world size, one stacked bar per layout (the Playbook's picture):
    # parameters, gradients, AdamW's state, communication buffers and peak activations.
    fig, axes = plt.subplots(1, len(WORLDS), figsize=(15, 4.5), sharey=False)
    for ax, world in zip(axes, WORLDS, strict=True):
        bottom = [0.0] * len(names)  # the stack's height so far, per layout
        for kind in MEMORY:
            values = [results[str(world)][n][kind] / 2**20 for n in names]
            ax.bar(names, values, bottom=bottom, label=kind)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_title(f"{world} ranks")
        ax.set_ylabel("MiB per rank (the largest rank)")
        ax.tick_params(axis="x", rotation=20)
    axes[0].legend(fontsize=8)
    fig.suptitle("Memory per rank by kind (dry run, fp32, AdamW; 8 x 8 x 256 GPT, "
                 "8 x 128 tokens per micro-step, 1 step)")
    fig.tight_layout()
    fig.savefig(HERE / "plan_memory.png", dpi=90)
    # Communication: the bytes a rank sends per step, stacked by the mesh axis they cross
    # (ring shares, as the dry run counts them: what one rank puts on its link).
    fig, axes = plt.subplots(1, len(WORLDS), figsize=(15, 4.5))
    axis_names = sorted({a for w in results.values() for p in w.values() for a in p["comm"]})
    for ax, world in zip(axes, WORLDS, strict=True):
        bottom = [0.0] * len(names)
        for axis in axis_names:
            # Every collective kind on this axis ("all_gather sent", ...), summed.
            values = [sum(v for k, v in results[str(world)][n]["comm"].get(axis, {}).items()
                          if k.endswith(" sent")) / 2**20 for n in names]
            ax.bar(names, values, bottom=bottom, label=axis)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_title(f"{world} ranks")
        ax.set_ylabel("MiB sent per rank per step")
        ax.tick_params(axis="x", rotation=20)
    axes[0].legend(fontsize=8, title="axis")
    fig.suptitle("Bytes each rank sends per step, by axis (ring shares; dry run)")
    fig.tight_layout()
    fig.savefig(HERE / "plan_comm.png", dpi=90)


def main() -> None:
    # The numbers first (plan.json, committed beside the pictures), then the two pictures.
    results = measure()
    (HERE / "plan.json").write_text(json.dumps(results, indent=1))
    draw(results)


if __name__ == "__main__":
    main()
