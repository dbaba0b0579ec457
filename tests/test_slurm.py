"""slurm_scripts/sbatch_run.sh on a real Slurm cluster: munged, slurmctld and two slurmd standing
in for two nodes on this machine (slurm_scripts/local_cluster.sh), for step 04 and step 05.

The test stubs in test_steps.py check the srun command line; only real daemons show that the
agents Slurm starts on two nodes meet, train as one job, and leave one snapshot written by
global rank 0. Needs root and apt (slurm-wlm, munge): without them the tests skip and say why.
"""
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from conftest import PYTHON, REPO, SLURM_INSTALL_VARIABLE, child_env, free_port
from mingpt_helpers import copy_mingpt, read_snapshot, tiny

CLUSTER = REPO / "slurm_scripts" / "local_cluster.sh"
SBATCH_RUN = REPO / "slurm_scripts" / "sbatch_run.sh"
UNAVAILABLE = 3  # local_cluster.sh: this machine cannot run the cluster (see its header)
JOB_LIMIT = 120  # seconds; a job that cannot be scheduled is cancelled, never waited on forever
NEVER_LIMIT = 5  # for the job that can never start; it waits beside the others, costing no time
# The GPU-less cluster refuses the script's --gpus-per-node=4 and has no 16 CPUs per node:
# sbatch options override #SBATCH lines, so the series' own script runs unchanged.
OVERRIDES = ["--gpus-per-node=0", "--cpus-per-task=1"]
# The script's own 16 CPUs per task, more than a node has here; more still on a bigger machine.
NEVER_CPUS = max(16, (os.cpu_count() or 1) + 1)
EPOCHS_04 = 2
STEPS_05 = 4


def free_ports(count: int, candidates: Iterable[int] | None = None) -> int:
    """The first of `count` consecutive ports free on 127.0.0.1 (slurmctld, node1, node2)."""
    for base in candidates or (free_port() for _ in range(50)):
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    pytest.fail(f"no {count} consecutive free ports")


@pytest.fixture(scope="module")
def cluster(request) -> dict[str, str]:
    """A started local cluster (its own directory and ports); stopped after the module's tests,
    also when a test or the start itself fails, and by a watchdog if pytest itself dies."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (apt-get, munged, slurmctld, slurmd)")
    # Not pytest's tmp_path: its parents are private to root, and munged (user munge) must
    # reach its socket directory.
    state = tempfile.mkdtemp(prefix="ddp-series-slurm-")
    # sbatch_run.sh's rendezvous port is 29500 + job id % 1000: the first job id is chosen so
    # that the three jobs' ports are free (job ids 1, 2, 3 would always take 29501-29503).
    rdzv_port = free_ports(3, random.sample(range(29510, 30490), 50))
    env = {"SLURM_LOCAL_DIR": state, "SLURM_LOCAL_PORT": str(free_ports(3)),
           "SLURM_LOCAL_FIRST_JOB_ID": str(rdzv_port - 29500 + 1000)}

    def stop() -> None:
        pids = [int(p.read_text()) for p in Path(state).glob("**/*.pid")]
        subprocess.run(["bash", str(CLUSTER), "stop"], env=child_env(**env), timeout=60)
        os.killpg(watchdog.pid, signal.SIGKILL)
        watchdog.wait()
        if os.environ.get("KEEP_SLURM_LOGS"):  # for a look at the daemons' logs afterwards
            print(f"local cluster's logs kept in {state}")
        else:
            shutil.rmtree(state, ignore_errors=True)
        left = [pid for pid in pids if Path(f"/proc/{pid}").exists()
                and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"]
        assert not left, f"local_cluster.sh stop left daemons running: {left}"

    # Stops the cluster if this pytest process is killed before the finalizer runs, and the
    # sbatch --wait processes (each in a process group of its own, listed in `submitters`).
    watchdog = subprocess.Popen(
        ["bash", "-c", f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done; "
                       f"for g in $(cat {state}/submitters 2>/dev/null); do kill -- -$g; done; "
                       f"bash {CLUSTER} stop; rm -rf {state}"],
        env=child_env(**env), start_new_session=True, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    request.addfinalizer(stop)  # registered before start: a half-started cluster is stopped too
    start = time.monotonic()
    installing = os.environ.get(SLURM_INSTALL_VARIABLE)
    while installing and not (Path(installing) / "exit").exists():  # conftest started it
        if time.monotonic() - start > 300:
            pytest.fail(f"the background apt-get install did not finish: {installing}/apt.log")
        time.sleep(0.5)  # then `start` finds the tools (or installs them, and says why not)
    if installing:
        shutil.rmtree(installing, ignore_errors=True)
    proc = subprocess.run(["bash", str(CLUSTER), "start"], env=child_env(**env),
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == UNAVAILABLE:
        print(proc.stderr)  # shown with -rs and in the captured output: never a silent pass
        pytest.skip(f"no local Slurm cluster on this machine: {proc.stderr.strip()}")
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}"
                         for p in sorted(Path(state).glob("*.log")))
        pytest.fail(f"local_cluster.sh start exited {proc.returncode}\n{proc.stdout}"
                    f"{proc.stderr}\n{logs}")
    print(f"local cluster started in {time.monotonic() - start:.1f} s (apt-get included)")
    return {**env, "SLURM_CONF": f"{state}/slurm.conf"}


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    """Step 04 and step 05, submitted together (each takes one CPU per node), and the script
    with more CPUs per node than the nodes have (it can never start), as {name: (local_cluster.sh
    submit's exit status, the job's output and submit's stderr, its working directory)}."""
    root = tmp_path_factory.mktemp("slurm_jobs")
    dir04 = root / "04"
    shutil.copytree(REPO / "04_multinode", dir04 / "04_multinode",
                    ignore=shutil.ignore_patterns("__pycache__", "snapshot.pt"))
    dir05 = root / "05"
    copy_mingpt(dir05)
    args05 = tiny(f"trainer_config.max_steps={STEPS_05}", "trainer_config.save_every=2",
                  "trainer_config.log_every=2", "trainer_config.sample_tokens=0",
                  "trainer_config.device=cpu")
    submissions = {
        "04": (dir04, {}, [str(EPOCHS_04), "1", "--batch_size", "256", "--device", "cpu"]),
        "05": (dir05, {"STEP": "mingpt"}, args05),
        "unsatisfiable": (root, {}, []),
    }
    # The job inherits this environment (sbatch --export=ALL): the venv's torchrun first on
    # PATH; one process per node; each output line labelled with its Slurm task (= node)
    # number; torchrun's INFO log, which has each agent's rendezvous result.
    env = child_env(**cluster, PATH=f"{Path(PYTHON).parent}:{os.environ['PATH']}",
                    NPROC_PER_NODE="1", SLURM_LABELIO="1", LOGLEVEL="INFO")
    procs = {}
    for step, (cwd, extra, args) in submissions.items():
        limit, overrides = (JOB_LIMIT, OVERRIDES) if args else (
            NEVER_LIMIT, [OVERRIDES[0], f"--cpus-per-task={NEVER_CPUS}"])
        cmd = ["bash", str(CLUSTER), "submit", str(limit), *overrides, f"--chdir={cwd}",
               f"--output={cwd}/slurm-%j.out", str(SBATCH_RUN), *args]
        procs[step] = subprocess.Popen(cmd, env={**env, **extra}, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, start_new_session=True)
        with open(f"{cluster['SLURM_LOCAL_DIR']}/submitters", "a") as f:
            f.write(f"{procs[step].pid}\n")  # for the watchdog
    results = {}
    for step, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=JOB_LIMIT + 30)
        cwd = submissions[step][0]
        outputs = sorted(cwd.glob("slurm-*.out"))
        text = outputs[0].read_text() if outputs else f"(no job output)\n{stdout}"
        results[step] = (proc.returncode, text + stderr, cwd)
    return results


def by_task(output: str) -> dict[int, list[str]]:
    """The job's lines per Slurm task (srun's `N: ` label; one task per node)."""
    lines: dict[int, list[str]] = {}
    for task, text in re.findall(r"^(\d+): (.*)$", output, re.M):
        lines.setdefault(int(task), []).append(text)
    return lines


def assert_two_nodes_met(output: str) -> tuple[int, list[str]]:
    """Both nodes' agents joined one rendezvous, as node ranks 0 and 1 of 2; returns the task
    of node rank 0 (where global rank 0 runs) and that task's lines."""
    header = re.search(r"^head node: (\S+):\d+, nodes: 2 \((\S+) (\S+)\), processes/node: 1$",
                       output, re.M)
    assert header, output[-3000:]
    assert header.groups() == ("node1", "node1", "node2"), header.group(0)  # scontrol's names
    tasks = by_task(output)
    assert sorted(tasks) == [0, 1], output[-3000:]  # srun started an agent on each node
    node_rank = {}
    for task, lines in tasks.items():
        text = "\n".join(lines)
        ranks = re.findall(r"\bgroup_rank=(\d+)$", text, re.M)
        assert len(ranks) == 1, f"task {task}: no single rendezvous result\n{text[-2000:]}"
        assert re.search(r"\bgroup_world_size=2$", text, re.M), text[-2000:]
        assert re.search(r"\bglobal_world_sizes=\[2\]$", text, re.M), text[-2000:]
        node_rank[task] = int(ranks[0])
    assert sorted(node_rank.values()) == [0, 1], node_rank  # distinct node ranks
    leader = min(node_rank, key=node_rank.get)
    return leader, tasks[leader]


def test_step04_trains_across_two_slurm_nodes(jobs):
    status, output, cwd = jobs["04"]
    assert status == 0, output[-4000:]
    leader, lines = assert_two_nodes_met(output)
    tasks = by_task(output)
    epochs = [line for line in lines if re.match(r"\[node 0 \| local 0 \| global 0 \| cpu\] "
                                                  r"Epoch \d+ \| .* \| Loss: [0-9.]+$", line)]
    assert len(epochs) == EPOCHS_04, "\n".join(lines)
    losses = [float(line.rsplit(" ", 1)[1]) for line in epochs]
    assert losses == sorted(losses, reverse=True), losses  # it learned: the loss fell
    saves = [(task, line) for task, ls in tasks.items() for line in ls
             if "Training snapshot saved" in line]
    # One save per epoch (save_every 1), each printed by global rank 0, on its node only.
    assert [task for task, _ in saves] == [leader] * EPOCHS_04, saves
    snapshot = torch.load(cwd / "snapshot.pt", weights_only=True)
    assert snapshot["EPOCHS_RUN"] == EPOCHS_04
    assert len(snapshot["RNG_STATES"]) == 2  # gathered from both nodes' ranks: world size 2
    assert sorted(p.name for p in cwd.iterdir()) == ["04_multinode", *(
        p.name for p in cwd.glob("slurm-*.out")), "snapshot.pt"]  # one file, no stray copies


def test_step05_trains_across_two_slurm_nodes(jobs):
    status, output, cwd = jobs["05"]
    assert status == 0, output[-4000:]
    leader, lines = assert_two_nodes_met(output)
    text = "\n".join(lines)
    assert "| backend gloo | world size 2" in text, text[-3000:]
    assert re.findall(rf"^step \d+/{STEPS_05} \| loss [0-9.]+", text, re.M), text[-3000:]
    final = re.search(r"^final val loss ([0-9.]+) \(run dir (\S+)\)$", text, re.M)
    assert final, text[-3000:]
    start = re.search(r"^step 0 \| val loss ([0-9.]+)$", text, re.M)
    assert start and float(final.group(1)) < float(start.group(1)), text[-3000:]
    # Every log line of the trainer comes from global rank 0: the other node prints none.
    other = "\n".join(by_task(output)[1 - leader])
    assert "snapshot saved" not in other and "val loss" not in other, other[-3000:]
    saves = re.findall(r"^step (\d+): snapshot saved to (\S+)$", text, re.M)
    assert [int(s) for s, _ in saves] == [2, 4], saves
    # The run directory is runs/<rendezvous id = Slurm job id> in the job's working directory.
    run_dir = Path(final.group(2))
    assert run_dir.parent == cwd / "runs", run_dir
    assert {Path(p) for _, p in saves} == {run_dir / "snapshot"}
    snapshot = read_snapshot(run_dir / "snapshot")
    assert snapshot["step"] == STEPS_05
    assert snapshot["world_size"] == 2 and len(snapshot["rng"]) == 2  # both ranks' RNG states


def test_a_job_that_can_never_start_is_cancelled_not_waited_on(jobs, cluster):
    status, output, _ = jobs["unsatisfiable"]
    assert status == 124, output  # timeout's status: sbatch --wait was still waiting
    job = re.search(rf"error: job (\d+) did not finish within {NEVER_LIMIT} s \(JobState=PENDING "
                    r"Reason=PartitionConfig\); cancelled$", output, re.M)
    assert job, output
    squeue = subprocess.run(["squeue", "-h", "-j", job.group(1), "-o", "%T"],
                            env=child_env(**cluster), capture_output=True, text=True)
    assert squeue.stdout.strip() in ("", "CANCELLED"), squeue.stdout  # it will never run later


def test_the_gpu_request_is_refused_without_gpus_so_it_must_be_overridable(cluster):
    # Why the jobs above pass --gpus-per-node=0: Slurm refuses the #SBATCH line at submission.
    proc = subprocess.run(["sbatch", "--cpus-per-task=1", str(SBATCH_RUN)], cwd=REPO,
                          env=child_env(**cluster), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0, proc.stdout
    assert "Invalid generic resource (gres) specification" in proc.stderr, proc.stderr
