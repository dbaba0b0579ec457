"""Hang forensics: a collective timeout, torch's Flight Recorder on, and every rank's trace on disk.

    forensics.configure(run_dir, entries)        # before init_process_group: Flight Recorder env
    forensics.arm(run_dir)                       # the run directory exists: dump on SIGTERM
    forensics.mark_step(step)                    # each step: which step a collective belongs to
    error = forensics.watch(train, run_dir, cfg, device)   # a failed collective: dump, exit 2

Each rank writes runs/<run_name>/flight_recorder/rank<N> (torch's dump; on NCCL the watchdog's)
and where<N>.json (stack, steps, groups, gloo's p2p ops) for analyze_hang.py (DEBUGGING.md).
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
from contextlib import suppress
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mingpt import errors

T = TypeVar("T")
DIR = "flight_recorder"  # under the run directory; analyze_hang.py reads it
PREFIX = "rank"  # dump files rank0, rank1, ...: torch's analyzer infers the prefix from them
STEP_MARKS = 4096  # steps whose start is kept: each issues at least one recorder entry
# A collective failed, not the program: gloo's timeout, a lost peer, DETAIL's mismatch or its
# barrier, NCCL's watchdog. Mostly plain RuntimeErrors (torch 2.14): the message decides.
COLLECTIVE_FAILURE = re.compile(
    r"Timed out waiting|Connection (reset|closed) by peer|mismatch between collectives|"
    r"failed to pass monitoredBarrier|Watchdog caught collective operation timeout|"
    r"NCCL communicator was aborted")

# The recorder's names of dtypes (c10's ScalarType)
SCALAR_TYPES = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16",
                torch.float64: "Double", torch.int64: "Long", torch.int32: "Int",
                torch.uint8: "Byte", torch.int8: "Char", torch.bool: "Bool"}

# Module state: a signal handler reaches nothing else, and the marks outlive a failed frame.
_marks: collections.deque = collections.deque(maxlen=STEP_MARKS)  # (step, time_ns)
_armed: dict = {}  # {"run_dir": ...} once arm() ran: where SIGTERM's dump goes
# gloo's point-to-point ops as NCCL's recorder keeps them; torch's own send and recv (disarm).
_p2p: collections.deque = collections.deque(maxlen=STEP_MARKS)
_p2p_seq: dict = {}  # {group name: this rank's point-to-point ops issued in it so far}
_unpatched: dict = {}


def configure(run_dir: str, entries: int) -> None:
    """Turn torch's Flight Recorder on (`entries` per rank; 0: off): before the process group."""
    if entries <= 0:
        return
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(entries))
    # NCCL only: the watchdog dumps on a timeout, before the teardown (gloo: dump() below).
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(run_dir, DIR, PREFIX))


def enabled() -> bool:
    return int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) > 0


def arm(run_dir: str) -> None:
    """The run directory exists: make the dump folder, and dump when torchrun stops this rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return  # one process: nothing to wait for
    if enabled():
        os.makedirs(os.path.join(run_dir, DIR), exist_ok=True)
    _armed["run_dir"] = run_dir
    if enabled() and dist.get_backend() == "gloo" and not _unpatched:
        _p2p.clear()  # this run's operations only (tests run several in one process)
        _p2p_seq.clear()
        record_p2p()
    # Under torchrun, over no handler of the program's, gloo only: a Python handler runs between
    # bytecodes, so a rank blocked in an NCCL wait would outlive SIGTERM by torchrun's grace.
    if "TORCHELASTIC_RUN_ID" in os.environ and dist.get_backend() == "gloo" and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def record_p2p() -> None:
    """Record each send and recv at ProcessGroup's, where all of torch's end on gloo."""
    for op in ("send", "recv"):
        original = getattr(dist.ProcessGroup, op)
        _unpatched[op] = original

        def recorded(group, tensors, peer, tag=0, _op=op, _original=original):
            _record(group, _op, tensors, peer)
            return _original(group, tensors, peer, tag)
        setattr(dist.ProcessGroup, op, recorded)


def _record(group, op: str, tensors: list, peer: int) -> None:
    """One entry as the Flight Recorder writes NCCL's: 'gloo:send 0->1' in group ranks."""
    with suppress(Exception):  # a record must never break the operation it records
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


def groups() -> dict:
    """{group name: {"desc", "ranks", "axes"}} of every group this rank is in."""
    try:  # torch's registry of groups (private: a dump without it still names the ranks seen)
        names = dist.distributed_c10d._world.pg_names
        found = {name: {"desc": pg.group_desc, "ranks": dist.get_process_group_ranks(pg),
                        "axes": []} for pg, name in names.items()}
    except Exception:
        return {}
    # The meshes alive name the axes (a dimension over every rank reuses the default group).
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
    for op, original in _unpatched.items():  # send and recv as torch has them (records stay)
        setattr(dist.ProcessGroup, op, original)
    _unpatched.clear()


def mark_step(step: int) -> None:
    """`step` starts: a collective created from now until the next mark belongs to it."""
    _marks.append((step, time.time_ns()))


def dump(run_dir: str, reason: str, stack: list[str]) -> str:
    """This rank's Flight Recorder entries and where it was; returns the dump folder."""
    folder = os.path.join(run_dir, DIR)
    os.makedirs(folder, exist_ok=True)
    rank = dist.get_rank()
    if enabled():  # torch's own dump (a pickle of a dict): what torchfrtrace reads
        nccl = "nccl" in str(dist.get_backend())
        trace = (torch._C._distributed_c10d._dump_nccl_trace() if nccl
                 else torch._C._distributed_c10d._dump_fr_trace())
        # NCCL: the watchdog's dump, taken before the abort, is the one to keep.
        _write(os.path.join(folder, f"{PREFIX}{rank}"), trace, replace=not nccl)
    where = {"rank": rank, "world_size": dist.get_world_size(), "host": socket.gethostname(),
             "pid": os.getpid(), "backend": dist.get_backend(), "reason": reason,
             "stack": stack, "steps": list(_marks), "groups": groups(), "p2p": list(_p2p)}
    _write(os.path.join(folder, f"where{rank}.json"), json.dumps(where, indent=1).encode())
    return folder


def _write(path: str, data: bytes, replace: bool = True) -> bool:
    """Written whole, then renamed: an analysis never reads half a dump. With replace=False, a
    file already at `path` stays (False returned): a hard link fails where the name exists."""
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
    """torchrun stops this rank because another one failed: dump, then die of SIGTERM. But not
    where this rank's own collective has just failed, the peer's exit having broken it, and the
    SIGTERM came while the error was on its way to watch(): watch() dumps it and says so in
    its error line (torchrun's SIGKILL still ends a rank that went on instead)."""
    error = sys.exc_info()[1]  # the exception being raised or handled where the signal came
    if error is not None and is_collective_failure(error):
        return
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
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and bool(COLLECTIVE_FAILURE.search(str(error))))


def watch(function: Callable[..., T], run_dir: str, *args) -> T:
    """`function(*args)`; a dump on any error, and for a failed collective one `error:` line and
    exit status 2 (anything else is re-raised)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return function(*args)  # one process: no collective can wait for another
    try:
        return function(*args)
    except Exception as e:
        # A peer's exit must not cut this dump and line short (torchrun's SIGKILL still ends it).
        disarm()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        folder = dump(run_dir, first, traceback.format_exception(e))
        if not is_collective_failure(e):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            raise
    first = re.sub(r"^\[[^\]]*\]:? ", "", first)  # gloo's "[.../x.cc:78] ", DETAIL's "[Rank 0]: "
    # DETAIL's fingerprints spell out every TensorOptions field: the shapes are what differ.
    first = re.sub(r", TensorDeviceTypes=TensorOptions\(.*?\(nullopt\)\)", "", first)
    # At once, by every failed rank (torchrun stops the rest as soon as one exits), whole.
    errors.report(f"rank {dist.get_rank()}: a collective failed ({first}); every rank's trace "
                  f"is in {folder}: python analyze_hang.py {folder}")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise SystemExit(2)  # as errors.fail: main.py's `finally` still leaves the process group


def load_dump(path: str) -> dict:
    """One rank's dump, as torch wrote it (a pickle: read only the dumps of your own runs)."""
    with open(path, "rb") as f:
        return pickle.load(f)
