"""The dry run's predicted step time (mingpt/step_time.py), computed from a recorded machine
profile, so every figure is known in advance: each term of the model checked by hand here.
The prediction against measured steps is a benchmark (bench/bench_step_time.py), not a test:
timings stay out of the suite. tests/test_mingpt_dry_run.py holds the counts the model reads
(work, calls, bytes) equal to a real step's."""
import json

import pytest

from mingpt_helpers import MINGPT, mingpt_imported

# A machine as bench/comm_lab.py records one, with round figures: a matmul at 100 GFLOP/s, an
# op 2 us, a DTensor op 20 us more, 20 GB/s; all-reduce fitted on 2 and 4 ranks, the others on 2.
PROFILE = {
    "machine": {"cpu": "a test CPU", "cores": 2}, "backend": "gloo",
    "compute": {"matmul_flops_per_s": 1e11, "op_s": 2e-6, "dtensor_op_s": 2e-5,
                "bytes_per_s": 2e10},
    "model": {"all_reduce": {"2": {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9},
                             "4": {"alpha_s": 1e-3, "beta_s_per_byte": 2e-9}},
              "send_recv": {"2": {"alpha_s": 5e-4, "beta_s_per_byte": 1e-9}},
              "all_gather": {"2": {"alpha_s": 2e-4, "beta_s_per_byte": 1e-9}},
              "reduce_scatter": {"2": {"alpha_s": 3e-4, "beta_s_per_byte": 1e-9}}},
}
# 20 ms of matmuls + 2 ms of ops + 2 ms of DTensor ops + 10 ms of bytes = 34 ms.
WORK = {"flops": 2e9, "ops": 1000, "dtensor_ops": 100, "bytes": 2e8}


@pytest.fixture(scope="module")
def st():
    with mingpt_imported("step_time") as m:
        yield m["step_time"]


def test_work_is_matmuls_ops_dtensor_ops_and_bytes(st):
    assert st.work_seconds(WORK, PROFILE["compute"]) == pytest.approx(0.034, rel=1e-12)


def test_a_collective_costs_its_calls_latency_and_its_size_over_the_link(st):
    # 2 all-reduces whose ring share is 3 MB on 4 ranks: the size S the lab's fit takes is the
    # share over nccl-tests' bus factor 2(n-1)/n = 1.5, 2 MB; 2 x 1 ms + 2 MB x 2 ns = 6 ms.
    comm = {"dp": {"all-reduce calls": 2, "all-reduce sent": 3_000_000,
                   "all-reduce received": 3_000_000, "all-reduce ranks": 4},
            # send/recv moves what it sends (factor 1): 4 x 0.5 ms + 1 MB x 1 ns = 3 ms
            "pp": {"send/recv calls": 4, "send/recv sent": 400_000,
                   "send/recv received": 1_000_000, "send/recv ranks": 2}}
    assert st.comm_seconds(comm, PROFILE) == pytest.approx(
        {"dp all-reduce": 0.006, "pp send/recv": 0.003}, rel=1e-12)


def test_a_group_size_the_lab_did_not_measure_takes_the_next_larger_or_the_largest(st):
    assert st.link(PROFILE, "all-reduce", 3) is PROFILE["model"]["all_reduce"]["4"]
    assert st.link(PROFILE, "all-reduce", 2) is PROFILE["model"]["all_reduce"]["2"]
    assert st.link(PROFILE, "all-reduce", 1024) is PROFILE["model"]["all_reduce"]["4"]


def test_a_world_larger_than_the_lab_measured_is_not_predicted(st):
    # 8 ranks where the lab measured 4 on one machine: the rest would cross links it never saw.
    with pytest.raises(ValueError) as e:
        st.predict(8, 1, {0: {"work": WORK, "comm": {}}}, PROFILE)
    assert str(e.value) == ("the machine profile measured at most 4 ranks on one machine; a "
                            "run of 8 ranks spans others: measure it where it runs (python "
                            "bench/comm_lab.py --worlds ...)")


def test_more_ranks_than_cores_divide_all_the_work_over_the_cores(st):
    # 4 ranks on 2 cores: rank 0 works 34 ms, rank 1 24 ms (their mean 29 ms stands for all
    # four): the cores need 29 x 4 / 2 = 58 ms, more than the slowest rank's 34 ms alone; then
    # its all-reduce, 2 x 1 ms + 2 MB x 2 ns = 6 ms, on the same cores (no overlap): 64 ms.
    comm = {"dp": {"all-reduce calls": 2, "all-reduce sent": 3_000_000,
                   "all-reduce received": 3_000_000, "all-reduce ranks": 4}}
    plans = {0: {"work": WORK, "comm": comm},
             1: {"work": {**WORK, "flops": 1e9}, "comm": comm}}
    p = st.predict(4, 1, plans, PROFILE)
    assert p["slowest rank"] == 0 and p["cores bound"]
    assert p["capacity"] == pytest.approx(0.058, rel=1e-12)
    assert p["step"] == pytest.approx(0.064, rel=1e-12)
    # On GPUs (nccl: a device per rank) the cores bound nothing: 34 + 6 ms.
    p = st.predict(4, 1, plans, {**PROFILE, "backend": "nccl"})
    assert not p["cores bound"] and p["step"] == pytest.approx(0.040, rel=1e-12)


def test_a_pipeline_stage_idles_p_minus_1_of_m_plus_p_minus_1_slots(st):
    # 2 stages on 2 cores, 4 micro-batches under 1F1B: 34 ms of work take (4 + 2 - 1) / 4 as
    # long, 42.5 ms, 8.5 of them the bubble; then 3 ms of send/recv.
    comm = {"pp": {"send/recv calls": 4, "send/recv sent": 1_000_000,
                   "send/recv received": 1_000_000, "send/recv ranks": 2}}
    p = st.predict(2, 2, {0: {"work": WORK, "comm": comm}}, PROFILE, microbatches=4)
    assert p["ranks"][0]["bubble"] == pytest.approx(0.0085, rel=1e-12)
    assert not p["cores bound"] and p["step"] == pytest.approx(0.0455, rel=1e-12)


def test_the_dry_run_prints_the_predicted_step_of_its_plans(tmp_path, capsys):
    """main.py's dry run with a profile file: the table's last line is predict() of the plans
    it printed, to the tenth of a millisecond it shows; without the file, one line says so
    and the plan still prints."""
    profile = tmp_path / "lab.json"
    profile.write_text(json.dumps(PROFILE))
    args = ["gpt_config.model_type=null", "gpt_config.n_layer=2", "gpt_config.n_head=2",
            "gpt_config.n_embd=32", "gpt_config.block_size=32", "trainer_config.batch_size=4",
            "trainer_config.device=cpu", "trainer_config.dry_run=2",
            "trainer_config.distributed_method=fsdp"]
    with mingpt_imported("main", "dry_run", "step_time") as m:
        cfg = m["config"].load([*args, f"trainer_config.dry_run_profile={profile}"])
        lay, plans = m["dry_run"].run(cfg)
        out = capsys.readouterr().out
        step = m["step_time"].predict(2, 1, plans, PROFILE)["step"]
        assert out.splitlines()[-1].startswith(f"predicted step: {1e3 * step:.1f} ms (rank ")
        assert "dp all-gather" in out and "compute" in out
        m["dry_run"].run(m["config"].load(
            [*args, f"trainer_config.dry_run_profile={tmp_path / 'none.json'}"]))
        out = capsys.readouterr().out
        assert out.splitlines()[-1] == (f"predicted step: none (no machine profile at "
                                        f"{tmp_path / 'none.json'}: run python "
                                        "bench/comm_lab.py on the machine to plan for)")
        assert "memory per rank" in out
    assert (MINGPT / "bench/comm_lab.json").is_file()  # the default profile is committed
