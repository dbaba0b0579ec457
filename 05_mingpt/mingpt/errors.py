"""Bad input ends a run with one `error:` line, on every node, and every rank learns of it:
`together` and `any_failure` agree on every rank's outcome, `fail` prints the line once per
node, `report` is the one place it is written.

A node's own storage (a BPE directory, a download, a snapshot folder) can fail on one node
only: without agreement its ranks would exit while the others waited in their next collective
until the timeout, and without a print on every node the failure would be seen nowhere.
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
    """Write `error: MESSAGE` and its newline to stderr in one write call: every rank writes
    to torchrun's one stderr, and print()'s two calls let another rank's line land between
    them; a pipe never splits one write of up to PIPE_BUF bytes (DEBUGGING.md)."""
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
    """One `error:` line from each node (its LOCAL_RANK 0, from torchrun's environment: config
    errors come before the process group exists) and exit 2 on every rank."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        report(error)
    sys.exit(2)


# A training run's way out of a snapshot it cannot use (export_hf.py, which reads, cuts it off).
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
    """`function(*args, **kwargs)` on every rank (a collective); a ValueError on any rank is
    raised on all, naming the first failed rank and its host where only some failed."""
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
    `e`'s traceback: a bug, which the other ranks must still learn of (any_failure)."""
    traceback.print_exception(e, file=sys.stderr)
    first = (str(e).strip().splitlines() or [""])[0]
    return message or f"{type(e).__name__}: {first}"


def any_failure(error: str | None) -> str | None:
    """A collective, given this rank's failure (None: it succeeded): None where every rank
    succeeded, else the one message each of them raises."""
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
    """argparse's errors as one `error:` line and exit status 2, without its usage block."""
    def error(message: str) -> NoReturn:
        report(message)
        sys.exit(2)
    parser.error = error
    return parser


# --- snapshots: each part of a save or a load, its outcome agreed by every rank -----------------

def save_part(url: str, part: Callable[..., None], *args) -> None:
    """`part(url, *args)`, a part of a save, then its outcome agreed by every rank (a
    collective, also where only rank 0 does the work): SaveError on all where any failed."""
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
    # Nothing is committed before everything is written: the snapshot before is intact.
    return (f"{failed}cannot save the snapshot to {url} ({reason}); the previous snapshot, if "
            f"any, is unchanged: {fix} or set trainer_config.snapshot_path, then run again to "
            "resume")


def load_part(function: Callable[..., T], *args) -> T:
    """`function(*args)` on every rank (a collective); a SnapshotError on any is one on all."""
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
