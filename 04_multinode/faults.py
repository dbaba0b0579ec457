"""Fault injection, to watch torchrun restart a crashed job (a demo tool, not for real runs)."""
import os
import signal

import torch.distributed as dist


def inject_fault(epoch: int) -> None:
    """FAULT_AT_EPOCH=N: the last rank kills itself (SIGKILL) during epoch N, on the first attempt.

    torchrun counts restarts in TORCHELASTIC_RESTART_COUNT; checking it makes the crash happen
    once, so the restarted job can get past epoch N.
    """
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    # One rank is enough: DDP cannot go on without it, so torchrun restarts them all.
    last_rank = dist.get_rank() == dist.get_world_size() - 1
    if first_attempt and last_rank and os.environ.get("FAULT_AT_EPOCH") == str(epoch):
        # flush=True: SIGKILL gives Python no chance to write out buffered output.
        print(f"[rank {dist.get_rank()}] FAULT_AT_EPOCH={epoch}: killing this worker", flush=True)
        # SIGKILL, not an exception: no cleanup runs, as when a node dies or the OOM killer strikes.
        os.kill(os.getpid(), signal.SIGKILL)
