"""Fault injection, to watch torchrun restart a crashed job (a demo and test tool, not for real
runs). Steps 03 and 04 count epochs; this version counts optimizer steps and can also crash
in the middle of a snapshot save."""
import os
import signal

import torch.distributed as dist


def inject_fault(step: int, during_save: bool = False) -> None:
    """A worker SIGKILLs itself, on torchrun's first attempt only.

    FAULT_AT_STEP=N: the last rank, before step N. FAULT_AT_SAVE=N: global rank 0 while saving
    the snapshot of step N, after writing it and before the commit that makes it the snapshot.
    TORCHELASTIC_RESTART_COUNT is 0 only on the first attempt, so the restarted workers resume
    from the snapshot and get past step N.
    """
    # The save fault hits rank 0 because rank 0 commits; the step fault hits the last rank, a
    # rank that prints nothing (on several nodes: not rank 0's node), to show that losing any
    # one worker stops the whole group.
    variable, rank = ("FAULT_AT_SAVE", 0) if during_save else ("FAULT_AT_STEP",
                                                              dist.get_world_size() - 1)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and dist.get_rank() == rank and os.environ.get(variable) == str(step):
        # flush: SIGKILL gives Python no chance to empty its buffers, the line would be lost.
        print(f"[rank {rank}] {variable}={step}: killing this worker", flush=True)
        # SIGKILL, not an exception: no `finally`, no destroy_process_group, no clean exit code,
        # as when the OOM killer or a lost node ends a worker. The other ranks block in their
        # next collective until torchrun's agent sees the dead worker, stops them all and, with
        # --max-restarts, starts a new attempt.
        os.kill(os.getpid(), signal.SIGKILL)
