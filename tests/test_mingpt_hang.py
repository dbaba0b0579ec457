"""A hang ends in bounded time, and every rank's trace says who did not reach which collective.

Two gloo processes of main.py under torchrun: a rank that stalls before step 3
(FAULT_STALL_AT_STEP). The same as a job of forked ranks (mingpt_helpers.Job, which stops
them as torchrun does: the claims are the programs', torchrun's part is the first test's): a
rank that leaves out step 3's all-reduce and goes on (tests/hang_worker.py; in the trainer,
FAULT_SKIP_AT_STEP), and shapes that differ across ranks (TORCH_DISTRIBUTED_DEBUG=DETAIL).
A rank that never comes to a collective under DETAIL (its barrier before each collective times
out). A rank that stalls on one axis of a DeviceMesh (tests/axis_hang_worker.py): pp's sends and
receives, tp's all-reduce, cp's all-to-all, and all of them in a 3-D layout (pp 2 x dp 2 x tp 2,
8 processes): analyze_hang.py names the rank, the axis, the operation and the step.
Also the step-time breakdown and the profile (trainer_config.profile_steps), and the config of
both.

The waits are bounded by the collective timeout, not by sleeps: each test measures from the
moment the hang began (the stalled rank's last step mark, in its own dump) to the job's exit,
so the start-up of two processes on a busy machine does not count against the bound.
"""
import json
import pickle
import re
import signal
import time

import pytest

from conftest import PYTHON, REPO, TORCHRUN, run
from mingpt_helpers import (
    copy_mingpt,
    ended_job,
    fork_server,
    mingpt_imported,
    script_in_process,
    tiny,
)

# Seconds a collective may wait. Long enough that no collective of a healthy run waits that
# long on a loaded 2-core machine (the longest, the first all-gather, waits for the slower
# rank's imports: a few seconds), short enough for a test.
TIMEOUT_S = 15
# The bound: the job ends within the timeout plus a minute (torchrun noticing the
# failed rank, SIGTERM to the others, their dumps and teardown: about 1-3 s measured).
MARGIN_S = 60
# The shapes test's timeout: never waited out when the test passes (see there).
SHAPES_TIMEOUT_S = 200
# How long torchrun's agent lets the other ranks of a failed one take after its SIGTERM,
# before its SIGKILL (LocalElasticAgent's default): a Job of the tests below stops them so.
GRACE_S = 30


@pytest.fixture(scope="module")
def mingpt(tmp_path_factory):
    return copy_mingpt(tmp_path_factory.mktemp("hang"))


def main_args(run_name: str) -> list[str]:
    """main.py's arguments for a hang's run: no snapshot, no sample, the short timeout."""
    return tiny(f"run_name={run_name}", "trainer_config.save_every=0",
                "trainer_config.sample_tokens=0",
                f"trainer_config.collective_timeout_s={TIMEOUT_S}")


def launch(mingpt, run_name: str, **env: str):
    """torchrun, 2 gloo processes of main.py; returns (process, end time, run directory)."""
    proc = run([TORCHRUN, "--standalone", "--nproc_per_node=2", "main.py", *main_args(run_name)],
               cwd=mingpt, check=False, timeout=240 + TIMEOUT_S + MARGIN_S, **env)
    return proc, time.time(), mingpt / "runs" / run_name


def job(cwd, script: str, *argv: str, nproc: int = 2, **env: str) -> tuple[int, str, float]:
    """`torchrun --standalone --nproc_per_node=NPROC SCRIPT ARGV` in `cwd` as a Job (forked
    ranks, stopped as torchrun stops them): mingpt_helpers.ended_job's exit status, output
    (stdout and stderr, line by line) and end time."""
    return ended_job(cwd, script, list(argv), nproc, cwd / "job.log", stop_grace_s=GRACE_S,
                     **env)


def analyze(folder) -> str:
    """`python analyze_hang.py FOLDER`'s report, run in this process (main(), as the command
    runs it): the command itself, as each error line names it, runs in the first test."""
    with mingpt_imported("analyze_hang") as modules:
        proc = script_in_process(modules["analyze_hang"], REPO / "05_mingpt", str(folder))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def hang_began(where: dict) -> float:
    """When the rank that stopped issuing collectives began its last step (its dump's marks)."""
    return where["steps"][-1][1] / 1e9


def test_a_stalled_rank_ends_in_the_timeout_with_every_ranks_trace(mingpt):
    proc, ended, run_dir = launch(mingpt, "stall", FAULT_STALL_AT_STEP="3")
    assert proc.returncode != 0
    assert "[rank 1] FAULT_STALL_AT_STEP=3: this rank stops here" in proc.stdout
    folder = run_dir / "flight_recorder"
    # One line from the rank that timed out: the collective's failure, the traces, the command.
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: rank 0: a collective failed (Timed out waiting {TIMEOUT_S * 1000}ms for recv "
        f"operation to complete); every rank's trace is in {folder}: python analyze_hang.py "
        f"{folder}"], proc.stderr[-3000:]
    assert sorted(p.name for p in folder.iterdir()) == ["rank0", "rank1", "where0.json",
                                                        "where1.json"]
    where = [json.loads((folder / f"where{r}.json").read_text()) for r in (0, 1)]
    assert where[1]["steps"][-1][0] == 3  # rank 1 marked step 3, then stalled
    assert ended - hang_began(where[1]) < TIMEOUT_S + MARGIN_S
    # torch's analyzer alone cannot read gloo's dumps (the bug analyze_hang.py works around).
    dump = pickle.loads((folder / "rank0").read_bytes())
    assert list(dump["pg_config"]) == [""] and dump["entries"][-1]["process_group"] == \
        ("0", "default_pg")
    bare = run([PYTHON, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder),
                "-p", "rank"], check=False)
    # (the rank in the key is the first dump the analyzer reads: the folder's order)
    assert bare.returncode != 0 and re.search(r"KeyError: \('0', [01]\)", bare.stderr)
    # The analysis: rank 1 never issued the gradient all-reduce of step 3 (every parameter in
    # DDP's one bucket), rank 0 waited in it, and rank 1 was in the fault's sleep.
    params = re.search(r"model: ([0-9,]+) parameters", proc.stdout)[1].replace(",", "")
    # The command the error line gives, as a user runs it (the other tests read the report
    # in this process: analyze()); on the run's folder, which it finds the dumps in.
    out = run([PYTHON, "analyze_hang.py", str(run_dir)], cwd=REPO / "05_mingpt").stdout
    assert out == analyze(run_dir)
    assert "missing ranks: {1}" in out
    seq = int(re.search(r"Not all ranks joining collective, sequence number: (\d+)", out)[1])
    assert f"rank 1: last issued #{seq - 1} all_reduce [[{params}]] Float, 1 behind: never " \
           f"issued #{seq}" in out
    assert (f"step 3: the ranks' collectives differ\n  rank 0 made #{seq} all_reduce "
            f"[[{params}]] Float\n  rank 1 made none\n") in out
    assert re.search(r"rank 0 \(pid \d+ on .+: Timed out waiting \d+ms for recv operation to "
                     r"complete\): runner\.py:\d+ forward_backward < faults\.py:\d+ "
                     r"forward_backward < trainer\.py:\d+ _run_batch", out)
    assert re.search(r"rank 1 \(pid \d+ on .+: stopped by SIGTERM .*\): faults\.py:\d+ "
                     r"inject_fault < faults\.py:\d+ forward_backward < trainer\.py:\d+ "
                     r"_run_batch", out)


def test_a_rank_that_skips_an_all_reduce_and_goes_on_pairs_off_by_one(tmp_path):
    """torch's analyzer points at the last all-reduce (#6, which rank 1 never issued); the
    step marks show where it began: rank 1 made none in step 3, and its #4 is step 4's."""
    code, log, ended = job(tmp_path, str(REPO / "tests/hang_worker.py"), str(tmp_path),
                           str(TIMEOUT_S))
    assert code != 0
    folder = tmp_path / "flight_recorder"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0", "rank1", "where0.json",
                                                        "where1.json"], log[-3000:]
    where1 = json.loads((folder / "where1.json").read_text())
    assert ended - hang_began(where1) < TIMEOUT_S + MARGIN_S
    out = analyze(folder)
    assert "Not all ranks joining collective, sequence number: 6" in out  # torch's view
    assert ("step 3: the ranks' collectives differ\n"
            "  rank 0 made #4 all_reduce [[4]] Float\n"
            "  rank 1 made none\n"
            "  rank 1 left out 1 and went on: its #4 all_reduce [[4]] Float (step 4) pairs with "
            "the other ranks' collective of the same number from step 3, off by one from here "
            "on\n") in out


def test_shapes_that_differ_are_named_on_both_ranks_with_detail(tmp_path):
    """Without DETAIL, gloo aborts the rank that receives the wrong size (SIGABRT, an enforce
    message and no dump); with it, both ranks raise before the collective, naming both shapes."""
    # The mismatch is found as soon as both ranks reach step 3, so no wait depends on the
    # timeout; a short one only turns a rank that is late under load into another failure
    # (DETAIL's barrier times out first: the next test), so this one is long.
    code, log, _ = job(tmp_path, str(REPO / "tests/hang_worker.py"), str(tmp_path),
                       str(SHAPES_TIMEOUT_S), "shapes", TORCH_DISTRIBUTED_DEBUG="DETAIL")
    assert code != 0
    errors = sorted(line for line in log.splitlines() if line.startswith("error:"))
    assert len(errors) == 2, log[-3000:]
    for rank, (mine, other) in enumerate([(4, 5), (5, 4)]):
        assert errors[rank].startswith(f"error: rank {rank}: a collective failed (Detected "
                                       "mismatch between collectives on ranks.")
        assert f"Rank {rank} is running collective: CollectiveFingerPrint(SequenceNumber=3, " \
               f"OpType=ALLREDUCE, TensorShape=[{mine}], TensorDtypes=Float)" in errors[rank]
        assert f"TensorShape=[{other}], TensorDtypes=Float)" in errors[rank]
        assert f"Tensor shapes: {mine}vs {other}" in errors[rank]
    out = analyze(tmp_path)
    assert "rank 0 (pid" in out and ": collectives differ: Tensor Tensor shapes: 4vs 5)" in out


def test_a_rank_that_never_comes_is_named_by_details_barrier(tmp_path):
    """Under DETAIL, a barrier before each collective times out when a peer never comes: that is
    a collective failure too (one error: line naming the missing rank, dumps), not a crash."""
    code, log, _ = job(tmp_path, str(REPO / "tests/hang_worker.py"), str(tmp_path),
                       str(TIMEOUT_S), "late", TORCH_DISTRIBUTED_DEBUG="DETAIL")
    folder = tmp_path / "flight_recorder"
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert errors == [f"error: rank 0: a collective failed (Ranks 1 failed to pass "
                      f"monitoredBarrier in {TIMEOUT_S * 1000} ms); every rank's trace is in "
                      f"{folder}: python analyze_hang.py {folder}"], log[-3000:]
    assert code == 2  # rank 0 left through the error line, not a traceback
    assert sorted(p.name for p in folder.iterdir()) == ["rank0", "rank1", "where0.json",
                                                        "where1.json"]


def test_analyze_hang_refuses_a_folder_without_dumps(tmp_path):
    proc = run([PYTHON, "analyze_hang.py", str(tmp_path)], cwd=REPO / "05_mingpt", check=False)
    assert (proc.returncode, proc.stderr) == (
        2, f"error: no Flight Recorder dumps (rank<N>, where<N>.json) in {tmp_path}\n")


def test_step_breakdown_and_profile(mingpt, mingpt_modules):
    """Every log line says where a step's time went, the four phases adding up to the step;
    profile_steps=2 writes a Chrome trace of steps 6 and 7 (after 5 left out, 1 of warm-up)."""
    proc = script_in_process(mingpt_modules["main"], mingpt, *tiny(
        "run_name=profiled", "trainer_config.profile_steps=2", "trainer_config.sample_tokens=0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"^step (\d+)/10 \| .* \| step ([0-9.]+) ms: data (\d+)% forward (\d+)% "
                       r"backward (\d+)% optimizer (\d+)%$", proc.stdout, re.M)
    assert [int(line[0]) for line in lines] == [5, 10], proc.stdout[-2000:]
    for _, total, *shares in lines:
        assert float(total) > 0
        # Four shares, each rounded to a whole percent: their sum is 100 within 4 x 0.5.
        assert abs(sum(int(s) for s in shares) - 100) <= 2
    trace = json.loads((mingpt / "runs/profiled/profile/rank0.json").read_text())
    steps = sorted({e["name"] for e in trace["traceEvents"]
                    if e.get("name", "").startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#6", "ProfilerStep#7"]
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"aten::mm", "Optimizer.step#AdamW.step"} <= names  # the model's and AdamW's work


def test_debugging_keys_are_checked(mingpt, mingpt_modules):
    main = mingpt_modules["main"]
    for override, message in [
        ("trainer_config.collective_timeout_s=0", "error: trainer_config.collective_timeout_s "
         "must be > 0 (seconds a collective may wait for the other ranks), got 0.0"),
        ("trainer_config.profile_steps=-1", "error: trainer_config.profile_steps must be an "
         "integer >= 0 (0: off), got -1"),
        ("trainer_config.memory_snapshot=true", "error: trainer_config.memory_snapshot must be "
         "False without a CUDA GPU (it records CUDA allocations; on a CPU, profile_steps shows "
         "where time goes), got True"),
    ]:
        proc = script_in_process(main, mingpt, override, CUDA_VISIBLE_DEVICES="")
        assert (proc.returncode, proc.stderr) == (2, message + "\n")


def test_memory_snapshot_files_are_per_rank(tmp_path, mingpt_modules):
    """The snapshot's file name (the GPU test checks its content): one per rank, in the run."""
    path = mingpt_modules["main"].profiling.memory_snapshot_path(str(tmp_path), 3)
    assert path == str(tmp_path / "memory" / "rank3.pickle")


def test_a_skipped_gradient_all_reduce_in_the_trainer_aborts_one_rank_and_the_other_dumps(
        mingpt):
    """FAULT_SKIP_AT_STEP=3: the last rank's later all-reduces pair with the others' earlier
    ones until the log step's first collective, whose size differs; gloo then aborts the rank
    that receives the wrong size (SIGABRT: no dump of its own) and the other one's collective
    fails with the connection: its dump and line are there, and the analysis says which rank
    left none (DEBUGGING.md: rerun with DETAIL, or read NCCL's dumps, to see both)."""
    code, log, _ = job(mingpt, "main.py", *main_args("skip"), FAULT_SKIP_AT_STEP="3")
    assert code != 0
    assert "[rank 1] FAULT_SKIP_AT_STEP=3: this rank skips the gradient all-reduce" in log
    assert "terminate called after throwing an instance of 'gloo::EnforceNotMet'" in log
    folder = mingpt / "runs/skip/flight_recorder"
    dumps = sorted(p.name for p in folder.iterdir() if p.name.startswith("rank"))
    assert len(dumps) == 1, log[-3000:]
    alive, dead = int(dumps[0][-1]), 1 - int(dumps[0][-1])
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: rank {alive}: a collective failed")
    out = analyze(folder)
    assert f"1 Flight Recorder dumps of 2 ranks in {folder}; none from rank(s) [{dead}] " \
           "(killed before they could write)" in out


# The mesh's groups wait this long for the stalled rank (the 3-D job's default group waits
# for 8 processes to start: axis_hang_worker.START_TIMEOUT_S).
AXIS_TIMEOUT_S = 10


def axis_stall(tmp_path, layout: str, nproc: int) -> tuple[list[str], str]:
    """tests/axis_hang_worker.py's job: the error lines and the analysis."""
    code, log, _ = job(tmp_path, str(REPO / "tests/axis_hang_worker.py"), str(tmp_path),
                       str(AXIS_TIMEOUT_S), layout, nproc=nproc)
    assert code != 0
    assert f"[rank {nproc - 1}] stalls before step 3" in log, log[-3000:]
    folder = tmp_path / "flight_recorder"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [f"rank{r}" for r in range(nproc)] + [f"where{r}.json" for r in range(nproc)])
    # Every rank that waited says so, each in a line of its own (in any order).
    errors = sorted(line for line in log.splitlines() if line.startswith("error:"))
    assert [e.split(":")[1] for e in errors] == [f" rank {r}" for r in range(nproc - 1)], errors
    assert all(f"Timed out waiting {AXIS_TIMEOUT_S * 1000}ms" in e for e in errors), errors
    return errors, analyze(folder)


# tp's all-reduce is named by the 3-D layout's test below (a claim checked once).
@pytest.mark.parametrize("layout, op", [
    # stage 0 sent step 3's activation; stage 1 never posted its receive (2 p2p ops a step)
    ("pp", "send 0->1 [[4, 8]] Float on pp (point-to-point #7, step 3)"),
    ("cp", "all_to_all [[2, 16]] Float on cp (#5, step 3)"),
])
def test_a_rank_stalled_on_one_axis_is_named_with_the_operation_and_step(tmp_path, layout, op):
    _, out = axis_stall(tmp_path, layout, 2)
    assert (f"stalled: rank 1, on {layout}\n  rank 0 waits for it in {op}\n"
            f"  rank 1's last {layout} op: ") in out, out
    if layout == "pp":  # what the default group alone showed: gloo's recorder has no p2p op
        assert "torch's analyzer (with gloo's pg_config rewritten):\n  no finding\n" in out


# Under load (the full suite on 2 cores) the analysis once named rank 6, itself blocked in its
# TP all-reduce behind the stalled rank 7, as the stalled one: the "stopped first" rule now
# prefers a rank that waits on nobody (test_the_stalled_rank_is_one_that_waits_on_nobody).
def test_a_rank_stalled_in_a_3d_layout_is_named_on_each_axis_it_holds_up(tmp_path):
    """pp 2 x dp 2 x tp 2: rank 7 (pp 1, dp 1, tp 1) stalls; its tp peer waits in step 3's
    all-reduce, its pp peer in the send of step 3's activation, its dp peer in the gradient
    all-reduce. The ranks those three left waiting are behind too, later: not the stall."""
    _, out = axis_stall(tmp_path, "3d", 8)
    assert re.search(r"^stalled: rank 7, on (pp|dp|tp), (pp|dp|tp), (pp|dp|tp)$", out, re.M), out
    for line in ["  rank 6 waits for it in all_reduce [[4, 8]] Float on tp (#4, step 3)",
                 "  rank 3 waits for it in send 0->1 [[4, 8]] Float on pp (point-to-point #7, "
                 "step 3)",
                 "  rank 5 waits for it in all_reduce [[32]] Float on dp (#4, step 3)",
                 "  rank 7's last tp op: #3, step 2", "  rank 7's last pp op: #6, step 2"]:
        assert line in out.splitlines(), (line, out)


def nccl_entry(group: tuple, op: str, seq: int, ns: int, p2p: bool) -> dict:
    """One entry as NCCL's Flight Recorder writes it (the fields the analysis reads)."""
    return {"process_group": group, "profiling_name": f"nccl:{op}", "is_p2p": p2p,
            "p2p_seq_id": seq if p2p else 0, "collective_seq_id": 0 if p2p else seq,
            "input_sizes": [[4, 8]], "input_dtypes": ["Float"], "time_created_ns": ns,
            "frames": []}


def test_nccls_point_to_point_entries_are_read_from_its_dump():
    """NCCL's recorder keeps sends and receives in its dump, and its pg_config names each
    group's ranks: no where<N>.json needed (the watchdog's dumps come alone)."""
    config = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"},
              "1": {"name": "1", "desc": "mesh_pp", "ranks": "[0, 1]"}}
    pp = ("1", "mesh_pp")
    dumps = {0: {"pg_config": config, "entries": [
                 nccl_entry(pp, "send 0->1", 1, 10, True), nccl_entry(pp, "recv 0<-1", 2, 20, True),
                 nccl_entry(pp, "send 0->1", 3, 30, True)]},
             1: {"pg_config": config, "entries": [
                 nccl_entry(pp, "recv 1<-0", 1, 11, True),
                 nccl_entry(pp, "send 1->0", 2, 19, True)]}}
    with mingpt_imported("analyze_hang") as modules:
        lines = modules["analyze_hang"].axis_stalls(dumps, {})
    assert lines[-3:] == [
        "stalled: rank 1, on pp",
        "  rank 0 waits for it in send 0->1 [[4, 8]] Float on pp (point-to-point #3, before the "
        "first step)",
        "  rank 1's last pp op: #2, before the first step"]


def test_the_stalled_rank_is_one_that_waits_on_nobody():
    """Rank 0 is behind rank 2 on group c (rank 2 waits for it there) but itself waits in
    group a's #2 for rank 1, whose newest operation (group b's, 40 ns) came after rank 0's
    (30 ns), as a loaded machine can order them: the rank that stopped first is rank 1, the
    one behind somewhere that waits on nobody, not rank 0, the one whose newest op is oldest."""
    config = {n: {"name": n, "desc": f"mesh_{n}", "ranks": ranks}
              for n, ranks in [("a", "[0, 1]"), ("b", "[1, 2]"), ("c", "[0, 2]")]}
    a, b, c = ("a", "mesh_a"), ("b", "mesh_b"), ("c", "mesh_c")
    def ops(*entries: tuple) -> dict:  # (group, sequence number, time) of each all-reduce
        return {"pg_config": config,
                "entries": [nccl_entry(g, "all_reduce", seq, ns, False) for g, seq, ns in entries]}
    dumps = {0: ops((c, 1, 5), (a, 1, 10), (a, 2, 30)), 1: ops((a, 1, 11), (b, 1, 40)),
             2: ops((c, 1, 6), (b, 1, 41), (c, 2, 50))}
    with mingpt_imported("analyze_hang") as modules:
        lines = modules["analyze_hang"].axis_stalls(dumps, {})
    assert lines[-3:] == [
        "stalled: rank 1, on a",
        "  rank 0 waits for it in all_reduce [[4, 8]] Float on a (#2, before the first step)",
        "  rank 1's last a op: #1, before the first step"]


def test_a_dump_that_must_not_replace_leaves_the_file_there_alone(tmp_path):
    """forensics._write(replace=False), as a rank's own NCCL dump is written: a file already
    there (the watchdog's) stays byte for byte, and no temporary file is left (the GPU test,
    tests/test_gpu.py, runs it on NCCL's dump)."""
    path = tmp_path / "rank0"
    with mingpt_imported("mingpt.forensics") as modules:
        write = modules["mingpt.forensics"]._write
        assert write(str(path), b"ours", replace=False) is True
        assert write(str(path), b"later", replace=False) is False
        assert path.read_bytes() == b"ours"
        assert write(str(path), b"replaced") is True  # gloo's: the series' own dump
    assert path.read_bytes() == b"replaced" and sorted(p.name for p in tmp_path.iterdir()) == \
        ["rank0"]


def _sigterm_while(error: str) -> None:
    """forensics' SIGTERM handler, called as Python calls it, while RuntimeError(`error`) is
    being raised, in a rank that armed nothing (so no dump): it returns, or the process ends
    by SIGTERM."""
    with mingpt_imported("mingpt.forensics") as m:
        try:
            raise RuntimeError(error)
        except RuntimeError:
            m["mingpt.forensics"]._on_sigterm(signal.SIGTERM, None)


@pytest.mark.parametrize("error, code", [("Connection reset by peer", 0),
                                         ("a bug of the program's", -signal.SIGTERM)])
def test_a_sigterm_while_the_ranks_collective_fails_leaves_it_its_error_line(error, code):
    """torchrun's SIGTERM (another rank failed) can come in the instant that rank's exit
    breaks this one's collective, while the error is on its way to forensics.watch: the rank
    goes on to its own dump and error line, as it would have a moment later. Seen once in
    three with a job that stops the others without torchrun's 0.1 s between polls (the
    trainer's skipped all-reduce above: a dump of "stopped by SIGTERM" and no line). Any other
    error: SIGTERM ends the rank at once."""
    process = fork_server().Process(target=_sigterm_while, args=(error,))
    process.start()
    process.join(120)
    assert process.exitcode == code


QUIET = """\
import sys
import time
from pathlib import Path
print("one line, then nothing until this rank's stacks are in the log", flush=True)
log = Path(sys.argv[1])
while "Current thread 0x" not in log.read_text():  # the probe's dump ends the wait
    time.sleep(0.05)
"""


def test_a_job_quiet_past_quiet_s_writes_its_stacks_and_goes_on(tmp_path):
    """Job.finish(quiet_s=...): a job whose log stops growing writes its live ranks' stacks
    into the log once, and is still waited for to its end (the probe of a stall that ends
    before the timeout)."""
    (tmp_path / "quiet.py").write_text(QUIET)
    log = tmp_path / "quiet.log"
    code, out, _ = ended_job(tmp_path, "quiet.py", [str(log)], 1, log, timeout=120,
                             quiet_s=0.5)
    assert code == 0, out
    assert out.count("--- the log was quiet for 0.5 s ---") == 1, out
    assert out.count("Current thread 0x") == 1 and 'File "' in out and "quiet.py" in out, out
