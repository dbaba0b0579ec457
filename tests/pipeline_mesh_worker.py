"""One rank of test_mingpt_pipeline's 2-D (fsdp_pp, 2 x 2) and 3-D (fsdp_tp_pp, 2 x 2 x 2) runs.

A module of its own, importing torch and a few 05_mingpt modules only (no pytest, hydra or
trainer): up to eight processes share the CI machine's two cores. Each trains STEPS steps on
fixed batches through the pipeline's own entry points, as the trainer calls them, and the
ranks at dp 0 and tp 0 save their stage's whole weights for the parent to compare.
"""
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

MINGPT = Path(__file__).resolve().parent.parent / "05_mingpt"
CONFIG = dict(model_type=None, n_layer=2, n_head=2, n_embd=16, vocab_size=11, block_size=8,
              dropout=0.0)
STEPS, BATCH, MICROBATCHES, LR = 3, 8, 2, 1e-2


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches of BATCH sequences, the same in every process."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 11, (BATCH, 8), generator=g),
             torch.randint(0, 11, (BATCH, 8), generator=g)) for _ in range(STEPS)]


def main(rank: int, out: str, world: int, method: str) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, str(MINGPT))  # a fresh process: nothing of the steps' modules loaded
    from mingpt import distributed, optim, parallel  # noqa: PLC0415  (path set)
    from mingpt.model import GPT, GPTConfig  # noqa: PLC0415
    from mingpt.parallel import grads, strided  # noqa: PLC0415
    dist.init_process_group("gloo", store=dist.FileStore(f"{out}/store", world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    model = parallel.parallelize(GPT(GPTConfig(**CONFIG)), torch.device("cpu"), method,
                                 pp_size=2, tp_size=2 if method == "fsdp_tp_pp" else 0,
                                 microbatches=MICROBATCHES)
    optimizer = optim.build_optimizer(model, method, lr=LR, weight_decay=0.0)
    pipeline, mesh = model.pipeline, model.mesh
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    losses = []
    for x, y in batches():  # each dp rank takes its share of the global batch
        share = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
        pipeline.start_step(1)
        pipeline.train_step(x[share], y[share])
        losses.append(pipeline.finish_step().tolist())
        grads.clip_grad_norm_(model.parameters(), 1.0, pipeline.group, pipeline.not_counted)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    # Whole tensors, collectively (FSDP's shards over dp, TP's over tp): every rank gathers.
    weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
               for k, v in strided.whole_strided(model.state_dict()).items()}
    # (pp, dp, tp): the mesh has a dimension for each axis that is on (layout.py).
    place = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate(), strict=True))
    coordinate = [place.get(axis, 0) for axis in ("pp", "dp", "tp")]
    if coordinate[1:] == [0, 0]:
        torch.save(weights, f"{out}/stage{coordinate[0]}.pt")
    Path(out, f"rank{rank}.json").write_text(json.dumps({"losses": losses,
                                                         "coordinate": coordinate}))
    del model, optimizer, pipeline, mesh  # what holds the group, before releasing it
    distributed.release()


def reference(out: str) -> list[float]:
    """The same steps in one process, on the whole batches; saves the weights, returns the
    mean losses per step (what DDP computes, summed in one place)."""
    sys.path.insert(0, str(MINGPT))
    from mingpt import optim  # noqa: PLC0415
    from mingpt.model import GPT, GPTConfig  # noqa: PLC0415
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    optimizer = optim.build_optimizer(model, "ddp", lr=LR, weight_decay=0.0)
    losses = []
    for x, y in batches():
        loss = model(x, y)[1]
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.save(model.state_dict(), f"{out}/reference.pt")
    return losses
