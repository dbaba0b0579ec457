"""One rank of a job whose last rank stalls at step 3 on a mesh axis (test_mingpt_hang.py).

    torchrun --nproc_per_node=N tests/axis_hang_worker.py RUN_DIR TIMEOUT_S LAYOUT

Each step makes the communication of LAYOUT on a DeviceMesh of real gloo groups, as 05's
strategies do: pp (2 ranks) a pipeline stage's activation sent forward and its gradient sent
back, point to point, through batch_isend_irecv as torch.distributed.pipelining sends them; cp
(2) the all-to-all that passes each rank's keys and values round the ring; 3d (8, pp 2 x dp 2
x tp 2) pp's, tp's (an all-reduce of a row-parallel layer's output) and dp's (the gradient
all-reduce). The last rank stops before step 3 and sleeps, as a rank stuck
in I/O; the others wait in their next operation with it until TIMEOUT_S, and every rank leaves
its trace through mingpt.forensics, as main.py's ranks do.
"""
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

MINGPT = Path(__file__).resolve().parent.parent / "05_mingpt"
STEPS, STALL = 5, 3
# Two dimensions even where one has a single rank, as 05's meshes have them ((pp, dp, tp),
# (dp, cp)): a one-dimensional mesh over every rank would reuse the default group.
MESHES = {"pp": ((2, 1), ("pp", "dp")), "cp": ((1, 2), ("dp", "cp")),
          "3d": ((2, 2, 2), ("pp", "dp", "tp"))}
# The default group's timeout while 8 processes import torch on a busy 2-core machine: the
# first ones wait for the last in the rendezvous. The stall is timed by the mesh's groups.
START_TIMEOUT_S = 300


def pipeline_step(pp: dist.ProcessGroup) -> None:
    """Stage 0 sends an activation to stage 1 and receives its gradient back; stage 1 the
    other way round (a 2-stage pipeline, one micro-batch)."""
    stage, peer = pp.rank(), dist.get_global_rank(pp, 1 - pp.rank())
    activation, gradient = torch.ones(4, 8), torch.ones(4, 8)
    first, then = (dist.isend, dist.irecv) if stage == 0 else (dist.irecv, dist.isend)
    for op, tensor in ((first, activation), (then, gradient)):
        for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, pp)]):
            work.wait()


def steps(mesh, layout: str) -> None:
    for step in range(STEPS):
        forensics.mark_step(step)
        if step == STALL and dist.get_rank() == dist.get_world_size() - 1:
            print(f"[rank {dist.get_rank()}] stalls before step {step}", flush=True)
            while True:  # as faults.inject_fault's FAULT_STALL_AT_STEP: asleep, until stopped
                time.sleep(1)
        if layout == "3d":
            dist.all_reduce(torch.ones(4, 8), group=mesh.get_group("tp"))
        if layout == "cp":
            dist.all_to_all_single(torch.empty(2, 16), torch.ones(2, 16),
                                   group=mesh.get_group("cp"))
        if layout in ("pp", "3d"):
            pipeline_step(mesh.get_group("pp"))
        if layout == "3d":
            dist.all_reduce(torch.ones(32), group=mesh.get_group("dp"))


if __name__ == "__main__":
    sys.path.insert(0, str(MINGPT))
    from mingpt import distributed, forensics  # noqa: PLC0415  (path set above)
    run_dir, timeout_s, layout = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    sizes, names = MESHES[layout]
    # A mesh dimension over every rank reuses the default group (2 ranks here): it must time
    # out as the others do. Where none does (3d), the default group may wait for the start.
    spans_world = max(sizes) == int(os.environ["WORLD_SIZE"])
    distributed.setup("cpu", collective_timeout_s=timeout_s if spans_world else START_TIMEOUT_S,
                      run_dir=run_dir, flight_recorder_entries=100)
    # The mesh's groups wait timeout_s, as collective_timeout_s makes them wait in main.py.
    distributed.later_groups_wait(timedelta(seconds=timeout_s))
    device_mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    dist.barrier()  # every rank has started: from here on the mesh's timeout counts
    forensics.arm(run_dir)
    try:
        forensics.watch(steps, run_dir, device_mesh, layout)
    finally:
        del device_mesh
        distributed.release()
