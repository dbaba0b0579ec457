"""torchrun's restart command works as the READMEs write it: a killed worker's job comes back
in one restart and finishes, every time, without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.

torchrun's agent shares one TCP store with every attempt's workers; a restarted group that
read the previous attempt's keys there failed with "Gloo connectFullMesh failed ... Connection
refused" at each restart, or hung, in 5 of 6 jobs of step 03 measured before the fix
(tests/README.md, "Restarts"). Steps 03-05 now form each attempt's group on keys of its own
(restarts.py). tests/restart_tries.py runs the try; the other tests set the variable
(conftest.child_env), so only this test, step 04's logs command (test_torchrun_logs.py), step
03's crash storm (test_crash_storm.py) and 05's killed ddp worker (test_mingpt_train.py) show
the restart as a new user runs it.
"""
import signal
import socket
import sys

import pytest

from conftest import ephemeral_ports, free_port, port_band
from restart_tries import one_try

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="torchrun's gloo restarts, as measured on Linux")


def test_step03_command_as_written_recovers(tmp_path):
    """4 processes, as the README's command; before the fix 1 of 6 such jobs recovered. This
    restart, step 03's crash storm (two), step 04's logs command and 05's killed ddp worker
    run one restarts.py (the copies are byte-identical: test_docs.py) on the shared store:
    were the fault back, all five restarts would succeed once in 7,776 runs."""
    result = one_try("03", tmp_path / "try", nproc=4, timeout_s=240)
    assert result["mesh_failures"] == 0, result["log_tail"]  # no "connectFullMesh failed"
    # exit 0, exactly one failed attempt (the kill), and the resume line after it
    assert (result["exit"], result["failed_attempts"], result["resumed"]) == (0, 1, True), result
    # The kill was the fault's SIGKILL in epoch 2; epochs 0 and 1 were snapshotted, so the
    # restart trained 2 and 3 (not 1, not only 3). Bit for bit: test_crash_storm.py.
    assert result["exit_codes"] == [-signal.SIGKILL], result
    assert result["epochs_after_resume"] == [2, 3], result


def test_the_tests_ports_lie_below_the_ephemeral_range_in_this_workers_band(monkeypatch):
    """A port for a rank or server to listen on is never one an outgoing connection can take
    meanwhile (conftest.free_port), nor one the other xdist worker hands out."""
    low, _ = ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert all(p in port_band() and p < low for p in ports), ports
    with socket.socket() as s:  # a port listened on is never handed out
        s.bind(("127.0.0.1", ports[0]))
        s.listen()
        monkeypatch.setattr("conftest.port_band", lambda: range(ports[0], ports[0] + 1))
        with pytest.raises(pytest.fail.Exception, match="no free port"):
            free_port()
    monkeypatch.undo()

    def bands(count: int) -> list[set[int]]:
        """Each worker's band, with `count` workers."""
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
        found = []
        for worker in range(count):
            monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
            found.append(set(port_band()))
        return found

    for count in (1, 2, 3):  # the workers' bands: disjoint, each below the ephemeral range
        each = bands(count)
        assert sum(map(len, each)) == len(set().union(*each)) > 20000 // count
        assert max(set().union(*each)) < low
    # Where nearly every port is ephemeral, the bands still part the workers' ports.
    monkeypatch.setattr("conftest.ephemeral_ports", lambda: (1024, 65535))
    first, second = bands(2)
    assert not first & second and min(len(first), len(second)) > 20000
