"""One of four ranks for test_mingpt_strategies' fsdp_tp check on a (dp=2, tp=2) mesh.

A module of its own so that each spawned process imports torch and four 05_mingpt modules
only (not pytest, hydra or the trainer): four processes share the CI machine's two cores.
"""
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

MINGPT = Path(__file__).resolve().parent.parent / "05_mingpt"
CONFIG = dict(model_type=None, n_layer=1, n_head=2, n_embd=8, vocab_size=5, block_size=4,
              dropout=0.0)


def main(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, str(MINGPT))  # a fresh process: nothing of the steps' modules loaded
    from mingpt import distributed, optim, parallel, shards, snapshot  # noqa: PLC0415
    from mingpt.model import GPT, GPTConfig  # noqa: PLC0415
    dist.init_process_group("gloo", store=dist.FileStore(f"{out}/store", 4), rank=rank,
                            world_size=4, timeout=timedelta(seconds=120))
    x = torch.randint(0, 5, (2, 4), generator=torch.Generator().manual_seed(1))

    def trained(seed: int, method: str) -> tuple:
        torch.manual_seed(seed)
        model = GPT(GPTConfig(**CONFIG))
        if method != "plain":
            model = parallel.parallelize(model, torch.device("cpu"), method, tp_size=2)
        optimizer = optim.build_optimizer(model, "ddp", lr=1e-2)
        model(x, x)[1].backward()  # the same batch on every rank
        optimizer.step()
        return model, optimizer

    def local(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list, list]:
        params = list(model.parameters())
        return ([p.to_local().clone() for p in params],
                [v.to_local().clone() for p in params for v in optimizer.state[p].values()
                 if isinstance(v, DTensor)])  # AdamW's moments (the step count is plain)

    model, optimizer = trained(1, "fsdp_tp")
    saved = local(model, optimizer)
    snapshot.save(f"{out}/snap", model, optimizer, {"step": 1})
    fresh, fresh_optimizer = trained(2, "fsdp_tp")  # other weights and moments
    shards.load_sharded(f"{out}/snap", fresh, fresh_optimizer)
    loaded = local(fresh, fresh_optimizer)
    result = {key: all(torch.equal(a, b) for a, b in zip(x, y, strict=True))
              for key, x, y in (("shards_equal", saved[0], loaded[0]),
                                ("moments_equal", saved[1], loaded[1]))}
    if rank == 0:  # the parent compares the snapshot with what a plain model reaches
        torch.save(trained(1, "plain")[0].state_dict(), f"{out}/plain.pt")
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    del model, optimizer, fresh, fresh_optimizer  # what holds the group, before releasing it
    distributed.release()
