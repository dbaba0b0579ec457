"""The CPU a test costs: every process it runs, the ones it starts and theirs (forked ranks,
torchrun's workers, daemons), counted by a control group (cgroup) the pytest worker moves
itself into; `pytest --cpu-time` (conftest.py) reports each file's CPU beside its time.

The wall time of a file says little under xdist: two workers share the cores, so a file of
processes that wait on each other (a notebook's gloo ranks) takes twice as long beside a busy
one, and a test's own process sees no CPU of the children it does not reap (the fork
server's ranks, a Job's). The kernel counts a cgroup's CPU for every process in it, and a
process stays in its parent's cgroup from fork on. Moving a process needs root; where the
kernel refuses (or has no cgroup file system), start() returns None and the report shows time
only. Both cgroup versions: v1's cpuacct controller (cpuacct.usage, nanoseconds) and v2's
cpu.stat (usage_usec), which every v2 cgroup has, cpu controller or not.
"""
import os
from pathlib import Path

MOUNTS = Path("/sys/fs/cgroup")


class Group:
    """A cgroup made for this process and moved into (start()); left with leave()."""

    def __init__(self, home: Path, mine: Path, usage: Path, scale: float) -> None:
        self.home, self.mine, self._usage, self._scale = home, mine, usage, scale

    def seconds(self) -> float:
        """CPU seconds of every process that has been in the group, the exited ones too."""
        text = self._usage.read_text()
        if self._usage.name == "cpu.stat":
            text = next(line.split()[1] for line in text.splitlines()
                        if line.startswith("usage_usec "))
        return int(text) * self._scale

    def leave(self) -> None:
        """Every process of the group back to the cgroup this one came from (this one, and any
        it started that still runs: the fork server exits after pytest), the group removed."""
        try:
            others = (self.mine / "cgroup.procs").read_text().split()
        except OSError:
            others = []
        for pid in [str(os.getpid()), *others]:
            try:
                (self.home / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # a process that ended meanwhile
        try:
            self.mine.rmdir()
        except OSError:
            pass


def start(name: str) -> Group | None:
    """A cgroup `name` inside this process's own (v1's cpuacct, else v2's), with this process
    moved into it; None where that is not allowed or there is none."""
    own = Path("/proc/self/cgroup")
    for line in own.read_text().splitlines() if own.exists() else []:
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(","):
            root, usage, scale = MOUNTS / "cpuacct", "cpuacct.usage", 1e-9
        elif controllers == "":  # v2: alone at the mount point, or beside v1 at unified/
            root = MOUNTS if (MOUNTS / "cgroup.controllers").exists() else MOUNTS / "unified"
            usage, scale = "cpu.stat", 1e-6
        else:
            continue
        home = root / path.lstrip("/")
        mine = home / name
        group = Group(home, mine, mine / usage, scale)
        try:
            mine.mkdir(exist_ok=True)
            (mine / "cgroup.procs").write_text(str(os.getpid()))
            group.seconds()
            return group
        except (OSError, StopIteration, ValueError):
            group.leave()
    return None
