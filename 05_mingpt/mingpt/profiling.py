"""Where a step's time goes: a breakdown per log line, a profiler trace per rank, CUDA memory.

The trainer's marks (start, "data", "forward" and "backward" per micro-step, end_step) split a
step into PHASES: CUDA events on a GPU (GPU times, no host sync), else StepTimer.clock's reads.
Backward holds the gradient communication that did not overlap it (DEBUGGING.md).
"""
import contextlib
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

PHASES = ("data", "forward", "backward", "optimizer")
# Steps left out before a profile starts: the first steps build DDP's buckets (after step 1),
# compile, autotune and fill the caching allocator; a profile of them shows start-up, not a step.
PROFILE_AFTER = 5
MEMORY_EVENTS = 100_000  # the newest allocations a memory snapshot keeps, as torch's example


class StepTimer:
    """Time per phase of a step; with `profile_steps`, a trace of that many steps per rank."""

    # On a CPU: the wall clock, what a step costs its rank, waits for the others included.
    clock = staticmethod(time.perf_counter)

    def __init__(self, device: torch.device, profile_steps: int = 0, run_dir: str = ".") -> None:
        self.cuda = device.type == "cuda"  # CUDA events, else clock
        self.seconds = dict.fromkeys(PHASES, 0.0)  # per phase, since the last report
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # on a GPU
        self.last: float | torch.cuda.Event | None = None  # the previous mark
        self.steps = 0  # since the last report
        self.profiler = self._profiler(profile_steps, run_dir) if profile_steps else None

    def _profiler(self, steps: int, run_dir: str) -> torch.profiler.profile:
        """A profiler of `steps` steps after PROFILE_AFTER + 1: a Chrome trace per rank."""
        # One file per rank: the ranks' traces differ, and the slowest rank sets the pace.
        path = os.path.join(run_dir, "profile", f"rank{dist.get_rank()}.json")

        def write(profiler: torch.profiler.profile) -> None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            profiler.export_chrome_trace(path)
        # CPU ops always; kernels and copies too on a GPU (CUPTI).
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(wait=PROFILE_AFTER, warmup=1, active=steps, repeat=1)
        profiler = torch.profiler.profile(activities=activities, on_trace_ready=write,
                                          schedule=schedule)
        profiler.start()  # records nothing until the schedule's warm-up step
        return profiler

    def _now(self) -> float | torch.cuda.Event:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # queued behind the work issued so far: no host sync
            return event
        return self.clock()

    def start(self) -> None:
        self.last = self._now()

    def mark(self, phase: str) -> None:
        """The time since the previous mark was spent in `phase`."""
        now = self._now()
        if self.last is not None:
            if self.cuda:
                self.events.append((phase, self.last, now))
            else:
                self.seconds[phase] += now - self.last
        self.last = now

    def end_step(self) -> None:
        self.mark("optimizer")
        self.last = None  # until start(): evaluation and snapshots belong to no phase
        self.steps += 1
        if self.profiler is not None:
            self.profiler.step()

    def report(self) -> dict[str, float]:
        """Milliseconds per step in each phase since the last report; on a GPU, a host sync."""
        if self.events:
            self.events[-1][2].synchronize()
            for phase, begin, end in self.events:
                self.seconds[phase] += begin.elapsed_time(end) / 1000  # elapsed_time: ms
            self.events.clear()
        steps, self.steps = self.steps, 0
        report = {p: 1000 * s / steps for p, s in self.seconds.items()} if steps else {}
        self.seconds = dict.fromkeys(PHASES, 0.0)
        return report

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None


def breakdown(report: dict[str, float]) -> str:
    """"step 41.2 ms: data 1% forward 30% backward 55% optimizer 14%", for a log line."""
    total = sum(report.values())
    if not total:
        return ""
    shares = " ".join(f"{p} {100 * ms / total:.0f}%" for p, ms in report.items())
    return f"step {total:.1f} ms: {shares}"


def memory_snapshot_path(run_dir: str, rank: int) -> str:
    """Where rank `rank`'s CUDA memory snapshot goes: drag it onto pytorch.org/memory_viz."""
    return os.path.join(run_dir, "memory", f"rank{rank}.pickle")


@contextlib.contextmanager
def memory_history(enabled: bool, run_dir: str, device: torch.device) -> Iterator[None]:
    """With `enabled` on CUDA, each rank's snapshot of every allocation's stack, at exit or OOM."""
    if not enabled or device.type != "cuda":
        yield
        return
    # Private API, as torch's memory docs use it: the only way to record allocation stacks.
    torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS)
    path = memory_snapshot_path(run_dir, dist.get_rank())
    try:
        yield
    except torch.OutOfMemoryError:
        _dump_memory(path)  # the allocations that filled the GPU, then the error as before
        raise
    else:
        _dump_memory(path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)  # stop recording


def _dump_memory(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.cuda.memory._dump_snapshot(path)
