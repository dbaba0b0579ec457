"""Fault injection (a demo and test tool, not for real runs): crash a worker at an optimizer
step or in the middle of a snapshot save, to watch torchrun restart the job; make one rank stall
or skip a collective (DEBUGGING.md); fail one rank's snapshot storage (SNAPSHOTS.md).

One seam: install(trainer), in the Trainer's constructor, does nothing unless a FAULT_* variable
is set; then it wraps the trainer's runner and saver, DDP's gradient hook and the storage
functions snapshots go through. The trainer and snapshot code call none of this.
"""
import errno
import os
import signal
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.checkpoint import FileSystemWriter
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt import storage


def _hang_target(variable: str, step: int) -> bool:
    """FAULT_STALL_AT_STEP / FAULT_SKIP_AT_STEP: the last rank, at that step, first attempt."""
    return (os.environ.get(variable) == str(step) and dist.get_rank() == dist.get_world_size() - 1
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")


def inject_fault(step: int, during_save: bool = False) -> None:
    """A worker SIGKILLs itself, or stalls, on torchrun's first attempt only (the restarted
    workers resume from the snapshot and get past step N). FAULT_AT_STEP=N: the last rank,
    before step N. FAULT_AT_SAVE=N: global rank 0 while saving step N's snapshot, between its
    write and its commit. FAULT_STALL_AT_STEP=N: the last rank stops before step N forever."""
    # The save fault hits rank 0, which commits; the step fault the last rank, which prints
    # nothing (on several nodes: not rank 0's node): losing any one worker stops the group.
    variable, rank = ("FAULT_AT_SAVE", 0) if during_save else ("FAULT_AT_STEP",
                                                              dist.get_world_size() - 1)
    if not during_save and _hang_target("FAULT_STALL_AT_STEP", step):
        print(f"[rank {dist.get_rank()}] FAULT_STALL_AT_STEP={step}: this rank stops here",
              flush=True)
        while True:  # sleep, not a busy loop: a stalled rank costs the machine nothing
            time.sleep(1)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and dist.get_rank() == rank and os.environ.get(variable) == str(step):
        # flush: SIGKILL gives Python no chance to empty its buffers, the line would be lost.
        print(f"[rank {rank}] {variable}={step}: killing this worker", flush=True)
        # SIGKILL, not an exception: no `finally`, no clean exit, as when the OOM killer or a
        # lost node ends a worker; torchrun's agent then stops the others and restarts.
        os.kill(os.getpid(), signal.SIGKILL)


def hold_quorum(step: int) -> None:
    """FAULT_HOLD_QUORUM=STEP:PATH[,STEP:PATH...]: a replica group (parallel/ft.py) waits
    before the quorum of step STEP until the file PATH exists: a test's gate, to start several
    groups' first quorum together or hold a survivor until a restarted group is there."""
    for gate in filter(None, os.environ.get("FAULT_HOLD_QUORUM", "").split(",")):
        at, _, path = gate.partition(":")
        if int(at) == step:
            print(f"[rank {dist.get_rank()}] FAULT_HOLD_QUORUM: step {step} waits for {path}",
                  flush=True)
            while not os.path.exists(path):
                time.sleep(0.05)


def skip_gradient_sync(model: torch.nn.Module, current_step: Callable[[], int]) -> None:
    """FAULT_SKIP_AT_STEP=N: the last rank leaves out the gradient all-reduce of step N and goes
    on, as code that calls a collective on some ranks only does (DEBUGGING.md). A DDP
    communication hook: torch's own allreduce_hook on every other step."""
    if "FAULT_SKIP_AT_STEP" not in os.environ:
        return
    if not isinstance(model, DDP):
        raise ValueError("FAULT_SKIP_AT_STEP skips DDP's gradient all-reduce: it needs "
                         "trainer_config.distributed_method=ddp and more than one process")

    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if _hang_target("FAULT_SKIP_AT_STEP", current_step()):
            if bucket.is_last():  # once per step, not per bucket
                print(f"[rank {dist.get_rank()}] FAULT_SKIP_AT_STEP={current_step()}: this "
                      "rank skips the gradient all-reduce", flush=True)
            skipped: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            skipped.set_result(bucket.buffer())  # this rank's own gradients, unaveraged
            return skipped
        return allreduce_hook(None, bucket)  # None: DDP's process group
    model.register_comm_hook(None, hook)


def io_error(operation: str, target: str, path: str) -> None:
    """FAULT_WRITE_ERROR=RANK:TARGET / FAULT_READ_ERROR=RANK:TARGET: global rank RANK's
    `operation` ("write" or "read") of a TARGET raises an OSError for `path` (EIO, or ENOENT
    for a read), on torchrun's first attempt only. TARGET: shard (this rank's DCP shards), file
    (one written or read whole: train_state.pt, a one-file snapshot) or latest (the commit)."""
    variable = f"FAULT_{operation.upper()}_ERROR"
    if os.environ.get(variable) != f"{dist.get_rank()}:{target}" or \
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    code = errno.EIO if operation == "write" else errno.ENOENT
    # The time, for tests that measure how long the others take to stop after it.
    print(f"[rank {dist.get_rank()}] {variable}={os.environ[variable]}: {path} fails "
          f"({errno.errorcode[code]}) at {time.time():.3f}", flush=True)
    raise OSError(code, os.strerror(code), path)


class FaultyWriter(FileSystemWriter):
    """DCP's local writer, whose shard writes fail where FAULT_WRITE_ERROR=RANK:shard says (a
    class, not a patched method: an asynchronous save pickles it to the staging process)."""

    def write_data(self, plan, planner):  # noqa: ANN001, ANN201 (DCP's own signature)
        io_error("write", "shard", f"{self.path}/__{dist.get_rank()}_0.distcp")
        return super().write_data(plan, planner)


class FaultyReader(storage.LocalReader):
    """DCP's local reader, whose shard reads fail where FAULT_READ_ERROR=RANK:shard says."""

    def read_data(self, plan, planner):  # noqa: ANN001, ANN201
        io_error("read", "shard", f"{self.path}/__{dist.get_rank()}_0.distcp")
        return super().read_data(plan, planner)


def faulty(dcp_storage: object) -> object:
    """DCP's local writer or reader, as its Faulty* kind where a fault names shards."""
    for kind, real, fault in (("WRITE", FileSystemWriter, FaultyWriter),
                              ("READ", storage.LocalReader, FaultyReader)):
        if type(dcp_storage) is real and \
                os.environ.get(f"FAULT_{kind}_ERROR", "").endswith(":shard"):
            dcp_storage.__class__ = fault
    return dcp_storage


# --- the seam ------------------------------------------------------------------------------

def install(trainer: object) -> None:
    """Where a FAULT_* variable is set, the faults around `trainer` (a Trainer being built) and
    the snapshot storage; in every other run nothing changes. Once per process for storage."""
    if not any(name.startswith("FAULT_") for name in os.environ):
        return
    step = lambda: trainer.step  # noqa: E731 (the steps done so far, read when a fault asks)
    trainer.runner = _BeforeStep(trainer.runner, step)  # FAULT_AT_STEP, FAULT_STALL_AT_STEP
    trainer.saver = _DuringSave(trainer.saver, step)  # FAULT_AT_SAVE
    skip_gradient_sync(trainer.model, step)  # FAULT_SKIP_AT_STEP
    if not _wrapped:  # FAULT_WRITE_ERROR, FAULT_READ_ERROR
        _wrap_storage()


class _BeforeStep:
    """The trainer's runner, whose forward_backward first runs inject_fault(step)."""

    def __init__(self, runner: object, step: Callable[[], int]) -> None:
        self.runner, self.step = runner, step

    def forward_backward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        inject_fault(self.step())
        return self.runner.forward_backward(*args, **kwargs)

    def __getattr__(self, name: str) -> object:  # evaluate, clip_grad_norm, ...: the runner's
        return getattr(self.runner, name)


class _DuringSave:
    """The trainer's saver, whose before_commit runs inject_fault(step, during_save=True)."""

    def __init__(self, saver: object, step: Callable[[], int]) -> None:
        self.saver, self.step = saver, step

    def save(self, model, optimizer, state, before_commit=None) -> None:  # noqa: ANN001
        self.saver.save(model, optimizer, state,
                        before_commit=partial(inject_fault, self.step(), during_save=True))

    def __getattr__(self, name: str) -> object:  # finish: the saver's
        return getattr(self.saver, name)


def _target(url: str) -> str:
    """io_error's target of a whole-file write or read: the sharded format's commit, or a file."""
    return "latest" if url.endswith("/latest") else "file"


_wrapped = False  # storage's functions are wrapped once per process, whatever the runs


def _wrap_storage() -> None:
    """storage's writers and readers as snapshot.py calls them (storage.X at each call), each
    first asking io_error whether this rank's write or read of its target fails."""
    global _wrapped
    writer, reader = storage.writer, storage.reader
    write_atomic, write_bytes_atomic, load_torch = \
        storage.write_atomic, storage.write_bytes_atomic, storage.load_torch

    def failing_write_atomic(url: str, write: Callable, before_commit=None) -> None:  # noqa: ANN001
        def checked(f: object) -> object:  # inside the temporary file: it must be cleaned up
            io_error("write", _target(url), url)
            return write(f)
        write_atomic(url, checked, before_commit)

    def failing_write_bytes_atomic(url: str, data: bytes,
                                   before_commit: Callable[[], None] | None = None) -> None:
        io_error("write", _target(url), url)  # an object store's upload (local: write_atomic)
        write_bytes_atomic(url, data, before_commit)

    def failing_load_torch(url: str) -> object:
        io_error("read", "file", url)
        return load_torch(url)
    storage.writer = lambda url: faulty(writer(url))
    storage.reader = lambda url: faulty(reader(url))
    storage.write_atomic, storage.write_bytes_atomic, storage.load_torch = \
        failing_write_atomic, failing_write_bytes_atomic, failing_load_torch
    _wrapped = True
