"""A short crash storm (tests/crash_storm.py): step 03 under torchrun, a random worker SIGKILLed
at three random points; the job finishes with the uninterrupted run's weights, bit for bit.

The long storms (15 kills, step 03 and 05 with DDP and FSDP) run from the command line; their
measured figures are in the README's "Crash storms" section.
"""
import sys

import pytest

from crash_storm import run_storm

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="finds torchrun's workers in /proc (Linux)")


def test_three_random_kills_of_step_03_leave_the_result_bitwise_unchanged(tmp_path):
    summary = run_storm("03", kills=3, seed=0, length=20, workdir=tmp_path)
    assert summary["exit"] == 0, summary["log_tail"]
    assert summary["kills"] == 3
    assert summary["bitwise_equal"]  # weights and momentum, tensor for tensor
    assert summary["snapshots_always_loadable"]
    # Every kill was followed by a restart that trained again, having lost at most the one
    # epoch it was in (03 saves every epoch).
    assert all(r["latency_s"] is not None for r in summary["records"]), summary["records"]
    assert all(0 <= lost <= 1 for lost in summary["lost_per_kill"]), summary["records"]
