"""05_mingpt/bench/bench.py (and bench_pipeline.py) as a user runs it, on a tiny model: what
it measures adds up.

The speed figures themselves are not asserted (a busy 2-core machine makes them noise); the
README quotes a full run. These tests check the bookkeeping behind them: the rounds, the
medians, the overhead ratio, the threads per rank, the model state, the files written."""
import json
import re
import statistics

import pytest

from conftest import PYTHON, run
from mingpt_helpers import copy_mingpt, tiny


@pytest.fixture(scope="module")
def mingpt(tmp_path_factory):
    return copy_mingpt(tmp_path_factory.mktemp("bench"))


def test_bench_times_the_trainer_and_the_bare_loop_per_strategy(mingpt):
    proc = run([PYTHON, "bench/bench.py", "--runs", "ddp:1", "fsdp:2", "--preset", "gpt-nano",
                "--block_size", "32", "--batch_size", "8", "--steps", "6", "--warmup", "2",
                "--rounds", "2", "--out", "bench/tiny"], cwd=mingpt)
    info = json.loads((mingpt / "bench/tiny.json").read_text())
    assert (mingpt / "bench/tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ddp, fsdp = info["results"]
    assert (ddp["strategy"], ddp["ranks"], fsdp["strategy"], fsdp["ranks"]) == \
        ("ddp", 1, "fsdp", 2)
    # One rank uses every core; two ranks share them, one thread each.
    assert fsdp["threads"] == 1 and ddp["threads"] == info["machine"]["cores"]
    for r in (ddp, fsdp):
        assert len(r["tokens_per_s_rounds"]) == 2
        assert r["tokens_per_s"] == statistics.median(r["tokens_per_s_rounds"])
        assert r["tokens_per_s_per_rank"] == r["tokens_per_s"] / r["ranks"]
        assert len(r["training_peak_mb"]) == len(r["model_state_mb"]) == r["ranks"]
        assert r["save_s"] > 0 and r["load_s"] > 0 and r["mfu"] is None  # no peak for a CPU
    # The bare loop runs beside ddp on one rank only; the ratio is the median over the rounds
    # of each trainer round's tokens/s over its bare round's.
    ratios = [t / b for t, b in zip(ddp["tokens_per_s_rounds"], ddp["bare_tokens_per_s_rounds"],
                                    strict=True)]
    assert ddp["overhead_ratio"] == statistics.median(ratios)
    assert "bare_tokens_per_s" not in fsdp
    # Model state counted from the tensors: fp32 parameters, gradients and AdamW's two moments
    # (16 bytes a parameter) plus a 4-byte step per parameter tensor; FSDP holds half a rank.
    n = ddp["num_params"]
    assert 16 * n < ddp["model_state_mb"][0] * 2**20 < 16 * n + 4 * 100
    assert max(fsdp["model_state_mb"]) == pytest.approx(ddp["model_state_mb"][0] / 2, rel=0.05)
    assert re.search(r"^ddp:1 .* ms/step .* tokens/s .*\n .* bare loop [0-9,]+ tokens/s: the "
                     r"trainer runs at [0-9.]+x of it$", proc.stdout, re.M)
    assert "fsdp:2 " in proc.stdout and "wrote " in proc.stdout


def test_bench_quality_times_main_py_to_every_validation(mingpt):
    overrides = tiny("trainer_config.eval_every=5", "run_name=quality")
    proc = run([PYTHON, "bench/bench.py", "--quality", "--out", "bench/quality", "--", *overrides],
               cwd=mingpt)
    info = json.loads((mingpt / "bench/quality.json").read_text())
    curve = info["curve"]  # (seconds since start, step, val loss) per validation
    assert [step for _, step, _ in curve] == [0, 5, 10]
    assert 0 < curve[0][0] < curve[1][0] < curve[2][0] < info["wall_s"]
    assert info["final_val"] == curve[-1][2]
    assert info["time_to_quality_s"] is None  # the tiny model never gets near 1.88
    assert info["command"] == "python main.py " + " ".join(overrides)
    # The trainer's own account of what evaluation and snapshots cost.
    assert re.fullmatch(r"[0-9.]+ s in training: evaluation [0-9.]+ s \([0-9.]+%\), "
                        r"snapshots [0-9.]+ s \([0-9.]+%\)", info["paused"])
    assert "val <= 1.88 at never; final val" in proc.stdout
    assert (mingpt / "bench/quality.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_pipeline_measures_the_bubble_and_matches_the_dry_run(mingpt):
    """bench/bench_pipeline.py on a tiny model: one row per rank, schedule and m; the idle
    and wait shares are fractions of the step; the ideal is (p - 1) / (m + p - 1) for 1f1b and
    (p - 1) / (v m + p - 1) for interleaved_1f1b; torch's refusal (1f1b needs m >= p) is a row,
    not a crash; each 1f1b rank's model state is the dry run's plan of that rank
    (model_size.predict), byte for byte; the looped schedules have no prediction."""
    run([PYTHON, "bench/bench_pipeline.py", "--schedules", "1f1b", "interleaved_1f1b",
         "--microbatches", "1", "2", "--steps", "1", "--n_layer", "4", "--n_embd", "16",
         "--block_size", "8", "--batch_size", "4", "--out", "bench/tiny_pp"], cwd=mingpt)
    info = json.loads((mingpt / "bench/tiny_pp.json").read_text())
    assert (mingpt / "bench/tiny_pp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {(r["schedule"], r["microbatches"], r["rank"]): r for r in info["rows"]}
    assert sorted(rows) == sorted((s, m, r) for s in ("1f1b", "interleaved_1f1b")
                                  for m in (1, 2) for r in (0, 1))
    assert "greater than or equal to the number of stages" in rows["1f1b", 1, 0]["refused"]
    assert rows["1f1b", 2, 0]["ideal_bubble"] == 1 / 3
    assert rows["interleaved_1f1b", 2, 0]["ideal_bubble"] == 1 / 5
    for row in (r for r in info["rows"] if "refused" not in r):
        assert 0 <= row["idle_share"] <= 1 and 0 <= row["wait_share"] <= 1, row
        if row["schedule"] == "1f1b":
            assert row["model_state"] == row["predicted_model_state"], row
            assert sum(row["model_state"].values()) > 0, row
        else:
            assert row["predicted_model_state"] is None, row


def test_bench_profile_sorts_the_kernels_an_h200_ran():
    """--profile's kinds (the GPU profile in bench/README.md) for the kernels bench/gpu_gpt2.json
    recorded on an H200: cuDNN's attention names "wgmma" as matmuls do, inductor's fused kernels
    "_to_copy" as copies do; each must land in its own kind, and the kinds add up to the time."""
    import importlib.util

    from mingpt_helpers import MINGPT

    spec = importlib.util.spec_from_file_location("bench", MINGPT / "bench/bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    profile = json.loads((MINGPT / "bench/gpu_gpt2.json").read_text())["results"][0]["profile"]
    kinds = {re.split("[_ ]", name)[0]: bench.kind_of(name)
             for name, _ in profile["top_kernels_ms"]}
    assert kinds == {"nvjet": "matmul", "cudnn": "attention", "triton": "compiled (triton)",
                     "void": "optimizer"}, kinds
    assert sum(profile["kinds_ms"].values()) == pytest.approx(profile["gpu_ms_per_step"])
    assert 0 < profile["gpu_busy"] <= 1


def test_comm_lab_times_every_collective_and_fits_its_link(mingpt):
    """bench/comm_lab.py on 2 gloo ranks, 1 to 16 KiB: a row per collective and size, algbw
    and busbw by nccl-tests' definitions (all_reduce's factor 2(n-1)/n = 1 on 2 ranks, the
    gathers' and scatters' (n-1)/n = 1/2), and a link model per collective."""
    run([PYTHON, "bench/comm_lab.py", "--worlds", "2", "--max_bytes", "16384", "--seconds",
         "0.01", "--out", "bench/lab"], cwd=mingpt)
    info = json.loads((mingpt / "bench/lab.json").read_text())
    assert (mingpt / "bench/lab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert info["backend"] == "gloo" and info["worlds"] == [2]
    names = ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
             "send_recv"]
    assert [(r["collective"], r["bytes"]) for r in info["rows"]] == \
        [(name, size) for name in names for size in (1024, 4096, 16384)]
    factor = {"all_reduce": 1.0, "reduce_scatter": 0.5, "all_gather": 0.5, "all_to_all": 0.5,
              "broadcast": 1.0, "send_recv": 1.0}
    for r in info["rows"]:
        assert r["seconds"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor[r["collective"]])
    assert sorted(info["model"]) == sorted(names)
    for by_world in info["model"].values():  # what fit guarantees, whatever the timings
        link = by_world["2"]
        assert link["alpha_s"] >= 0 and link["beta_s_per_byte"] >= 0, link


def test_comm_lab_fit_recovers_a_link_and_never_goes_negative(monkeypatch):
    """comm_lab.fit on exact times alpha + beta x size gives alpha and beta back; times that
    fall with size (noise on a loaded machine) give no negative term: latency or bandwidth
    alone. (The lab's own timings decide nothing here: they vary with the machine's load.)"""
    import importlib

    from mingpt_helpers import MINGPT

    monkeypatch.syspath_prepend(str(MINGPT / "bench"))  # comm_lab imports its neighbours
    fit = importlib.import_module("comm_lab").fit
    sizes = [2**10 * 4**k for k in range(9)]
    link = fit([(s, 3e-4 + s / 1.5e9) for s in sizes])
    assert link["alpha_s"] == pytest.approx(3e-4, rel=1e-9)
    assert link["large_algbw_GBps"] == pytest.approx(1.5, rel=1e-9)
    assert link["worst_relative_error"] == pytest.approx(0, abs=1e-9)
    bandwidth = fit([(1024, 1e-5), (4096, 1e-4), (16384, 1e-3)])  # alpha would be < 0
    assert bandwidth["alpha_s"] == 0 and bandwidth["beta_s_per_byte"] > 0
    latency = fit([(1024, 5e-4), (4096, 4e-4), (16384, 3e-4)])  # beta would be < 0
    assert latency["beta_s_per_byte"] == 0 and latency["alpha_s"] > 0
    assert latency["large_algbw_GBps"] is None


def test_records_runs_each_row_per_seed_and_summarises_the_seeds(mingpt):
    """bench/records.py on a tiny model: one timed run per row and seed (one row, two seeds:
    each run is a main.py of its own, 8 s of CPU), the row's overrides and seed in its
    command, the best val the lowest it printed, the table the seeds' median and range; a row
    it does not have is one error line."""
    overrides = tiny("trainer_config.eval_every=5", "trainer_config.max_steps=10")
    proc = run([PYTHON, "bench/records.py", "--rows", "options", "--seeds", "1", "2",
                "--out", "bench/rec", "--", *overrides], cwd=mingpt)
    runs = json.loads((mingpt / "bench/rec.json").read_text())["runs"]
    assert [(r["row"], r["seed"]) for r in runs] == [("options", 1), ("options", 2)]
    for r in runs:
        assert f"trainer_config.seed={r['seed']}" in r["command"].split()
        assert "gpt_config.qk_norm=true" in r["command"].split()  # the row's overrides
        assert "run_dir=" not in r["command"]  # the scratch folder is not the reader's
        assert [step for _, step, _ in r["curve"]] == [0, 5, 10]
        assert r["best_val"] == min(v for _, _, v in r["curve"])
        assert r["tokens_per_step"] == 8 * 32  # TINY's batch 8 x block 32
    finals = [r["final_val"] for r in runs]  # never at 1.88: each ran to its end
    assert finals[0] != finals[1]  # two seeds, two runs
    line = next(x for x in proc.stdout.splitlines() if x.startswith("| `options` |"))
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[2] == "2" and cells[3] == "never" and \
        cells[6] == f"{statistics.median(finals):.4f} ({min(finals):.4f}–{max(finals):.4f})"
    refused = run([PYTHON, "bench/records.py", "--rows", "nope"], cwd=mingpt, check=False)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: no row nope for target 1.88; rows: nanogpt, adamw, options, muon, short, "
        "two_layers, without_rotary, without_qk_norm, without_relu2, without_untied_head, lean, "
        "default"]


def test_a_timed_run_stops_at_its_target(mingpt):
    """bench.timed_main(stop_at=...): the first val loss at or below it ends the run (records.py's
    1.88 rows); step 0's, about ln 65 = 4.17 for any fresh model, is below 10."""
    code = ("import json, sys; sys.path.insert(0, 'bench'); import bench; "
            f"print(json.dumps(bench.timed_main({tiny('trainer_config.eval_every=5')!r}, "
            "stop_at=10.0)))")
    proc = run([PYTHON, "-c", code], cwd=mingpt)
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [step for _, step, _ in info["curve"]] == [0]
    assert info["returncode"] == -15  # SIGTERM: steps 5 and 10 never came
