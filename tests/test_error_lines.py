"""`error:` lines stay whole when several ranks fail at once: each is one write call.

Every rank of a job writes to the one stderr torchrun gave them all. print() writes a line's
text and its newline in two calls, and under load another rank's line landed between them: two
lines came out as one (`...flight_recordererror: rank 0: ...`). mingpt.errors.report, the one
place 05's error lines are written (errors.fail, argparse's errors, forensics.watch,
analyze_hang.py), writes each line with its newline in a single os.write.
"""
import os
import subprocess
import sys

import pytest

from conftest import PYTHON, child_env
from mingpt_helpers import MINGPT

# Processes writing at once, and lines each: on 2 cores, print()'s two writes per line joined
# lines of 4 such processes in every run measured (DEBUGGING.md, "Error lines").
WRITERS, LINES = 4, 400
# A line as long as the longest the series writes (a DETAIL mismatch, with its two
# fingerprints: about 600 characters), and below PIPE_BUF (4096 on Linux), the size up to
# which the kernel never interleaves one write to a pipe with another process's.
TEXT = "x" * 600
WRITER = f"""
import os, sys, time
sys.path.insert(0, {str(MINGPT)!r})
from mingpt.errors import report
rank, ready = int(sys.argv[1]), sys.argv[2]
open(f"{{ready}}/{{rank}}", "w").close()  # imported: wait for the others, then all write at once
while len(os.listdir(ready)) < {WRITERS}:
    time.sleep(0.01)
for i in range({LINES}):
    report(f"rank {{rank}}: line {{i}} {TEXT}")
"""


def test_ranks_that_report_at_once_never_join_their_lines(tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    read, write = os.pipe()  # one pipe for every writer, as torchrun's workers share stderr
    writers = [subprocess.Popen([PYTHON, "-c", WRITER, str(rank), str(ready)], stderr=write,
                                env=child_env()) for rank in range(WRITERS)]
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        out = pipe.read().decode()
    assert [w.wait(timeout=60) for w in writers] == [0] * WRITERS
    lines = out.splitlines()
    # Every line whole, in any order: each starts with `error:` and holds one rank's line.
    joined = [line for line in lines if not line.startswith("error: rank ")
              or line.count("error:") != 1 or not line.endswith(TEXT)]
    assert joined == [], f"{len(joined)} of {len(lines)} lines not whole: {joined[0][:200]}"
    assert sorted(lines) == sorted(f"error: rank {r}: line {i} {TEXT}"
                                   for r in range(WRITERS) for i in range(LINES))


def test_one_error_line_is_one_write_call(mingpt_modules, tmp_path, monkeypatch):
    """What the test above sees by chance, here by construction: report() makes one write
    call, of the whole line with its newline, to stderr's file descriptor."""
    errors = mingpt_modules["errors"]
    calls = []

    def recording_write(fd: int, data: bytes) -> int:
        calls.append((fd, bytes(data)))
        return len(data)

    with open(tmp_path / "stderr", "w") as stderr:
        monkeypatch.setattr(sys, "stderr", stderr)
        monkeypatch.setattr(errors.os, "write", recording_write)
        errors.report("rank 1: a collective failed (Timed out)")
        with pytest.raises(SystemExit) as exit_:
            errors.fail("trainer_config.batch_size must be a positive integer, got -1")
        assert calls == [
            (stderr.fileno(), b"error: rank 1: a collective failed (Timed out)\n"),
            (stderr.fileno(),
             b"error: trainer_config.batch_size must be a positive integer, got -1\n")]
    assert exit_.value.code == 2


def test_a_write_cut_short_is_finished_not_repeated(mingpt_modules, tmp_path, monkeypatch):
    """A write(2) interrupted by a signal may take part of the line: the rest follows, and
    nothing is written twice (a pipe takes a short line whole: this does not happen there)."""
    errors = mingpt_modules["errors"]
    written = []

    def short_write(fd: int, data: bytes) -> int:
        n = min(len(data), 10)
        written.append(bytes(data[:n]))
        return n

    with open(tmp_path / "stderr", "w") as stderr:
        monkeypatch.setattr(sys, "stderr", stderr)
        monkeypatch.setattr(errors.os, "write", short_write)
        errors.report("rank 0: cut")
    assert b"".join(written) == b"error: rank 0: cut\n"


def test_a_stream_without_a_file_gets_the_line_in_one_call(mingpt_modules, monkeypatch):
    """Tests and notebooks replace stderr with a StringIO: no file descriptor there, so one
    write of the whole line to the stream itself."""
    errors = mingpt_modules["errors"]

    class Recorder:
        def __init__(self):
            self.writes = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    recorder = Recorder()
    monkeypatch.setattr(sys, "stderr", recorder)
    errors.report("no data")
    assert recorder.writes == ["error: no data\n"]
