"""cpu_time.py, which `pytest --cpu-time` reports each file's CPU with: a cgroup counts the CPU of
a process its member started and never waited for (a fork server's rank), which the member's
own counters (getrusage) never see; leaving puts every process back and removes the group."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

# Run in a process of its own: moving the test worker into a group of this test's would take
# it out of --cpu-time's. A grandchild (forked twice, so the child never waits for it) burns
# CPU and says how much; the child reports what the group counted and what it counts itself.
CHILD = """
import json, os, sys, time, resource
sys.path.insert(0, {tests!r})
import cpu_time
group = cpu_time.start("pytest-cpu-time-test-" + str(os.getpid()))
if group is None:
    print(json.dumps(None)); sys.exit()
before = group.seconds()
read, write = os.pipe()
if os.fork() == 0:
    if os.fork() == 0:  # the grandchild
        start = time.process_time()
        while time.process_time() - start < 0.5:
            pass
        os.write(write, str(time.process_time()).encode()); os._exit(0)
    os._exit(0)
os.wait()  # the first fork: the grandchild is no child of this process
os.close(write)
with os.fdopen(read) as pipe:  # to the end: the pipe closes when the grandchild exits
    burnt = float(pipe.read())
counted = group.seconds() - before
children = resource.getrusage(resource.RUSAGE_CHILDREN)
group.leave()
print(json.dumps({{"burnt": burnt, "counted": counted,
                  "reaped": children.ru_utime + children.ru_stime,
                  "left": group.mine.exists()}}))
"""


def test_a_group_counts_a_process_its_member_never_waited_for():
    tests = str(Path(__file__).parent)
    proc = subprocess.run([sys.executable, "-c", CHILD.format(tests=tests)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    if result is None:
        pytest.skip("no cgroup could be made here (moving a process into one needs root)")
    # The grandchild's CPU is in the group's count (and the rest is the child's own, a few
    # milliseconds between the two reads); getrusage's children see none of it.
    assert result["burnt"] >= 0.5
    assert result["burnt"] <= result["counted"] < result["burnt"] + 0.5, result
    assert result["reaped"] < 0.1, result
    assert result["left"] is False
