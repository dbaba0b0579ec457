"""Count FSDP's all-gathers per optimizer step under a pipeline, with and without resharding
after forward; JSON.

    python bench/bench_pp_gathers.py                       # 4 CPU ranks: pp 2 x dp 2, m = 4

Spawns 4 gloo processes, lays a small GPT out as fsdp with pp_size=2 through
parallel.parallelize (as main.py does), and counts FSDP's all-gathers and reduce-scatters in
one step (the second: the first also builds the schedule's buffers) by counting the calls of
torch.distributed's all_gather_single and reduce_scatter_single, through which FSDP2 issues
them. (torch's CommDebugMode would count them too, but its hooks refuse the autograd.grad
call of a pipeline stage's backward.) parallelize keeps each stage's weights gathered after
forward under a pipeline (reshard_after_forward=False); the "before" row sets FSDP's switch
back to True on every FSDP module of the stages, which is what the pipeline did before:
each micro-batch's forward and backward then gather the stage's weights again.
"""
import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import spawn  # bench/ranks.py: run as a script, its own folder is on the path

# The scripts and the library live one folder up (05_mingpt/), from wherever this is run.
HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
WORLD = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--out", default="bench/pp_gathers", help="writes OUT.json")
    return parser.parse_args(argv)


def count_step(reshard: bool, microbatches: int, n_layer: int) -> dict[str, int]:
    """The collectives of one step of fsdp x pp 2 on this process group, by kind."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    from mingpt import optim, parallel  # noqa: PLC0415  (path set above)
    from mingpt.model import GPT, GPTConfig  # noqa: PLC0415
    # Small and fast: the counts depend on the FSDP units and micro-batches, not on sizes.
    torch.manual_seed(0)
    config = GPTConfig(model_type=None, n_layer=n_layer, n_head=2, n_embd=32, vocab_size=65,
                       block_size=32, dropout=0.0)
    model = parallel.parallelize(GPT(config), torch.device("cpu"), "fsdp", pp_size=2,
                                 microbatches=microbatches)
    # Every FSDP unit of this rank's stages (its blocks and the stage root) gets the switch.
    for stage in model.pipeline.stages:
        for module in stage.submod.modules():
            if isinstance(module, FSDPModule):
                module.set_reshard_after_forward(reshard)
    optimizer = optim.build_optimizer(model, "fsdp", lr=1e-3)
    runner = parallel.runner(model, torch.device("cpu"), "fp32")
    # One micro-step of 2 x m sequences: the runner cuts it into m micro-batches.
    x = torch.randint(0, 65, (2 * microbatches, 32), generator=torch.Generator().manual_seed(1))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    counts: dict[str, int] = {}
    calls = {"all_gather": dist.all_gather_single, "reduce_scatter": dist.reduce_scatter_single}

    def counted(name: str):
        """torch's function `name`, counting its calls in `counts`."""
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return calls[name](*args, **kwargs)
        return call

    for step in range(2):
        if step == 1:  # FSDP looks the functions up on torch.distributed at each call
            dist.all_gather_single = counted("all_gather")
            dist.reduce_scatter_single = counted("reduce_scatter")
        runner.forward_backward([(x, x)], scaler, lambda phase: None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.all_gather_single = calls["all_gather"]
    dist.reduce_scatter_single = calls["reduce_scatter"]
    return counts


def _worker(rank: int, store: str, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=300))
    # Both settings in the same processes, one after the other: the same model each time.
    rows = [{"reshard_after_forward": reshard,
             **count_step(reshard, args.microbatches, args.n_layer)} for reshard in (True, False)]
    if rank == 0:  # rank 0 holds the first stage (embeddings, half the blocks)
        Path(out).write_text(json.dumps({"ranks": WORLD, "layout": "fsdp: pp 2 x dp 2",
                                         "microbatches": args.microbatches,
                                         "n_layer": args.n_layer, "rank0": rows}, indent=1))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for row in spawn(_worker, WORLD, HERE / f"{args.out}.json", args)["rank0"]:
        print(row)


if __name__ == "__main__":
    main()
