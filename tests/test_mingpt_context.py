"""05_mingpt's context parallelism (trainer_config.cp_size, mingpt/parallel/context.py): the
ring attention equals full attention in forward and backward at cp 2 and 4, training with cp
follows DDP on the same sequences (with ddp and fsdp, cp alone and dp x cp), resumes bit for
bit, resumes into plain ddp, and sample.py loads its snapshot; and the config refuses what
does not fit in one line.

The multi-rank checks run in spawned gloo processes (one process group per process): one set
of 4 (attention at cp 4 and on a (2, 2) mesh; ddp against ddp and fsdp over dp 2 x cp 2) and
one pair (cp over 2 ranks with ddp and fsdp, resumes, activation memory). Each writes its
findings for the tests to assert on.
"""
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before any group exists (test_teardown.py)
from torch.distributed.device_mesh import init_device_mesh

from conftest import REPO, TORCHRUN, run
from mingpt_helpers import (
    U,
    assert_refused,
    copy_mingpt,
    join_world,
    log_units,
    mingpt_imported,
    real_step,
    recorded_warnings,
    spawn_world,
    tiny,
    train_losses,
    val_losses,
)
from test_mingpt_strategies import full_weights, train_here

CPU = torch.device("cpu")
STEPS, HALF = 4, 2
# Weights after STEPS AdamW steps against DDP's on the same sequences, as for the other
# strategies (test_mingpt_strategies.py derives it): cp sums the same terms in other orders
# (each rank's loss is the mean of its own tokens and the ranks' means are averaged; attention
# merges its key blocks by log-sum-exp; gradients of K and V are summed on their way round the
# ring), so gradients differ by rounding, a few ulps of their terms. AdamW moves a weight by at
# most lr_t per step (|m / sqrt(v)| <= 1.002 for these betas and steps): STEP_BUDGET in all;
# rounding-level gradient differences move a step by ~1e-7 of it, except where a gradient
# cancels to ~0 and eps = 1e-8 caps the move at lr_t * d / eps, 1e-2 of STEP_BUDGET for
# d ~ 1e-10. A bug (a wrong chunk, position or mask; a missing gradient) changes gradients by
# their own size and moves most weights by O(STEP_BUDGET). Up to OUTLIERS weights (gradients
# that cancel to within their rounding, and so may flip a step's sign) may lie beyond it.
STEP_BUDGET = 3e-3 * (0.5 + 1 + 1 + 1)
WEIGHT_TOLERANCE = 1e-2 * STEP_BUDGET
OUTLIERS = 3


# --- ring attention against full attention ---------------------------------------------------

def reference(q, k, v, dout):
    """Full causal attention and its gradients in float64, and the entrywise error bound of an
    fp32 evaluation of each (out, dq, dk, dv) in any order of summation.

    Standard error analysis: each entry is a sum of at most T products, each product made of
    factors that carry a few roundings each: a score q.k (hs products and sums) times the
    scale, its exp (whose input error e becomes a relative error e of the weight), a weight
    times v (or dout), and for dq/dk the factor (dP - D), two dot products of hs terms. So the
    computed entry is within R * U * M of the exact one, where M is the sum of the magnitudes
    of the terms (computed here from absolute values in float64), and R counts the roundings a
    term can carry: T for the sum, hs * (1 + S) for the score (S: the largest
    scale * sum_d |q_d k_d|, the size of the score's terms, which exp turns into relative
    error), and 8 for exp, the normalisation, the products and the log-sum-exp merges (2 per
    ring step). The ring and the one-kernel attention each obey it, so they differ by at most
    twice that."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    T, hs = q.size(2), q.size(3)
    scale = hs ** -0.5
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    p = scores.softmax(-1)  # (B, nh, T, T)
    out = p @ v
    dp = dout @ v.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    grads = (scale * ds @ k, scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ dout)
    # Magnitudes of the terms: |dP - D| <= |dout| |v|^T + sum |dout| |out|.
    a = p * (dout.abs() @ v.abs().transpose(-1, -2) + (dout.abs() * out.abs()).sum(-1, True))
    sizes = (p @ v.abs(), scale * a @ k.abs(), scale * a.transpose(-1, -2) @ q.abs(),
             p.transpose(-1, -2) @ dout.abs())
    s = (scale * q.abs() @ k.abs().transpose(-1, -2)).max().item()
    return (out, *grads), sizes, T + hs * (1 + s) + 8


def ring_check(m: dict, cp: int) -> dict:
    """Ring attention on this rank's zig-zag chunks against full attention, on every rank of
    a (4 / cp, cp) mesh: the largest difference of out, dq, dk, dv, and how many entries lie
    beyond twice the derived bound."""
    context = m["parallel"].context
    mesh = init_device_mesh("cpu", (4 // cp, cp), mesh_dim_names=("dp", "cp"))
    torch.manual_seed(0)  # the same tensors on every rank: each keeps its chunks
    B, nh, T, hs = 2, 3, 64, 16
    q, k, v, dout = (torch.randn(B, nh, T, hs) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*full, is_causal=True)
    out.backward(dout)  # the one-kernel attention of the model without cp, fp32
    exact, sizes, roundings = reference(q, k, v, dout)
    pos = context.zigzag_positions(T, cp, mesh["cp"].get_local_rank())
    local = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    ring = context.RingAttention.apply(*local, mesh["cp"].get_group())
    ring.backward(dout[:, :, pos])
    found = {}
    for name, got, want, x, size in zip(
            ("out", "dq", "dk", "dv"), (ring, *(t.grad for t in local)),
            (out, *(t.grad for t in full)), exact, sizes, strict=True):
        got, want, x = got.detach().double(), want[:, :, pos].detach().double(), x[:, :, pos]
        bound = (roundings + 2 * cp) * U * size[:, :, pos]
        found[name] = {"max": (got - want).abs().max().item(),
                       "beyond": int(((got - want).abs() > 2 * bound).sum()),
                       "ring_vs_exact": int(((got - x).abs() > bound).sum())}
    return found


# --- training, in-process as main.py runs it -----------------------------------------------

def overrides(run_dir: Path, text: Path, method: str, cp: int, batch: int, steps: int,
              *extra: str) -> list[str]:
    return tiny(f"run_dir={run_dir}", f"data_config.path={text}",
                f"trainer_config.distributed_method={method}", f"trainer_config.cp_size={cp}",
                f"trainer_config.batch_size={batch}", f"trainer_config.max_steps={steps}",
                f"trainer_config.snapshot_path={run_dir}/snapshot",
                # cp has no attention dropout; a constant lr after warmup, so the HALF-step
                # run is exactly the first half of the longer one.
                "gpt_config.dropout=0.0", "trainer_config.min_lr_ratio=1.0",
                "trainer_config.log_every=1", "trainer_config.save_every=0",
                # The same 16 validation sequences whatever the batch size (the trainer
                # evaluates eval_batches x batch_size of them), so val losses compare too.
                f"trainer_config.eval_batches={16 // batch}", "trainer_config.sample_tokens=0",
                *extra)


def fit(m: dict, args: list[str]) -> tuple[str, dict]:
    """main.train's build, resume and train in this process: (rank 0's log, full weights)."""
    # Composed afresh each time (not test_mingpt_strategies.configure's cached base): the
    # runs here differ in which keys they set.
    log, model, _ = train_here(m, m["config"].load(args))
    return log, full_weights(m, model)


def weights_report(weights: dict, reference: dict) -> dict:
    diffs = torch.cat([(weights[k] - reference[k]).abs().flatten() for k in reference])
    return {"max": diffs.max().item(), "beyond": int((diffs > WEIGHT_TOLERANCE).sum()),
            "equal": all(torch.equal(weights[k], reference[k]) for k in reference)}


def _four_worker(rank: int, store: str, out: str, text: str) -> None:
    """Ring attention at cp 4 and cp 2 (a (2, 2) mesh); ddp on 4 ranks against ddp x cp 2."""
    join_world(rank, store, 4)
    out_dir, result = Path(out), {}
    with mingpt_imported("main") as m:
        for cp in (2, 4):
            result[f"attention cp {cp}"] = ring_check(m, cp)
        # 8 sequences per step both ways: 4 ranks x 2, or 2 dp groups x 4 (each cp pair
        # shares its 4, every rank keeping half of each sequence).
        ddp_log, ddp = fit(m, overrides(out_dir / "ddp4", Path(text), "ddp", 0, 2, STEPS))
        for method in ("ddp", "fsdp"):  # fsdp: every weight sharded over all 4 ranks
            with recorded_warnings() as warned:
                log, weights = fit(m, overrides(out_dir / f"{method}_cp4", Path(text), method,
                                                2, 4, STEPS))
            result[f"{method} dp x cp"] = {"ddp_log": ddp_log, "log": log,
                                           **weights_report(weights, ddp), "warnings": warned}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    m["distributed"].release()  # every reference dropped first: gloo's threads are joined


# Activations with and without cp: one step of this model on the pair, 4 sequences of 64
# tokens per data-parallel rank (ddp: each rank its own 4; cp 2: both ranks the same 4, half
# of each sequence).
ACTIVATION_MODEL = {"model_type": None, "n_layer": 2, "n_head": 2, "n_embd": 32,
                    "vocab_size": 65, "block_size": 64, "dropout": 0.0}
ACTIVATION_LAYOUTS = {"ddp": ["trainer_config.distributed_method=ddp"],
                      "ddp cp 2": ["trainer_config.distributed_method=ddp",
                                   "trainer_config.cp_size=2"]}
ACTIVATIONS = ("activations / micro-batch", "peak activations")


def activation_model(m: dict):
    """ACTIVATION_MODEL on the meta device: what model_size.predict plans from."""
    with torch.device("meta"):
        return m["model"].GPT(m["model"].GPTConfig(**ACTIVATION_MODEL))


def activation_memory(m: dict) -> dict:
    """What autograd keeps for backward in one real training step of each layout on this
    rank, counted by the dry run's own counter (dry_run.measure_step), under the config
    model_size.predict plans (layout_config)."""
    found = {}
    for name, overrides in ACTIVATION_LAYOUTS.items():
        cfg = m["model_size"].layout_config(activation_model(m), overrides, 2, 4)
        gpt_config = m["config"].model_config(cfg, {"vocab_size": 65, "block_size": 64})[0]
        counted = real_step(m, cfg, gpt_config)
        found[name] = {key: counted[key] for key in ACTIVATIONS}
    return found


def _pair_worker(rank: int, store: str, out: str, text: str) -> None:
    """cp over both ranks with ddp and fsdp against ddp; resumes; resume into plain ddp."""
    join_world(rank, store, 2)
    out_dir, text, result = Path(out), Path(text), {}
    with mingpt_imported("main", "model_size", "dry_run") as m:
        result["memory"] = activation_memory(m)
        # ddp: 4 + 4 sequences; cp 2 (dp 1): both ranks take all 8, half of each sequence.
        result["ddp_log"], ddp = fit(m, overrides(out_dir / "ddp", text, "ddp", 0, 4, STEPS))
        runs = {"ddp_cp": ("ddp", ()), "fsdp_cp": ("fsdp", ()),
                "ddp_cp_ac": ("ddp", ("trainer_config.activation_checkpointing=true",))}
        for name, (method, extra) in runs.items():
            log, weights = fit(m, overrides(out_dir / name, text, method, 2, 8, STEPS, *extra))
            result[name] = {"log": log, **weights_report(weights, ddp)}
            if name == "ddp_cp_ac":
                continue
            if rank == 0:
                torch.save(weights, out_dir / f"{name}.pt")
            half = out_dir / f"{name}_half"
            fit(m, overrides(half, text, method, 2, 8, HALF))  # saves at step HALF ...
            resumed_log, resumed = fit(m, overrides(half, text, method, 2, 8, STEPS))
            result[name] |= {"resumed_log": resumed_log,
                             "resumed_equal": weights_report(resumed, weights)["equal"]}
        # The ddp format's file from a cp run resumed by plain ddp (4 + 4 sequences).
        fit(m, overrides(out_dir / "into_ddp", text, "ddp", 2, 8, HALF))
        log, weights = fit(m, overrides(out_dir / "into_ddp", text, "ddp", 0, 4, STEPS))
        result["cp->ddp"] = {"log": log, **weights_report(weights, ddp)}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    m["distributed"].release()


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return spawn_world(_four_worker, 4, tmp_path_factory.mktemp("cp4"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp2")
    return out, spawn_world(_pair_worker, 2, out)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_full_attention_forward_and_backward(four, cp):
    for rank, result in enumerate(four):
        for name, found in result[f"attention cp {cp}"].items():
            # Within twice the derived bound of the one-kernel attention, and within the bound
            # of the exact (float64) values. Measured (randn inputs, T = 64): out and dq within
            # 4e-7 of the one-kernel attention, dk and dv (sums over up to 64 queries, entries
            # up to ~10) within 1.5e-6.
            assert found["beyond"] == 0 and found["ring_vs_exact"] == 0, (rank, name, found)


def assert_follows_ddp(log: str, ddp_log: str) -> None:
    """The same loss at every step within one unit of the log's 4th decimal (the losses differ
    by rounding, a few ulps of ~4), and the same final validation loss."""
    losses, ddp = train_losses(log), train_losses(ddp_log)
    assert sorted(losses) == list(range(1, STEPS + 1)) and ddp[STEPS] < ddp[1] - 0.1, ddp
    assert all(log_units(losses[s], ddp[s]) <= 1 for s in ddp), (losses, ddp)
    assert log_units(val_losses(log)[STEPS], val_losses(ddp_log)[STEPS]) <= 1


def test_cp_trains_as_ddp_does_on_the_same_sequences(pair):
    _, results = pair
    for name in ("ddp_cp", "fsdp_cp", "ddp_cp_ac"):
        r = results[0][name]
        assert_follows_ddp(r["log"], results[0]["ddp_log"])
        assert r["beyond"] <= OUTLIERS and not r["equal"], (name, r["max"], r["beyond"])


@pytest.mark.parametrize("method", ["ddp", "fsdp"])
def test_dp_times_cp_trains_as_ddp_does(four, method):
    """2 dp groups x 2 cp ranks: gradients averaged over all 4 ranks (DDP's all-reduce, FSDP's
    reduce-scatter) are the mean over the batch, as each rank holds as many tokens."""
    r = four[0][f"{method} dp x cp"]
    assert "data-parallel size 2" in r["log"]  # 2 dp groups of 2 cp ranks
    assert_follows_ddp(r["log"], r["ddp_log"])
    assert r["beyond"] <= OUTLIERS, (r["max"], r["beyond"])
    # No warning: before, DeviceMesh's on every rank, that slicing the flattened "dp_cp" from
    # the root mesh will go (layout.axis keeps the flattened meshes).
    assert r["warnings"] == [], r["warnings"]


def test_cp_resumes_bitwise_and_into_plain_ddp(pair):
    _, results = pair
    for rank, result in enumerate(results):
        for name in ("ddp_cp", "fsdp_cp"):
            r = result[name]
            assert r["resumed_equal"], (rank, name)  # every weight, bit for bit
            if rank:
                continue  # the log lines come from rank 0
            whole, resumed = train_losses(r["log"]), train_losses(r["resumed_log"])
            assert sorted(resumed) == list(range(HALF + 1, STEPS + 1)), (name, resumed)
            assert all(resumed[s] == whole[s] for s in resumed), (name, resumed, whole)
        r = result["cp->ddp"]
        assert r["beyond"] <= OUTLIERS, (r["max"], r["beyond"])
        assert rank or "resumed from" in r["log"]


def test_model_size_predicts_cps_activations_exactly(pair):
    """model_size.predict (the dry run: the same step on fake tensors) plans what autograd
    keeps for backward per micro-batch and at its peak, to the byte, without cp and with
    cp 2, on each rank: what a real step counts. cp 2 keeps about half (all but the
    positions' ids and one vector more per block for the ring's output). Planned here, in
    the test's process: the dry run starts a process per rank, which a spawned gloo rank
    should not."""
    with mingpt_imported("model_size") as m:
        planned = m["model_size"].predict(activation_model(m), ACTIVATION_LAYOUTS, 2, 4,
                                          ranks=(0, 1))
    for rank, result in enumerate(pair[1]):
        memory = result["memory"]
        for name in ACTIVATION_LAYOUTS:
            plan = {key: planned[name][rank][key] for key in ACTIVATIONS}
            assert memory[name] == plan, (rank, name, memory[name], plan)
        plain, split = (memory[name]["activations / micro-batch"] for name in ACTIVATION_LAYOUTS)
        assert 0.5 < split / plain < 0.55, memory


def test_sample_loads_a_cp_snapshot(pair):
    out, _ = pair
    with mingpt_imported() as m:
        weights = torch.load(out / "ddp_cp.pt")
        model, meta = m["sample"].load_model(str(out / "ddp_cp/snapshot"), CPU)
        assert all(torch.equal(model.state_dict()[k], weights[k]) for k in weights)
        assert len(m["sample"].generate_text(model, meta, "\n", 5, device=CPU)) == 6


@pytest.mark.parametrize("args, message", [
    (["trainer_config.cp_size=2", "gpt_config.block_size=30"],
     "gpt_config.block_size=30 must divide by 2 x cp_size = 4 (each rank keeps 2 of the "
     "2 x cp_size equal chunks of a sequence); change block_size or trainer_config.cp_size"),
    # Any flavour takes cp, and a pipeline (test_mingpt_layouts); nn.DataParallel does not.
    (["trainer_config.cp_size=2", "trainer_config.distributed_method=dp"],
     "distributed_method=dp (nn.DataParallel, one process) combines with no other axis, got "
     "cp_size=2; use ddp or fsdp with it"),
    (["trainer_config.cp_size=2", "gpt_config.dropout=0.1"],
     "trainer_config.cp_size=2 needs gpt_config.dropout=0 (the ring attention has no "
     "attention dropout), got 0.1"),
    (["trainer_config.cp_size=2", "gpt_config.dropout=0.0", "trainer_config.compile=true"],
     "trainer_config.compile must be false with cp_size=2 (the ring attention's collectives "
     "would break the compiled graph)"),
    (["trainer_config.cp_size=-1"],
     "trainer_config.cp_size must be an integer >= 0 (0 or 1: off), got -1"),
])
def test_config_refuses_cp_that_does_not_fit(args, message):
    with mingpt_imported() as m:
        assert_refused(m["config"], tiny(*args), message)


def test_the_models_positions_and_attend_generalise_it_without_changing_it():
    """GPT.forward's positions default to 0..T-1 and CausalSelfAttention.attend to causal
    attention: given explicitly they compute the same, bit for bit; a swapped attend is what
    every block runs when nothing is cached, and generate's cached steps do not use it."""
    with mingpt_imported() as m:
        torch.manual_seed(0)
        gpt = m["model"].GPT(m["model"].GPTConfig(model_type="gpt-nano", vocab_size=11,
                                                  block_size=16, dropout=0.0))
        x = torch.randint(0, 11, (2, 16))
        logits, _ = gpt(x)
        assert torch.equal(gpt(x, positions=torch.arange(16))[0], logits)
        calls = []

        def recorded(q, k, v, dropout_p):
            calls.append(q.shape)
            return m["model"].causal_attention(q, k, v, dropout_p)

        for block in gpt.blocks:
            block.attn.attend = recorded
        assert torch.equal(gpt(x)[0], logits) and len(calls) == 3  # one per block
        gpt.eval()
        gpt.generate(x[:, :4], 3, do_sample=False)  # the prompt: no cache yet, then cached
        assert calls[3:] == [torch.Size([2, 3, 4, 16])] * 3, calls


def test_torchs_ring_rotates_as_the_cpu_ring_and_is_switched_off_when_the_run_ends():
    """What the GPU branch of ContextParallelAttention switches on (tests/test_gpu.py runs it
    on CUDA): torch's dispatch of DTensor attention to its ring, with the zig-zag layout and
    all-to-all rotation, as the CPU ring uses around each call (one memory prediction for
    both); distributed.release() then switches the dispatch off and restores the options."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    options = cp._cp_options
    before = (options.enable_load_balance, options.rotate_method)
    options.enable_load_balance = False  # not torch's default: its restoring is seen
    with mingpt_imported() as m:
        context = m["parallel"].context
        handlers = DTensor._op_dispatcher._custom_op_handlers
        assert flash not in handlers  # off before any run
        with context._ring_options():  # the CPU ring's, around each call
            assert (options.enable_load_balance, options.rotate_method) == \
                (True, cp._RotateMethod.ALL_TO_ALL)
        assert (options.enable_load_balance, options.rotate_method) == \
            (False, cp._RotateMethod.ALL_GATHER)
        context._torch_ring_on()
        context._torch_ring_on()  # a second stage of the same run: nothing more to save
        assert flash in DTensor._op_dispatcher._custom_op_handlers
        assert (options.enable_load_balance, options.rotate_method) == \
            (True, cp._RotateMethod.ALL_TO_ALL)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        m["distributed"].release()  # where every run of main.py ends
        assert flash not in DTensor._op_dispatcher._custom_op_handlers
        assert (options.enable_load_balance, options.rotate_method) == \
            (False, cp._RotateMethod.ALL_GATHER)
        context.end_run()  # a second end: nothing to undo
        assert flash not in DTensor._op_dispatcher._custom_op_handlers
    options.enable_load_balance, options.rotate_method = before


def test_zigzag_positions_cover_each_sequence_once_with_equal_causal_work():
    with mingpt_imported() as m:
        context = m["parallel"].context
        for cp in (1, 2, 4):
            chunks = [context.zigzag_positions(32, cp, r) for r in range(cp)]
            assert sorted(torch.cat(chunks).tolist()) == list(range(32))
            # The (query, key) pairs a causal mask keeps, per rank: sum of (position + 1).
            work = {int((c + 1).sum()) for c in chunks}
            assert len(work) == 1, (cp, work)
        assert context.zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_the_readmes_cp_command_trains(tmp_path):
    """The cp command of 05's README (Strategies), as written plus tiny overrides: two gloo
    processes train, evaluate, save and sample."""
    readme = (REPO / "05_mingpt/README.md").read_text()
    command = next(line for line in readme.splitlines()
                   if line.startswith("torchrun") and "cp_size" in line)
    given = command.split("main.py", 1)[1].split()
    mingpt = copy_mingpt(tmp_path)
    proc = run([TORCHRUN, "--standalone", "--nproc_per_node=2", "main.py",
                *tiny(*given, "run_name=cp", "gpt_config.dropout=0.0")], cwd=mingpt)
    assert "data-parallel size 1" in proc.stdout  # one cp group of both processes
    assert "block 256" in proc.stdout and "sample:" in proc.stdout
    losses = val_losses(proc.stdout)
    assert losses[max(losses)] < losses[0] - 0.3, losses
    assert (mingpt / "runs/cp/snapshot/latest").is_file()  # DCP's directory, as every layout
