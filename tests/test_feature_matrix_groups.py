"""Every pair of a replica groups' feature (feature_matrix.REPLICAS: trainer_config.ft_replicas,
and its ft_sync local_sgd and diloco) with another feature of 05_mingpt runs together, or is
refused in one line (tests/README.md's grid; test_feature_matrix.py holds the other pairs).

- feature_matrix.runs(groups=True): a few runs that turn many features on at once, every such
  pair in one of them under its own flavour. Each run is two replica groups of two ranks (each
  group a job of main.py's ranks as FAULT_TOLERANCE.md starts it with torchrun, forked:
  mingpt_helpers.Job, compiling with aot_eager as the warm world does; a torchft lighthouse
  of their own) that train with a snapshot after every step; then both groups again from
  their own snapshots of step 1, to the end: main.py run again in the same ranks (Job's
  `then`), each half with its own process group, Manager and lighthouse, as the warm world's
  ranks run a case's halves. Each group ends with the weights of its run that never stopped,
  bit for bit.
- The groups agree: with ft_sync=step (gradients averaged at every step) and local_sgd
  (weights averaged every 2 steps: at step 2, the end; step 1's snapshot lies inside the
  interval) both groups end with the same weights. diloco's weights meet in 2 fragments, one
  at a time (Streaming DiLoCo), every 2 steps: the first at steps 1 and 3, the second at step
  2, so the resumed run meets with the last meeting's weights and the outer momentum that step
  1's snapshot holds; between meetings the groups' fragments differ, so they agree in what
  they met with: each meeting's outer gradient, whose norm both logs print.
- Each run's snapshot (group 0's) exports to GPT-2 bit for bit, or is refused in one line
  (test_feature_matrix.check_export).
"""
import functools
import re
from pathlib import Path

import pytest

import feature_matrix
from mingpt_helpers import (
    MINGPT,
    REPO,
    Job,
    Then,
    copy_step,
    graphs_compiled,
    mingpt_imported,
    step_files,
    weights_at,
)
from test_feature_matrix import (
    case_overrides,
    check_export,
    config,  # noqa: F401 (a fixture: mingpt/config.py)
    location,
    pretrained,  # noqa: F401 (a fixture: init_from's GPT-2)
)
from test_mingpt_s3 import s3_env  # noqa: F401 (a fixture: the moto server and its bucket)
from test_mingpt_torchft import Lighthouse

# The first test trains every run (the module's fixture): 22 jobs, each both halves of a
# group's run (two jobs a half before: 292 core-seconds alone, 216 since, Xeon, 2 cores); with
# a third pytest worker on 2 cores it once ran past pyproject's 300 s for a test. A hang ends
# sooner: each job stops at Job.finish's 240 s.
pytestmark = pytest.mark.timeout(900)

# How the groups meet (settings, not features): every 2 steps; diloco in 2 fragments, one at
# a time, for 3 steps (each fragment meets once after the resume, the first with the outer
# momentum of its meeting at step 1).
MEET = {"trainer_config.ft_sync_every": "2", "trainer_config.collective_timeout_s": "60"}
DILOCO = {"trainer_config.ft_fragments": "2", "trainer_config.max_steps": "3",
          "trainer_config.keep_last": "3"}


def group_args(schema, names: tuple[str, ...], run_dir: Path, text: Path,
               gpt2: tuple[str, str], g: int) -> list[str]:
    """Group g's overrides: the run's (test_feature_matrix.case_overrides), and how it meets."""
    given = dict(arg.split("=", 1) for arg in case_overrides(schema, names, run_dir, text, gpt2))
    given |= MEET | (DILOCO if "diloco" in names else {})
    return [*(f"{k}={v}" for k, v in given.items()), f"trainer_config.ft_replica_group={g}"]


def train(schema, names: tuple[str, ...], case: Path, text: Path, gpt2: tuple[str, str],
          env: dict, step: tuple[str, str]) -> None:
    """Both groups of run `names`, whole, then resumed, to their end: group g keeps each
    half's snapshot at location(case / f"{kind}{g}") and its log beside it. `schema`:
    mingpt/config.py; `gpt2`: the pretrained fixture's; `step`: step_files(1), the names of
    step 1's directory and of `latest`. Each group is one Job whose ranks run both halves, as
    the world's ranks do (Then): its rank 0 copies step 1's snapshot in between. Each half
    has a lighthouse of its own: every quorum is of these two groups alone, none of an
    earlier run's whose heartbeats it still remembers."""
    case.mkdir(parents=True, exist_ok=True)

    def args(kind: str, g: int) -> list[str]:
        return group_args(schema, names, case / f"{kind}{g}", text, gpt2, g)

    # min_replicas: every quorum waits for both groups, so each step is both groups' step.
    with Lighthouse(case, min_replicas=feature_matrix.GROUPS) as whole, \
            Lighthouse(case, min_replicas=feature_matrix.GROUPS) as resumed:
        jobs = [Job(MINGPT, "main.py", args("whole", g), feature_matrix.GROUP,
                    case / f"whole{g}.log", compile_backend="aot_eager", **env,
                    TORCHFT_LIGHTHOUSE=f"http://localhost:{whole.port}",
                    then=(Then(args("resumed", g), case / f"resumed{g}.log",
                               {"TORCHFT_LIGHTHOUSE": f"http://localhost:{resumed.port}"},
                               functools.partial(copy_step, location(names, case / f"whole{g}"),
                                                 location(names, case / f"resumed{g}"),
                                                 *step)),))
                for g in range(feature_matrix.GROUPS)]
        for job in jobs:
            # A run once waited ~235 s between its groups' last lines and their ends (one in
            # 18 runs of this file, cause unknown): a quiet minute writes the ranks' stacks.
            out = job.finish(quiet_s=60)
            assert job.returncode == 0, (names, out[-4000:])


@pytest.fixture(scope="module")
def groups(tmp_path_factory, config, s3_env, pretrained):  # noqa: F811 (fixtures)
    """Every run of replica groups, trained, then resumed; their snapshots at location()."""
    out = tmp_path_factory.mktemp("groups")
    text = out / "input.txt"
    text.write_text((REPO / "05_mingpt/data/input.txt").read_text()[:40_000])
    runs = feature_matrix.runs(config, groups=True)
    step = step_files(1)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in s3_env.items():
            patch.setenv(key, value)  # this process reads the s3 runs' snapshots
        for names in runs:
            train(config, names, out / "+".join(names), text, pretrained, s3_env, step)
        yield out, runs


def meetings(log: str) -> list[tuple[str, str]]:
    """The steps the groups met at, with the norm of the outer gradient they met with."""
    return re.findall(r"^step (\d+): replica groups met .*?(outer gradient norm \S+|$)", log,
                      re.M)


def test_every_replica_pair_resumes_bit_for_bit_and_the_groups_agree(groups):
    out, runs = groups
    apart, met = {}, {}
    for names in runs:
        case, run = out / "+".join(names), "+".join(names)
        weights, logs = {}, []
        for g in range(feature_matrix.GROUPS):
            log = (case / f"resumed{g}.log").read_text()
            assert f"resumed from {location(names, case / f'resumed{g}')} at step 1" in log, \
                (names, log[-3000:])
            logs.append(log)
            # compile's runs compiled graphs on each of the group's ranks, the others none.
            # The resumed half runs in the whole half's processes: it steps in their graphs,
            # but for those that guard on an object of the whole half's model, compiled again
            # (tensor parallelism's forward hooks on the attention's Linears: measured, 1 of
            # tp's graphs per rank; ddp's and fsdp's none).
            whole, resumed = (graphs_compiled((case / f"{kind}{g}.log").read_text())
                              for kind in ("whole", "resumed"))
            assert len(whole) == len(resumed) == feature_matrix.GROUP and \
                all((n > 0) == ("compile" in names) for n in whole) and \
                all(r <= w for r, w in zip(resumed, whole, strict=True)), \
                (names, whole, resumed)
            for kind in ("whole", "resumed"):
                weights[kind, g] = weights_at(location(names, case / f"{kind}{g}"))
        for (kind, g), w in weights.items():
            mine = weights["whole", 0 if "diloco" not in names else g]
            worst = max((w[k] - mine[k]).abs().max().item() for k in mine)
            if worst > 0:
                apart[f"{run} {kind} {g}"] = worst
        if {"local_sgd", "diloco"} & set(names):
            met[run] = [meetings(log) for log in logs]
    assert apart == {}
    for run, (first, second) in met.items():
        assert first == second and [step for step, _ in first] == \
            (["2", "3"] if "diloco" in run else ["2"]), (run, first, second)


def test_every_replica_run_exports_its_weights_or_is_refused_in_one_line(
        groups, config, tmp_path):  # noqa: F811 (a fixture)
    out, runs = groups
    with mingpt_imported("export_hf", "pretrained") as m:
        for names in runs:
            check_export(m, config, names, location(names, out / "+".join(names) / "resumed0"),
                         tmp_path / "+".join(names))
