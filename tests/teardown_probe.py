"""Run a training entry point as `python SCRIPT ARGS` would, then count gloo's threads at exit.

    torchrun --standalone --nproc_per_node=2 tests/teardown_probe.py 02_multigpu/train.py 1 1

When Python starts to shut down (atexit: the last moment it still runs Python code), each rank
prints `[rank R] gloo threads at exit: N`. N must be 0: destroy_process_group joins gloo's
worker threads when it frees the group, and a worker still running while Python shuts down can
abort the process (tests/test_teardown.py).

PROBE_COMPILE_BACKEND=eager makes torch.compile trace with dynamo but run the traced graphs
as they are: what the teardown depends on (dynamo's guards and caches, which keep references
and weakref proxies) without the minutes of C++ compilation that inductor spends on 2 ranks.
"""
import atexit
import functools
import os
import runpy
import sys


def gloo_threads() -> int:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read())
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return sum("gloo" in name for name in names)  # pt_gloo_runloop, gloo_tcp_loop


def report() -> None:
    line = f"[rank {os.environ.get('RANK', 0)}] gloo threads at exit: {gloo_threads()}\n"
    os.write(1, line.encode())  # one write: the ranks share stdout, print() writes twice


atexit.register(report)
if backend := os.environ.get("PROBE_COMPILE_BACKEND"):
    import torch

    # nn.Module.compile calls torch.compile: both take the backend from here.
    torch.compile = functools.partial(torch.compile, backend=backend)
script = os.path.abspath(sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
sys.path.insert(0, os.path.dirname(script))  # the step's own helpers, as `python script` has
runpy.run_path(script, run_name="__main__")
