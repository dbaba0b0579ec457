"""Elastic training: two torchrun agents (two "nodes") with --nnodes=1:2; one node is lost
(its agent and worker SIGKILLed); the other re-rendezvouses alone and finishes the job from the
snapshot, at world size 1.

The rendezvous store lives in one agent: the first to start binds the endpoint, unless
`--rdzv-conf=is_host=...` says which (here: a). Losing that node ends the job (the others get
`RendezvousConnectionError`), so node b is the one killed here. torchrun starts each worker
in its own process group: losing a node means killing the agent and its worker.
"""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import REPO, TORCHRUN, child_env, free_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses pkill -P")


def test_a_lost_node_leaves_the_other_to_finish_from_the_snapshot(tmp_path):
    cmd = [TORCHRUN, "--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=3",
           "--rdzv-id=elastic", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           # Once one node is in, wait 5 s for more before starting (default 30 s); a node
           # that missed 3 heartbeats 1 s apart is dead (default 5 s apart: 15 s).
           "--rdzv-conf=last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"]
    script = [str(REPO / "04_multinode/train.py"), "60", "1"]
    lines: dict[str, list[str]] = {"a": [], "b": []}

    def start(node: str) -> subprocess.Popen:
        # a hosts the rendezvous store (is_host), b connects to it, whichever starts first:
        # both start at once, so neither waits out last_call_timeout alone on a busy machine.
        conf = f"{cmd[-1]},is_host={str(node == 'a').lower()}"
        proc = subprocess.Popen([*cmd[:-1], conf, *script], cwd=tmp_path, env=child_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        threading.Thread(target=lambda: lines[node].extend(proc.stdout), daemon=True).start()
        return proc

    a, b = start("a"), start("b")
    try:
        deadline = time.monotonic() + 120
        while not any("Steps: 32" in line for line in lines["a"]):  # 2 ranks share 64 batches
            assert time.monotonic() < deadline and a.poll() is None, "".join(lines["a"][-30:])
            time.sleep(0.05)
        subprocess.run(["pkill", "-KILL", "-P", str(b.pid)])  # node b's worker...
        os.killpg(b.pid, signal.SIGKILL)  # ...and its agent
        assert a.wait(timeout=180) == 0, "".join(lines["a"][-40:])
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)])
                os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines["a"])
    resumed = out.split("Resuming training from snapshot at epoch ")
    assert len(resumed) == 2, out[-3000:]  # a's worker failed, a restarted it once
    assert "Steps: 64" in resumed[1] and "Steps: 32" not in resumed[1]  # now alone
    assert torch.load(tmp_path / "snapshot.pt", weights_only=True)["EPOCHS_RUN"] == 60
