"""How the training loop saves a snapshot: blocking (the default), or in the background.

    saver = savers.build(cfg, gather)                   # trainer_config.async_save picks
    saver.save(model, optimizer, state, before_commit)  # at every save_every step
    saver.finish()                                      # before the run ends

snapshot.py owns the protocol; this module when the writing happens. An asynchronous save
(SNAPSHOTS.md) writes with DCP's `async_save` from a staging process while training goes on,
and is committed once every rank agreed it completed: at the next save, or at finish().
"""
import contextlib
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig
from torch.distributed.checkpoint import _async_process_executor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from mingpt import errors, shards, snapshot, storage
from mingpt.log import print0
from mingpt.parallel.strided import checkpointable


class Saver:
    """snapshot.save, blocking: the snapshot is committed when save() returns."""

    def __init__(self, url: str, keep_last: int, gather: Callable | None) -> None:
        self.url, self.keep_last, self.gather = url, keep_last, gather

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict,
             before_commit: Callable[[], None] | None = None) -> None:
        snapshot.save(self.url, model, optimizer, state, before_commit, self.keep_last,
                      self.gather)

    def finish(self) -> None:
        """Nothing is in flight: each save() committed its snapshot."""


class AsyncSaver(Saver):
    """The snapshot through DCP's async_save; at most one save in flight."""

    # The save in flight: (its future, step directory name, train state), or None.
    pending: tuple | None = None

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict,
             before_commit: Callable[[], None] | None = None) -> None:
        self.finish()  # the one before: written, agreed and committed first
        name, state, written = snapshot.begin_save(self.url, model, optimizer, state)
        # Returns once this rank's shards are copied to host memory; the staging process
        # writes them (the first call starts it: it imports __main__ again, hence main.py's
        # `if __name__ == "__main__":` guard).
        with staging_store():
            future = dcp.async_save(
                checkpointable(written), storage_writer=storage.writer(f"{self.url}/{name}"),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        self.pending = (future, name, state)
        if before_commit:  # while the shards are being written (faults.py: FAULT_AT_SAVE)
            before_commit()

    def finish(self) -> None:
        """Wait for the save in flight, agree on its outcome, then commit it (blocking)."""
        if self.pending is None:
            return
        (future, name, state), self.pending = self.pending, None
        try:
            future.result()
            error = None
        # The staging process's DCP raises CheckpointException (naming the failed rank) on
        # every rank; a dead staging process is a RuntimeError on its own rank only.
        except (Exception, CheckpointException) as e:
            error = errors.save_error(self.url, e)
        message = errors.any_failure(error)
        if message is not None:
            raise errors.SaveError(message)
        errors.save_part(self.url, shards.commit_sharded, name, state, None, self.keep_last)
        print0(f"step {state['step']}: snapshot saved to {self.url}")


@contextlib.contextmanager
def staging_store() -> Iterator[None]:
    """Around the first dcp.async_save of this process, which starts the staging processes: they
    form their group on a store that global rank 0 hosts on a port the OS gives it at once.

    Left to itself, DCP has rank 0 pick a free port (bound and closed again) and the staging
    processes, spawned and importing main.py seconds later, listen on it: a port any other
    program may take in between (EADDRINUSE: the save fails on one rank, the others' staging
    processes wait to connect). torch's DCP_USE_PREFIX_STORE=1 reads MASTER_ADDR:MASTER_PORT
    instead; under torchrun that is the agent's store, which every restart attempt shares (see
    restarts.py), so it gets this store's address there, for this call only."""
    executor = _async_process_executor
    if executor._CHECKPOINT_PROCESS is not None:  # started: it reads no address again
        yield
        return
    # Where rank 0 runs, as DCP's own choice assumes too (MASTER_ADDR, or this machine for a
    # one-process run). TCPStore listens on every interface; port 0: the OS picks a free one
    # and the store holds it from that moment on.
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = [0]
    if dist.get_rank() == 0:
        # Kept beside DCP's _CHECKPOINT_PROCESS, as long as it (this module may be imported
        # again in one process, a test's warm world; the staging processes are not).
        executor._mingpt_staging_store = dist.TCPStore(host, 0, is_master=True,
                                                       wait_for_workers=False)
        port = [executor._mingpt_staging_store.port]
    dist.broadcast_object_list(port, src=0)
    # Read once, as DCP builds its staging processes' address (_ProcessGroupInitInfo), inside
    # async_save: set for that call alone, then as they were.
    given = {"DCP_USE_PREFIX_STORE": "1", "MASTER_ADDR": host, "MASTER_PORT": str(port[0])}
    before = {key: os.environ.get(key) for key in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def build(cfg: DictConfig, gather: Callable | None = None) -> Saver:
    errors.require(not (cfg.async_save and gather), "trainer_config.async_save",
                   "False with xla_main.py (its snapshot is gathered to the CPU first)",
                   cfg.async_save)
    return (AsyncSaver if cfg.async_save else Saver)(cfg.snapshot_path, cfg.keep_last, gather)
