"""The GPU paths (CUDA + NCCL), run where a GPU exists and skipped, saying so, where none does.

The rest of the suite forces the CPU (CUDA_VISIBLE_DEVICES=""); these tests give the GPUs back.
`tests/gpu_pass.sh OUT_DIR` runs this file with `python main.py` and the GPU benchmark.

Last run (2026-11-30, the code of 76b1555: `tests/gpu_pass.sh OUT tests`, this file with `-n 4`
beside `python main.py`): one NVIDIA H200, torch 2.11.0+cu130 (the machine's own; the series
pins 2.14.1; hydra-core, omegaconf and antlr4 carried as wheels), 15 passed, 10 skipped in 84 s;
`python main.py` val 1.7323, as at 7904bb3 (2026-11-29). The 15: step 02 with
NCCL, step 03's resume, the killed worker of steps 03 and 04, ddp and fsdp in bf16, fsdp offload
with fp16 and clipping, AdamW's step counts on resume, fsdp built on meta (with and without
offload), nn.DataParallel on one GPU, the memory snapshot with the profile and the CUDA-event
breakdown, the out-of-memory snapshot, the NCCL Flight Recorder dump, and the benchmark's profile
(test_bench_profiles_where_the_gpu_time_goes). The GPT-2 124M figures in bench/README.md are from
2026-11-28's run of the script. Never run on GPUs, needing two or more (10 skipped): step 02's
second node, tp and fsdp_tp, cp, zero's resume, pp's two schedules, the experts' all-to-all,
nn.DataParallel's replicas, and the communication lab's NCCL rows. On the CPU under torch 2.11 (not
on GPUs), two of those failed inside torch: pp (2.11's pipelining called the stage's forward with a
keyword `arg_mbs`) and fsdp_tp (2.11's DTensor could not order a `_StridedShard` placement); under
2.14.1 both pass on the CPU (test_mingpt_pipeline.py, test_mingpt_layouts.py).
"""
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import PYTHON, REPO, TORCHRUN, child_env, free_port, run
from mingpt_helpers import MINGPT, copy_mingpt, mingpt_imported, tiny, val_losses

GPUS = torch.cuda.device_count()
pytestmark = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU (none on this machine)")
VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(GPUS)))


def test_step02_nccl_one_process_per_gpu(tmp_path):
    proc = run([PYTHON, str(REPO / "02_multigpu/train.py"), "3", "1", "--device", "cuda"],
               cwd=tmp_path, CUDA_VISIBLE_DEVICES=VISIBLE)
    assert f"[cuda:0] Epoch 2 | Batchsize: 32 | Steps: {2048 // 32 // GPUS}" in proc.stdout
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True, map_location="cpu")
    assert all(t.device.type == "cpu" for t in state.values())


def test_step03_nccl_resume(tmp_path):
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={GPUS}",
           str(REPO / "03_torchrun_fault_tolerance/train.py"), "--device", "cuda"]
    run([*cmd, "2", "1"], cwd=tmp_path, CUDA_VISIBLE_DEVICES=VISIBLE)
    proc = run([*cmd, "3", "1"], cwd=tmp_path, CUDA_VISIBLE_DEVICES=VISIBLE)
    assert "Resuming training from snapshot at epoch 2" in proc.stdout


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs, one per 'node'")
def test_step02_torchrun_second_node_uses_its_local_gpu(tmp_path):
    """Two one-GPU 'nodes': the second has RANK=1 but only cuda:0, which LOCAL_RANK gives."""
    cmd = [TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv-id=step02-gpu",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           str(REPO / "02_multigpu/train.py"), "2", "1", "--device", "cuda"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=child_env(CUDA_VISIBLE_DEVICES=gpu),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for gpu in VISIBLE.split(",")[:2]]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert "[cuda:0] Epoch 1 | Batchsize: 32 | Steps: 32" in "".join(out for out, _ in outs)


@pytest.mark.parametrize("step", ["03_torchrun_fault_tolerance", "04_multinode"])
def test_killed_worker_resumes_on_the_gpu(tmp_path, step):
    """torchrun restarts a killed job on CUDA: the snapshot loads to the CPU, so set_rng_state
    works (a numpy RNG key mapped to cuda:N raised TypeError in every restart), the weights and
    momentum go back onto the GPU, and training carries on along the uninterrupted loss curve."""
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={GPUS}", "--max-restarts=1",
           str(REPO / step / "train.py"), "6", "2", "--device", "cuda"]
    plain = run([*cmd, "--snapshot_path", "a.pt"], cwd=tmp_path, CUDA_VISIBLE_DEVICES=VISIBLE)
    proc = run([*cmd, "--snapshot_path", "b.pt"], cwd=tmp_path, CUDA_VISIBLE_DEVICES=VISIBLE,
               FAULT_AT_EPOCH="3")
    assert "FAULT_AT_EPOCH=3: killing this worker" in proc.stdout
    assert "TypeError" not in proc.stderr
    assert "Resuming training from snapshot at epoch 2" in proc.stdout
    after = proc.stdout.split("Resuming training")[-1]
    assert re.findall(r"cuda:0\] Epoch (\d+) \| Batchsize", after) == ["2", "3", "4", "5"]
    loss = [float(x) for x in re.findall(r"Loss: ([0-9.]+)", after)]
    plain_loss = [float(x) for x in re.findall(r"Loss: ([0-9.]+)", plain.stdout)]
    assert loss == pytest.approx(plain_loss[2:], abs=2e-4)
    saved = torch.load(tmp_path / "b.pt", weights_only=True)  # each tensor where rank 0 had it
    assert saved["EPOCHS_RUN"] == 6
    assert {str(t.device) for t in saved["MODEL_STATE"].values()} == {"cuda:0"}
    momentum = [s["momentum_buffer"] for s in saved["OPTIMIZER_STATE"]["state"].values()]
    assert {str(t.device) for t in momentum} == {"cuda:0"}  # it followed the weights after resume
    assert len(saved["RNG_STATES"]) == GPUS
    assert all(r["numpy"][1].device.type == "cpu" for r in saved["RNG_STATES"])


@pytest.mark.parametrize("method", ["ddp", "fsdp"])
def test_mingpt_bf16_on_gpu(tmp_path, method):
    mingpt = copy_mingpt(tmp_path)
    proc = run([TORCHRUN, "--standalone", f"--nproc_per_node={GPUS}", "main.py",
                *tiny(f"run_name={method}", f"trainer_config.distributed_method={method}",
                      "trainer_config.precision=bf16", "trainer_config.eval_every=5")],
               cwd=mingpt, CUDA_VISIBLE_DEVICES=VISIBLE)
    assert re.search(r"device cuda", proc.stdout), proc.stdout[:2000]
    losses = val_losses(proc.stdout)  # {step: val loss}
    assert losses[max(losses)] < losses[0]
    assert "backend nccl" in proc.stdout


def test_mingpt_fsdp_cpu_offload_with_fp16_and_clipping(tmp_path):
    # Offloaded gradients are CPU tensors: clipping and the fp16 scaler reduce them over gloo,
    # which the process group has beside NCCL only when asked (an NCCL-only group crashed here).
    mingpt = copy_mingpt(tmp_path)
    proc = run([TORCHRUN, "--standalone", f"--nproc_per_node={GPUS}", "main.py",
                *tiny("run_name=offload", "trainer_config.distributed_method=fsdp",
                      "trainer_config.cpu_offload=true", "trainer_config.precision=fp16",
                      "trainer_config.grad_clip=1.0", "trainer_config.eval_every=5")],
               cwd=mingpt, CUDA_VISIBLE_DEVICES=VISIBLE)
    assert "backend cuda:nccl,cpu:gloo" in proc.stdout
    losses = val_losses(proc.stdout)
    assert losses[max(losses)] < losses[0]


def test_mingpt_resume_keeps_adam_step_counts_on_the_cpu(tmp_path):
    # A snapshot mapped straight to the GPU put AdamW's `step` counts there, and the foreach
    # path then synced the host for every parameter on every step. Loaded to the CPU, the
    # moments move to the GPU with their parameters and the counts stay on the CPU.
    with mingpt_imported() as m:
        config = m["model"].GPTConfig(model_type=None, n_layer=1, n_head=2, n_embd=16,
                                      vocab_size=11, block_size=8)
        model = m["model"].GPT(config).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 11, (2, 8), device="cuda")
        model(x, x)[1].backward()
        optimizer.step()
        m["shards"].save_file(str(tmp_path / "s.pt"), {"step": 1,
                                                         "optimizer": optimizer.state_dict()})
        resumed = torch.optim.AdamW(model.parameters(), lr=1e-3)
        resumed.load_state_dict(m["shards"].load_file(str(tmp_path / "s.pt"))["optimizer"])
    for state in resumed.state.values():
        assert state["step"].device.type == "cpu"
        assert state["exp_avg"].device.type == "cuda"


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_mingpt_fsdp_built_on_meta_holds_the_plain_weights_on_the_gpu(cpu_offload):
    """main.py's FSDP path on CUDA: built on meta, sharded, init_sharded. The weights are drawn
    on the CPU (as GPT(config) draws them), cut, and copied into shards on the GPU (or kept in
    CPU memory with offload), bit for bit the plain model's; the first forward matches it.
    Also: reset_peak_memory starts CUDA's peak counter afresh."""
    import gc

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)  # before the NCCL group, as distributed.setup does
    backend = "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        with mingpt_imported() as m:
            config = m["model"].GPTConfig(model_type=None, n_layer=2, n_head=2, n_embd=16,
                                          vocab_size=11, block_size=8, dropout=0.0)
            torch.manual_seed(0)
            reference = m["model"].GPT(config)
            torch.manual_seed(0)
            with torch.device("meta"):
                model = m["model"].GPT(config)
            model = m["parallel"].parallelize(model, device, "fsdp", cpu_offload=cpu_offload)
            m["fsdp"].init_sharded(model, device, cpu_offload)
            for a, b in zip(model.parameters(), reference.parameters(), strict=True):
                local = a.to_local()  # one rank: its shard is the whole parameter
                assert local.device.type == ("cpu" if cpu_offload else "cuda")
                assert torch.equal(local.cpu(), b)
            assert model.wte.weight is model.lm_head.weight
            x = torch.randint(0, 11, (2, 8))
            loss = model(x.to(device), x.to(device))[1]
            torch.testing.assert_close(loss.cpu(), reference(x, x)[1], rtol=1e-4, atol=1e-5)
            big = torch.ones(2**28, device=device)  # 1 GiB
            del big
            m["memory"].reset_peak_memory(device)
            assert m["memory"].peak_memory_mb(device)[0] < 512
            del model
    finally:
        # Free what holds the group first (tests/test_teardown.py: gloo threads at exit).
        for mesh in [o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)]:
            getattr(mesh, "_pg_registry", {}).clear()
        gc.collect()
        dist.destroy_process_group()


def test_mingpt_dp_one_process_drives_every_gpu(tmp_path):
    """nn.DataParallel: `python main.py`, one process, the batch split over every visible GPU;
    its snapshot is DDP's one file, which sample.py loads."""
    mingpt = copy_mingpt(tmp_path)
    proc = run([PYTHON, "main.py", *tiny("run_name=dp", "trainer_config.distributed_method=dp",
                                         "trainer_config.eval_every=5")],
               cwd=mingpt, CUDA_VISIBLE_DEVICES=VISIBLE)
    assert "device cuda:0" in proc.stdout and "world size 1" in proc.stdout, proc.stdout[:2000]
    losses = val_losses(proc.stdout)
    assert losses[max(losses)] < losses[0]
    assert (mingpt / "runs/dp/snapshot/latest").is_file()  # DCP's directory, as every layout
    sample = run([PYTHON, "sample.py", "--snapshot", "runs/dp/snapshot", "--num_tokens", "5"],
                 cwd=mingpt, CUDA_VISIBLE_DEVICES=VISIBLE)
    assert "loaded runs/dp/snapshot (dcp, step 10" in sample.stderr


@pytest.mark.skipif(GPUS < 2, reason="tensor parallelism needs 2 GPUs")
@pytest.mark.parametrize("method", ["tp", "fsdp_tp"])
def test_mingpt_tensor_parallel_on_gpus(tmp_path, method):
    """tp over 2 GPUs; fsdp_tp over every GPU (pairs of GPUs as TP groups) with NCCL."""
    nproc = 2 if method == "tp" or GPUS % 2 else GPUS
    mingpt = copy_mingpt(tmp_path)
    proc = run([TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "main.py",
                *tiny(f"run_name={method}", f"trainer_config.distributed_method={method}",
                      f"trainer_config.tp_size={2 if method == 'fsdp_tp' else 0}",
                      "trainer_config.eval_every=5")],
               cwd=mingpt, CUDA_VISIBLE_DEVICES=VISIBLE)
    assert "backend nccl" in proc.stdout
    losses = val_losses(proc.stdout)
    assert losses[max(losses)] < losses[0]
    assert (mingpt / f"runs/{method}/snapshot/latest").is_file()  # the sharded (DCP) layout


@pytest.mark.skipif(GPUS < 2, reason="ZeRO shards its optimizer over 2 GPUs")
def test_mingpt_zero_resumes_on_gpus_with_fused_adamw(tmp_path):
    """ZeroRedundancyOptimizer.load_state_dict leaves AdamW's step counts on the CPU, and CUDA's
    fused kernel (what build_optimizer builds) refused them at the first resumed step."""
    mingpt = copy_mingpt(tmp_path)
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "main.py", "run_name=zero",
           "trainer_config.distributed_method=zero"]
    run([*cmd, *tiny("trainer_config.max_steps=4")], cwd=mingpt, CUDA_VISIBLE_DEVICES=VISIBLE)
    proc = run([*cmd, *tiny()], cwd=mingpt, CUDA_VISIBLE_DEVICES=VISIBLE)  # resumes at step 4
    assert "resumed from" in proc.stdout and "step 10/10" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.skipif(GPUS < 2, reason="nn.DataParallel's replicas need 2 GPUs")
def test_mingpt_dp_replicas_compute_in_bf16_and_count_every_gpu(tmp_path):
    """parallel_apply's replica threads started from CUDA's default autocast dtype, fp16, in a
    bf16 run; and MFU and peak memory counted GPU 0 only."""
    mods_dir = copy_mingpt(tmp_path)
    with mingpt_imported() as m:
        dtypes = []
        layer = torch.nn.Linear(8, 8).cuda()
        layer.register_forward_hook(lambda mod, args, out: dtypes.append(out.dtype))
        model = m["dataparallel"].DataParallel(layer)
        with m["precision"].autocast(torch.device("cuda"), "bf16"):
            model(torch.ones(2 * GPUS, 8, device="cuda"))
        assert set(dtypes) == {torch.bfloat16} and len(dtypes) == GPUS, dtypes
        assert len(m["wrappers"].local_devices(model, torch.device("cuda"))) == GPUS
    proc = run([PYTHON, "main.py", *tiny("run_name=dp", "trainer_config.distributed_method=dp",
                                         "trainer_config.precision=bf16")],
               cwd=mods_dir, CUDA_VISIBLE_DEVICES=VISIBLE)
    table = proc.stdout[proc.stdout.index("memory per rank"):]
    peaks = re.search(r"training peak(.*)", table).group(1).split()
    assert len(peaks) == GPUS, table  # one column per GPU of the one process


def _cp_attention_worker(rank: int, store: str, out: str) -> None:
    """One of 2 GPUs: PyTorch's own context parallelism (what context.py picks on CUDA) on
    this rank's zig-zag chunks, forward and backward, against exact (float64) attention."""
    import json
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from test_mingpt_context import reference

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    with mingpt_imported() as m:
        context = m["parallel"].context
        mesh = init_device_mesh("cuda", (1, 2), mesh_dim_names=("dp", "cp"))
        switch = context._Switch()
        switch.active = True  # as in a forward with targets
        attend = context.ContextParallelAttention(mesh["cp"], switch)
        torch.manual_seed(0)  # the same tensors on both ranks: each keeps its chunks
        q, k, v, dout = (torch.randn(2, 3, 64, 16) for _ in range(4))
        exact, sizes, roundings = reference(q, k, v, dout)
        pos = context.zigzag_positions(64, 2, rank)
        local = [t[:, :, pos].cuda().requires_grad_() for t in (q, k, v)]
        from torch.distributed.tensor.debug import CommDebugMode
        with CommDebugMode() as comm:  # the ring's collectives, forward and backward
            y = attend(*local, 0.0)
            y.backward(dout[:, :, pos].cuda())
        # K/V rotated all-to-all, as on the CPU ring (torch's default would all-gather them)
        counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
        beyond = {}
        for name, got, x, size in zip(("out", "dq", "dk", "dv"), (y, *(t.grad for t in local)),
                                      exact, sizes, strict=True):
            # The bound of test_mingpt_context.reference, as for the CPU ring.
            bound = (roundings + 4) * 2.0**-24 * size[:, :, pos]
            beyond[name] = int(((got.detach().cpu().double() - x[:, :, pos]).abs() > bound)
                               .sum())
        from torch.distributed.tensor import DTensor
        flash = torch.ops.aten._scaled_dot_product_flash_attention.default
        dispatch = [flash in DTensor._op_dispatcher._custom_op_handlers]
        context.end_run()  # as distributed.release() does when a run ends
        dispatch.append(flash in DTensor._op_dispatcher._custom_op_handlers)
        result = {"torch_ring": attend.torch_ring is not None, "beyond": beyond,
                  "all_to_all": counts.get("all_to_all_single", 0) > 0,
                  "all_gather": counts.get("all_gather_into_tensor", 0),
                  "dispatch on, after end_run": dispatch,
                  "rotate after end_run": context.torch_cp()._cp_options.rotate_method.name}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.skipif(GPUS < 2, reason="context parallelism needs 2 GPUs")
def test_mingpt_context_parallel_on_gpus_equals_full_attention_and_trains(tmp_path):
    """cp_size=2 on 2 GPUs: PyTorch's context parallelism is chosen (not the CPU ring) and
    computes what full attention computes, as the CPU ring does (test_mingpt_context.py),
    rotating K/V all-to-all as the CPU ring does, its dispatch off once the run ends; then
    main.py trains with it over NCCL and resumes."""
    import json

    import torch.multiprocessing as mp

    mp.start_processes(_cp_attention_worker, args=(str(tmp_path / "store"), str(tmp_path)),
                       nprocs=2, start_method="spawn")
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {"torch_ring": True,
                          "beyond": {"out": 0, "dq": 0, "dk": 0, "dv": 0},
                          "all_to_all": True, "all_gather": 0,
                          "dispatch on, after end_run": [True, False],
                          "rotate after end_run": "ALL_GATHER"}, (rank, result)
    mingpt = copy_mingpt(tmp_path)
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "main.py"]
    args = ["run_name=cp", "trainer_config.cp_size=2", "gpt_config.dropout=0.0",
            "trainer_config.eval_every=5"]
    first = run([*cmd, *tiny(*args, "trainer_config.max_steps=5")], cwd=mingpt,
                CUDA_VISIBLE_DEVICES=VISIBLE)
    proc = run([*cmd, *tiny(*args)], cwd=mingpt, CUDA_VISIBLE_DEVICES=VISIBLE)  # from step 5
    assert "backend nccl" in proc.stdout and "resumed from" in proc.stdout
    start, end = val_losses(first.stdout), val_losses(proc.stdout)
    assert end[10] < start[5] < start[0], (start, end)


def test_mingpt_memory_snapshot_profile_and_breakdown_on_the_gpu(tmp_path):
    """memory_snapshot writes every rank's CUDA allocation history (PyTorch's memory visualizer
    reads it), profile_steps a trace with CUDA kernels, and the log line a breakdown read from
    CUDA events (tests/test_mingpt_hang.py checks the same on a CPU)."""
    import json
    import pickle

    mingpt = copy_mingpt(tmp_path)
    proc = run([TORCHRUN, "--standalone", f"--nproc_per_node={GPUS}", "main.py",
                *tiny("run_name=gpu_debug", "trainer_config.memory_snapshot=true",
                      "trainer_config.profile_steps=2", "trainer_config.sample_tokens=0")],
               cwd=mingpt, CUDA_VISIBLE_DEVICES=VISIBLE)
    lines = re.findall(r"^step \d+/10 \| .* \| step ([0-9.]+) ms: data \d+% forward \d+% "
                       r"backward \d+% optimizer \d+%$", proc.stdout, re.M)
    assert len(lines) == 2 and all(float(ms) > 0 for ms in lines), proc.stdout[-2000:]
    run_dir = mingpt / "runs/gpu_debug"
    for rank in range(GPUS):
        with open(run_dir / f"memory/rank{rank}.pickle", "rb") as f:
            snapshot = pickle.load(f)  # torch's own format, from this test's own run
        events = [e for trace in snapshot["device_traces"] for e in trace]
        assert snapshot["segments"] and any(e["action"] == "alloc" for e in events)
        # The allocations' stacks reach the series' code (the model's forward, say).
        assert any("mingpt" in frame["filename"] for e in events for frame in e["frames"])
        trace = json.loads((run_dir / f"profile/rank{rank}.json").read_text())
        assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])


def test_bench_profiles_where_the_gpu_time_goes(tmp_path):
    """bench.py --profile on a GPU: every kernel's time by kind, the GPU's busy share, and the
    round that waits for the GPU only at its ends (tests/test_mingpt_bench.py sorts the kernel
    names an H200 ran)."""
    import json

    mingpt = copy_mingpt(tmp_path)
    run([PYTHON, "bench/bench.py", "--runs", "ddp:1", "--preset", "gpt-nano", "--block_size",
         "64", "--batch_size", "8", "--steps", "6", "--warmup", "2", "--rounds", "1",
         "--precision", "bf16", "--profile", "3", "--out", "bench/gpu"], cwd=mingpt,
        CUDA_VISIBLE_DEVICES=VISIBLE)
    result = json.loads((mingpt / "bench/gpu.json").read_text())["results"][0]
    profile = result["profile"]
    assert profile["kinds_ms"]["matmul"] > 0 and profile["kinds_ms"]["optimizer"] > 0, profile
    assert sum(profile["kinds_ms"].values()) == pytest.approx(profile["gpu_ms_per_step"])
    assert 0 < profile["gpu_busy"] <= 1
    assert result["unsynced_tokens_per_s"] > 0


def test_mingpt_out_of_memory_writes_the_memory_snapshot(tmp_path):
    """An out-of-memory error inside memory_history leaves the snapshot, then goes on as before."""
    import torch.distributed as dist

    with mingpt_imported("main") as m:
        device = torch.device("cuda", 0)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            with pytest.raises(torch.OutOfMemoryError):
                with m["main"].profiling.memory_history(True, str(tmp_path), device):
                    kept = torch.ones(2**20, device=device)  # noqa: F841  (in the snapshot)
                    torch.empty(2**50, device=device)  # 1 PiB: more than any GPU has
        finally:
            dist.destroy_process_group()
    assert (tmp_path / "memory/rank0.pickle").stat().st_size > 0


@pytest.mark.skipif(GPUS < 2, reason="pipeline parallelism needs 2 GPUs, one stage each")
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_zb"])
def test_mingpt_pipeline_on_gpus(tmp_path, schedule):
    """pp over 2 GPUs with NCCL's point-to-point sends, in bf16: it learns, saves the sharded
    layout, resumes from it, and samples from the whole model the snapshot holds (the CPU
    test of the same mechanism: tests/test_mingpt_pipeline.py)."""
    mingpt = copy_mingpt(tmp_path)
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "main.py", "run_name=pp",
           "trainer_config.distributed_method=pp", f"trainer_config.pp_schedule={schedule}",
           "trainer_config.precision=bf16"]
    four = "gpt_config.n_layer=4"  # interleaved_zb: 2 stages per GPU, a block each
    proc = run([*cmd, *tiny(four, "trainer_config.max_steps=6", "trainer_config.eval_every=3")],
               cwd=mingpt, CUDA_VISIBLE_DEVICES=VISIBLE)
    assert "backend nccl" in proc.stdout
    losses = val_losses(proc.stdout)
    assert losses[6] < losses[0], losses
    assert (mingpt / "runs/pp/snapshot/latest").is_file()  # the sharded (DCP) layout
    proc = run([*cmd, *tiny(four)], cwd=mingpt, CUDA_VISIBLE_DEVICES=VISIBLE)  # resumes at 6
    assert "resumed from" in proc.stdout and "step 10/10" in proc.stdout, proc.stdout[-2000:]
    assert "sample:" in proc.stdout


# One NCCL rank: forensics.dump as a failed rank calls it, once over a file the watchdog wrote
# (kept as it was), once alone (torch's NCCL dump: its own recorder's entries).
NCCL_DUMP = f"""
import os, pickle, sys
sys.path.insert(0, {str(MINGPT)!r})
os.environ["TORCH_FR_BUFFER_SIZE"] = "100"
import torch, torch.distributed as dist
from mingpt import forensics
torch.cuda.set_device(0)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
dist.all_reduce(torch.ones(4, device="cuda"))
torch.cuda.synchronize()
run_dir = sys.argv[1]
folder = os.path.join(run_dir, "flight_recorder")
os.makedirs(folder)
with open(os.path.join(folder, "rank0"), "wb") as f:
    f.write(b"the watchdog's dump")
forensics.dump(run_dir, "first", [])
print(open(os.path.join(folder, "rank0"), "rb").read() == b"the watchdog's dump")
os.remove(os.path.join(folder, "rank0"))
forensics.dump(run_dir, "second", [])
with open(os.path.join(folder, "rank0"), "rb") as f:
    print(sorted({{e["profiling_name"] for e in pickle.load(f)["entries"]}}))
print(sorted(os.listdir(folder)))
dist.destroy_process_group()
"""


def test_a_ranks_nccl_dump_is_torchs_and_never_replaces_the_watchdogs(tmp_path):
    """On NCCL a rank's own dump is torch's NCCL dump (_dump_nccl_trace: the recorder the
    watchdog reads), and a rank<N> the watchdog already wrote at the timeout stays as it was:
    its dump was taken before the communicator was torn down."""
    proc = run([PYTHON, "-c", NCCL_DUMP, str(tmp_path)], CUDA_VISIBLE_DEVICES=VISIBLE)
    kept, ops, files = proc.stdout.splitlines()[-3:]
    assert kept == "True", proc.stdout
    assert "nccl:all_reduce" in ops, ops
    assert files == "['rank0', 'where0.json']"  # no .tmp left behind either time


# Rows each rank sends to rank 0 and rank 1: uneven, one split empty (the experts' exchange).
A2A_SEND = ((1, 3), (2, 0))


def _a2a_rows(rank: int, device) -> torch.Tensor:
    """Rank `rank`'s rows to send, 4 values each, distinct on every rank."""
    rows = sum(A2A_SEND[rank])
    return torch.arange(rows * 4, dtype=torch.float32, device=device).view(rows, 4) + 100 * rank


def _a2a_worker(rank: int, store: str, out: str, backend: str = "nccl") -> None:
    """(backend gloo: the same check on the CPU, where the expected values were checked.)"""
    import json

    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_fn
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            device_id=device if backend == "nccl" else None)
    send = list(A2A_SEND[rank])
    recv = [A2A_SEND[src][rank] for src in (0, 1)]
    x = _a2a_rows(rank, device).requires_grad_()
    y = dist_fn.all_to_all_single(x.new_empty(sum(recv), 4), x, recv, send)
    # A loss whose gradient is a different number per received row and rank: each sent row's
    # gradient must come back from the rank (and the place) it went to.
    weight = lambda r: torch.arange(sum(A2A_SEND[s][r] for s in (0, 1)) * 4,  # noqa: E731
                                    dtype=torch.float32, device=device).view(-1, 4) + 1000 * r
    (y * weight(rank)).sum().backward()
    expected_y = torch.cat([_a2a_rows(src, device)[sum(A2A_SEND[src][:rank]):][:recv[src]]
                            for src in (0, 1)])
    grad = []
    for dst in (0, 1):  # my rows to dst sit after the rows of the ranks before me there
        before = sum(A2A_SEND[src][dst] for src in range(rank))
        grad.append(weight(dst)[before:before + send[dst]])
    result = {"y": torch.equal(y.detach(), expected_y),
              "grad": torch.equal(x.grad, torch.cat(grad))}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.skipif(GPUS < 2, reason="expert parallelism's all-to-all needs 2 GPUs")
def test_mingpt_experts_all_to_all_on_gpus(tmp_path):
    """NCCL's all_to_all_single with uneven splits (one empty) and its autograd backward, as
    05_mingpt/mingpt/parallel/expert.py sends tokens to their experts; then main.py trains a
    MoE with ep_size=2 over NCCL."""
    import json

    import torch.multiprocessing as mp

    mp.start_processes(_a2a_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == \
            {"y": True, "grad": True}, rank
    mingpt = copy_mingpt(tmp_path)
    proc = run([TORCHRUN, "--standalone", "--nproc_per_node=2", "main.py",
                *tiny("run_name=ep", "gpt_config.n_expert=4", "gpt_config.expert_top_k=2",
                      "trainer_config.ep_size=2", "trainer_config.eval_every=5")],
               cwd=mingpt, CUDA_VISIBLE_DEVICES=VISIBLE)
    assert "backend nccl" in proc.stdout and "tokens/expert" in proc.stdout
    losses = val_losses(proc.stdout)
    assert losses[max(losses)] < losses[0]


@pytest.mark.skipif(GPUS < 2, reason="the communication lab's NCCL rows need 2 GPUs")
def test_comm_lab_times_nccls_collectives_and_fits_their_link(tmp_path):
    """bench/comm_lab.py on 2 GPUs takes NCCL (test_mingpt_bench.py runs the same lab on 2 gloo
    ranks): a row per collective and size, busbw by nccl-tests' factors, and a link model per
    collective that the dry run can read."""
    import json

    mingpt = copy_mingpt(tmp_path)
    run([PYTHON, "bench/comm_lab.py", "--worlds", "2", "--max_bytes", "1048576", "--seconds",
         "0.05", "--out", "bench/lab_nccl"], cwd=mingpt, CUDA_VISIBLE_DEVICES=VISIBLE)
    info = json.loads((mingpt / "bench/lab_nccl.json").read_text())
    assert info["backend"] == "nccl" and info["worlds"] == [2]
    factor = {"all_reduce": 1.0, "reduce_scatter": 0.5, "all_gather": 0.5, "all_to_all": 0.5,
              "broadcast": 1.0, "send_recv": 1.0}
    assert sorted({r["collective"] for r in info["rows"]}) == sorted(factor)
    for r in info["rows"]:
        assert r["seconds"] > 0
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor[r["collective"]])
    assert all(by_world["2"]["alpha_s"] >= 0 for by_world in info["model"].values())
