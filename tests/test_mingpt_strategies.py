"""05_mingpt's strategies beyond DDP (zero, tp, fsdp_tp, dp): the same loss trajectory as DDP,
exact resume, snapshots that other strategies and sample.py load, and one-line errors.

All multi-rank checks run in ONE pair of spawned gloo processes (a process group is one per
process), which train every strategy in-process through main.load_train_objs and the Trainer,
as main.py does, and run main.train for its error path. The rest is config checking in this
process. (fsdp itself is tested in test_mingpt_parallel.py and test_mingpt_train.py.)
"""
import contextlib
import gc
import io
import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before any group exists (test_teardown.py)
import torch.multiprocessing as mp
import yaml
from omegaconf import DictConfig, OmegaConf
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import mesh_2x2_worker
from conftest import REPO
from mingpt_helpers import mingpt_imported, tiny, train_losses, val_losses

CPU = torch.device("cpu")
# run -> (distributed_method, batch_size per data-parallel rank, tp_size). On 2 ranks, ddp
# and zero split each step's 8 sequences 4 + 4; tp and fsdp_tp over a (dp=1, tp=2) mesh give
# both ranks all 8. The trainer deals the same permutation over the dp ranks, so every run
# trains on the same 8 sequences per step: the losses compare. (A (2, 2) mesh needs 4 ranks:
# its snapshot round trip is the last test here.)
METHODS = {"ddp": ("ddp", 4, 0), "zero": ("zero", 4, 0), "fsdp": ("fsdp", 4, 0),
           "tp": ("tp", 8, 0), "fsdp_tp": ("fsdp_tp", 8, 2)}
NEW = ("zero", "fsdp", "tp")  # trained twice more: stopped halfway, then resumed
# Train losses (log lines, 4 decimals) of every run within this of DDP's, at every step
# (measured: equal to all 4 decimals), and the weights after the last step. zero adds the
# same numbers in the same order (measured: bitwise equal); fsdp's reduce-scatter sums in
# another order than the all-reduce (measured: at most 6e-8); tp's sharded matmuls add up in
# another order, which moves the 6th-7th digit (measured: at most 3.4e-6).
LOSS_TOLERANCE = 1e-4
WEIGHT_TOLERANCE = {"ddp": 0.0, "zero": 1e-6, "fsdp": 1e-6, "tp": 5e-5, "fsdp_tp": 5e-5}
STEPS, HALF = 4, 2


def overrides(name: str, run_dir: Path, text: Path, max_steps: int) -> list[str]:
    method, batch, tp_size = METHODS[name]
    return tiny(f"run_dir={run_dir}", f"data_config.path={text}",
                f"trainer_config.distributed_method={method}", f"trainer_config.tp_size={tp_size}",
                f"trainer_config.batch_size={batch}", f"trainer_config.max_steps={max_steps}",
                f"trainer_config.snapshot_path={run_dir}/snapshot",
                # No dropout: TP's ranks draw other masks than DDP's. A constant lr after the
                # warmup: the run of HALF steps is exactly the first half of the longer one.
                "gpt_config.dropout=0.0", "trainer_config.min_lr_ratio=1.0",
                "trainer_config.log_every=1", "trainer_config.save_every=0",
                "trainer_config.eval_batches=2", "trainer_config.sample_tokens=0")


def configure(m: dict, args: list[str], base: dict = {}) -> DictConfig:  # noqa: B006 (a cache)
    """config.load(args), with hydra's composition (0.5 s on a busy CI machine) done once: the
    runs differ only in the keys overrides() sets, put into a copy and checked by validate."""
    if "cfg" not in base:
        base["cfg"] = m["config"].load(args)
    cfg = base["cfg"].copy()
    for arg in args:
        key, value = arg.split("=", 1)
        OmegaConf.update(cfg, key, yaml.safe_load(value) if key != "run_dir" else value)
    m["config"].validate(cfg)
    return cfg


def full(m: dict, t: torch.Tensor) -> torch.Tensor:
    """The global tensor; TP's q/k/v under FSDP need tensor_parallel's own gather."""
    t = m["tensor"].whole_strided(t)
    return t.full_tensor() if isinstance(t, DTensor) else t


def fit(m: dict, args: list[str]) -> tuple[str, dict]:
    """main.train's steps in this process: build, resume, train; (rank 0's log, full weights)."""
    cfg = configure(m, args)
    t = cfg.trainer_config
    model, optimizer, train_set, val_set, data, meta, flops = \
        m["main"].load_train_objs(cfg, CPU)
    trainer = m["trainer"].Trainer(t, model, optimizer, train_set, val_set, CPU, cfg.run_dir,
                                   meta, flops)
    state = m["snapshot"].load(t.snapshot_path, t.distributed_method, model, optimizer, meta,
                               data.MATCH_KEYS)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        if state is not None:
            trainer.load_state_dict(state)
        trainer.train()
    # Collective for DTensors (tp, fsdp): every rank gathers each whole tensor in turn.
    weights = {k: full(m, v).clone()
               for k, v in m["common"].unwrap(model).state_dict().items()}
    return log.getvalue(), weights


def _worker(rank: int, store: str, out: str, text: str) -> None:
    torch.set_num_threads(1)  # two processes share the cores
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    out_dir, result = Path(out), {}
    with mingpt_imported("main") as m:
        for method in METHODS:
            whole, half = out_dir / f"{method}_whole", out_dir / f"{method}_half"
            log, weights = fit(m, overrides(method, whole, text, STEPS))
            result[method] = {"log": log}
            if rank == 0:
                torch.save(weights, out_dir / f"{method}.pt")
            if method in NEW:
                fit(m, overrides(method, half, text, HALF))  # saves at step HALF ...
                resumed_log, resumed = fit(m, overrides(method, half, text, STEPS))  # resumes
                result[method] |= {"resumed_log": resumed_log, "resumed_equal": all(
                    torch.equal(weights[k], resumed[k]) for k in weights)}
        # Another strategy of the same layout resumes each snapshot: DCP reshards tp's into
        # fsdp's shards; zero's file is ddp's.
        for method, into in (("tp", "fsdp"), ("zero", "ddp")):
            args = overrides(into, out_dir / f"{method}_whole", text, STEPS)
            _, weights = fit(m, args)
            saved = torch.load(out_dir / f"{method}.pt") if rank == 0 else None
            result[f"{method}->{into}"] = rank != 0 or all(
                torch.equal(weights[k], saved[k]) for k in weights)
        result["errors"] = mesh_errors(m)
        # main.train's path for them: the message comes back (main.py prints it as one
        # `error:` line and exits 2) after the group-holding objects are released.
        with contextlib.redirect_stdout(io.StringIO()):
            result["train_error"] = m["main"].train(configure(m,
                overrides("tp", out_dir / "refused", text, STEPS)
                + ["gpt_config.n_head=3", "gpt_config.n_embd=48"]), CPU)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    # As distributed.release: free the meshes' group references so gloo's threads are joined.
    for mesh in [o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)]:
        getattr(mesh, "_pg_registry", {}).clear()
    gc.collect()
    dist.destroy_process_group()


def mesh_errors(m: dict) -> dict[str, str]:
    """The one-line ValueErrors where the world size (2) or the model does not fit the mesh."""
    model = m["model"]
    cases = {"tp_size=3": ("fsdp_tp", 3, 2), "tp over half": ("tp", 1, 2),
             "n_head=3": ("tp", 0, 3)}
    errors = {}
    for name, (method, tp_size, n_head) in cases.items():
        gpt = model.GPT(model.GPTConfig(model_type=None, n_layer=1, n_head=n_head,
                                        n_embd=8 * n_head, vocab_size=5, block_size=4))
        try:
            m["parallel"].parallelize(gpt, CPU, method, tp_size=tp_size)
        except ValueError as e:
            errors[name] = str(e)
    return errors


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """Both ranks' results; the weights are in out/<method>.pt, snapshots in out/<method>_*."""
    out = tmp_path_factory.mktemp("strategies")
    text = out / "input.txt"  # 40,000 characters of the usual text: fast to read, same vocab
    text.write_text((REPO / "05_mingpt/data/input.txt").read_text()[:40_000])
    mp.start_processes(_worker, args=(str(out / "store"), str(out), str(text)), nprocs=2,
                       start_method="spawn")  # any failure, an abort at exit too, raises
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_every_strategy_follows_ddps_loss_trajectory(spawned):
    _, (result, _) = spawned
    ddp = train_losses(result["ddp"]["log"])
    assert sorted(ddp) == list(range(1, STEPS + 1)) and ddp[STEPS] < ddp[1] - 0.1, ddp
    for method in METHODS:
        losses = train_losses(result[method]["log"])
        assert sorted(losses) == sorted(ddp), (method, losses)
        worst = max(abs(losses[s] - ddp[s]) for s in ddp)
        assert worst <= LOSS_TOLERANCE, (method, losses, ddp)


def test_every_strategy_ends_at_ddps_weights(spawned):
    out, _ = spawned
    ddp = torch.load(out / "ddp.pt")
    for method in METHODS:
        weights = torch.load(out / f"{method}.pt")
        worst = max((weights[k] - ddp[k]).abs().max().item() for k in ddp)
        assert worst <= WEIGHT_TOLERANCE[method], (method, worst)


def test_every_new_strategy_resumes_bitwise(spawned):
    for rank, result in enumerate(spawned[1]):
        for method in NEW:
            r = result[method]
            assert r["resumed_equal"], method  # the final weights, bit for bit, on each rank
            if rank:
                continue  # the log lines come from rank 0
            whole, resumed = train_losses(r["log"]), train_losses(r["resumed_log"])
            assert sorted(resumed) == list(range(HALF + 1, STEPS + 1)), (method, resumed)
            assert all(resumed[s] == whole[s] for s in resumed), (method, resumed, whole)
            assert val_losses(r["resumed_log"])[STEPS] == val_losses(r["log"])[STEPS], method
            assert "resumed from" in r["resumed_log"], method
    assert not (spawned[0] / "refused").exists()  # refused before the run folder was written


def test_snapshots_load_into_another_strategy_of_their_layout(spawned):
    for result in spawned[1]:
        for pair in ("tp->fsdp", "zero->ddp"):
            assert result[pair] is True, pair


def test_sample_loads_every_strategys_snapshot(spawned):
    out, _ = spawned
    with mingpt_imported() as m:
        for method in METHODS:
            weights = torch.load(out / f"{method}.pt")
            model, meta = m["sample"].load_model(str(out / f"{method}_whole/snapshot"), CPU)
            loaded = model.state_dict()
            assert all(torch.equal(loaded[k], weights[k]) for k in weights), method
            text = m["sample"].generate_text(model, meta, "\n", 5, device=CPU)
            assert len(text) == 6, (method, text)


def test_mesh_errors_are_one_line(spawned):
    assert spawned[1][0]["train_error"] == (
        "tensor parallelism over tp_size=2 ranks needs n_head and n_embd divisible by 2, got "
        "n_head=3, n_embd=48; change the model or trainer_config.tp_size")
    errors = spawned[1][0]["errors"]
    assert errors == {
        "tp_size=3": "trainer_config.tp_size=3 must divide the world size 2 (the ranks form "
                     "world_size / tp_size tensor-parallel groups)",
        "tp over half": "distributed_method=tp puts every rank in one tensor-parallel group, "
                        "so tp_size must be 0 or the world size (2), got 1; use fsdp_tp for "
                        "data parallelism across TP groups",
        "n_head=3": "tensor parallelism over tp_size=2 ranks needs n_head and n_embd divisible "
                    "by 2, got n_head=3, n_embd=24; change the model or trainer_config.tp_size",
    }


# --- in this process: config checks, the TP model, clipping ----------------------------------

@pytest.mark.parametrize("args, message", [
    (["trainer_config.distributed_method=tp", "trainer_config.tp_size=3"],
     "tensor parallelism over tp_size=3 ranks needs n_head and n_embd divisible by 3, got "
     "n_head=2, n_embd=32; change the model or trainer_config.tp_size"),
    (["trainer_config.tp_size=2"],
     "trainer_config.tp_size must be 0 unless distributed_method is tp or fsdp_tp, got 2"),
    (["trainer_config.distributed_method=fsdp_tp", "trainer_config.tp_size=-1"],
     "trainer_config.tp_size must be an integer >= 0 (0: every rank), got -1"),
])
def test_config_refuses_tp_sizes_that_do_not_fit(args, message):
    with mingpt_imported() as m:
        with pytest.raises(ValueError) as e:
            m["config"].load(tiny(*args))
    assert str(e.value) == message


@pytest.mark.parametrize("args, env, message", [
    (["trainer_config.device=cpu"], {}, "from one process, and this run has none (device=cpu "
     "or no GPU); use ddp, which runs on CPUs and GPUs"),
    ([], {"WORLD_SIZE": "2"}, "runs in ONE process that drives every GPU, but 2 processes "
     "were started: use python main.py, not torchrun (or use ddp, one process per GPU)"),
])
def test_dp_says_why_it_cannot_run(monkeypatch, args, env, message):
    """Checked with the config, before any process group, run folder or model exists."""
    if env and not torch.cuda.is_available():
        pytest.skip("the process-count check follows the GPU check; needs a CUDA GPU")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with mingpt_imported() as m:
        with pytest.raises(ValueError) as e:
            m["config"].load(tiny("trainer_config.distributed_method=dp", *args))
    assert str(e.value).startswith("distributed_method=dp ") and str(e.value).endswith(message)


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group (an in-memory store), as `python main.py` makes one."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    for mesh in [o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)]:
        getattr(mesh, "_pg_registry", {}).clear()  # as distributed.release, before destroying
    gc.collect()
    dist.destroy_process_group()


def test_dp_refuses_a_cpu_model_where_the_config_was_not_checked(group):
    """parallelize's own check, for callers that skip config.py (notebooks, tests)."""
    with mingpt_imported() as m:
        gpt = m["model"].GPT(m["model"].GPTConfig(model_type=None, n_layer=1, n_head=2,
                                                  n_embd=8, vocab_size=5, block_size=4))
        with pytest.raises(ValueError) as e:
            m["parallel"].parallelize(gpt, CPU, "dp")
    assert str(e.value) == ("distributed_method=dp (nn.DataParallel) splits each batch across "
                            "CUDA GPUs and needs at least one; on the CPU use ddp")


@pytest.mark.parametrize("method", ["tp", "fsdp_tp"])
def test_tp_with_activation_checkpointing_computes_the_plain_models_loss_and_grads(group,
                                                                                  method):
    """TP is applied before the checkpoint wrapper (which would hide the submodules its plan
    names), and the sharded model computes what the plain one does."""
    with mingpt_imported() as m:
        torch.manual_seed(0)
        config = m["model"].GPTConfig(model_type=None, n_layer=2, n_head=2, n_embd=16,
                                      vocab_size=11, block_size=8, dropout=0.0)
        plain = m["model"].GPT(config)
        torch.manual_seed(0)
        model = m["parallel"].parallelize(m["model"].GPT(config), CPU, method,
                                             activation_checkpointing=True)
        qkv = [p for name, p in model.named_parameters() if "c_attn" in name]
        assert len(qkv) == 4 and all(isinstance(p, DTensor) for p in qkv)
        assert list(model.state_dict()) == list(plain.state_dict())  # snapshots interchange
        x = torch.randint(0, 11, (4, 8), generator=torch.Generator().manual_seed(1))
        loss, expected = model(x, x)[1], plain(x, x)[1]
        torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
        loss.backward()
        expected.backward()
        for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(full(m, a.grad), b.grad, rtol=0, atol=1e-6, msg=name)
        # The norm over plain and DTensor gradients (two meshes) equals torch's on the plain.
        norm = m["common"].clip_grad_norm_(model.parameters(), 1e-3)
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(plain.parameters(),
                                                                        1e-3))
        for a, b in zip(model.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(full(m, a.grad), b.grad, rtol=0, atol=1e-8)



# --- fsdp_tp on a (2, 2) mesh: the one layout that needs 4 ranks -----------------------------

def test_fsdp_tp_on_a_2x2_mesh_saves_the_global_weights_and_loads_its_shards(tmp_path):
    """FSDP cuts each rank's strided q/k/v slice into dp chunks: only on a (2, 2) mesh do both
    steps of tensor_parallel's gather and cut run on more than one rank. The four spawned
    processes (tests/mesh_2x2_worker.py, which imports only what it needs: four processes
    share two cores) train one step, save, and load the snapshot back into other weights."""
    mp.start_processes(mesh_2x2_worker.main, args=(str(tmp_path),), nprocs=4,
                       start_method="spawn")
    for rank in range(4):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {"shards_equal": True, "moments_equal": True}, (rank, result)
    with mingpt_imported() as m:
        plain = torch.load(tmp_path / "plain.pt")
        model = m["model"].GPT(m["model"].GPTConfig(**mesh_2x2_worker.CONFIG))
        m["snapshot"].load_sharded_weights(str(tmp_path / "snap"), model)
    # The snapshot holds the global weights a plain model reaches with the same step.
    # Measured: at most 6.8e-6 apart (AdamW's first step divides by tiny second moments);
    # a q/k/v slice in the wrong place is ~1e-2 off.
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, plain[key], rtol=0, atol=1e-4, msg=key)
