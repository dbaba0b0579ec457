"""Spawn the gloo ranks of a benchmark and read back what rank 0 wrote; shared by the
benchmarks that measure inside one process group (bench_experts.py, bench_pp_gathers.py,
bench_pipeline.py, bench_context.py).

    import ranks  # the scripts' own folder, bench/, is on the path when run as a script
    info = ranks.spawn(worker, 4, Path("bench/experts.json"), args)

`worker(rank, store, out, *args)` runs in each of the spawned processes: it joins the group
through the FileStore at `store` and, on rank 0 only, writes its JSON to `out`.
"""
import json
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def spawn(worker, world: int, out: Path, *args) -> Any:
    """Run worker(rank, store, out, *args) in `world` spawned processes; return out's JSON."""
    store = out.with_suffix(".store")  # the group's FileStore, beside the JSON
    store.unlink(missing_ok=True)  # a FileStore left by a failed run would hold stale keys
    # spawn, not fork: each rank starts a fresh interpreter, with no threads of this process.
    mp.start_processes(worker, args=(str(store), str(out), *args), nprocs=world,
                       start_method="spawn")
    store.unlink(missing_ok=True)
    return json.loads(out.read_text())
