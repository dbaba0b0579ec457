"""Fast in-process checks of 05_mingpt's distributed pieces: the lr schedule, parallelize,
set_grad_sync, and snapshot compatibility and round trips, in a one-rank gloo group with an
in-memory store. The gradient-sync checks that need two ranks run in two spawned processes:
the default process group is one per process, so two threads cannot be two ranks."""
import copy
import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before any group exists (test_teardown.py)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt_helpers import U, assert_close_ulps, mingpt_imported, start_world

CPU = torch.device("cpu")
VOCAB, BLOCK = 11, 8


@pytest.fixture(scope="module")
def m():
    with mingpt_imported() as modules:
        yield modules


@pytest.fixture(scope="module")
def group(m):
    """A one-rank gloo group (an in-memory store, no port), as `python main.py` makes one."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def tiny_gpt(m, seed: int = 0, **config) -> torch.nn.Module:
    """A 2-layer GPT without dropout, so two forward passes over the same weights agree."""
    torch.manual_seed(seed)
    fields = dict(model_type=None, n_layer=2, n_head=2, n_embd=16, vocab_size=VOCAB,
                  block_size=BLOCK, dropout=0.0) | config
    return m["model"].GPT(m["model"].GPTConfig(**fields))


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (4, BLOCK), generator=g),
            torch.randint(0, VOCAB, (4, BLOCK), generator=g))


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a parameter, gradient or optimizer state (DTensor under FSDP)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


# --- lr_factor --------------------------------------------------------------------------------

def test_lr_factor_warms_up_then_follows_the_cosine_down_to_min_lr_ratio(m):
    # Python floats (float64, no torch kernel): approx's default (1e-6 relative) only absorbs
    # math.cos's last bits, the same on every CPU.
    lr = m["optim"].lr_factor
    f = [lr(s, warmup_steps=4, max_steps=14, min_lr_ratio=0.1) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]  # linear, and never 0: step 0 already learns
    assert f[4] == 1.0  # the peak where the decay starts
    assert f[9] == pytest.approx(0.55)  # halfway through the decay: halfway to min_lr_ratio
    assert f[4:15] == sorted(f[4:15], reverse=True)
    assert f[14:] == [pytest.approx(0.1)] * 6  # min_lr_ratio at max_steps and after
    # No warmup: the full lr at step 0; min_lr_ratio=0 decays to exactly 0 only at the end.
    assert lr(0, warmup_steps=0, max_steps=10, min_lr_ratio=0.0) == 1.0
    assert lr(10, warmup_steps=0, max_steps=10, min_lr_ratio=0.0) == pytest.approx(0.0)
    assert lr(5, warmup_steps=0, max_steps=10, min_lr_ratio=0.0) == pytest.approx(0.5)


# --- parallelize ------------------------------------------------------------------------------

def test_one_process_trains_the_plain_model_without_ddp(m, group):
    # DDP over a group of one only costs time (bench.py); two ranks get DDP (below).
    for method in ("ddp", "zero"):
        plain = tiny_gpt(m)
        model = m["parallel"].parallelize(plain, CPU, method)
        assert model is plain and m["wrappers"].unwrap(model) is plain
    optimizer = m["optim"].build_optimizer(model, "ddp", lr=1e-3)
    assert optimizer.defaults["fused"] is True  # one kernel for every parameter's update


def test_compile_takes_the_whole_model_for_ddp_and_each_block_for_fsdp(m, group):
    # nn.Module.compile() in place sets _compiled_call_impl (nothing compiles before a call).
    def compiled(module: torch.nn.Module) -> bool:
        return module._compiled_call_impl is not None

    model = m["parallel"].parallelize(tiny_gpt(m), CPU, "ddp", compile=True)
    assert compiled(model) and not any(compiled(block) for block in model.blocks)
    model = m["parallel"].parallelize(tiny_gpt(m), CPU, "fsdp", compile=True)
    assert not compiled(model) and all(compiled(block) for block in model.blocks)
    # In place: the parameter names (and so the snapshots) are those of the plain model.
    names = [name for name, _ in model.named_parameters()]
    assert names == [name for name, _ in tiny_gpt(m).named_parameters()]


def test_fsdp_shards_every_block_and_the_root(m, group):
    model = m["parallel"].parallelize(tiny_gpt(m), CPU, "fsdp")
    assert isinstance(model, FSDPModule)
    assert all(isinstance(block, FSDPModule) for block in model.blocks)
    assert m["wrappers"].unwrap(model) is model
    params = dict(model.named_parameters())
    assert params and all(isinstance(p, DTensor) for p in params.values()), [
        name for name, p in params.items() if not isinstance(p, DTensor)]
    assert list(params) == [name for name, _ in tiny_gpt(m).named_parameters()]


@pytest.mark.parametrize("method", ["ddp", "fsdp"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_wrapped_model_computes_the_plain_models_loss_and_gradients(m, group, method,
                                                                    checkpointing):
    plain = tiny_gpt(m)
    model = m["parallel"].parallelize(copy.deepcopy(plain), CPU, method,
                                      activation_checkpointing=checkpointing)
    # The wrapper hides itself from state_dict keys, so snapshots load with and without it.
    assert list(m["wrappers"].unwrap(model).state_dict()) == list(plain.state_dict())
    x, y = batch(1)
    _, expected = plain(x, y)
    _, loss = model(x, y)
    # One rank: DDP is not applied, FSDP's all-gather and reduce-scatter are copies, the
    # checkpoint recomputes the same forward. The same operations, on tensors laid out
    # otherwise (FSDP's gathered weights, recomputed activations), which may change a kernel's
    # blocking and so the order of a dot product's (n_embd 16) or a weight gradient's (4 x 8
    # tokens) sums: at most ~n = 32 ulps of the tensor's largest entry (assert_close_ulps).
    # Measured: equal, under ATEN_CPU_CAPABILITY=default, avx2 and avx512.
    assert_close_ulps(loss, expected, 32)
    expected.backward()
    loss.backward()
    unwrapped = m["wrappers"].unwrap(model)
    for (name, a), b in zip(unwrapped.named_parameters(), plain.parameters(), strict=True):
        assert_close_ulps(full(a.grad), b.grad, 32, msg=name)


def test_fsdp_bf16_computes_in_bf16_and_keeps_fp32_shards(m, group):
    policy = m["precision"].fsdp_policy("bf16")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert m["precision"].fsdp_policy("fp32") is None  # FSDP's default: no casts
    model = m["parallel"].parallelize(tiny_gpt(m), CPU, "fsdp", precision="bf16")
    states = [module._get_fsdp_state() for module in model.modules()
              if isinstance(module, FSDPModule)]
    assert len(states) == 3  # two blocks and the root
    assert all(state._mp_policy == policy for state in states)
    assert {param.dtype for param in model.parameters()} == {torch.float32}  # what AdamW updates
    logits, _ = model(*batch(1))
    assert logits.dtype == torch.bfloat16
    fp32 = m["parallel"].parallelize(tiny_gpt(m), CPU, "fsdp", precision="fp32")
    assert fp32(*batch(1))[0].dtype == torch.float32


# --- set_grad_sync (one rank: the switches; two ranks: the gradients, further down) ----------

def test_set_grad_sync_uses_ddp_no_sync_for_one_micro_step(m, group):
    set_grad_sync = m["grads"].set_grad_sync
    model = m["ddp"].wrap(tiny_gpt(m), CPU)  # parallelize: DDP from 2 ranks on
    assert model.require_backward_grad_sync
    with set_grad_sync(model, sync=False):
        assert not model.require_backward_grad_sync  # this backward skips the all-reduce
    assert model.require_backward_grad_sync  # only for that one micro-step
    with set_grad_sync(model, sync=True):
        assert model.require_backward_grad_sync


def test_set_grad_sync_switches_fsdp_gradient_reduction_until_changed(m, group):
    set_grad_sync = m["grads"].set_grad_sync
    model = m["parallel"].parallelize(tiny_gpt(m), CPU, "fsdp")
    groups = [module._get_fsdp_state()._fsdp_param_group for module in model.modules()
              if isinstance(module, FSDPModule)]
    assert len(groups) == 3 and all(g.reduce_grads for g in groups)
    x, y = batch(1)
    with set_grad_sync(model, sync=False):
        model(x, y)[1].backward()
    # FSDP2's switch stays set after the context: every block, not only the root, and no
    # gradient has been reduced into the shards yet.
    assert not any(g.reduce_grads for g in groups)
    assert all(param.grad is None for param in model.parameters())
    with set_grad_sync(model, sync=True):
        model(x, y)[1].backward()
    assert all(g.reduce_grads for g in groups)
    # The held-back micro-step was accumulated, not lost: twice one step's gradient (g + g is
    # 2 g exactly; g itself as in test_wrapped_model_computes_..., so within 32 ulps; measured:
    # equal under all three capabilities).
    plain = tiny_gpt(m)
    plain(x, y)[1].backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert_close_ulps(full(a.grad), 2 * b.grad, 32)


def test_clip_takes_torchs_fused_norm_for_plain_gradients_only(m, group, monkeypatch):
    """grads.clip_grad_norm_ with plain and DTensor gradients (TP's mix) takes each kind's
    norm with torch's get_total_norm: the plain ones told foreach=True (torch's own default
    for them, said so that the dry run's fake tensors take the same path), the DTensor ones
    left to torch's choice (None)."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor import Shard, distribute_tensor  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (1,))
    plain = torch.nn.Parameter(torch.ones(3))
    sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    plain.grad = torch.full((3,), 2.0)
    sharded.grad = distribute_tensor(torch.full((4, 2), 2.0), mesh, [Shard(0)])
    asked = []
    total_norm = torch.nn.utils.get_total_norm

    def spy(tensors, *args, foreach=None, **kwargs):
        asked.append((isinstance(tensors[0], DTensor), foreach))
        return total_norm(tensors, *args, foreach=foreach, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "get_total_norm", spy)
    total = m["grads"].clip_grad_norm_([plain, sharded], 1.0)
    assert asked == [(False, True), (True, None)]
    assert total.item() == pytest.approx(2.0 * (3 + 8) ** 0.5)  # every gradient entry is 2


def _two_rank_worker(rank: int, store_path: str, out_dir: str) -> None:
    """One of two ranks: two micro-steps, the first without gradient sync, for DDP and FSDP."""
    torch.set_num_threads(1)  # two processes share the cores
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    with mingpt_imported() as m:
        micro = [batch(10 + rank), batch(20 + rank)]  # each rank its own data
        plain = tiny_gpt(m)
        for x, y in micro:
            plain(x, y)[1].backward()
        mine = torch.cat([g.grad.flatten() for g in plain.parameters()])

        def gathered(t: torch.Tensor) -> list[torch.Tensor]:
            out = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(out, t)
            return out

        expected = torch.stack(gathered(mine)).mean(0)  # DDP and FSDP average over ranks
        result = {}
        for method in ("ddp", "fsdp"):
            plain_model = tiny_gpt(m)
            model = m["parallel"].parallelize(plain_model, CPU, method)
            if method == "ddp":  # wrapped, and unwrap gives the model back
                assert isinstance(model, DDP) and m["wrappers"].unwrap(model) is plain_model
                # The "module." prefix is why snapshots save unwrap(model)'s state dict.
                assert list(model.state_dict())[0].startswith("module.")
            with m["grads"].set_grad_sync(model, sync=False):
                model(*micro[0])[1].backward()
            grads = [full(g.grad).flatten() for g in model.parameters() if g.grad is not None]
            before = gathered(torch.cat(grads)) if grads else None
            with m["grads"].set_grad_sync(model, sync=True):
                model(*micro[1])[1].backward()
            after = gathered(torch.cat([full(g.grad).flatten() for g in model.parameters()]))
            result[method] = {
                "unsynced_grads": len(grads),
                "ranks_differ_before": None if before is None else
                (before[0] - before[1]).abs().max().item(),
                "ranks_differ_after": (after[0] - after[1]).abs().max().item(),
                "error": (after[rank] - expected).abs().max().item(),
                "scale": expected.abs().max().item(),
            }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # As main.py does: free everything that holds the group, so destroy_process_group joins
    # gloo's worker threads before Python exits (tests/test_teardown.py explains the abort).
    del model, plain, plain_model
    m["distributed"].release()


def test_two_ranks_average_gradients_only_on_the_synced_micro_step(tmp_path):
    start_world(_two_rank_worker, 2, str(tmp_path / "store"), str(tmp_path))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        ddp, fsdp = result["ddp"], result["fsdp"]
        # DDP under no_sync: each rank keeps its own gradients, so the ranks disagree.
        assert ddp["ranks_differ_before"] > 1e-3, ddp
        # FSDP2 holds the unsharded gradients back: nothing reaches the shards yet.
        assert fsdp["unsynced_grads"] == 0, fsdp
        for r in (ddp, fsdp):
            # The synced step averages both micro-steps of both ranks, identically everywhere.
            assert r["ranks_differ_after"] == 0.0, r
            # As the plain model's gradients average: (a + b) / 2 and a / 2 + b / 2 are equal in
            # binary floating point, each rank's a as in test_wrapped_model_computes_...: within
            # 32 ulps of the largest entry (measured: equal, under all three capabilities).
            assert r["error"] <= 32 * U * r["scale"], r


# --- snapshot compatibility -------------------------------------------------------------------

MODEL = {"model_type": None, "n_layer": 2, "n_head": 2, "n_embd": 16, "vocab_size": VOCAB,
         "block_size": BLOCK, "dropout": 0.0, "bias": True}
DATA = {"kind": "char", "vocab_size": VOCAB, "block_size": BLOCK, "itos": list("abcdefghijk"),
        "path": "data/input.txt"}  # char_dataset's meta


def saved(model: dict | None = None, data: dict | None = None) -> dict:
    return {"step": 4, "model_config": MODEL | (model or {}), "data_meta": DATA | (data or {})}


def check(m, state: dict) -> None:
    """SnapshotError unless a char-data run with MODEL and DATA may resume from `state`."""
    return m["snapshot"].check_compatible(state, MODEL, DATA, "snap.pt",
                                          m["char_dataset"].MATCH_KEYS)


def test_another_model_width_is_refused_naming_both_values(m):
    snapshot = m["snapshot"]
    with pytest.raises(snapshot.SnapshotError) as e:
        check(m, saved({"n_embd": 32}))
    assert "snapshot snap.pt holds a different model (n_embd=32 there, 16 here)" in str(e.value)
    assert "\n" not in str(e.value)


def test_dropout_and_the_preset_name_may_change_on_resume(m):
    # Neither changes a weight's shape: resuming with other dropout (or a preset spelled out
    # as sizes) is allowed.
    state = saved({"dropout": 0.2, "model_type": "gpt-nano"})
    assert check(m, state) is None


@pytest.mark.parametrize("data, key", [({"itos": list("abcdefghijz")}, "itos"),
                                       ({"vocab_size": 12}, "vocab_size"),
                                       ({"kind": "cifar10"}, "kind")])
def test_other_data_is_refused(m, data, key):
    snapshot = m["snapshot"]
    with pytest.raises(snapshot.SnapshotError, match=rf"different data \({key} differs\)"):
        check(m, saved(data=data))


def test_data_keys_outside_match_keys_are_ignored(m):
    # The same text found at another path: the vocabulary, which the weights depend on, fits.
    state = saved(data={"path": "/elsewhere/input.txt"})
    assert check(m, state) is None


# --- snapshot.save / snapshot.load ------------------------------------------------------------

def trained(m, method: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A wrapped tiny GPT and its AdamW after one step, so the optimizer has state to save."""
    model = m["parallel"].parallelize(tiny_gpt(m, seed), CPU, method)
    optimizer = torch.optim.AdamW(m["wrappers"].unwrap(model).optim_groups(0.1), lr=1e-2)
    model(*batch(seed))[1].backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """AdamW's step, exp_avg and exp_avg_sq of every parameter, in parameter order."""
    return [full(optimizer.state[p][key]) for group in optimizer.param_groups
            for p in group["params"] for key in sorted(optimizer.state[p])]


def one_file(m, url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             state: dict) -> None:
    """A snapshot as older runs of ddp, zero and dp wrote it: one file, rank 0's whole
    weights and AdamW's state by parameter number (shards.save_file writes it as they did)."""
    if dist.get_rank() == 0:
        m["shards"].save_file(url, {**state, "model": m["wrappers"].unwrap(model).state_dict(),
                                     "optimizer": optimizer.state_dict()})
    dist.barrier()


@pytest.mark.parametrize("method", ["ddp", "fsdp"])
def test_save_then_load_restores_weights_and_optimizer(m, group, tmp_path, method):
    snapshot, keys = m["snapshot"], m["char_dataset"].MATCH_KEYS
    url = str(tmp_path / "snap")
    meta = {"model_config": MODEL, "data_meta": DATA}
    model, optimizer = trained(m, method, seed=1)
    snapshot.save(url, model, optimizer, {"step": 7, "note": "mine", **meta})
    assert snapshot.snapshot_kind(url) == "dcp"  # one format: DCP's directory for every layout

    fresh, fresh_optimizer = trained(m, method, seed=2)  # other weights, other moments
    assert not all(torch.equal(full(a), full(b))
                   for a, b in zip(fresh.parameters(), model.parameters(), strict=True))
    state = snapshot.load(url, fresh, fresh_optimizer, meta, keys)
    # The rest of the state comes back; weights and optimizer went into the objects.
    assert state["step"] == 7 and state["note"] == "mine"
    assert "model" not in state and "optimizer" not in state
    for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(full(a), full(b))
    saved_state, loaded_state = optimizer_tensors(optimizer), optimizer_tensors(fresh_optimizer)
    assert len(saved_state) == len(loaded_state) == 3 * len(list(model.parameters()))
    for a, b in zip(loaded_state, saved_state, strict=True):
        assert torch.equal(a, b)


def test_load_finds_nothing_or_reads_the_other_layout(m, group, tmp_path):
    """ddp's snapshot resumes a sharded layout and the reverse, weights and AdamW's state
    whole, and so does an older run's one file; into ZeRO's optimizer too, each rank the
    state of the parameters it owns. The first save after a file keeps it as URL.pt."""
    snapshot, keys = m["snapshot"], m["char_dataset"].MATCH_KEYS
    meta = {"model_config": MODEL, "data_meta": DATA}
    objects = {method: trained(m, method, seed=1 + i) for i, method in enumerate(("ddp", "fsdp"))}
    for method, (model, optimizer) in objects.items():
        missing = str(tmp_path / "none" / method)
        assert snapshot.load(missing, model, optimizer, meta, keys) is None
        snapshot.save(str(tmp_path / method), model, optimizer, {"step": 7, **meta})
    objects["file"] = objects["ddp"]
    one_file(m, str(tmp_path / "file"), *objects["file"], {"step": 7, **meta})
    assert snapshot.snapshot_kind(str(tmp_path / "file")) == "file"
    for saved_as, loaded_as in (("ddp", "fsdp"), ("fsdp", "ddp"), ("file", "ddp"),
                                ("file", "fsdp")):
        fresh, fresh_optimizer = trained(m, loaded_as, seed=9)  # other weights and state
        state = snapshot.load(str(tmp_path / saved_as), fresh, fresh_optimizer, meta,
                              keys)
        assert state["step"] == 7 and "model" not in state and "optimizer" not in state
        model, optimizer = objects[saved_as]
        for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
            assert torch.equal(full(a), full(b)), (saved_as, loaded_as)
        for a, b in zip(optimizer_tensors(fresh_optimizer), optimizer_tensors(optimizer),
                        strict=True):
            assert torch.equal(a, b), (saved_as, loaded_as)
    written = (tmp_path / "file").read_bytes()
    snapshot.save(str(tmp_path / "file"), fresh, fresh_optimizer, {"step": 8, **meta})
    assert snapshot.snapshot_kind(str(tmp_path / "file")) == "dcp"
    assert (tmp_path / "file.pt").read_bytes() == written  # the file resumed from, kept
    # ZeRO reads the sharded one too: DCP names the state of each parameter its AdamW owns.
    model = m["parallel"].parallelize(tiny_gpt(m, 9), CPU, "zero")
    zero = m["optim"].build_optimizer(model, "zero", lr=1e-2)
    assert snapshot.load(str(tmp_path / "fsdp"), model, zero, meta, keys)["step"] == 7
    saved, saved_optimizer = objects["fsdp"]
    local = m["optim"].local_optimizer(zero)  # its parameters sorted by size: by parameter
    for a, b in zip(model.parameters(), saved.parameters(), strict=True):
        assert torch.equal(full(a), full(b))
        assert sorted(local.state[a]) == sorted(saved_optimizer.state[b]) == [
            "exp_avg", "exp_avg_sq", "step"]
        for key in local.state[a]:
            assert torch.equal(full(local.state[a][key]), full(saved_optimizer.state[b][key]))


class Meetings:
    """torchft's replica-group wrapper as snapshot.py sees it (mingpt/parallel/ft.py): the
    optimizer inside (`inner`) and DiLoCo's state beside it (extra_state: the last meeting's
    weights by parameter name, shaped as the parameters, DTensors where FSDP shards them; the
    outer momentum; the meetings' count), here drawn from `scale` so that two runs' differ."""

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, scale: float):
        self.model, self.inner, self.scale = model, inner, scale
        self.loaded: dict | None = None

    def extra_state(self) -> dict:  # new tensors each time: a load reads into them
        state = {"meetings": torch.tensor([int(self.scale), 2 * int(self.scale)])}
        for name, p in self.model.named_parameters():
            state[f"original/{name}"] = p.detach() * self.scale
            state[f"momentum/{name}"] = p.detach() + self.scale
        return state

    def load_extra_state(self, state: dict) -> None:
        self.loaded = state


def test_a_one_file_snapshot_brings_the_meetings_into_shards(m, group, tmp_path):
    """DiLoCo's state in an older run's one-file snapshot comes back under a sharded layout,
    resharded as the weights are (it was dropped without a word: a resumed group's next
    meeting then started from its current weights, not its last meeting's)."""
    snapshot, keys = m["snapshot"], m["char_dataset"].MATCH_KEYS
    meta = {"model_config": MODEL, "data_meta": DATA}
    model, optimizer = trained(m, "ddp", seed=1)
    saver = Meetings(m["wrappers"].unwrap(model), optimizer, scale=3.0)
    url = str(tmp_path / "snap.pt")
    one_file(m, url, model, optimizer, {"step": 7, **meta, "replicas": saver.extra_state()})
    fresh, fresh_optimizer = trained(m, "fsdp", seed=2)
    loader = Meetings(fresh, fresh_optimizer, scale=5.0)
    assert snapshot.load(url, fresh, loader, meta, keys)["step"] == 7
    saved = saver.extra_state()
    assert loader.loaded is not None and sorted(loader.loaded) == sorted(saved)
    for key, value in saved.items():
        assert torch.equal(full(loader.loaded[key]), value), key
        assert isinstance(loader.loaded[key], DTensor) == (key != "meetings"), key


def test_another_model_is_refused_before_any_weight_changes(m, group, tmp_path):
    snapshot, keys = m["snapshot"], m["char_dataset"].MATCH_KEYS
    url = str(tmp_path / "snap.pt")
    model, optimizer = trained(m, "ddp", seed=1)
    snapshot.save(url, model, optimizer,
                  {"step": 7, "model_config": MODEL | {"n_layer": 3}, "data_meta": DATA})
    fresh, fresh_optimizer = trained(m, "ddp", seed=2)
    before = [p.clone() for p in fresh.parameters()]
    with pytest.raises(snapshot.SnapshotError, match=r"n_layer=3 there, 2 here"):
        snapshot.load(url, fresh, fresh_optimizer,
                      {"model_config": MODEL, "data_meta": DATA}, keys)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters(), strict=True))


@pytest.mark.parametrize("method", ["ddp", "fsdp"])
def test_keep_last_keeps_the_snapshots_before_the_newest(m, group, tmp_path, method):
    """keep_last=2: the newest snapshot and the one before it, each its step directory; older
    ones go (a roll-back by hand: write the older one's name into `latest`)."""
    snapshot = m["snapshot"]
    url = str(tmp_path / "snap")
    model, optimizer = trained(m, method, seed=1)
    for step in (2, 4, 6):
        snapshot.save(url, model, optimizer, {"step": step}, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "snap").iterdir()) == [
        "latest", "step_00000004", "step_00000006"]
    assert (tmp_path / "snap/latest").read_text() == "step_00000006"
    # Saves that were cut off (no train_state.pt; or a later step than the next save) are
    # no snapshots to roll back to: they go, and step 6, the last committed one, stays.
    for cut_off in ("step_00000007", "step_00000009"):
        (tmp_path / "snap" / cut_off).mkdir(exist_ok=True)
    dist.barrier()
    snapshot.save(url, model, optimizer, {"step": 8}, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "snap").iterdir()) == [
        "latest", "step_00000006", "step_00000008"]
    # keep_last=1: the older step directories go.
    snapshot.save(url, model, optimizer, {"step": 10}, keep_last=1)
    assert sorted(p.name for p in (tmp_path / "snap").iterdir()) == ["latest", "step_00000010"]
