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
