"""Shared test helpers: every test launches the series' own commands as a user would.

Everything runs on CPU with the gloo backend. Child processes get one intra-op thread each:
the CI machine has two cores and the tests start several processes at once.
"""
import contextlib
import io
import os
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
    """Start installing slurm-wlm and munge now, in the background, when the Slurm tests will
    need them: apt-get's half minute then overlaps other tests instead of holding up the one
    worker that runs tests/test_slurm.py (its cluster fixture waits for the result). Once, in
    the main pytest process (xdist's workers inherit the variable that names the result), and
    only where local_cluster.sh would install them: as root, with apt-get, tools missing."""
    if hasattr(config, "workerinput") or os.environ.get(SLURM_INSTALL_VARIABLE):
        return
    slurm_test = REPO / "tests/test_slurm.py"
    paths = [Path(a.split("::")[0]).resolve() for a in config.args] or [REPO / "tests"]
    if not any(p == slurm_test or p in slurm_test.parents for p in paths):
        return  # this run does not include the Slurm tests
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


# Test files by the seconds of test time they took in a full run on 2 cores (measured; the
# rest take about a second or less): handed out longest first, each file whole to one worker
# (pytest-xdist --dist loadfile --no-loadscope-reorder, pyproject.toml; xdist's own order is by
# number of tests, and put two 20-second files last on one worker while the other idled for
# 40 s). The Slurm tests come late enough for the background install to have finished.
SLOW_FILES = (
    # 80 (at a load average of 3 to 5), plus building .venv-xla where it is missing (README)
    "test_xla.py",
    # 341, measured in two parts on a busy machine (load 4 to 10 on 2 cores): 117 s for five
    # 2-rank launches, two of them waiting out the collective timeout, and 224 s for the four
    # stalls on a mesh axis (three 2-rank jobs, one of 8 processes), each waiting 10 s
    "test_mingpt_hang.py",
    # 255 alone on a busy machine (load ~10; 116 s of CPU): three 2-rank launches to train,
    # three from their exports
    "test_mingpt_export.py",
    "test_mingpt_train.py",  # 82
    "test_mingpt_layouts.py",  # 150 at a load of 5 (ten 4-rank runs); fewer runs since
    # 143 at a load average of 4 to 8: five torchrun jobs, each killed once and restarted
    "test_restarts.py",
    "test_mingpt_context.py",  # 60: eleven 2- and 4-rank launches
    # 146 alone, 222 to 420 at a load average of 4 to 10: a lighthouse and five 1-process
    # torchrun jobs, 60 slow (500 ms) steps while one group is killed and started again
    "test_mingpt_torchft.py",
    # 85 with pip's cache cold, 24 warm, 1 once its venv exists (aws-parallelcluster's schema)
    "test_cluster.py",
    # 75, plus 97 for pitfalls.ipynb (alone, at a load average of 10), 263 since its section 9
    # plans GPT-2 XL with the dry run (at a load average of 8)
    "test_notebooks.py",
    "test_steps.py",  # 70
    "test_teardown.py",  # 48
    "test_mingpt_pretrained.py",  # 41
    "test_crash_storm.py",  # 40
    "test_mingpt_pipeline.py",  # 155 on a loaded machine; its 8-process mesh alone ~80
    "test_mingpt_strategies.py",  # 34
    # 21 to 35 at a load average of 8 to 11: four processes importing torch, then writing
    "test_error_lines.py",
    "test_mingpt_s3.py",  # 31
    # 262 at a load average of 7: eleven 2-rank runs (rank 0 in the test process), plus two
    # torchrun launches with DCP's staging processes
    "test_mingpt_snapshot_faults.py",
    "test_mingpt_bench.py",  # 22
    "test_torchrun_logs.py",  # 25: docs/LOGS.md's launch, at 3 processes, with a kill and a restart
    "test_vscode.py",  # 25: torchrun under debugpy, attached as VS Code attaches
    "test_elastic.py",  # 20
    "test_slurm.py",  # 29, most of it waiting for the daemons and the job
    "test_mingpt_parallel.py",  # 15
    "test_mingpt_image.py",  # 15
    "test_bad_input.py",  # 14
    "test_mingpt_errors.py",  # 12
    "test_mingpt_memory.py",  # 9
    "test_mingpt_model.py",  # 6
)


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
    "test_restarts.py",
    "test_slurm.py",
    "test_teardown.py",
)


# tryfirst: the marker must be on the items before pytest's own hook deselects by `-m`.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (SLOW_FILES), the rest as collected; each file's tests in order.
    Every test of a file in ROBUSTNESS_FILES is marked `robustness`, and so is every test
    named *_slowest elsewhere (kill-and-resume runs, a minute of launches each): the usage
    run stays short, and the full run (CI's) still has them."""
    for item in items:
        if item.path.name in ROBUSTNESS_FILES or item.originalname.endswith("_slowest"):
            item.add_marker(pytest.mark.robustness)

    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOW_FILES.index(name) if name in SLOW_FILES else len(SLOW_FILES)

    items.sort(key=rank)  # stable: the order within each file and among the rest is kept


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a launched command: CPU only, one thread, unbuffered output."""
    env = dict(os.environ)
    env.update(
        CUDA_VISIBLE_DEVICES="",  # prove the CPU path even where a GPU exists
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # A fresh store for each torchrun attempt, as before restarts.py made the shared one
        # safe; test_restarts.py runs the restart commands without it, as a user does.
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
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)
        torch.set_num_threads(old_threads)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def free_port() -> int:
    """A TCP port that is free right now on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
