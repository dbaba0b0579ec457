"""export_hf.py: a snapshot of any layout becomes a Hugging Face GPT-2 that computes what our
model computes, and gpt_config.init_from starts training again from it.

One tiny run per layout (ddp on one process, in this process; fsdp, fsdp with tp and a
pipeline on two, in one warm world of two spawned ranks that trains, exports and trains again
from the export) serves every check of its snapshot: the exported weights are
the snapshot's bit for bit, transformers' logits are ours within a derived fp32 bound, its
greedy `generate` writes sample.py's greedy text, and a run started from the export evaluates
to the trained run's last validation loss. Bad input is one `error:` line, nothing written.
"""
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from bpe_fixture import write_tokenizer
from conftest import PYTHON, in_process, run
from mingpt_helpers import (
    MINGPT,
    assert_close_ulps,
    copy_mingpt,
    exported_weights,
    join_world,
    mingpt_imported,
    read_snapshot,
    script_in_process,
    spawn_world,
    tiny,
    val_losses,
)

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")
# layout -> overrides. ddp's snapshot holds the same whole weights from any number of ranks:
# one process, in this process. The others on two ranks (WORLD_LAYOUTS), so that their
# snapshots hold pieces only the export puts together: fsdp shards every tensor by rows, tp
# splits each matmul (q, k and v each by rows), the pipeline puts one block on each rank.
LAYOUTS = {
    "ddp": ("trainer_config.distributed_method=ddp",),
    "fsdp": ("trainer_config.distributed_method=fsdp",),
    "fsdp_tp": ("trainer_config.distributed_method=fsdp_tp", "trainer_config.tp_size=2"),
    "pp": ("trainer_config.distributed_method=pp",),
}
WORLD_LAYOUTS = ("fsdp", "fsdp_tp", "pp")
HF_FILES = ["config.json", "generation_config.json", "model.safetensors"]


@pytest.fixture(scope="module")
def mods():
    with mingpt_imported("main", "export_hf", "pretrained", "bpe_dataset", "prepare") as modules:
        yield modules


@pytest.fixture(scope="module")
def mingpt(tmp_path_factory):
    return copy_mingpt(tmp_path_factory.mktemp("mingpt_export"))


def layout_args(layout: str, run_name: str, *extra: str) -> list[str]:
    """main.py's overrides for a run of `layout`; its snapshot is runs/<run_name>/snapshot."""
    # No sample at the end: a pipeline reads its snapshot back for it, time this file can save.
    return tiny(f"run_name={run_name}", "trainer_config.sample_tokens=0", *LAYOUTS[layout],
                *extra)


def train(mods, mingpt: Path, layout: str, run_name: str, *extra: str):
    """`python main.py` of a one-process layout, in this process: the stdout."""
    proc = script_in_process(mods["main"], mingpt, *layout_args(layout, run_name, *extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _world(rank: int, store: str, out: str, text: str, mingpt: str) -> None:
    """One of two ranks: for each of WORLD_LAYOUTS, main.py's training on this warm group
    (main.train, what torchrun's workers run after joining theirs), rank 0's export of its
    snapshot, then one step from that export; rank 0 writes what it saw (spawn_world reads it)."""
    join_world(rank, store, 2)
    folder, result = Path(mingpt), {}
    with mingpt_imported("main", "export_hf") as m:
        def main_py(*args: str) -> str:
            def train() -> None:
                error = m["main"].train(m["config"].load(list(args)), CPU)
                if error is not None:
                    raise SystemExit(f"error: {error}")
            proc = in_process(train, ["main.py", *args], folder)
            assert proc.returncode == 0, proc.stderr[-3000:]
            return proc.stdout

        for layout in WORLD_LAYOUTS:
            result[layout] = {"log": main_py(*layout_args(layout, layout))}
            exported = Path(out) / layout
            if rank == 0:
                proc = script_in_process(m["export_hf"], folder,
                                         str(folder / "runs" / layout / "snapshot"),
                                         str(exported))
                result[layout]["export"] = [str(exported), proc.returncode, proc.stdout,
                                            proc.stderr]
            dist.barrier()  # the export is written
            result[layout]["again"] = main_py(*layout_args(
                layout, f"{layout}_again", f"gpt_config.init_from={exported}",
                "trainer_config.max_steps=1"))
        if rank == 0:
            (Path(out) / "rank0.json").write_text(json.dumps(result))
        m["distributed"].release()


def export(mods, mingpt: Path, *args: str):
    """`python export_hf.py ARGS` in this process: its exit status, stdout and stderr."""
    return script_in_process(mods["export_hf"], mingpt, *map(str, args))


@pytest.fixture(scope="module")
def world(mingpt, tmp_path_factory) -> dict:
    """WORLD_LAYOUTS' runs: layout -> rank 0's log, export and log of the run from it."""
    out = tmp_path_factory.mktemp("world")
    return spawn_world(_world, 2, out, str(mingpt))[0]


@pytest.fixture(scope="module")
def trained(mods, mingpt, world, tmp_path_factory):
    """layout -> (snapshot, the run's stdout, its export): one run of 10 steps each."""
    out = tmp_path_factory.mktemp("exports")
    runs = {}
    for layout in LAYOUTS:
        snapshot = mingpt / "runs" / layout / "snapshot"
        if layout in WORLD_LAYOUTS:
            stdout, (exported, code, said, err) = world[layout]["log"], world[layout]["export"]
            exported = Path(exported)
        else:
            stdout, exported = train(mods, mingpt, layout, layout), out / layout
            exported.mkdir()  # an empty OUT_DIR is taken (replaced once complete)
            proc = export(mods, mingpt, snapshot, exported)
            code, said, err = proc.returncode, proc.stdout, proc.stderr
        assert code == 0, err
        assert said == f"wrote {exported}: GPT2LMHeadModel ({', '.join(HF_FILES)})\n"
        runs[layout] = (snapshot, stdout, exported)
    return runs


def our_model(mods, snapshot: Path):
    """Our GPT as sample.py loads it from the snapshot itself, and the data meta."""
    model, meta = mods["sample"].load_model(str(snapshot), CPU)
    return model.eval(), meta


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_holds_the_snapshots_weights_bit_for_bit(mods, trained, layout):
    snapshot, _, exported = trained[layout]
    ours, meta = our_model(mods, snapshot)
    assert sorted(os.listdir(exported)) == HF_FILES  # char data: no tokenizer files
    config = json.loads((exported / "config.json").read_text())
    assert {k: config[k] for k in ("model_type", "architectures", "n_layer", "n_head", "n_embd",
                                   "vocab_size", "n_positions", "activation_function",
                                   "layer_norm_epsilon", "n_inner", "tie_word_embeddings",
                                   "bos_token_id", "eos_token_id", "dtype", "characters")} == {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_head": 2,
        "n_embd": 32, "vocab_size": 65, "n_positions": 32,
        # Our MLP's nn.GELU(approximate="tanh") is GPT-2's gelu_new; nn.LayerNorm's eps.
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "n_inner": None,
        "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": None,
        "dtype": "float32", "characters": "".join(meta["itos"])}
    # Every tensor of model.safetensors, mapped back by pretrained.py's own import of GPT-2
    # weights, is the snapshot's: no value changed, the Conv1D weights transposed back.
    back = exported_weights(mods["pretrained"], exported, block_size=32)
    state = ours.state_dict()
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert back[name].dtype == torch.float32 and torch.equal(back[name], tensor), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_pt_file_from_torchs_converter_holds_the_weights(mods, trained, layout, tmp_path):
    """The README's one-file export: torch's own converter (format_utils' dcp_to_torch) of the
    step directory `latest` names writes one torch.save file that loads with
    weights_only=True; its "model" is the snapshot's whole model, bit for bit, whatever the
    layout spread over the ranks (the command once, for the layout that splits the most; the
    others through the function it calls). train_state.pt beside it holds the config."""
    snapshot = trained[layout][0]
    step, out = snapshot / (snapshot / "latest").read_text(), tmp_path / "model.pt"
    if layout == "fsdp_tp":
        run([PYTHON, "-m", "torch.distributed.checkpoint.format_utils", "dcp_to_torch",
             str(step), str(out)])
    else:
        dcp_to_torch_save(step, out)
    whole = torch.load(out, weights_only=True)["model"]
    ours = our_model(mods, snapshot)[0].state_dict()
    assert sorted(whole) == sorted(ours)
    assert [k for k, v in ours.items() if not torch.equal(whole[k], v)] == []
    config = torch.load(step / "train_state.pt", weights_only=True)["model_config"]
    assert (config["n_layer"], config["n_embd"]) == (2, 32)


# How far transformers' logits may be from ours: derived from fp32 rounding, not measured.
# Both compute the same function of the same fp32 weights with the same operations, but for
# the order of each sum (Linear's x @ W.T against Conv1D's addmm with W.T stored: other GEMM
# kernels and blocking; our flash SDPA's online softmax against transformers' attention) and
# GELU (torch's tanh kernel against gelu_new's formula: 8 roundings). A sum of n terms in any
# order is within gamma_n * sum|terms| ~ n U sum|terms| of the exact sum (Higham, Accuracy and
# Stability of Numerical Algorithms, eq. 3.5), so two orders differ by at most 2 n U sum|terms|.
# Along the longest path from a token to a logit, with C = n_embd and T = block_size: the
# embedding sum (1); per block ln_1's mean and variance (2C), q/k/v (C + 1 with the bias),
# scores (a head's C / n_head <= C), softmax's denominator (T), the weighted values (T), c_proj
# (C + 1), the residual (1), ln_2 (2C), c_fc (C + 1), GELU (8), the MLP's c_proj (4C + 1), the
# residual (1): 12C + 2T + 14; then ln_f (2C) and the head (C). To first order these errors
# add: LayerNorm brings the residual stream back to unit scale before every use, so each one
# enters the next operation at its size relative to the values there, and the head's
# sum|terms| is the logits' own scale (measured: the largest is 1.03 to 1.06 x the largest
# |logit|). Hence 2 n U max|logit|: for 2 layers, 32 wide, 32 long, n = 1021, so 2042 ulps of
# the largest logit (1.2e-4 of it). A worst case, since a sum's roundings do not all go one
# way: measured 2.0 to 5.2 ulps (ddp, fsdp, fsdp_tp, pp; ATEN_CPU_CAPABILITY=default, avx2,
# avx512). A wrong mapping (a weight not transposed, a bias dropped, another LayerNorm eps)
# moves the logits by percents; the config's GELU and eps are checked by name above.
def logit_bound(config) -> int:
    """The bound above for our model's config: in ulps of the largest logit."""
    C, T, L = config.n_embd, config.block_size, config.n_layer
    n = 1 + L * (12 * C + 2 * T + 14) + 3 * C
    return 2 * n


@pytest.mark.parametrize("layout", LAYOUTS)
def test_transformers_computes_our_logits_and_greedy_text(mods, mingpt, trained, layout):
    snapshot, _, exported = trained[layout]
    ours, meta = our_model(mods, snapshot)
    hf = transformers.GPT2LMHeadModel.from_pretrained(exported).eval()
    assert hf.lm_head.weight is hf.transformer.wte.weight  # tied, as GPT-2
    idx = torch.randint(0, 65, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, expected = ours(idx)[0], hf(idx).logits
    assert expected.abs().max() > 0.5  # 10 steps of training: no longer a uniform guess
    assert_close_ulps(expected, logits, logit_bound(ours.config))
    # Greedy decoding: sample.py with top-k 1 against transformers' generate, the prompt
    # encoded with the characters the export carries in config.json (README).
    prompt = "ROMEO:"
    proc = script_in_process(mods["sample"], mingpt, "--snapshot", str(snapshot), "--prompt",
                             prompt, "--num_tokens", "20", "--top_k", "1")
    assert proc.returncode == 0, proc.stderr
    chars = transformers.AutoConfig.from_pretrained(exported).characters
    with torch.no_grad():
        ids = hf.generate(torch.tensor([[chars.index(c) for c in prompt]]), max_new_tokens=20,
                          do_sample=False)
    assert ids.shape == (1, len(prompt) + 20)
    assert proc.stdout == "".join(chars[i] for i in ids[0].tolist()) + "\n"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_init_from_the_export_starts_where_the_run_ended(mods, mingpt, trained, world, layout):
    """A run of the same layout started from the export evaluates, at step 0, to the trained
    run's last validation loss: the same weights bit for bit, the same validation windows and
    the same arithmetic on the same ranks, so the same logged loss, not merely a close one."""
    _, stdout, exported = trained[layout]
    last = val_losses(stdout)
    assert max(last) == 10
    again = world[layout]["again"] if layout in WORLD_LAYOUTS else train(
        mods, mingpt, layout, f"{layout}_again", f"gpt_config.init_from={exported}",
        "trainer_config.max_steps=1")
    assert f"weights from {exported}" in again
    assert val_losses(again)[0] == last[10], (val_losses(again), last)


@pytest.fixture(scope="module")
def bpe_run(mods, mingpt, tmp_path_factory):
    """A tiny run on BPE tokens of a tokenizer of our own (GPT-2's needs the network)."""
    where = tmp_path_factory.mktemp("bpe")
    text = (MINGPT / "data/input.txt").read_text()[:60000]
    write_tokenizer(where / "tokenizer", text, 200)
    (where / "text.txt").write_text(text)
    meta = mods["prepare"].prepare(str(where / "data"), str(where / "tokenizer"),
                                   files=[str(where / "text.txt")])
    train(mods, mingpt, "ddp", "bpe", "data_config=bpe", f"data_config.path={where}/data",
          "trainer_config.max_steps=4")
    return mingpt / "runs/bpe/snapshot", meta, where


def test_bpe_export_carries_its_tokenizer(mods, mingpt, bpe_run, tmp_path):
    snapshot, meta, where = bpe_run
    proc = export(mods, mingpt, snapshot, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    files = set(os.listdir(tmp_path / "hf"))
    assert files == {*HF_FILES, "tokenizer.json", "tokenizer_config.json", "vocab.json",
                     "merges.txt"}, files
    config = json.loads((tmp_path / "hf/config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == meta["eot"] == 456
    assert "characters" not in config
    # transformers' tokenizer from the export encodes as the data was encoded (tiktoken).
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    enc = mods["bpe_dataset"].load_tokenizer(meta["tokenizer"])
    probe = (MINGPT / "data/input.txt").read_text()[100000:101000]
    assert tok(probe)["input_ids"] == enc.encode_ordinary(probe)
    assert tok.eos_token_id == meta["eot"]
    # Greedy text through transformers' tokenizer and generate equals sample.py's.
    sample = script_in_process(mods["sample"], mingpt, "--snapshot", str(snapshot), "--prompt",
                               "ROMEO:", "--num_tokens", "20", "--top_k", "1")
    assert sample.returncode == 0, sample.stderr
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        ids = hf.generate(tok("ROMEO:", return_tensors="pt")["input_ids"], max_new_tokens=20,
                          do_sample=False)
    assert sample.stdout == tok.decode(ids[0]) + "\n"
    # GPT-2's vocab.json + merges.txt are the data's tokenizer (tiktoken's fingerprint), and
    # sample.py --init_from the export (our model, that tokenizer) writes the same text.
    fingerprint = mods["bpe_dataset"].fingerprint
    assert fingerprint(mods["bpe_dataset"].load_tokenizer(str(tmp_path / "hf"))) == \
        meta["tokenizer_sha"]
    again = script_in_process(mods["sample"], mingpt, "--init_from", str(tmp_path / "hf"),
                              "--prompt", "ROMEO:", "--num_tokens", "20", "--top_k", "1")
    assert again.returncode == 0, again.stderr
    assert again.stdout == sample.stdout


def one_error_line(proc) -> str:
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_bad_input_is_one_error_line_and_writes_nothing(mods, mingpt, trained, tmp_path):
    snapshot = trained["ddp"][0]
    out = tmp_path / "out"

    def refused(source, dest=out) -> str:
        before = sorted(os.listdir(tmp_path))
        line = one_error_line(export(mods, mingpt, source, dest))
        assert sorted(os.listdir(tmp_path)) == before  # no OUT_DIR, no temporary directory left
        return line

    # An OUT_DIR with something in it: nothing there is touched.
    (tmp_path / "full").mkdir()
    (tmp_path / "full/README.md").write_text("mine")
    assert refused(snapshot, tmp_path / "full") == (
        f"error: {tmp_path}/full exists and is not empty: give a new or empty directory "
        "(nothing there is overwritten)")
    assert os.listdir(tmp_path / "full") == ["README.md"]
    assert (tmp_path / "full/README.md").read_text() == "mine"
    (tmp_path / "file").write_text("mine")
    assert refused(snapshot, tmp_path / "file") == (
        f"error: {tmp_path}/file exists and is a file: give a new or empty directory (nothing "
        "there is overwritten)")
    # Not a snapshot: nothing there, a text file, another torch file, a plain directory.
    assert refused(tmp_path / "nope") == (
        f"error: no snapshot at {tmp_path}/nope: give a snapshot file or directory "
        "(runs/<run_name>/snapshot)")
    assert refused(tmp_path / "file").startswith(
        f"error: cannot load snapshot {tmp_path}/file (")
    assert refused(tmp_path / "file").endswith("): it is corrupt or not a snapshot")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    assert refused(tmp_path / "other.pt") == (
        f"error: {tmp_path}/other.pt is not a training snapshot of this trainer")
    assert refused(tmp_path / "full") == (
        f"error: {tmp_path}/full is a directory without a 'latest' file, so not a snapshot")


def test_models_gpt2_cannot_represent_are_refused(mods, mingpt, trained, tmp_path):
    out = tmp_path / "out"
    # No biases: GPT-2 has one in every Linear and LayerNorm.
    train(mods, mingpt, "ddp", "nobias", "gpt_config.bias=false", "trainer_config.max_steps=1")
    nobias = mingpt / "runs/nobias/snapshot"
    assert one_error_line(export(mods, mingpt, nobias, out)) == (
        f"error: {nobias} holds a model without biases (gpt_config.bias=false), which GPT-2 "
        "(GPT2LMHeadModel) cannot represent: it has a bias in every Linear and LayerNorm")
    # A mixture of experts, trained (MOE.md): its config keys are this GPT's own, and its
    # weights those its config builds, so neither check below saw it (exit 0, a dense GPT-2
    # without its MLPs).
    train(mods, mingpt, "ddp", "moe", "gpt_config.n_expert=4", "trainer_config.max_steps=1")
    moe = mingpt / "runs/moe/snapshot"
    assert one_error_line(export(mods, mingpt, moe, out)) == (
        f"error: {moe} holds a mixture of experts (gpt_config.n_expert=4), which GPT-2 "
        "(GPT2LMHeadModel) cannot represent: it has one dense MLP per block")
    # A model with parts GPT-2 has not: a config key this GPT lacks (another version's), or a
    # weight beyond those of its config.
    state = read_snapshot(trained["ddp"][0])  # as an older run's one file held it
    extra = {**state, "model_config": {**state["model_config"], "n_rotary": 4}}
    torch.save(extra, tmp_path / "extra")
    assert one_error_line(export(mods, mingpt, tmp_path / "extra", out)) == (
        f"error: {tmp_path}/extra holds a model with n_rotary=4, which GPT-2 "
        "(GPT2LMHeadModel) cannot represent")
    router = {**state, "model": {**state["model"], "blocks.0.mlp.router.weight": torch.ones(4)}}
    torch.save(router, tmp_path / "router")
    assert one_error_line(export(mods, mingpt, tmp_path / "router", out)) == (
        f"error: {tmp_path}/router holds a weight blocks.0.mlp.router.weight, which GPT-2 "
        "(GPT2LMHeadModel) cannot represent")
    assert not out.exists()


def test_a_snapshot_behind_a_url_exports_as_a_local_one(mods, mingpt, trained, tmp_path):
    """A URL (s3://) is read through fsspec, as training reads its snapshots there
    (test_mingpt_s3.py runs those against a moto server); fsspec's in-memory filesystem stands
    in for the store here, in this process, for a file and for a sharded directory."""
    import fsspec

    fs = fsspec.filesystem("memory")
    try:
        for layout in ("ddp", "fsdp_tp"):
            snapshot, _, local = trained[layout]
            url = f"memory://export/{layout}/snapshot"
            fs.put(str(snapshot), url, recursive=True)
            proc = export(mods, mingpt, url, tmp_path / layout)
            assert proc.returncode == 0, proc.stderr
            # The same bytes as the export of the local copy: the same weights, the same file.
            for name in HF_FILES:
                assert (tmp_path / layout / name).read_bytes() == (local / name).read_bytes()
    finally:
        fs.rm("memory://export", recursive=True)
