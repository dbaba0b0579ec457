"""A two-rank program under torchrun in which rank 1 leaves out step 3's all-reduce and goes on
(test_mingpt_hang.py): the off-by-one pairing that the trainer cannot show on gloo. With
`shapes`, rank 1 all-reduces 5 numbers at step 3 where rank 0 all-reduces 4; with `late`, rank
1 never comes to its first all-reduce (under TORCH_DISTRIBUTED_DEBUG=DETAIL, the barrier that
checks each collective times out on rank 0).

In the trainer the collectives after a skip soon differ in size, and gloo then aborts the rank
that receives the wrong size (SIGABRT: no dump). Here every step's all-reduce has the same
size, so rank 1's step 4 silently pairs with rank 0's step 3, as NCCL would pair any sizes;
rank 1 then finishes its steps and waits elsewhere, rank 0's last all-reduce times out, and
both leave their traces through mingpt.forensics, as main.py's ranks do.

    torchrun --nproc_per_node=2 tests/hang_worker.py RUN_DIR TIMEOUT_S [skip|shapes|late]
"""
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

MINGPT = Path(__file__).resolve().parent.parent / "05_mingpt"
STEPS, SKIP = 6, 3


def steps(mode: str) -> None:
    for step in range(STEPS if mode != "late" or dist.get_rank() == 0 else 0):
        forensics.mark_step(step)
        odd = dist.get_rank() == 1 and step == SKIP
        if mode == "shapes":
            dist.all_reduce(torch.ones(5 if odd else 4))
        elif not odd:
            dist.all_reduce(torch.ones(4))  # the same size every step: pairing stays silent
    while True:  # the rank with a step fewer: busy elsewhere (no collective) until stopped
        time.sleep(1)


if __name__ == "__main__":
    sys.path.insert(0, str(MINGPT))
    from mingpt import distributed, forensics  # noqa: PLC0415  (path set above)
    run_dir, timeout_s = sys.argv[1], float(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "skip"
    distributed.setup("cpu", collective_timeout_s=timeout_s, run_dir=run_dir,
                      flight_recorder_entries=100)
    forensics.arm(run_dir)
    try:
        forensics.watch(steps, run_dir, mode)
    finally:
        distributed.release()
