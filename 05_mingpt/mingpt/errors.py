"""Bad input ends a run with one `error:` line, on every node, and every rank learns of it.

    data = errors.together(build_datasets, cfg)  # a ValueError on one rank: on all of them
    errors.fail(e)                               # print `error: ...` once per node, exit 2
    errors.report(message)                       # the one place an `error:` line is written
    message = errors.any_failure(error)          # every rank's outcome (str or None) on all

A config mistake is the same on every rank. A node's own storage is not: a BPE directory, a
CIFAR-10 download or a writable snapshot folder can be there on one node and missing on
another. Without agreement the failing node would exit while the others went on into their
next collective and waited there until the timeout; without a print on every node, a failure
on a node other than global rank 0's would be seen nowhere.
"""
import argparse
import io
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from mingpt import storage

T = TypeVar("T")


def report(message: object) -> None:
    """Write `error: MESSAGE` and its newline to stderr in one write call.

    Every rank of a job writes to the same stderr (torchrun passes its own to each worker),
    and print() writes a line's text and its newline in two calls: another rank's line could
    land between them, and two ranks' lines came out joined as one ("...flight_recorder" then
    "error: rank 0: ..."). One os.write of the whole line is one write(2): on a pipe, a write of
    at most PIPE_BUF bytes (4096 on Linux) is never interleaved with another process's."""
    line = f"error: {message}\n"
    stream = sys.stderr
    try:
        fd = stream.fileno()
    except (AttributeError, io.UnsupportedOperation):  # a StringIO: a test's or a notebook's
        stream.write(line)  # one call here too, and no other process writes into it
        stream.flush()
        return
    stream.flush()  # what Python still buffers comes first, as the program wrote it
    data = line.encode(stream.encoding or "utf-8", "backslashreplace")
    while data:  # a pipe takes it whole; the loop is for a write cut short by a signal
        data = data[os.write(fd, data):]


def fail(error: Exception | str) -> NoReturn:
    """One `error:` line from each node (its LOCAL_RANK 0) and exit 2 on every rank.

    LOCAL_RANK from torchrun's environment, not the process group: config errors come before
    the group exists, and a worker that cannot reach MASTER_ADDR never joins it."""
    # Once per node: the node's log shows it (a Slurm job or a cluster UI often keeps one
    # log per node), and its other ranks, which hit the same error, keep quiet.
    if os.environ.get("LOCAL_RANK", "0") == "0":
        report(error)
    sys.exit(2)


# What a training run can do about a snapshot it cannot use, at the end of those messages (a
# command that only reads snapshots, export_hf.py, cuts it off: it has no snapshot_path).
MOVE_IT_AWAY = "move it away or set trainer_config.snapshot_path"


class SnapshotError(ValueError):
    """A snapshot exists but cannot be used; the message says which one and why."""


class SaveError(Exception):
    """A snapshot could not be written (a full disk, a read-only folder, an object store's
    error); the message says so in one line, and that the previous snapshot is intact."""


def require(ok: bool, key: str, allowed: str, value: object) -> None:
    """ValueError "KEY must be ALLOWED, got VALUE" unless `ok`: every config check's form."""
    if not ok:
        raise ValueError(f"{key} must be {allowed}, got {value!r}")


def together(function: Callable[..., T], *args, **kwargs) -> T:
    """`function(*args, **kwargs)` on every rank; a ValueError on any rank is raised on all.

    A collective: every rank calls it at the same point. Where only some ranks failed, the
    message names the first of them and its host (the node whose storage to look at)."""
    try:
        result, error = function(*args, **kwargs), None
    except ValueError as e:  # bad input: its one line
        result, error = None, str(e)
    except Exception as e:  # a bug: this rank's traceback, then the same one line as above
        result, error = None, unexpected(e)
    message = any_failure(error)
    if message is not None:
        raise ValueError(message)
    return result


def unexpected(e: Exception, message: str | None = None) -> str:
    """`message` (by default the exception's name and first line), after this rank printed
    `e`'s traceback: an exception no check raises is a bug, but the other ranks must still
    learn of it (any_failure) rather than wait in their next collective for a rank that left."""
    traceback.print_exception(e, file=sys.stderr)
    first = (str(e).strip().splitlines() or [""])[0]
    return message or f"{type(e).__name__}: {first}"


def any_failure(error: str | None) -> str | None:
    """Every rank's outcome on every rank: None where all succeeded, else the one message each
    of them raises (together's; snapshot.py raises its own SnapshotError or SaveError with it).

    A collective: `error` is this rank's failure, None where it succeeded."""
    # One process (or none in a group yet: a notebook, a unit test): nothing to agree on.
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    # Every rank's outcome on every rank: (message, host) where it failed, else None.
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, error and (error, socket.gethostname()))
    failed = [(rank, report) for rank, report in enumerate(seen) if report]
    if not failed:
        return None
    rank, (message, host) = failed[0]
    if len(failed) == len(seen) and len({report[0] for _, report in failed}) == 1:
        return message  # the same on every rank: a mistake in the config
    # Some ranks only: name the first, and its host, whose storage is the one to look at.
    others = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    return f"rank {rank} on {host}{others}: {message}"


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """argparse's errors as one `error:` line and exit status 2, without its usage block (as
    every other bad input of this folder reads; --help still shows the usage)."""
    def error(message: str) -> NoReturn:
        report(message)
        sys.exit(2)
    parser.error = error
    return parser


# --- snapshots: each part of a save or a load, its outcome agreed by every rank -----------------


def save_part(url: str, part: Callable[..., None], *args) -> None:
    """`part(url, *args)`, a part of a save, then its outcome agreed by every rank: SaveError,
    the same one line on all of them, where it failed on any (any_failure names the rank).
    Every rank calls this, also where only rank 0 does the work."""
    try:
        storage.storage_errors(OSError)(part)(url, *args)  # an object store's: one OSError
        error = None
    # DCP (the sharded format) raises CheckpointException, a BaseException with each rank's.
    except (OSError, CheckpointException) as e:
        error = save_error(url, e)
    except Exception as e:  # not the storage's: a bug, whose traceback this rank shows
        error = unexpected(e, save_error(url, e))
    message = any_failure(error)
    if message is not None:
        raise SaveError(message)


def save_error(url: str, e: BaseException) -> str:
    """A failed save in one line: the storage's words, the file, which rank (DCP's), the fix."""
    failed, error = "", e
    if isinstance(e, CheckpointException):  # every rank has it: name the one(s) that failed
        ranks = sorted(e.failures)
        error = e.failures[ranks[0]][0]
        if dist.get_world_size() > 1:
            others = f" (and {len(ranks) - 1} more)" if len(ranks) > 1 else ""
            failed = f"rank {ranks[0]}{others}: "
    reason = error.strerror if isinstance(error, OSError) and error.strerror else \
        (str(error).strip().splitlines() or [type(error).__name__])[0]
    if isinstance(error, OSError) and error.strerror and error.filename:
        reason += f": {error.filename}"
    # A local disk fills up; an object store's own line already says what to check.
    fix = "free some space" if "://" not in url else "fix what it says"
    # Both formats commit by a rename (file) or by rewriting `latest` (directory) only once
    # everything is written, so the snapshot from before, if any, is intact.
    return (f"{failed}cannot save the snapshot to {url} ({reason}); the previous snapshot, if "
            f"any, is unchanged: {fix} or set trainer_config.snapshot_path, then run again to "
            "resume")


def load_part(function: Callable[..., T], *args) -> T:
    """`function(*args)` on every rank; its SnapshotError on any rank is one on all of them
    (any_failure: naming the rank where only some failed). A collective."""
    try:
        result, error = function(*args), None
    except SnapshotError as e:
        result, error = None, str(e)
    except Exception as e:  # not the snapshot's: a bug, whose traceback this rank shows
        result, error = None, f"cannot load the snapshot ({unexpected(e)})"
    message = any_failure(error)
    if message is not None:
        raise SnapshotError(message)
    return result
