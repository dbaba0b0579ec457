"""Shared pieces of the 05_mingpt trainer tests: a private copy of the folder, tiny overrides,
parsers for the trainer's log lines, and the warm worlds of gloo ranks (start_world)."""
import contextlib
import faulthandler
import functools
import gc
import importlib
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from omegaconf import OmegaConf

from conftest import REPO, child_env, free_port, in_process

MINGPT = REPO / "05_mingpt"

# A model and run small enough for a busy 2-core CI machine; every test adds its own keys.
TINY = {
    "gpt_config.model_type": "null",
    "gpt_config.n_layer": "2",
    "gpt_config.n_head": "2",
    "gpt_config.n_embd": "32",
    "gpt_config.block_size": "32",
    "trainer_config.batch_size": "8",
    "trainer_config.max_steps": "10",
    "trainer_config.warmup_steps": "2",
    "trainer_config.log_every": "5",
    "trainer_config.eval_every": "0",
    "trainer_config.eval_batches": "4",
    "trainer_config.save_every": "4",
    "trainer_config.sample_tokens": "20",
    # The recipe the golden curves were recorded with (main.py's defaults before the faster
    # one of bench/README.md, Speed), so a change of defaults does not move what tests compare.
    "gpt_config.dropout": "0.1",
    "optimizer_config.name": "adamw",
    "optimizer_config.lr": "3e-3",
    "optimizer_config.betas": "[0.9,0.95]",
}


def tiny(*overrides: str) -> list[str]:
    """The given overrides, then the TINY ones they do not set (hydra refuses a key twice)."""
    given = {o.split("=", 1)[0] for o in overrides}
    return [*overrides, *(f"{k}={v}" for k, v in TINY.items() if k not in given)]


def copy_mingpt(dest: Path) -> Path:
    """05_mingpt without earlier runs: commands run as written, the repo stays clean."""
    return Path(shutil.copytree(MINGPT, dest / "05_mingpt", ignore=shutil.ignore_patterns(
        "__pycache__", "runs", "outputs")))


# Warm worlds are forks of multiprocessing's fork server: one process per test worker that
# imports torch and the libraries the ranks use once (PRELOAD) and starts no thread, so a
# fork of it is safe. A rank then starts in a fraction of a second; a spawned one imported
# all of it again (about 4 s of CPU each, 8 ranks sharing 2 cores). transformers (init_from's
# GPT-2: 2 s of CPU), s3fs and torchft are imported only by the runs that use them, but dozens
# of forked ranks do (the feature matrix's). So are the modules a compiled step imports on
# its first call (AOTAutograd, the aot_eager backend, and the parts of inductor they reach:
# about 600 modules, 1.6 s of CPU per compiling rank, measured). So is this module, where
# every fork's function lies (a rank's, a staging process's), and pytest with it: 0.11 s of a
# fork's 0.15 s before it ran anything (measured, 20 forks). 05's dry run starts the same
# server with its own preload when it runs first in a worker: the ranks import the rest.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "torch.utils.tensorboard", "hydra", "fsspec",
           "transformers.models.gpt2.modeling_gpt2", "s3fs", "torchft",
           "torch._functorch.aot_autograd", "torch._dynamo.backends.debugging",
           "torch._inductor.compile_fx", "mingpt_helpers"]


def fork_server() -> multiprocessing.context.ForkServerContext:
    """multiprocessing's fork server, which imports PRELOAD when it starts (once per process)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    return multiprocessing.get_context("forkserver")


def start_world(worker: Callable, world: int, *args: object, spawn: bool = False) -> None:
    """`worker(rank, *args)` in `world` processes, forked from the fork server (or spawned:
    `spawn`, for a check of what a fresh interpreter reads at start, such as the kernel set);
    each with this process's environment, as a spawned process would have (the server's is
    the one it started with). Any rank's failure, an abort at exit too, raises here."""
    if spawn:
        mp.start_processes(worker, args=args, nprocs=world, start_method="spawn")
        return
    fork_server()
    stacks = Path(tempfile.mkdtemp(prefix="world-stacks-"))  # see _in_environment
    context = mp.start_processes(_in_environment, args=(dict(os.environ), str(stacks), worker,
                                                        *args),
                                 nprocs=world, start_method="forkserver", join=False)
    try:
        while not context.join():
            pass
    except pytest.fail.Exception as e:  # pytest's timeout (its signal, in this thread)
        live = {r: (p.pid, stacks / f"rank{r}.txt") for r, p in enumerate(context.processes)
                if p.is_alive()}
        dump_stacks(list(live.values()))
        for r in live:
            context.processes[r].kill()
        said = "".join(f"rank {r}:\n{path.read_text()}" for r, (_, path) in live.items())
        pytest.fail(f"{e}\nthe world's live ranks, where they were:\n{said}")
    finally:
        shutil.rmtree(stacks, ignore_errors=True)


def _adopt(environ: dict) -> None:
    """A fork of the fork server takes the environment its starter gave it (the server's own
    is the one the server started with). The server's imports are shared with the fork until
    written: a full garbage collection would visit, and so copy, every object of them (0.3 s
    of CPU and 17,000 page faults per rank of a 2-step run, measured). Frozen first, the
    collector ignores them."""
    gc.freeze()
    os.environ.clear()
    os.environ.update(environ)


def _in_environment(rank: int, environ: dict, stacks: str, worker: Callable,
                    *args: object) -> None:
    _adopt(environ)
    stage_in_forks()
    # A world still running at pytest's timeout says where each rank was (start_world): its
    # stderr is the fork server's, a file pytest's capture has left, so a file of its own.
    _stacks_file.append(open(os.path.join(stacks, f"rank{rank}.txt"), "w"))  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_stacks_file[-1], all_threads=True)
    worker(rank, *args)


_stacks_file: list = []  # a rank's file for faulthandler's dump, open while the rank lives


def dump_stacks(ranks: list[tuple[int, Path]]) -> None:
    """Each (pid, file) rank writes its threads' stacks to its file, after a line naming its
    pid: faulthandler, from its SIGUSR1 handler, one "Current thread" line in each dump; a
    rank after the other, so that dumps into one file do not interleave (one that cannot
    take the signal writes none: after 10 s the next one's turn comes)."""
    for pid, path in ranks:
        with path.open("a") as f:  # (made here if the rank has not made it yet)
            f.write(f"--- the stacks of pid {pid} ---\n")
        before = path.read_text().count(ONE_PER_DUMP)
        os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while path.read_text().count(ONE_PER_DUMP) == before and time.monotonic() < deadline:
            time.sleep(0.1)


ONE_PER_DUMP = "Current thread 0x"  # once in each faulthandler dump of all threads


class Then(NamedTuple):
    """A Job's later run: SCRIPT's arguments, its log, the variables it changes (a process
    group on a port of its own is the Job's doing), and what its rank 0 runs before it (a
    module-level function, taken to the fork by pickle), or None."""

    argv: list[str]
    log: Path
    env: dict[str, str]
    before: Callable[[], None] | None = None


class Job:
    """`torchrun --standalone --nproc_per_node=NPROC SCRIPT ARGV` in `cwd`, as its ranks see
    it, for checks of what the script does rather than of torchrun: each rank forked from the
    fork server (start_world's), with the variables a launcher sets (RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), `env` and conftest.child_env's
    (one thread, CPU only), running SCRIPT as `python SCRIPT ARGV` runs it. Their output, line
    by line, in `log`. As torchrun's agent does, the first rank to fail stops the others; the
    job's returncode is that rank's exit status, else 0. A Popen's poll, wait and returncode,
    so a test can wait for one job's line while another runs.

    How the others stop: SIGKILL at once; with `stop_grace_s`, as torchrun's agent stops them
    (SIGTERM, then SIGKILL to any still running `stop_grace_s` later; torchrun waits 30 s), with
    TORCHELASTIC_RUN_ID set as torchrun sets it: a rank of a hang's test leaves its Flight
    Recorder dump on SIGTERM (mingpt.forensics.arm), as it does under torchrun.

    `then`: later runs of SCRIPT in the same processes, one after the other, each in its own
    log (Then), as a warm world's ranks run case after case: the imports, DTensor's sharding
    decisions and dynamo's graphs of the run before are kept. A run that fails ends its rank."""

    def __init__(self, cwd: Path, script: str, argv: list[str], nproc: int, log: Path,
                 compile_backend: str | None = None, stop_grace_s: float | None = None,
                 then: tuple[Then, ...] = (), **env: str) -> None:
        self.log, self.returncode, self.stop_grace_s = log, None, stop_grace_s
        self.logs = [log, *(run.log for run in then)]
        if stop_grace_s is not None:
            env = {"TORCHELASTIC_RUN_ID": f"job-{os.getpid()}-{log.stem}", **env}
        environ = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                            WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), **env)
        # Each later run makes its process group anew: on a port of its own.
        later = [run._replace(env={**run.env, "MASTER_PORT": str(free_port())}) for run in then]
        context = fork_server()
        self.ranks = [context.Process(target=_job_rank, daemon=False,
                                      args=(rank, environ, str(cwd), script, argv, str(log),
                                            None, compile_backend, later))
                      for rank in range(nproc)]
        for path in self.logs:
            path.touch()
        for rank in self.ranks:
            rank.start()

    def current_log(self) -> Path:
        """The log of the run the ranks are in: the last one written to."""
        return next((path for path in reversed(self.logs) if path.stat().st_size), self.log)

    def poll(self) -> int | None:
        if self.returncode is None:
            codes = [rank.exitcode for rank in self.ranks]
            failed = [code for code in codes if code not in (None, 0)]
            if failed:
                self.stop()  # torchrun's agent: one failed worker ends the job
                self.returncode = failed[0]
            elif None not in codes:
                self.returncode = 0
        return self.returncode

    def wait(self, timeout: float, quiet_s: float | None = None) -> int:
        """The job's returncode once it ended; TimeoutExpired past `timeout`. With `quiet_s`:
        once the log has not grown for that long, the live ranks' stacks written into it
        (once; the wait goes on)."""
        deadline = time.monotonic() + timeout
        size, since = -1, time.monotonic()
        while self.poll() is None:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise subprocess.TimeoutExpired(self.log.name, timeout)
            if quiet_s is not None:  # the logs' size, looked at every second
                grown = sum(path.stat().st_size for path in self.logs)
                if grown != size:
                    size, since = grown, now
                elif now - since >= quiet_s:
                    log = self.current_log()
                    with log.open("a") as f:
                        f.write(f"--- the log was quiet for {quiet_s:g} s ---\n")
                    dump_stacks([(rank.pid, log) for rank in self.ranks if rank.is_alive()])
                    quiet_s = None
                left = min(left, 1.0)
            multiprocessing.connection.wait([r.sentinel for r in self.ranks if r.is_alive()],
                                            timeout=left)
        return self.returncode

    def stop(self) -> None:
        """Every rank still running stopped, as the job's first failure stops them (above)."""
        if self.stop_grace_s is not None:
            for rank in self.ranks:
                if rank.is_alive():
                    rank.terminate()
            deadline = time.monotonic() + self.stop_grace_s
            for rank in self.ranks:
                rank.join(max(0.0, deadline - time.monotonic()))
        for rank in self.ranks:
            rank.kill()
            rank.join()

    def kill(self) -> None:
        for rank in self.ranks:
            rank.kill()
        self.wait(60)

    def finish(self, timeout: float = 240, quiet_s: float | None = None) -> str:
        """Its log (its runs' logs, one after the other) once every rank has ended; a job
        past `timeout` (under pytest's 300 s, so that this report is the one seen) or still
        running at pytest's own timeout is killed and fails the test, with the current log's
        tail and every live rank's Python stacks (each rank's faulthandler, on SIGUSR1: see
        _job_rank). With `quiet_s`, a job whose logs have not grown for that long has its live
        ranks' stacks written into the current log once and goes on: a stall that ends before
        the timeout still names where it waited."""
        try:
            self.wait(timeout, quiet_s)
        except (subprocess.TimeoutExpired, pytest.fail.Exception) as e:
            log = self.current_log()
            dump_stacks([(rank.pid, log) for rank in self.ranks if rank.is_alive()])
            self.kill()
            said = (f"the job ran past {timeout} s" if isinstance(e, subprocess.TimeoutExpired)
                    else str(e).rstrip("."))
            pids = ", ".join(f"rank {r} {rank.pid}" for r, rank in enumerate(self.ranks))
            pytest.fail(f"{log.name}: {said} (pids: {pids}):\n{log.read_text()[-12000:]}")
        return "".join(path.read_text() for path in self.logs)


def ended_job(cwd: Path, script: str, argv: list[str], nproc: int, log: Path,
              timeout: float = 240, quiet_s: float | None = None,
              **kwargs) -> tuple[int, str, float]:
    """A Job (its keywords and `env` in kwargs) run to its end (Job.finish: a job past
    `timeout` fails the test; `quiet_s`, its probe): its exit status, its log, and when it
    ended."""
    job = Job(cwd, script, argv, nproc, log, **kwargs)
    out = job.finish(timeout, quiet_s)
    return job.returncode, out, time.time()


def main_job(cwd: Path, nproc: int, *args: str, timeout: float = 240,
             **kwargs) -> tuple[int, str, float]:
    """`torchrun --standalone --nproc_per_node=NPROC main.py ARGS` in `cwd` as a Job, for a
    run whose claim is the run's, not torchrun's: ended_job's outcome, the log in
    <run_name>.log beside main.py."""
    name = next(a.split("=", 1)[1] for a in args if a.startswith("run_name="))
    return ended_job(cwd, "main.py", list(args), nproc, cwd / f"{name}.log", timeout, **kwargs)


def run_job(cwd: Path, nproc: int, *args: str, timeout: float = 240, **env: str) -> str:
    """main_job's run, which must succeed: its log (stdout and stderr); a failure fails the
    test."""
    code, out, _ = main_job(cwd, nproc, *args, timeout=timeout, **env)
    assert code == 0, out[-4000:]
    return out


class Peer:
    """A forked rank with a Popen's wait(timeout) (TimeoutExpired past it) and returncode."""

    def __init__(self, process: multiprocessing.Process) -> None:
        self.process = process

    def wait(self, timeout: float) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired("the peer", timeout)
        return self.process.exitcode

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode


@contextlib.contextmanager
def forked_peer(cwd: Path, script: str, argv: list[str], env: dict[str, str]) -> Iterator[Peer]:
    """step_helpers.peer_process's other rank (`python SCRIPT ARGV` in `cwd`, `env` its
    launcher's variables), forked from the fork server as a Job's rank is, not a fresh
    interpreter: its imports are the server's (about 2.5 s of CPU less a launch). Its output
    in cwd/peer.out and peer.err; killed if it still runs when the block ends."""
    out, err = cwd / "peer.out", cwd / "peer.err"
    out.write_text("")
    err.write_text("")
    process = fork_server().Process(
        target=_job_rank, args=(None, child_env(**env), str(cwd), script, argv, str(out),
                                str(err)))
    process.start()
    try:
        yield Peer(process)
    finally:
        if process.is_alive():
            process.kill()
        process.join()


# The graphs compile_with's backend has compiled in this process: a compiled run that
# compiled none would prove nothing.
COMPILED_GRAPHS = [0]


def compile_with(backend: str) -> None:
    """Every nn.Module.compile of this process (a warm world's or a job's rank; each of
    main.py's layouts compiles through it) with torch.compile's `backend`, counted in
    COMPILED_GRAPHS. The feature matrix's compiled runs use aot_eager: dynamo and AOTAutograd
    trace as under inductor (what meets FSDP's hooks, DTensors, checkpointing, autocast), and
    the graphs run as traced, without inductor's C++ kernels (its five runs took 3.5 minutes of
    g++ on 2 cores with a cold cache, and passed); inductor against eager:
    test_mingpt_train.py."""
    compiler = torch._dynamo.lookup_backend(backend)

    def counted(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        COMPILED_GRAPHS[0] += 1
        return compiler(graph, example_inputs)

    torch.nn.Module.compile = functools.partialmethod(torch.nn.Module.compile,
                                                      backend=counted)


def graphs_compiled(log: str) -> list[int]:
    """Each rank's count of compiled graphs in a Job's log: _job_rank's last line, under
    `compile_backend`."""
    return [int(n) for n in re.findall(r"^compile_with: (\d+) graphs compiled$", log, re.M)]


@contextlib.contextmanager
def recorded_warnings() -> Iterator[list[str]]:
    """Every warning raised inside, each one (not once per place): the list it yields holds
    them on exit, "Category: message" (300 characters at most), sorted, each once."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        yield found
    found[:] = sorted({f"{w.category.__name__}: {w.message}"[:300] for w in warned})


def _job_rank(rank: int | None, environ: dict, cwd: str, script: str, argv: list[str],
              log: str, err: str | None = None, compile_backend: str | None = None,
              later: list[Then] = ()) -> None:
    """One rank of a Job: `python SCRIPT ARGV` in a fork of the fork server, RANK and
    LOCAL_RANK `rank` (None: environ's, forked_peer's one worker of its node); its stderr in
    `err` where given, else in `log` with its stdout; its compiles with `compile_backend`
    where given (compile_with; each run's count, its log's last line). Then each of `later`'s
    runs (Job's `then`) in this process."""
    _adopt(environ)
    if rank is not None:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    # What the server read at its start, read again from this rank's environment: the thread
    # count, and TORCH_DISTRIBUTED_DEBUG (which `import torch.distributed` reads).
    torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    dist.set_debug_level_from_env()
    os.chdir(cwd)
    sys.path.insert(0, cwd)  # as `python SCRIPT` puts the script's folder first
    # The folder's own modules, as a fresh interpreter imports them, whatever the server
    # holds (the dry run has it preload mingpt.dry_run, which it finds when it was started in
    # a folder that has mingpt: not the tests', but the purge does not rely on that).
    for name in [name for name in sys.modules if is_mingpt_module(name)]:
        del sys.modules[name]
    if compile_backend:
        compile_with(compile_backend)
    stage_in_forks()
    _output_to(log, err)
    # Line by line, as PYTHONUNBUFFERED gives a launched rank: tests wait for a line.
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    # A stuck job's ranks say where they are (Job.dump_stacks); the series uses no SIGUSR1.
    # It writes to fd 2, whichever log that is by then.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    for n, run in enumerate([Then(argv, log, {}), *later]):
        if run.before is not None and os.environ["RANK"] == "0":
            run.before()
        os.environ.update(run.env)
        if n:  # the first run's output is set above
            _output_to(run.log, None)
        sys.argv = [script, *run.argv]
        before_run = COMPILED_GRAPHS[0]
        # An absolute __file__, as Python gives `python SCRIPT`: a process it spawns (DCP's
        # staging process) imports the script again from there.
        try:
            runpy.run_path(os.path.join(cwd, script), run_name="__main__")
        finally:
            if compile_backend:
                print(f"compile_with: {COMPILED_GRAPHS[0] - before_run} graphs compiled",
                      flush=True)


def _output_to(log: str | Path, err: str | None) -> None:
    """This process's stdout into `log` (appended), its stderr into `err`, else `log` too."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    for fd, path in ((1, log), (2, err or log)):
        opened = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(opened, fd)
        os.close(opened)


class _ForkedStaging:
    """What DCP's process-based async_save takes from torch.multiprocessing: get_context("spawn"),
    and of that context Pipe and Process; Process forked from the fork server (stage_in_forks)."""

    def get_context(self, method: str) -> "_ForkedStaging":
        assert method == "spawn", method  # the only one DCP asks for
        return self

    def Pipe(self, *args, **kwargs):  # noqa: N802 (multiprocessing's name)
        return multiprocessing.get_context("forkserver").Pipe(*args, **kwargs)

    def Process(self, target: Callable, args: tuple = (), **kwargs):  # noqa: N802
        # Where this rank's output goes (a Job's log; a warm world's, the server's): a spawned
        # process writes to its parent's; the fork server's fork, to the server's otherwise.
        out = [os.readlink(f"/proc/self/fd/{fd}") for fd in (1, 2)]
        return multiprocessing.get_context("forkserver").Process(
            target=_as_spawned, args=(environment(), out, target, *args), **kwargs)


def environment() -> dict[str, str]:
    """os.environ, copied in one step. DCP builds its staging process on a thread of its own,
    while the rank's main thread may be putting savers.staging_store's variables back:
    dict(os.environ) reads it key by key, and a key removed in between raised KeyError there
    (DCP's staging process was never started, its peers' waited for it, and the replica groups'
    matrix failed once in a run of the whole suite). Copying the dict that os.environ keeps is
    one operation under the GIL, as a spawned process takes the environment in one piece."""
    data = dict(os.environ._data)  # noqa: SLF001 (the mapping's own store: see above)
    return {os.fsdecode(key): os.fsdecode(value) for key, value in data.items()}


def _as_spawned(environ: dict, out: list[str], target: Callable, *args: object) -> None:
    """A staging process, forked from the fork server: the environment and output its rank
    would have given a spawned one (S3's credentials, DCP's store variables), then DCP's own
    function. Its rank's main.py has been run again as __mp_main__, as under spawn (the
    folder's mingpt modules where the server holds none: _job_rank's purge comes later; a
    server that the dry run started holds the repository's, the same code)."""
    _adopt(environ)
    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", "1")))
    for fd, path in zip((1, 2), out, strict=True):
        if os.path.isfile(path):
            os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    target(*args)


def stage_in_forks() -> None:
    """DCP's async_save (trainer_config.async_save) writes from a staging process per rank,
    which torch starts with multiprocessing's spawn (hard-coded): a fresh interpreter that
    imports torch, DCP and the rank's main.py again, 3 s of CPU each (the replica groups'
    matrix started 24 of them: a third of its CPU, py-spy). In a forked rank (a warm world's,
    a Job's) it is forked from the fork server instead, and runs DCP's own function in the
    rank's environment. A spawned one: test_mingpt_snapshot_faults.py's crash mid-write, a
    torchrun job restarted from its asynchronous snapshot."""
    import torch.distributed.checkpoint._async_process_executor as executor  # noqa: PLC0415

    executor.mp = _ForkedStaging()
    # This rank's fork server is the one that forked it: a fork knows its address, not that it
    # runs (it is not the fork's child), and would start a server of its own (multiprocessing's
    # ensure_running). It runs as long as the test worker that started it.
    server = multiprocessing.forkserver._forkserver
    assert server._forkserver_address is not None, "not a fork of the fork server"
    server.ensure_running = lambda: None


def spawn_world(worker: Callable, world: int, out: Path, *args: object,
                spawn: bool = False) -> list[dict | None]:
    """One warm world: `worker(rank, store, out, text, *args)` in `world` processes
    (start_world), which run every check of a test file (join_world makes the group; `text`
    is 40,000 characters of the usual text: fast to read, the same vocabulary). Each rank's
    out/rank{r}.json where it wrote one, else None."""
    text = out / "input.txt"
    text.write_text((REPO / "05_mingpt/data/input.txt").read_text()[:40_000])
    start_world(worker, world, str(out / "store"), str(out), str(text), *args, spawn=spawn)
    files = [out / f"rank{rank}.json" for rank in range(world)]
    return [json.loads(f.read_text()) if f.is_file() else None for f in files]


def join_world(rank: int, store: str, world: int) -> None:
    """A spawned rank's gloo group over the file `store`; one thread, as the processes share
    the cores."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))


def retrace(run_dir: Path, text: Path, max_steps: int, *overrides: str) -> list[str]:
    """tiny(*overrides) for a run compared step by step with another layout's: its folder,
    text and length, its snapshot in run_dir, no dropout (ranks that split a head or a
    sequence draw other masks than one process), a constant lr after the warmup (a run of
    half the steps is exactly the first half of the longer one), a loss logged at every step,
    no snapshot before the end and no sample."""
    return tiny(*overrides, f"run_dir={run_dir}", f"data_config.path={text}",
                f"trainer_config.max_steps={max_steps}",
                f"trainer_config.snapshot_path={run_dir}/snapshot",
                "gpt_config.dropout=0.0", "trainer_config.min_lr_ratio=1.0",
                "trainer_config.log_every=1", "trainer_config.save_every=0",
                "trainer_config.eval_batches=2", "trainer_config.sample_tokens=0")


def overridden(config, cfg, overrides: list[str]):
    """A copy of `cfg` (config.load's, `config`: mingpt/config.py) with `overrides` put in and
    checked by validate, as config.load(its overrides + these) makes it where the overrides
    set keys only (no config group): hydra's composition, the slow part, is not redone."""
    cfg = cfg.copy()
    for arg in overrides:
        key, value = arg.split("=", 1)
        OmegaConf.update(cfg, key, yaml.safe_load(value) if key != "run_dir" else value)
    config.validate(cfg)
    return cfg


def assert_refused(config, overrides: list[str], message: str) -> None:
    """`config.load(overrides)` (config: mingpt/config.py, imported) refuses them with a
    ValueError whose text is `message` to the letter: what main.py prints after `error: `."""
    with pytest.raises(ValueError) as e:
        config.load(overrides)
    # Both texts in the failure: pytest rewrites the asserts of test files, not this one's.
    assert str(e.value) == message, (str(e.value), message)


def val_losses(stdout: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step (\d+) \| val loss ([0-9.]+)$",
                                                    stdout, re.M)}


def train_losses(stdout: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step (\d+)/\d+ \| loss ([0-9.]+)",
                                                    stdout, re.M)}


def assert_learned(stdout: str, margin: float = 0.3) -> float:
    """Validation loss fell from its start (about ln 65 = 4.17) by at least `margin`."""
    val = val_losses(stdout)
    assert 0 in val and len(val) >= 2, stdout[-2000:]
    assert abs(val[0] - 4.17) < 0.1, val  # an untrained model guesses uniformly
    final = val[max(val)]
    assert final < val[0] - margin, val
    return final


# --- Numerical tolerances ------------------------------------------------------------------
# Two computations agree bit for bit only where they do the same arithmetic in the same order
# (a resume, zero and DDP). Elsewhere (another strategy, formulation or CPU) the tests bound the
# difference by what fp32 rounding can do, derived at each check, not tuned on one machine:
# PyTorch picks its CPU kernels by instruction set (ATEN_CPU_CAPABILITY; oneDNN and MKL choose
# their own), so the same sums are added in other orders on other CPUs.
U = 2.0**-24  # fp32's unit roundoff: one rounding changes a value by at most U of its size
LOG_UNIT = 1e-4  # the trainer logs losses with 4 decimals


def other_cpu_kernels() -> dict[str, str]:
    """The kernels of a CPU one instruction set below this one, for the checks that guard the
    tolerances: the environment for a fresh process (each library reads its variable as it
    loads). An AVX-512 machine gets an AVX2 CPU's (ATen's, oneDNN's and MKL's AVX2 kernels:
    where a bound tuned on AVX-512 failed), any other the most basic ones (ATen's scalar
    kernels, oneDNN's SSE4.1 ones, MKL's compatible code path). ATEN_CPU_CAPABILITY names
    the one torch.backends.cpu.get_cpu_capability() then reports, in lower case."""
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        return {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    return {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
            "MKL_CBWR": "COMPATIBLE"}


def log_units(a: float, b: float) -> int:
    """How many units of the log's last (4th) decimal two logged losses differ by. (A parsed
    value is no exact multiple of 1e-4: 3.6472 - 3.6471 = 1.0000000000000009e-4, so a check
    `<= 1e-4` fails about one difference of one unit in three.)"""
    return round(abs(a - b) / LOG_UNIT)


def assert_same_curve(lines: list[str], golden: list[str]) -> None:
    """The logged loss lines are the golden ones, each loss within one unit of the 4th decimal.
    The losses are deterministic on one CPU, but other CPUs' kernels add in other orders and
    move a loss of ~4 by a few ulps (U * 4 = 2.4e-7 each; measured at most 9.5e-7 across
    ATEN_CPU_CAPABILITY=default, avx2 and avx512 and MKL's code paths): a logged value then
    changes only where it lies within ~1e-6 of a rounding boundary, and by one unit. (The
    recorded step 9, 3.6318510, lies 9.6e-7 from one.) What the trainer computes differently
    (data, dropout masks, the lr schedule, the model) moves the losses by far more."""
    loss = re.compile(r"(?<=loss )[0-9.]+")
    assert [loss.sub("#", line) for line in lines] == [loss.sub("#", line) for line in golden], \
        lines  # the same steps and lr
    for line, recorded in zip(lines, golden, strict=True):
        assert log_units(float(loss.search(line)[0]),
                         float(loss.search(recorded)[0])) <= 1, (line, recorded)


def assert_close_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: float,
                      msg: str | None = None) -> None:
    """Every entry within `ulps` roundings (U) of `expected`'s largest magnitude: the bound for
    the same values computed with their sums in another order. That error scales with the
    terms summed, so with the tensor's size, not with each entry (an entry that cancels to
    ~0 keeps the absolute error of its terms): a relative bound per entry would be wrong."""
    torch.testing.assert_close(actual, expected, rtol=0,
                               atol=ulps * U * expected.abs().max().item(), msg=msg)


def weights_apart(weights: dict, reference: dict, bound: float) -> tuple[float, int]:
    """The largest |weight - reference| over every weight, and how many exceed `bound`."""
    diffs = torch.cat([(weights[k] - reference[k]).abs().flatten() for k in reference])
    return diffs.max().item(), int((diffs > bound).sum())


def snapshot_weights(run_dir: Path) -> dict:
    """A run's final snapshot's weights (run_dir/snapshot), whole: weights_at's."""
    return weights_at(str(run_dir / "snapshot"))


def weights_at(url: str) -> dict:
    """The weights of the snapshot at `url` (a path or an fsspec URL such as s3://), whole:
    sample.py's reader, which takes any layout's snapshot (and an older one file) alike."""
    with mingpt_imported() as m:
        return m["sample"].load_model(url, torch.device("cpu"))[0].state_dict()


def exported_weights(pretrained, folder: Path, block_size: int) -> dict:
    """export_hf.py's model.safetensors in `folder`, mapped back by `pretrained` (05's
    pretrained module, imported) to our names; the head, tied to wte and so not in the file
    (as in GPT-2's own files: asserted), is wte."""
    from safetensors.torch import load_file  # noqa: PLC0415 (transformers' tests only)
    saved = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in saved  # tied to wte, as GPT-2's own files
    back = pretrained.hf_to_ours(saved, block_size=block_size)
    back["lm_head.weight"] = back["wte.weight"]
    return back


def assert_retraces(out: Path, logs: dict, name: str, reference: str, steps: range, *,
                    loss_units: int, tolerance: float, outliers: int) -> None:
    """Run `name` retraces run `reference` (rank 0's logs in logs[run]["log"], final
    snapshots in out/<run>/snapshot): it logs a loss at exactly `steps`, each within
    `loss_units` of the log's last decimal of the reference's at that step, and its weights
    lie within `tolerance` of the reference's, at most `outliers` of them beyond."""
    losses, ref = train_losses(logs[name]["log"]), train_losses(logs[reference]["log"])
    assert sorted(losses) == list(steps), (name, losses)
    assert all(log_units(losses[s], ref[s]) <= loss_units for s in losses), (name, losses, ref)
    worst, beyond = weights_apart(snapshot_weights(out / name),
                                  snapshot_weights(out / reference), tolerance)
    assert beyond <= outliers, (name, worst, beyond)


def snapshot_at(whole: str, resumed: str, step: int) -> None:
    """A copy of the snapshot at URL `whole` as it stood after `step` (a step directory that
    keep_last kept), to URL `resumed`: its other step directories left out, `latest` naming
    that step. fsspec, so local paths and s3:// alike."""
    copy_step(whole, resumed, *step_files(step))


def step_files(step: int) -> tuple[str, str]:
    """(the name of `step`'s directory, the name of `latest`): mingpt.shards' names."""
    with mingpt_imported() as m:
        return m["shards"].step_dir(step), m["shards"].LATEST


def copy_step(whole: str, resumed: str, name: str, latest: str) -> None:
    """snapshot_at's copy, of step directory `name`, with `latest` (step_files' names) naming
    it; nothing imported, so a Job's rank can run it between its runs (Then.before)."""
    fs, source = fsspec.core.url_to_fs(whole)
    target = fsspec.core.url_to_fs(resumed)[1]
    for path in fs.find(source):
        rest = path[len(source) + 1:]
        if rest.startswith(f"{name}/"):
            fs.makedirs(f"{target}/{rest}".rsplit("/", 1)[0], exist_ok=True)
            fs.copy(path, f"{target}/{rest}")
    fs.pipe_file(f"{target}/{latest}", name.encode())


def read_snapshot(path: Path) -> dict:
    """A snapshot as one dict, in the shape older runs' one file had: its train state, the
    whole weights ("model"), the optimizer's state dict by parameter number ("optimizer"), and
    the replica groups' meetings ("replicas") where it holds them."""
    with mingpt_imported() as m:
        snapshot, shards, storage = m["snapshot"], m["shards"], m["storage"]
        url = str(path)
        kind = snapshot.snapshot_kind(url)
        state = dict(snapshot.load_train_state(url, kind))
        if kind == "file":
            return state
        state["model"], state["optimizer"] = shards.read_whole(
            url, state["model_config"], state.get("optimizer_name", "adamw"))
        if state.pop("replica_state", False):  # DCP keeps them as `replicas.<key>`
            checkpoint = shards.latest_sharded(url)
            saved = storage.reader(checkpoint).read_metadata().state_dict_metadata
            replicas = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
                        for key, entry in saved.items() if key.startswith("replicas.")}
            storage.load_dcp(replicas, checkpoint, no_dist=True)
            state["replicas"] = {k.removeprefix("replicas."): v for k, v in replicas.items()}
        return state


# 05's library modules, by the short names the tests use; scripts (main, launch, ...) and the
# modules below that only some tests need are `extra` names of mingpt_imported.
MINGPT_MODULES = {
    "config": "mingpt.config", "data": "mingpt.data", "char_dataset": "mingpt.data.char",
    "devices": "mingpt.devices", "distributed": "mingpt.distributed",
    "errors": "mingpt.errors", "faults": "mingpt.faults",
    "log": "mingpt.log", "memory": "mingpt.memory", "mfu": "mingpt.mfu",
    "model": "mingpt.model", "muon": "mingpt.muon", "optim": "mingpt.optim",
    "parallel": "mingpt.parallel",
    "wrappers": "mingpt.parallel.wrappers", "grads": "mingpt.parallel.grads",
    "ddp": "mingpt.parallel.ddp", "dataparallel": "mingpt.parallel.dataparallel",
    "fsdp": "mingpt.parallel.fsdp",
    "tensor": "mingpt.parallel.tensor", "strided": "mingpt.parallel.strided",
    "layout": "mingpt.parallel.layout",
    "pipeline": "mingpt.parallel.pipeline", "precision": "mingpt.precision",
    "snapshot": "mingpt.snapshot", "shards": "mingpt.shards",
    "storage": "mingpt.storage", "trainer": "mingpt.trainer",
    "sample": "sample"}
EXTRA_MODULES = {"bpe_dataset": "mingpt.data.bpe", "image_dataset": "mingpt.data.image",
                 "pretrained": "mingpt.pretrained", "dry_run": "mingpt.dry_run",
                 "step_time": "mingpt.step_time"}
SCRIPTS = ("main", "sample", "launch", "prepare", "model_size", "export_hf", "analyze_hang")


def is_mingpt_module(name: str) -> bool:
    """A module of a 05_mingpt folder: the `mingpt` package or one of the scripts."""
    return name == "mingpt" or name.startswith("mingpt.") or name in SCRIPTS


@contextlib.contextmanager
def mingpt_imported(*extra: str):
    """05_mingpt's modules (and the `extra` ones named), imported as its scripts import them.
    Whatever of those names was imported before (another copy's) is put back afterwards."""
    names = {**MINGPT_MODULES, **{name: EXTRA_MODULES.get(name, name) for name in extra}}
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if is_mingpt_module(name)}
    sys.path.insert(0, str(MINGPT))
    try:
        yield {key: importlib.import_module(module) for key, module in names.items()}
    finally:
        sys.path.remove(str(MINGPT))
        for name in [name for name in sys.modules if is_mingpt_module(name)]:
            sys.modules.pop(name)
        sys.modules.update(saved)


def real_step(m: dict, cfg, gpt_config) -> dict:
    """One training step of `cfg`'s layout on this process's group, laid out as main.py lays
    it out and counted by the dry run's own counters (dry_run.measure_step): what the dry run
    of the same config plans, measured. `m`: mingpt_imported(..., "dry_run")."""
    t, o, dry_run = cfg.trainer_config, cfg.optimizer_config, m["dry_run"]
    torch.manual_seed(t.seed)
    model = m["parallel"].parallelize(m["model"].GPT(gpt_config), torch.device("cpu"),
                                      t.distributed_method,
                                      **{key: t[key] for key in m["parallel"].Settings._fields})
    optimizer = m["optim"].build_optimizer(model, t.distributed_method, o.lr, o.betas,
                                           o.weight_decay)
    return dry_run.measure_step(model, optimizer, t, dry_run.batches(t, gpt_config))


def script_in_process(module, cwd: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    """`python main.py ARGV` (or sample.py: `module` is the imported script) in this process:
    `module.main(argv)` through conftest.in_process, in `cwd`, with `env` added."""
    def main() -> None:
        with warnings.catch_warnings():
            # As a fresh interpreter shows them: every warning, on stderr (pytest records them).
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, category, filename, lineno, file=None, \
                line=None: sys.stderr.write(warnings.formatwarning(message, category, filename,
                                                                   lineno, line))
            code = module.main(list(argv))
            if code:  # as `sys.exit(main())` turns a returned status into the exit status
                raise SystemExit(code)

    return in_process(main, [module.__name__, *argv], cwd, **env)
