"""05_mingpt's layouts compose: a data-parallel flavour plus degrees (tp_size, pp_size, cp_size)
trains what DDP trains on the same global batch, resumes bit for bit, and resumes under other
degrees; every layout's step-time breakdown marks its forward and backward.

The runs of each world size share ONE group of spawned gloo processes (4, and 8 for the 3-D
layouts), trained in-process through main.load_train_objs and the Trainer as main.py runs them
(test_mingpt_strategies.run). The reference is ddp over every rank, whose arithmetic is one
process's on the same 8 sequences per step up to the order of the all-reduce's sum
(test_mingpt_strategies compares them on 2 ranks). Config-level refusals run in this process.
"""
import json
import re
import statistics
import time
from pathlib import Path

import pytest
import torch

from mingpt_helpers import (
    assert_refused,
    assert_retraces,
    join_world,
    mingpt_imported,
    retrace,
    snapshot_weights,
    spawn_world,
    tiny,
    train_losses,
)
from test_mingpt_strategies import HALF, LOSS_UNITS, OUTLIERS, STEP_BUDGET, STEPS, run

WORLD = 4
GLOBAL_BATCH = 8  # sequences per step, whatever the layout: batch_size x dp
# name -> (distributed_method, tp_size, pp_size, cp_size). The data-parallel degree is what
# the world size leaves: dp = 4 / (tp x pp x cp).
LAYOUTS = {
    "ddp": ("ddp", 0, 0, 0),           # dp 4: the reference
    "ddp_tp2": ("ddp", 2, 0, 0),       # replicas of TP groups: dp 2 x tp 2
    "ddp_pp2": ("ddp", 0, 2, 0),       # replicas of pipelines: pp 2 x dp 2
    "zero_pp2": ("zero", 0, 2, 0),     # the same, each stage's AdamW state over its dp 2
    "fsdp_pp2": ("fsdp", 0, 2, 0),     # pipelines, FSDP across them: pp 2 x dp 2
    "fsdp_tp2_cp2": ("fsdp", 2, 0, 2),  # dp 1 x cp 2 x tp 2
    "fsdp_pp2_cp2": ("fsdp", 0, 2, 2),  # pp 2 x dp 1 x cp 2: stages pass T / cp tokens
}
# Resumed into, from ddp's one-file snapshot: pp 2 x dp 2, FSDP over each stage's dp ranks.
MOVED = LAYOUTS["fsdp_pp2"]
# On 8 ranks: the 3-D layouts, against ddp over the 8 (dp 8, one sequence per rank).
LAYOUTS_8 = {
    "ddp": ("ddp", 0, 0, 0),
    "fsdp_pp2_tp2": ("fsdp", 2, 2, 0),  # pp 2 x dp 2 x tp 2
    "ddp_pp2_cp2_tp2": ("ddp", 2, 2, 2),  # pp 2 x cp 2 x tp 2, replicas of one (dp 1)
}
# The weights after STEPS steps against ddp's: test_mingpt_strategies derives the bound for
# sums in another order (FSDP's reduce-scatter, TP's split matmuls; here also the pipeline's
# tied-embedding sum over two stages and cp's ring, both a few ulps per term): rounding moves
# a weight by ~1e-7 of its step budget, a bug by O(STEP_BUDGET); 1% of it, OUTLIERS beyond.
WEIGHT_TOLERANCE = 1e-2 * STEP_BUDGET
# A run against its reference (mingpt_helpers.assert_retraces): test_mingpt_strategies's loss
# bound, the weight bound above.
BOUNDS = {"loss_units": LOSS_UNITS, "tolerance": WEIGHT_TOLERANCE, "outliers": OUTLIERS}
BREAKDOWN = re.compile(r"^step (\d+)/\d+ \| .* ms: data (\d+)% forward (\d+)% backward (\d+)% "
                       r"optimizer (\d+)%$", re.M)


def overrides(name: str, run_dir: Path, text: Path, max_steps: int, world: int = WORLD
              ) -> list[str]:
    method, tp, pp, cp = (LAYOUTS if world == WORLD else LAYOUTS_8).get(name, MOVED)
    dp = world // (max(tp, 1) * max(pp, 1) * max(cp, 1))
    return retrace(run_dir, text, max_steps,
                   f"trainer_config.distributed_method={method}", f"trainer_config.tp_size={tp}",
                   f"trainer_config.pp_size={pp}", f"trainer_config.cp_size={cp}",
                   f"trainer_config.batch_size={GLOBAL_BATCH // dp}",
                   # A pipeline cuts each micro-step's batch into 2 micro-batches (1F1B).
                   f"trainer_config.microbatches={2 if pp else 1}")


def _worker(rank: int, store: str, out: str, text: str, world: int = WORLD) -> None:
    join_world(rank, store, world)
    out_dir, text, result = Path(out), Path(text), {}
    with mingpt_imported("main") as m:
        # The step breakdown's clock: this rank's CPU time (test_every_layouts_breakdown_...).
        m["main"].profiling.StepTimer.clock = staticmethod(time.thread_time)
        if world != WORLD:  # the 3-D layouts only
            for name in LAYOUTS_8:
                result[name] = {"log": run(m, overrides(name, out_dir / name, text, STEPS,
                                                        world))[0]}
            (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
            m["distributed"].release()
            return
        # Each run saves its final snapshot (the weights the tests compare: whole, as
        # sample.py reads them, whatever the layout held on each rank).
        for name in LAYOUTS:
            result[name] = {"log": run(m, overrides(name, out_dir / name, text, STEPS))[0]}
        # Stopped halfway and resumed under the same layout: bit for bit.
        run(m, overrides("ddp_pp2", out_dir / "half", text, HALF))
        run(m, overrides("ddp_pp2", out_dir / "half", text, STEPS))
        # Stopped halfway and resumed under other degrees and the other snapshot format: ddp's
        # one file (dp 4) into fsdp's shards over pp 2 x dp 2.
        run(m, overrides("ddp", out_dir / "moved", text, HALF))
        result["moved"] = {"log": run(m, overrides("moved", out_dir / "moved", text, STEPS))[0]}
        # ... and into ZeRO's pipeline: each stage's two ranks read the state of what they own.
        run(m, overrides("ddp", out_dir / "moved_zero", text, HALF))
        result["moved_zero"] = {"log": run(m, overrides("zero_pp2", out_dir / "moved_zero",
                                                        text, STEPS))[0]}
        # Dropout's streams as snapshots keep them (test_dropout_streams_follow_the_layout):
        # pp 2 x dp 2, resumed as dp 2 x tp 2 (the same world and data-parallel sizes).
        run(m, overrides("ddp_pp2", out_dir / "streams", text, HALF))
        run(m, overrides("ddp_tp2", out_dir / "streams", text, STEPS))
        result["flattened"] = _flattened_meshes(m)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    m["distributed"].release()  # every reference dropped first: gloo's threads are joined


def _flattened_meshes(m: dict) -> dict:
    """Two meshes of one layout with flattened dims (dp x cp: dp_cp; ep: dp), as two runs of
    one process build them: which flattened mesh layout.axis() gives each."""
    layout, found = m["layout"], {}
    for name, degrees in (("dp_cp", {"cp_size": 2}), ("dp", {"ep_size": 2})):
        lay = layout.resolve("ddp", WORLD, **degrees)
        first = layout.build_mesh(lay, torch.device("cpu"))
        own = layout.axis(first, name)
        second = layout.build_mesh(lay, torch.device("cpu"))
        found[name] = {"equal meshes": first == second,
                       "first keeps its own": layout.axis(first, name) is own,
                       "second has another": layout.axis(second, name) is not own,
                       "size": layout.axis(second, name).size()}
    return found


def spawn(tmp_path_factory, world: int) -> tuple[Path, dict]:
    """Rank 0's results; each run's snapshot in out/<name>/snapshot."""
    out = tmp_path_factory.mktemp(f"layouts{world}")
    return out, spawn_world(_worker, world, out, world)[0]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return spawn(tmp_path_factory, WORLD)


@pytest.fixture(scope="module")
def spawned8(tmp_path_factory):
    return spawn(tmp_path_factory, 8)


@pytest.mark.parametrize("world", [WORLD, 8])
def test_every_layout_follows_ddps_losses_and_weights(world, request):
    out, result = request.getfixturevalue("spawned" if world == WORLD else "spawned8")
    ddp = train_losses(result["ddp"]["log"])
    assert sorted(ddp) == list(range(1, STEPS + 1)) and ddp[STEPS] < ddp[1] - 0.1, ddp
    for name in (LAYOUTS if world == WORLD else LAYOUTS_8):
        assert_retraces(out, result, name, "ddp", range(1, STEPS + 1), **BOUNDS)


def test_the_start_line_names_the_axes_of_a_replica(spawned):
    _, result = spawned
    assert "world size 4)" in result["ddp"]["log"]
    for name, axes in (("ddp_tp2", "tensor-parallel 2"),
                       ("fsdp_tp2_cp2", "context-parallel 2 x tensor-parallel 2"),
                       ("ddp_pp2", "pipeline-parallel 2"),
                       ("fsdp_pp2_cp2", "pipeline-parallel 2 x context-parallel 2")):
        assert f"processes per model replica: {axes})" in result[name]["log"], name


def test_a_resume_is_bitwise_and_other_degrees_resume_it(spawned):
    out, result = spawned
    whole, resumed = snapshot_weights(out / "ddp_pp2"), snapshot_weights(out / "half")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    # ddp for HALF steps, then fsdp x pp 2 from its snapshot: still ddp's trajectory.
    assert (out / "moved/snapshot/latest").is_file()
    assert_retraces(out, result, "moved", "ddp", range(HALF + 1, STEPS + 1), **BOUNDS)
    assert_retraces(out, result, "moved_zero", "ddp", range(HALF + 1, STEPS + 1), **BOUNDS)


def saved_streams(snapshot: Path) -> list[torch.Tensor]:
    """Every rank's torch RNG state in a sharded snapshot's train_state.pt, by global rank."""
    step = (snapshot / "latest").read_text().strip()
    state = torch.load(snapshot / step / "train_state.pt", weights_only=True)
    return [rng["torch"] for rng in state["rng"]]


def test_dropout_streams_follow_the_layout(spawned):
    """One stream per data-parallel rank and pipeline stage, shared within a TP group; a
    resume under another layout draws new ones by that rule. These runs have no dropout, so
    each rank's stream is still where it was seeded. (The stages of one pipeline shared one
    seed; pp 2 x dp 2 resumed as dp 2 x tp 2 restored the streams rank by rank, as its world
    and data-parallel sizes matched: one TP group's ranks got two stages' streams.)"""
    out, _ = spawned
    pp = saved_streams(out / "ddp_pp2/snapshot")  # rank = stage x 2 + data-parallel rank
    assert [torch.equal(pp[0], other) for other in pp[1:]] == [False, False, False]
    assert not torch.equal(pp[1], pp[3]) and not torch.equal(pp[2], pp[3])
    tp = saved_streams(out / "streams/snapshot")  # ranks 0, 1: one TP group; 2, 3 the other
    assert torch.equal(tp[0], tp[1]) and torch.equal(tp[2], tp[3])
    assert not torch.equal(tp[0], tp[2])


def test_each_mesh_keeps_its_own_flattened_dims(spawned):
    """layout.axis() looks a flattened dim up in what build_mesh kept for that mesh object
    (DeviceMesh warns against slicing it from the root by name): two equal meshes, as two runs
    of one process build them, each get their own. Keyed by equality, the first mesh got the
    second's (built over the second's groups)."""
    found = spawned[1]["flattened"]
    assert found == {name: {"equal meshes": True, "first keeps its own": True,
                            "second has another": True, "size": WORLD}
                     for name in ("dp_cp", "dp")}, found


def test_every_layouts_breakdown_marks_forward_and_backward(spawned):
    """Where a step's time goes, for every layout: a pipeline's schedule once logged
    `forward 0% backward 0% optimizer 99%`. The forward and backward of these models cost about
    6 x 25,000 parameters x 256 tokens per rank = 40 MFLOP a step, AdamW a few operations per
    parameter (~0.3 MFLOP), so the median over steps 2.. (step 1 warms the kernels up) gives
    forward and backward each at least 5% and together more than the optimizer. That is their
    work; the log's wall clock adds a rank's waits for the others, unbounded here (4 ranks on 2
    cores beside another test worker: a loaded machine logged ddp's backward at 91%, forward
    4%), so the ranks time their phases by their own CPU time (time.thread_time: gloo's waits
    block the thread, they do not run it). What is marked where is the same either way."""
    _, result = spawned
    for name in LAYOUTS:
        lines = [tuple(map(int, line)) for line in BREAKDOWN.findall(result[name]["log"])]
        assert [line[0] for line in lines] == list(range(1, STEPS + 1)), name
        median = {phase: statistics.median(line[i] for line in lines[1:])
                  for i, phase in enumerate(("data", "forward", "backward", "optimizer"), 1)}
        assert median["forward"] >= 5 and median["backward"] >= 5, (name, median)
        assert median["forward"] + median["backward"] > median["optimizer"], (name, median)


# --- in this process: refusals, before any process group ---------------------------------

@pytest.mark.parametrize("args, world, message", [
    (["trainer_config.tp_size=4"], "6",
     "trainer_config.tp_size=4 must divide the world size 6 (the ranks form world_size / "
     "tp_size tensor-parallel groups)"),
    (["trainer_config.distributed_method=fsdp", "trainer_config.tp_size=2",
      "trainer_config.cp_size=2"], "6",
     "cp_size=2 x tp_size=2 = 4 must divide the world size 6 (each model replica takes that "
     "many ranks)"),
    (["trainer_config.distributed_method=fsdp", "trainer_config.pp_size=2",
      "trainer_config.cp_size=2"], "6",
     "pp_size=2 x cp_size=2 = 4 must divide the world size 6 (each model replica takes that "
     "many ranks)"),
])
def test_a_layout_that_cannot_work_is_one_line_before_any_group(monkeypatch, args, world,
                                                                message):
    """torchrun sets WORLD_SIZE before main.py starts: the degrees are checked against it with
    the config, before any process group or run folder exists."""
    monkeypatch.setenv("WORLD_SIZE", world)
    with mingpt_imported() as m:
        assert_refused(m["config"], tiny(*args), message)


def test_shorthands_are_degrees():
    """The older names are flavours plus degrees, and resolve as they always trained."""
    with mingpt_imported() as m:
        resolve = m["layout"].resolve
        assert resolve("fsdp_tp_pp", 8, tp_size=2, pp_size=2) == resolve("fsdp", 8, 2, 2)
        assert resolve("fsdp_tp", 4, tp_size=0).sizes() == {"dp": 1, "tp": 4}
        assert resolve("tp", 4).sizes() == {"dp": 1, "tp": 4}
        assert resolve("pp", 4).sizes() == {"pp": 4, "dp": 1}
        assert resolve("ddp", 8, tp_size=2, cp_size=2).sizes() == {"dp": 2, "cp": 2, "tp": 2}
        # Where every rank holds the whole model (the dry run gives those ranks real storage).
        assert [resolve(*args).whole for args in (("ddp", 4), ("zero", 4, 0, 0, 2),
                                                  ("ddp", 4, 2), ("fsdp", 4))] == \
            [True, True, False, False]
