"""Shared test helpers: every test launches the series' own commands as a user would.

Everything runs on CPU with the gloo backend. Child processes get one intra-op thread each:
the CI machine has two cores and the tests start several processes at once.
"""
import contextlib
import gc
import io
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import cpu_time
import pcluster_venv

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# torchrun installed next to the interpreter running the tests (the venv's own).
TORCHRUN = str(Path(PYTHON).with_name("torchrun"))
TEARDOWN_ABORT = "terminate called without an active exception"
# Runs a training script and prints, per rank, the gloo threads still alive as Python exits
# (tests/test_teardown.py). Launches that other tests make anyway go through it: the check
# costs no launch of its own.
TEARDOWN_PROBE = str(REPO / "tests/teardown_probe.py")


# Where the background install of slurm-wlm and munge (below) reports its exit status.
SLURM_INSTALL_VARIABLE = "DDP_SERIES_SLURM_INSTALL"


def pytest_configure(config: pytest.Config) -> None:
    """Start the installs some test files need, in the background, in the main pytest process
    only (not in xdist's workers): they then overlap other tests instead of holding up the
    worker that reaches the file."""
    _cpu["wanted"] = config.getoption("cpu_time")
    if hasattr(config, "workerinput"):
        return
    paths = [Path(a.split("::")[0]).resolve() for a in config.args] or [REPO / "tests"]

    def runs(name: str) -> bool:
        test = REPO / "tests" / name
        return any(p == test or p in test.parents for p in paths)

    if runs("test_slurm.py"):
        _start_slurm_install()
    if runs("test_cluster.py") and pcluster_venv.missing():
        # aws-parallelcluster's venv (pcluster_venv.py): 85 s with nothing in pip's cache,
        # 25 s of it the install's CPU, the rest the download. Never killed: a build cut
        # short is never used (it is renamed into place when complete), and its file lock
        # makes the fixture wait for it.
        subprocess.Popen([sys.executable, str(REPO / "tests/pcluster_venv.py")],
                         start_new_session=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)


def _start_slurm_install() -> None:
    """Start installing slurm-wlm and munge now, in the background: apt-get's half minute then
    overlaps other tests instead of holding up the one worker that runs tests/test_slurm.py
    (its cluster fixture waits for the result). Once (xdist's workers inherit the variable
    that names the result), and only where local_cluster.sh would install them: as root, with
    apt-get, tools missing."""
    if os.environ.get(SLURM_INSTALL_VARIABLE):
        return
    sbin = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    if os.geteuid() != 0 or not shutil.which("apt-get") or all(
            shutil.which(tool, path=sbin) for tool in ("munged", "slurmctld", "slurmd", "sbatch")):
        return
    state = tempfile.mkdtemp(prefix="ddp-series-slurm-install-")
    os.environ[SLURM_INSTALL_VARIABLE] = state
    # Never killed: an apt-get stopped halfway leaves dpkg for the next one to repair.
    subprocess.Popen(["bash", "-c", 'bash "$1" install; echo $? > "$2/exit"', "install",
                      str(REPO / "slurm_scripts/local_cluster.sh"), state],
                     env={**os.environ, "SLURM_LOCAL_DIR": state}, start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# Each test file's budget: seconds of test time (its tests' setup, call and teardown, summed),
# about 1.25 x what it took in a full run on the 2-core EPYC (tests/README.md: How long), and
# the order the files are handed out in, longest first, each file whole to one worker
# (pytest-xdist --dist loadfile --no-loadscope-reorder, pyproject.toml; xdist's own order is by
# number of tests, and put two 20-second files last on one worker while the other idled for
# 40 s). test_xla.py leads: its first run builds .venv-xla besides (README). The Slurm tests
# come late enough for the background install to have finished. The end of every run prints
# each file's time beside its budget (pytest_terminal_summary): a report, not a failure.
BUDGETS = {
    # 68 s with .venv-xla built (132 s before its resumed run joined the probe's process,
    # 7c72718); a fresh clone's run builds the venv first (2 min with pip's cache warm)
    "test_xla.py": 230,
    "test_notebooks.py": 215,
    "test_feature_matrix.py": 190,  # 143 s alone with compile's runs (74 s before them)
    "test_mingpt_bench.py": 195,
    "test_mingpt_train.py": 150,
    "test_mingpt_hang.py": 140,  # 233 s under torchrun; 105 to 112 s as forked jobs (Xeon)
    "test_mingpt_snapshot_faults.py": 70,  # 96 s; 52 s with two runs as forked jobs (Xeon)
    # 212 s at bc26469 (the matrix's 15 runs: 89 s of it); 175 s (Xeon) with the 4 runs that
    # hold every feature (fb77d84)
    "test_mingpt_dry_run.py": 210,
    # 209 s at 03fcdd6; 150 to 171 s (Xeon) once its staging processes were forked (afba9a8);
    # 137 s with a group's halves in one job (0de1142)
    "test_feature_matrix_groups.py": 175,
    "test_mingpt_diloco.py": 50,  # 37 s at 03fcdd6 (its kill case: the groups' file)
    # 68 s (Xeon) once 05's try was test_mingpt_train.py's (a031807); one try of 03 since
    "test_restarts.py": 50,
    "test_steps.py": 90,
    "test_mingpt_torchft.py": 80,
    "test_cluster.py": 80,  # pip's cache cold: its venv's install; about 1 s once it exists
    "test_crash_storm.py": 55,  # 35 to 42 s (Xeon) with 03's peer-death check alone (58 s before)
    "test_teardown.py": 55,  # 44 to 46 s (Xeon) with probe and shim in one launch (68 s before)
    "test_mingpt_muon.py": 70,
    "test_mingpt_layouts.py": 60,
    "test_mingpt_pretrained.py": 55,
    "test_mingpt_experts.py": 50,
    "test_mingpt_export.py": 50,
    "test_mingpt_strategies.py": 50,
    "test_mingpt_memory.py": 45,
    "test_mingpt_errors.py": 45,
    "test_slurm.py": 40,  # most of it waiting for the daemons and the job
    "test_elastic.py": 35,
    "test_mingpt_s3.py": 35,
    "test_mingpt_context.py": 35,
    "test_vscode.py": 30,
    "test_bad_input.py": 30,
    "test_mingpt_model_options.py": 30,
    "test_torchrun_logs.py": 25,
    "test_mingpt_image.py": 25,
    "test_mingpt_snapshot_memory.py": 25,
    "test_mingpt_pipeline.py": 20,  # fsdp_pp: test_mingpt_layouts.py's world
}
DEFAULT_BUDGET = 10  # every other file
# The whole suite's aim: 10 minutes on 2 cores, so about 1,200 s of test time in all.
AIM_S = 1200


# Test files that break things on purpose (bad input, kills, lost nodes, faults, teardown
# races) or stand up a cluster or a server: every test in them gets the `robustness` marker,
# so `python -m pytest -m "not robustness"` runs the usage tests alone. tests/README.md groups
# the files the same way (tests/test_docs.py checks that the two agree).
ROBUSTNESS_FILES = (
    "test_bad_input.py",
    "test_crash_storm.py",
    "test_elastic.py",
    "test_error_lines.py",
    "test_mingpt_errors.py",
    "test_mingpt_hang.py",
    "test_mingpt_s3.py",
    "test_mingpt_snapshot_faults.py",
    "test_mingpt_torchft.py",
    "test_mingpt_diloco.py",
    "test_restarts.py",
    "test_slurm.py",
    "test_teardown.py",
)


# The learner's quick check, `python -m pytest -m quick` (about 2 minutes on 2 cores): every
# test of QUICK_FILES (each module's own behaviour, in this process or one small world) and
# the QUICK_TESTS that run the README's first commands (step 01, step 02's spawn, 05's
# `python main.py` then `sample.py`). Every layout, launch and fault stays in the full run.
QUICK_FILES = (
    "test_docs.py",
    "test_mingpt_docs.py",
    "test_mingpt_units.py",
    "test_mingpt_model.py",
    "test_mingpt_parallel.py",
    "test_mingpt_bpe.py",
    "test_mingpt_image.py",
    "test_mingpt_sample.py",
    "test_mingpt_step_time.py",
    "test_mingpt_strategy_mix.py",
    "test_cluster.py",
    "test_container.py",
    "test_gpu.py",  # skipped without CUDA; on a GPU machine, its own quick check
)
QUICK_TESTS = (
    "test_step01_default_command_learns",
    "test_step02_spawn_learns_and_rank0_alone_logs_and_saves",
    "test_python_main_py_then_sample_py",
)


# tryfirst: the marker must be on the items before pytest's own hook deselects by `-m`.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (BUDGETS), the rest as collected; each file's tests in order.
    Every test of a file in ROBUSTNESS_FILES is marked `robustness`, and so is every test
    named *_slowest elsewhere (kill-and-resume runs, a minute of launches each): the usage
    run stays short, and the full run (CI's) still has them. QUICK_FILES' tests and
    QUICK_TESTS are marked `quick`: the learner's quick check."""
    for item in items:
        if item.path.name in ROBUSTNESS_FILES or item.originalname.endswith("_slowest"):
            item.add_marker(pytest.mark.robustness)
        elif item.path.name in QUICK_FILES or item.originalname in QUICK_TESTS:
            item.add_marker(pytest.mark.quick)

    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return list(BUDGETS).index(name) if name in BUDGETS else len(BUDGETS)

    items.sort(key=rank)  # stable: the order within each file and among the rest is kept


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-time", action="store_true",
                     help="each file's CPU seconds beside its time: every process its tests ran "
                          "or started, counted by a cgroup per pytest worker (cpu_time.py; "
                          "needs root)")


# With --cpu-time: this process's cgroup (made at its first test) and its CPU at the end of
# the last test phase reported.
_cpu: dict[str, object] = {}


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    if _cpu.get("wanted") and "group" not in _cpu:  # a process that runs tests: xdist's
        _cpu["group"] = cpu_time.start(f"pytest-{os.getpid()}")  # workers, or pytest -n 0
    group = _cpu.get("group")
    if group is not None:
        _cpu["mark"] = group.seconds()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _cpu.get("group") is not None:
        _cpu["group"].leave()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """With --cpu-time, each phase's report (setup, call, teardown) carries its CPU seconds,
    which xdist hands the main process with the report (user_properties)."""
    outcome = yield
    group = _cpu.get("group")
    if group is not None:
        now = group.seconds()
        outcome.get_result().user_properties.append(("cpu_s", now - _cpu["mark"]))
        _cpu["mark"] = now


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Each file's test time (setup, call and teardown of its tests, summed; under xdist the
    files overlap in wall time) beside its budget (BUDGETS), longest first: growth shows the
    day it happens, as a report, not as a test that fails on a loaded machine. With
    --cpu-time, its CPU too: what the 10 minutes on 2 cores are spent on (cpu_time.py)."""
    seconds: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                name = Path(report.nodeid.split("::")[0]).name
                seconds[name] = seconds.get(name, 0.0) + report.duration
                for key, value in report.user_properties:
                    if key == "cpu_s":
                        cpu[name] = cpu.get(name, 0.0) + value
    if not seconds:
        return
    terminalreporter.section("time per test file (budget: tests/conftest.py BUDGETS)")
    for name, spent in sorted(seconds.items(), key=lambda item: -item[1]):
        budget = BUDGETS.get(name, DEFAULT_BUDGET)
        over = "  OVER" if spent > budget else ""
        used = f"  {cpu.get(name, 0.0):7.1f} s CPU" if cpu else ""
        terminalreporter.write_line(f"{spent:7.1f} s  (budget {budget:4d} s){used}  {name}{over}")
    terminalreporter.write_line(f"{sum(seconds.values()):7.1f} s in all, over {len(seconds)} "
                                f"files (the aim: {AIM_S} s, 10 minutes on 2 workers)")
    if cpu:
        terminalreporter.write_line(f"{sum(cpu.values()):7.1f} s of CPU in all (10 minutes on 2 "
                                    f"cores hold {AIM_S})")
    elif config.getoption("cpu_time"):
        terminalreporter.write_line("CPU: not counted (cpu_time.py could not make a cgroup: "
                                    "moving a process into one needs root)")


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a launched command: CPU only, one thread, unbuffered output."""
    env = dict(os.environ)
    env.update(
        CUDA_VISIBLE_DEVICES="",  # prove the CPU path even where a GPU exists
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # A fresh store for each torchrun attempt, as before restarts.py made the shared one
        # safe; the restart tests run without it, as a user does (tests/README.md, Restarts).
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path = REPO, timeout: float = 240, check: bool = True,
        **env: str) -> subprocess.CompletedProcess:
    """Run a command, capture text output; with `check`, fail unless it exited 0, unaborted."""
    proc = subprocess.run(cmd, cwd=cwd, env=child_env(**env), capture_output=True, text=True,
                          timeout=timeout)
    # A gloo thread left running as Python exits aborts the process (tests/test_teardown.py).
    # Never expected, even where torchrun restarted the workers and the launch still exited 0.
    if check and (proc.returncode != 0 or TEARDOWN_ABORT in proc.stderr):
        pytest.fail(f"{cmd} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                    f"\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


def in_process(main: Callable[[], object], args: list[str], cwd: Path, unset: tuple = (),
               **env: str) -> subprocess.CompletedProcess:
    """`main()` as if it were a launched command, without starting an interpreter: in `cwd`,
    with `unset` removed from and `env` added to the environment, one intra-op thread; the exit
    status, stdout and stderr as `run` returns them for `args`. Python prints a SystemExit's
    text on stderr and exits 1: so does this. Everything is put back afterwards.

    For runs that stop at an error or train a few steps: a launch costs seconds of imports,
    this costs none. What only a real process shows (its exit, a kill, torchrun) stays end to
    end."""
    out, err = io.StringIO(), io.StringIO()
    old_cwd, old_env, old_threads = os.getcwd(), dict(os.environ), torch.get_num_threads()
    for name in unset:
        os.environ.pop(name, None)
    os.environ.update(env)
    os.chdir(cwd)
    # One thread, as child_env gives a launched command: beside the other test worker, a
    # second one only spins (OpenMP waits busily) and costs more CPU than it saves.
    torch.set_num_threads(1)
    # The test process's heap (torch, transformers, pytest, every test module: a million
    # objects) kept out of the run's garbage collections, as a launched process has none of
    # it: distributed.release's gc.collect and gc.get_objects then see what the run made.
    gc.freeze()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as e:  # as the interpreter turns it into an exit status
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        gc.unfreeze()
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)
        torch.set_num_threads(old_threads)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


# The tests' ports (MASTER_PORT, rendezvous endpoints, servers) lie below the kernel's
# ephemeral range, from which every outgoing connection on the machine (each gloo pair, store
# client, RPC) takes its local port: a port picked by binding to 0 came from that range, and
# between the pick and the rank that listened there another connection once took it ("EADDRINUSE:
# address already in use" at a restarted DiLoCo group's start, in a whole run). Each xdist
# worker picks from a band of its own, so two workers never hand out the same port.
LOWEST_PORT = 10000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's ephemeral range (Linux's default where /proc does not say)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def port_band() -> range:
    """This pytest process's ports: its xdist worker's share of LOWEST_PORT up to the
    ephemeral range (the whole of it without xdist). Where that range starts lower (a machine
    that made nearly every port ephemeral), the share of LOWEST_PORT up to 65535: the workers
    still never pick the same port."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    top = ephemeral_ports()[0]
    if top - LOWEST_PORT < 1000 * workers:
        top = 65536
    size = (top - LOWEST_PORT) // workers
    return range(LOWEST_PORT + worker * size, LOWEST_PORT + (worker + 1) * size)


def free_port() -> int:
    """A TCP port of this process's band (port_band) free right now on 127.0.0.1."""
    band = port_band()
    tries = min(200, len(band))
    for port in random.sample(band, tries):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # listened on, or held by a closed connection (TIME_WAIT)
                continue
            return port
    pytest.fail(f"no free port among {tries} of {band}")


def gloo_threads_at_exit(stdout: str) -> list[str]:
    """What tests/teardown_probe.py printed: one count per rank, each must be "0"."""
    return re.findall(r"gloo threads at exit: (\d+)", stdout)


@pytest.fixture(scope="module")
def mingpt_modules():
    """05_mingpt's modules with main.py, as its scripts import them, for one test file
    (mingpt_helpers.mingpt_imported: removed from sys.modules again afterwards)."""
    from mingpt_helpers import mingpt_imported  # here: mingpt_helpers imports this module

    with mingpt_imported("main") as modules:
        yield modules


@pytest.fixture(scope="session")
def late_worker_shim(tmp_path_factory):
    """tests/late_gloo_worker.c, built: gloo's workers run late (as on a busy machine)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if not sys.platform.startswith("linux") or compiler is None:
        pytest.skip("the late-worker shim needs Linux and a C compiler (cc)")
    shim = tmp_path_factory.mktemp("shim") / "late_gloo_worker.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(shim),
                    str(REPO / "tests/late_gloo_worker.c"), "-ldl"], check=True)
    return shim
