"""Hang forensics: a collective timeout, torch's Flight Recorder on, and every rank's trace on disk.

    forensics.configure(run_dir, entries)        # before init_process_group: Flight Recorder env
    dist.init_process_group(..., timeout=timedelta(seconds=collective_timeout_s))
    forensics.arm(run_dir)                       # the run directory exists: dump on SIGTERM
    forensics.mark_step(step)                    # each step: which step a collective belongs to
    error = forensics.watch(train, run_dir, cfg, device)   # a failed collective: dump, exit 2

A collective that one rank never reaches leaves the others waiting: with the timeout they stop,
and each rank writes what its Flight Recorder saw (every collective it issued: sequence number,
op, sizes, the Python stack that issued it) to runs/<run_name>/flight_recorder/rank<N>, in torch's
own dump format, plus where<N>.json: the rank's stack when it stopped and the wall-clock start of
its recent steps (to tell which step each collective belonged to). `analyze_hang.py` reads them.

NCCL: torch's watchdog dumps by itself on a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT, into
TORCH_FR_DUMP_TEMP_FILE<rank>): configure() points it at the same files, and a rank's own dump
(torch's NCCL dump, _dump_nccl_trace) never replaces one the watchdog wrote. gloo records
entries but writes no dump of its own (torch 2.14), so the series writes them: when a
collective raises (gloo's timeout or a peer's error), and when torchrun stops a rank (SIGTERM)
because another failed: a rank stuck outside any collective is the one whose stack matters most.

Every process group is in the dumps (the default one, each DeviceMesh dimension's: pp, dp, tp,
cp), and where<N>.json names each group's ranks and axis. gloo's recorder keeps no
point-to-point operation (a pipeline's sends and receives): arm() records them here, in the
recorder's own fields, into where<N>.json's "p2p" (NCCL's recorder has them in its dump).
"""
import collections
import gc
import json
import os
import pickle
import re
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mingpt import errors

T = TypeVar("T")
DIR = "flight_recorder"  # under the run directory; analyze_hang.py reads it
PREFIX = "rank"  # dump files rank0, rank1, ...: torch's analyzer infers the prefix from them
# Steps whose start is kept, for mapping a collective to its step: enough for the Flight
# Recorder's entries (a step issues at least one collective).
STEP_MARKS = 4096
# Errors that say a collective failed, not the program: gloo's timeout and a lost peer, a
# mismatch that TORCH_DISTRIBUTED_DEBUG=DETAIL detected (or DETAIL's barrier before each
# collective, timed out by a peer that never came), NCCL's watchdog. torch 2.14 raises
# most of them as plain RuntimeErrors, so the message decides (DistError where torch uses it).
COLLECTIVE_FAILURE = re.compile(
    r"Timed out waiting|Connection (reset|closed) by peer|mismatch between collectives|"
    r"failed to pass monitoredBarrier|Watchdog caught collective operation timeout|"
    r"NCCL communicator was aborted")

# The recorder's names of dtypes (c10's ScalarType), for the entries recorded here.
SCALAR_TYPES = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16",
                torch.float64: "Double", torch.int64: "Long", torch.int32: "Int",
                torch.uint8: "Byte", torch.int8: "Char", torch.bool: "Bool"}

# Module state, on purpose: a signal handler can reach nothing else, and the step marks must be
# there whichever frame fails.
_marks: collections.deque = collections.deque(maxlen=STEP_MARKS)  # (step, time_ns)
_armed: dict = {}  # {"run_dir": ...} once arm() ran: where SIGTERM's dump goes
# gloo's point-to-point operations, as the recorder would keep them (its buffer's size); and
# ProcessGroup's own send and recv, put back by disarm().
_p2p: collections.deque = collections.deque(maxlen=STEP_MARKS)
_p2p_seq: dict = {}  # {group name: this rank's point-to-point ops issued in it so far}
_unpatched: dict = {}


def configure(run_dir: str, entries: int) -> None:
    """Turn torch's Flight Recorder on (`entries` per rank; 0: off), for gloo and NCCL.

    Environment variables, read when the process group is created, so before that. A value the
    user set already wins (setdefault): e.g. a larger buffer for a long hang hunt."""
    if entries <= 0:
        return
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(entries))
    # NCCL only: the watchdog writes <TORCH_FR_DUMP_TEMP_FILE><rank> when a collective times
    # out, before it tears the process down. gloo ignores both (we dump ourselves, below).
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(run_dir, DIR, PREFIX))


def enabled() -> bool:
    """Whether the Flight Recorder records (configure() ran with entries > 0, or the user's)."""
    return int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) > 0


def arm(run_dir: str) -> None:
    """From now on the run directory exists: make the dump folder (NCCL's watchdog writes into
    it, but does not create it) and dump when torchrun stops this rank (SIGTERM)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return  # one process: nothing to wait for
    if enabled():
        os.makedirs(os.path.join(run_dir, DIR), exist_ok=True)
    _armed["run_dir"] = run_dir
    if enabled() and dist.get_backend() == "gloo" and not _unpatched:
        _p2p.clear()  # this run's operations only (tests run several in one process)
        _p2p_seq.clear()
        record_p2p()
    # Not under `python main.py` (no torchrun to stop the rank), never over a handler the
    # program set itself, and gloo only: a Python handler runs only between bytecodes, so a
    # rank blocked in an NCCL wait would outlive torchrun's SIGTERM by its grace period (30 s),
    # where SIGTERM's default ends it at once; NCCL's ranks dump through torch's watchdog.
    if "TORCHELASTIC_RUN_ID" in os.environ and dist.get_backend() == "gloo" and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def record_p2p() -> None:
    """Record each send and recv of any group (what gloo's Flight Recorder leaves out).

    Through ProcessGroup.send/recv, where torch.distributed's isend, irecv, send, recv and
    batch_isend_irecv all end on gloo: what calls them (a pipeline schedule) is unchanged."""
    from torch._C._distributed_c10d import ProcessGroup  # noqa: PLC0415  (gloo only)

    for op in ("send", "recv"):
        original = getattr(ProcessGroup, op)
        _unpatched[op] = original

        def recorded(group, tensors, peer, tag=0, _op=op, _original=original):
            _record(group, _op, tensors, peer)
            return _original(group, tensors, peer, tag)

        setattr(ProcessGroup, op, recorded)


def _record(group, op: str, tensors: list, peer: int) -> None:
    """One entry as the Flight Recorder writes NCCL's: 'gloo:send 0->1' in group ranks."""
    try:
        name = group.group_name
        _p2p_seq[name] = _p2p_seq.get(name, 0) + 1
        me = dist.get_group_rank(group, dist.get_rank())
        arrow = f"{me}->{peer}" if op == "send" else f"{me}<-{peer}"
        _p2p.append({"process_group": [name, group.group_desc], "is_p2p": True,
                     "p2p_seq_id": _p2p_seq[name], "collective_seq_id": 0,
                     "profiling_name": f"gloo:{op} {arrow}",
                     "input_sizes": [list(t.shape) for t in tensors],
                     "input_dtypes": [SCALAR_TYPES.get(t.dtype, str(t.dtype)) for t in tensors],
                     "time_created_ns": time.time_ns()})
    except Exception:  # a record must never break the operation it records
        pass


def groups() -> dict:
    """{group name: {"desc", "ranks", "axes"}} of every group this rank is in: its ranks (gloo's
    dump keys its one pg_config entry '' and names none), and the mesh dimensions it serves
    (a dimension over every rank reuses the default group: its name says nothing of the axis)."""
    try:  # torch's registry of groups (private: a dump without it still names the ranks seen)
        names = dist.distributed_c10d._world.pg_names
        found = {name: {"desc": pg.group_desc, "ranks": dist.get_process_group_ranks(pg),
                        "axes": []} for pg, name in names.items()}
    except Exception:
        return {}
    # The meshes alive: what each dimension is called (pp, dp, tp, cp) and which group it uses.
    for mesh in [o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)]:
        for dim, axis in enumerate(getattr(mesh, "mesh_dim_names", None) or ()):
            try:
                name = mesh.get_group(dim).group_name
            except Exception:  # a mesh this rank is not part of, or already torn down
                continue
            if name in found and axis not in found[name]["axes"]:
                found[name]["axes"].append(axis)
    return found


def disarm() -> None:
    """Training is over (or failed and dumped): SIGTERM kills again without a dump."""
    if _armed.pop("run_dir", None) is not None and \
            signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _unpatched:  # send and recv as torch has them (the records stay, for the dump)
        from torch._C._distributed_c10d import ProcessGroup  # noqa: PLC0415

        for op, original in _unpatched.items():
            setattr(ProcessGroup, op, original)
        _unpatched.clear()


def mark_step(step: int) -> None:
    """The wall-clock start of `step` on this rank (on the Flight Recorder's clock): a collective
    created after it and before the next mark belongs to that step. Costs an append."""
    _marks.append((step, time.time_ns()))


def dump(run_dir: str, reason: str, stack: list[str]) -> str:
    """This rank's Flight Recorder entries (where it records) and where it was; returns the
    dump folder."""
    folder = os.path.join(run_dir, DIR)
    os.makedirs(folder, exist_ok=True)
    rank = dist.get_rank()
    if enabled():  # torch's own dump (a pickle of a dict): what torchfrtrace reads
        nccl = "nccl" in str(dist.get_backend())
        # NCCL's recorder is its own (the watchdog's dump); gloo's is the generic one.
        trace = (torch._C._distributed_c10d._dump_nccl_trace() if nccl
                 else torch._C._distributed_c10d._dump_fr_trace())
        # The watchdog may have written this rank's file already, at the timeout itself: its
        # dump, not ours, is the one to keep (it is taken before the communicator is aborted).
        _write(os.path.join(folder, f"{PREFIX}{rank}"), trace, replace=not nccl)
    where = {"rank": rank, "world_size": dist.get_world_size(), "host": socket.gethostname(),
             "pid": os.getpid(), "backend": dist.get_backend(), "reason": reason,
             "stack": stack, "steps": list(_marks), "groups": groups(), "p2p": list(_p2p)}
    _write(os.path.join(folder, f"where{rank}.json"), json.dumps(where, indent=1).encode())
    return folder


def _write(path: str, data: bytes, replace: bool = True) -> bool:
    """Written whole, then renamed: an analysis never reads half a dump. With replace=False, a
    file already at `path` stays as it is (False returned): a hard link, unlike a rename, fails
    when the name exists, so even a file written a moment earlier is never replaced."""
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    if replace:
        os.replace(path + ".tmp", path)
        return True
    try:
        os.link(path + ".tmp", path)
        return True
    except FileExistsError:
        return False
    finally:
        os.remove(path + ".tmp")


def _on_sigterm(signum: int, frame) -> None:
    """torchrun stops this rank because another one failed: dump where it is, then die of
    SIGTERM as before (torchrun reads the signal from the exit status)."""
    run_dir = _armed.get("run_dir")
    if run_dir is not None:
        try:
            dump(run_dir, "stopped by SIGTERM (torchrun stops every rank when one fails)",
                 traceback.format_stack(frame))
        except Exception as e:  # a dump must never keep a rank from stopping
            print(f"[rank {dist.get_rank()}] no Flight Recorder dump: {e}", file=sys.stderr)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def is_collective_failure(error: BaseException) -> bool:
    """A collective failed (timed out, lost its peer, mismatched), rather than the program."""
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and bool(COLLECTIVE_FAILURE.search(str(error))))


def watch(function: Callable[..., T], run_dir: str, *args) -> T:
    """`function(*args)`; if a collective in it fails, this rank's dump, then one `error:` line
    that names the dumps and the command that reads them, and exit status 2.

    Anything else is re-raised as it was, after a dump too: a rank that crashes is part of the
    picture the other ranks' dumps show. The line is printed at once, by every rank whose
    collective failed (the others may be stuck elsewhere): torchrun stops the remaining ranks
    as soon as one exits, and a line printed after the group's teardown could come too late."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return function(*args)  # one process: no collective can wait for another
    try:
        return function(*args)
    except Exception as e:
        # torchrun stops every rank as soon as one exits: a peer that failed a moment earlier
        # must not cut this rank's dump and line short (torchrun sends SIGKILL after a grace
        # period of its own, so ignoring SIGTERM cannot keep a rank alive).
        disarm()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        folder = dump(run_dir, first, traceback.format_exception(e))
        if not is_collective_failure(e):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            raise
    # gloo's "[.../unbound_buffer.cc:78] " prefix, DETAIL's "[Rank 0]: "
    first = re.sub(r"^\[[^\]]*\]:? ", "", first)
    # DETAIL's fingerprints spell out every TensorOptions field: the shapes are what differ.
    first = re.sub(r", TensorDeviceTypes=TensorOptions\(.*?\(nullopt\)\)", "", first)
    # Every rank whose collective failed says so at once: one write per line (errors.report),
    # so that two ranks' lines never come out joined into one.
    errors.report(f"rank {dist.get_rank()}: a collective failed ({first}); every rank's trace "
                  f"is in {folder}: python analyze_hang.py {folder}")
    # Said and written: from here on torchrun's SIGTERM may end the teardown, as before.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # SystemExit, as errors.fail: main.py's `finally` still leaves the process group.
    raise SystemExit(2)


def load_dump(path: str) -> dict:
    """One rank's dump, as torch wrote it (a pickle: read only the dumps of your own runs)."""
    with open(path, "rb") as f:
        return pickle.load(f)
