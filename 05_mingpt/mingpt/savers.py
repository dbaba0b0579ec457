"""How the training loop saves a snapshot: blocking (the default), or in the background.

    saver = savers.build(cfg, gather)                   # trainer_config.async_save picks
    saver.save(model, optimizer, state, before_commit)  # at every save_every step
    saver.finish()                                      # before the run ends

snapshot.py owns the protocol; this module when the writing happens. An asynchronous save
(SNAPSHOTS.md) writes with DCP's `async_save` from a staging process while training goes on,
and is committed once every rank agreed it completed: at the next save, or at finish().
"""
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig
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


def build(cfg: DictConfig, gather: Callable | None = None) -> Saver:
    errors.require(not (cfg.async_save and gather), "trainer_config.async_save",
                   "False with xla_main.py (its snapshot is gathered to the CPU first)",
                   cfg.async_save)
    return (AsyncSaver if cfg.async_save else Saver)(cfg.snapshot_path, cfg.keep_last, gather)
