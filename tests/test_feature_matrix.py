"""Every pair of 05_mingpt's features runs together or is refused in one line
(tests/feature_matrix.py builds the pairs from the config schema; the replica groups' pairs
run in test_feature_matrix_groups.py).

- Every config key is a feature or a setting, so a new key joins the grid, and the grid in
  tests/README.md is the matrix's own output.
- Each pair of the features a CPU trains (feature_matrix.RUNNABLE) that the config takes runs
  in ONE warm world of 4 spawned gloo processes (as test_mingpt_layouts.py's), inside one of a
  few runs that turn many features on at once (feature_matrix.runs: all-pairs testing's
  covering runs; every pair lies in one): 2 steps with a snapshot after each, then the
  snapshot of step 1 resumed to step 2, which must end with the uninterrupted run's weights,
  bit for bit (step 2's update reads the optimizer's state and the dropout streams the
  snapshot restored). compile's runs trace with dynamo and AOTAutograd and run the traced
  graphs with the aot_eager backend (inductor's kernels: test_mingpt_train.py). The s3 runs
  keep their snapshots in a moto server's bucket (test_mingpt_s3.py's); the init_from runs
  start from a stand-in GPT-2 on its BPE tokens (test_mingpt_pretrained.py's). A refused
  pair is refused by the config, before any process group: one line, the grid's.
- Every run's snapshot exports (export_hf.py) to GPT-2 holding its weights bit for bit, or,
  where the run has a part GPT-2 has not (experts, a model option), is refused in one line.
"""
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from omegaconf import OmegaConf

import feature_matrix
from bpe_fixture import write_hf_gpt2, write_tokenizer
from conftest import REPO
from mingpt_helpers import (
    COMPILED_GRAPHS,
    MINGPT,
    compile_with,
    exported_weights,
    join_world,
    mingpt_imported,
    script_in_process,
    snapshot_at,
    spawn_world,
    tiny,
    weights_at,
)
from test_mingpt_s3 import s3_env  # noqa: F401 (a fixture: the moto server and its bucket)
from test_mingpt_strategies import run

WORLD = feature_matrix.WORLD
README = REPO / "tests/README.md"
BEGIN, END = "<!-- feature grid: begin -->", "<!-- feature grid: end -->"


@pytest.fixture(scope="module")
def config():
    with mingpt_imported() as m:
        yield m["config"]


def test_every_config_key_is_a_feature_or_a_setting(config):
    keys = feature_matrix.schema_keys(config)
    on = feature_matrix.features(config)  # ValueError for a key in neither list
    named = set(feature_matrix.FEATURES) | set(feature_matrix.SETTINGS)
    assert named - set(keys) == set(), "names of keys the config no longer has"
    assert set(feature_matrix.RUNNABLE) <= set(on)


def test_the_readme_grid_is_the_matrix(config):
    """tests/README.md shows what the matrix computes now (`python tests/feature_matrix.py`
    prints it): a refusal added or lifted, or a new feature, changes the grid."""
    text = README.read_text()
    shown = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()
    assert shown == feature_matrix.markdown(config).strip(), \
        "tests/README.md's grid is stale: paste `python tests/feature_matrix.py`'s output"


def test_every_pair_the_config_takes_is_run_by_a_test(config):
    """No "·" in the grid: each pair is refused, runs in a covering run, or (a "◐" cell,
    feature_matrix.DRY_PARTLY) is run by the test it names, which must exist: a test renamed
    or removed fails here instead of leaving the grid's word stale."""
    rows = feature_matrix.markdown(config).split("\n\n")[0]
    assert "·" not in rows, rows
    names, cells = feature_matrix.grid(config)
    for name, (test, _) in feature_matrix.DRY_PARTLY.items():
        assert cells[tuple(sorted(("dry_run", name), key=names.index))] is None, name
        file, function = test.split("::")
        assert f"\ndef {function}(" in (REPO / "tests" / file).read_text(), test


def location(names: tuple[str, ...], run_dir: Path) -> str:
    """Where run `run_dir` (out/<case>/<whole or resumed>) keeps its snapshot: beside it, or
    with the s3 feature in the moto server's bucket (test_mingpt_s3.s3_env), under the same
    names."""
    if "s3" not in names:
        return f"{run_dir}/snapshot"
    return f"s3://mingpt/{run_dir.parent.name}/{run_dir.name}/snapshot"


def case_overrides(config, names: tuple[str, ...], run_dir: Path, text: Path,
                   pretrained: tuple[str, str]) -> list[str]:
    """One run: its features on (feature_matrix.overrides), a tiny model, 2 steps with a
    snapshot after each (the one before stays: keep_last 2). With init_from: the stand-in
    GPT-2 of `pretrained` (its directory, and the text in its BPE tokens) and that data."""
    on = feature_matrix.features(config)
    # Every key any feature sets, at its default unless this pair sets it: the runs share one
    # composition (test_mingpt_strategies.configure), which keeps what a key was last set to.
    keys = {arg.split("=", 1)[0] for args in [*on.values(), *feature_matrix.NEEDS.values()]
            for arg in args}
    cfg = feature_matrix.base_config(config)
    given = {key: yaml.safe_dump(OmegaConf.select(cfg, key)).split("\n")[0] for key in keys}
    given["gpt_config.dropout"] = "0.0"  # TINY's is 0.1, which cp refuses
    del given["trainer_config.snapshot_path"]  # the run's own, below
    given |= dict(arg.split("=", 1) for arg in feature_matrix.overrides(on, *names))
    data = [f"data_config.path={text}"]
    if "init_from" in names:  # TINY's sizes are the stand-in's: n_layer 2, n_head 2, 32 wide
        given["gpt_config.init_from"], bpe = pretrained
        data = ["data_config=bpe", f"data_config.path={bpe}"]
    args = [f"{key}={value}" for key, value in given.items()]
    return tiny(*args, f"run_dir={run_dir}", *data,
                f"trainer_config.snapshot_path={location(names, run_dir)}",
                "trainer_config.max_steps=2",
                "trainer_config.save_every=1", "trainer_config.keep_last=2",
                "trainer_config.log_every=1", "trainer_config.eval_batches=2",
                "trainer_config.sample_tokens=0", "trainer_config.microbatches=2")


def _worker(rank: int, store: str, out: str, text: str, runs: list,
            pretrained: tuple[str, str]) -> None:
    join_world(rank, store, WORLD)
    compile_with("aot_eager")  # compile's runs (in the world's own processes only)
    out_dir, text = Path(out), Path(text)
    with mingpt_imported("main") as m:
        for names in map(tuple, runs):
            case = out_dir / "+".join(names)
            # Each run compiles its graphs from nothing, as its own process would: dynamo's
            # caches kept from an earlier run let it reuse graphs (or, past the recompile
            # limit, run eagerly), which a count could not tell apart. The resumed run reuses
            # the whole run's graphs: the same shapes, so it compiles none of its own.
            torch._dynamo.reset()
            before = COMPILED_GRAPHS[0]
            run(m, case_overrides(m["config"], names, case / "whole", text, pretrained))
            graphs = [COMPILED_GRAPHS[0] - before]  # rank 0's
            if rank == 0:
                snapshot_at(location(names, case / "whole"), location(names, case / "resumed"), 1)
            dist.barrier()
            log = run(m, case_overrides(m["config"], names, case / "resumed", text,
                                        pretrained))[0]
            graphs.append(COMPILED_GRAPHS[0] - before - graphs[0])
            if rank == 0:
                (case / "resumed.log").write_text(log)
                (case / "graphs").write_text(json.dumps(graphs))
    m["distributed"].release()  # every reference dropped first: gloo's threads are joined


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> tuple[str, str]:
    """init_from's GPT-2: a small random GPT2LMHeadModel saved with save_pretrained and its
    BPE tokenizer (test_mingpt_pretrained.py's stand-in: no network in tests), and 60,000
    characters of the usual text in its tokens (prepare.py, run in this process)."""
    folder = tmp_path_factory.mktemp("gpt2")
    text = (MINGPT / "data/input.txt").read_text()[:60000]
    vocab = write_tokenizer(folder / "gpt2", text, 200)
    write_hf_gpt2(folder / "gpt2", vocab)
    (folder / "text.txt").write_text(text)
    with mingpt_imported("prepare") as m:
        proc = script_in_process(m["prepare"], MINGPT, str(folder / "text.txt"), "--out",
                                 str(folder / "bpe"), "--tokenizer", str(folder / "gpt2"),
                                 "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    return str(folder / "gpt2"), str(folder / "bpe")


@pytest.fixture(scope="module")
def world(tmp_path_factory, config, s3_env, pretrained):  # noqa: F811 (s3_env: imported)
    """Every covering run, trained in one world; its snapshots at location(). The moto
    server's AWS_* settings (s3_env) in the environment: the world's ranks inherit them, and
    this process reads the s3 runs' snapshots with them."""
    out = tmp_path_factory.mktemp("matrix")
    runs = feature_matrix.runs(config)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in s3_env.items():
            patch.setenv(key, value)
        spawn_world(_worker, WORLD, out, runs, pretrained)
        yield out, runs


@pytest.mark.parametrize("groups", [False, True], ids=["world", "groups"])
def test_the_runs_hold_every_pair_under_its_own_flavour(config, groups):
    """Every pair the grid marks ✔ lies in a run the config takes on WORLD ranks (a replica
    group's pairs: on a group's GROUP ranks), under the pair's own flavour (a pair of two
    features that name none runs under plain ddp, as alone; a replica group's, under its own
    ft_sync)."""
    on = feature_matrix.features(config)
    runs = feature_matrix.runs(config, groups)
    for names in runs:
        assert feature_matrix.verdict(config, feature_matrix.overrides(on, *names),
                                      feature_matrix.world(*names)) is None
        assert bool(set(names) & set(feature_matrix.REPLICAS)) == groups, names
    held = [(set(names), feature_matrix.method(config, *names)) for names in runs]
    for pair in feature_matrix.proven_pairs(config, groups):
        flavour = feature_matrix.method(config, *pair)
        assert any(set(pair) <= names and kind == flavour for names, kind in held), pair


def test_the_dry_runs_hold_every_feature_the_covering_runs_hold(config):
    """dry_run's row needs each feature in one planned run (feature_matrix.dry_runs): the runs
    it plans are covering runs, and between them they hold every feature the covering runs
    do (but DRY_UNCHECKED's, whose cells are ◐)."""
    kept = feature_matrix.checked_runs(config)
    dry = feature_matrix.dry_runs(config)
    assert set(dry) <= set(kept) and len(set(dry)) == len(dry)
    assert {n for names in dry for n in names} == {n for names in kept for n in names}


@pytest.mark.timeout(600)
def test_every_runnable_pair_resumes_bit_for_bit(world, config):
    out, runs = world
    apart = {}
    for names in runs:
        case = out / "+".join(names)
        assert "resumed from" in (case / "resumed.log").read_text(), names
        # compile's runs compiled graphs of their own, the others none (rank 0's count); a
        # resumed run none: it steps in the whole run's graphs (ddp.settle_buckets once gave
        # it a one-sample graph, then one with the batch dimension dynamic)
        whole_graphs, resumed_graphs = json.loads((case / "graphs").read_text())
        assert (whole_graphs > 0) == ("compile" in names), (names, whole_graphs)
        assert resumed_graphs == 0, (names, resumed_graphs)
        whole, resumed = (weights_at(location(names, case / kind)) for kind in ("whole", "resumed"))
        worst = max((whole[k] - resumed[k]).abs().max().item() for k in whole)
        if worst > 0:
            apart["+".join(names)] = worst
    assert apart == {}


def test_every_run_exports_its_weights_or_is_refused_in_one_line(world, config, tmp_path):
    out, runs = world
    with mingpt_imported("export_hf", "pretrained") as m:
        for names in runs:
            check_export(m, config, names, location(names, out / "+".join(names) / "resumed"),
                         tmp_path / "+".join(names))


def check_export(m: dict, config, names: tuple[str, ...], url: str, target: Path) -> None:
    """export_hf.py on the snapshot at `url` of a run of `names` (any layout, on S3 too):
    GPT-2's files in `target` whose every tensor, mapped back by pretrained.py's import, is
    the snapshot's bit for bit; or, where the run has what GPT-2 cannot hold, the one line that
    says which (experts first, then the model options in model.OPTIONS's order,
    export_hf.check_representable's). `m`: export_hf and pretrained imported."""
    proc = script_in_process(m["export_hf"], Path(m["export_hf"].__file__).parent, url,
                             str(target))
    options = [key for key in m["model"].OPTIONS if key in names]
    given = feature_matrix.overrides(feature_matrix.features(config), *names)
    moe = any(arg.startswith("gpt_config.n_expert=") for arg in given)  # ep_size's too
    if moe or options:
        what = "a mixture of experts" if moe else f"a model with gpt_config.{options[0]}=true"
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr
        assert errors[0].startswith(f"error: {url} holds {what}") and \
            "which GPT-2 (GPT2LMHeadModel) cannot represent" in errors[0], errors
        assert not target.exists()
        return
    assert proc.returncode == 0, (names, proc.stderr)
    back = exported_weights(m["pretrained"], target, block_size=32)
    ours = weights_at(url)
    assert set(back) == set(ours), names
    assert [k for k in ours if not torch.equal(back[k], ours[k])] == [], names
