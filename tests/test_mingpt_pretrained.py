"""GPT-2 weights through `gpt_config.init_from`: a small random GPT2LMHeadModel saved with
save_pretrained stands in for OpenAI's (no network in tests), with a tokenizer of the same
vocabulary in the same directory, as a saved Hugging Face GPT-2 model would have.

The slowest tests (several runs of 2 ranks each) have `slowest` in their names.
"""
import signal

import pytest
import torch
import torch.nn.functional as F

from bpe_fixture import hf_gpt2, write_hf_gpt2, write_tokenizer
from conftest import PYTHON, run
from mingpt_helpers import (
    LOG_UNIT,
    MINGPT,
    U,
    assert_close_ulps,
    copy_mingpt,
    ended_job,
    mingpt_imported,
    read_snapshot,
    run_job,
    script_in_process,
    tiny,
    val_losses,
)

transformers = pytest.importorskip("transformers")
OWN = ("pretrained", "prepare", "bpe_dataset", "main")
VOCAB = 457  # 256 bytes + 200 merges + <|endoftext|>


@pytest.fixture(scope="module")
def mods():
    with mingpt_imported(*OWN) as modules:
        yield modules


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models on a shared 2-core machine
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A 'pretrained GPT-2': 2 layers, 2 heads, 32 wide, context 64, and its tokenizer."""
    path = tmp_path_factory.mktemp("gpt2_tiny")
    text = (MINGPT / "data/input.txt").read_text()[:60000]
    assert write_tokenizer(path, text, 200) == VOCAB
    write_hf_gpt2(path, VOCAB)
    return path


SETTINGS = {"model_type": None, "n_layer": None, "n_head": None, "n_embd": None,
            "dropout": 0.0, "bias": True}


def build(mods, source, block_size=64, **settings):
    pretrained = mods["pretrained"]
    config = pretrained.gpt_config_from(str(source), {**SETTINGS, **settings}, VOCAB, block_size,
                                        "bpe")
    model = mods["model"].GPT(config).eval()
    pretrained.load_pretrained(model, str(source))
    return model


def build_model(mods):
    """A random model of the stand-in's shape."""
    config = mods["model"].GPTConfig(**{**SETTINGS, "n_layer": 2, "n_head": 2, "n_embd": 32},
                                     vocab_size=VOCAB, block_size=64)
    return mods["model"].GPT(config)


def test_init_from_a_directory_gives_hugging_face_logits(mods, gpt2_dir):
    # The reference: Hugging Face's model, read back from the same directory.
    hf = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    model = build(mods, gpt2_dir)
    assert model.wte.weight is model.lm_head.weight  # still tied after loading
    torch.manual_seed(0)
    idx = torch.randint(0, VOCAB, (2, 64))
    with torch.no_grad():
        expected = hf(idx).logits
        logits, _ = model(idx)
    assert expected.abs().max() > 1.0  # the perturbed weights give large, distinct logits
    # The same function computed otherwise (test_mingpt_model's HF parity: Conv1D's addmm and
    # eager attention against Linear and scaled_dot_product_attention): within 64 ulps of the
    # largest logit (measured: 5.3, and 4.4 on the prefix, under ATEN_CPU_CAPABILITY=default,
    # avx2 and avx512).
    assert_close_ulps(logits, expected, 64)
    # A shorter context keeps the first positions of wpe: the same logits on a prefix.
    short = build(mods, gpt2_dir, block_size=16)
    with torch.no_grad():
        assert_close_ulps(short(idx[:, :16])[0], expected[:, :16], 64)
    # Greedy decoding (our KV cache) follows Hugging Face's argmax step by step.
    tokens = idx[:1, :8]
    with torch.no_grad():
        ours = model.generate(tokens, 12, do_sample=False)
        theirs = tokens
        for _ in range(12):
            theirs = torch.cat([theirs, hf(theirs).logits[:, -1:].argmax(-1)], dim=1)
    assert ours.tolist() == theirs.tolist()


def test_hf_names_map_onto_ours(mods):
    hf = hf_gpt2(11, n_layer=1, n_head=1, n_embd=4, block=8)
    state = mods["pretrained"].hf_to_ours(hf.state_dict(), block_size=5)
    assert state["blocks.0.attn.c_attn.weight"].shape == (12, 4)  # Conv1D (4, 12) transposed
    assert state["blocks.0.mlp.c_fc.weight"].equal(hf.transformer.h[0].mlp.c_fc.weight.t())
    assert state["wpe.weight"].equal(hf.transformer.wpe.weight[:5])
    assert set(state) >= {"wte.weight", "lm_head.weight", "ln_f.bias", "blocks.0.ln_2.weight"}


@pytest.mark.parametrize("settings, block, vocab, message", [
    ({"model_type": "gpt-micro"}, 64, VOCAB,
     "gpt_config.init_from={dir} has n_layer=2, n_head=2, n_embd=32, but gpt_config asks for "
     "n_layer=4, n_head=4, n_embd=128 (model_type=gpt-micro): set gpt_config.model_type=null "
     "and leave the sizes unset"),
    ({"n_layer": 3, "n_head": 2}, 64, VOCAB,
     "gpt_config.init_from={dir} has n_layer=2, n_head=2, n_embd=32, but gpt_config asks for "
     "n_layer=3 (model_type=None): set gpt_config.model_type=null and leave the sizes unset"),
    ({}, 64, 65,
     "gpt_config.init_from={dir} has a vocabulary of 457 tokens, but data_config=bpe has 65: "
     "the data must be tokenised with the model's own tokenizer (data_config=bpe, prepared by "
     "prepare.py with the same tokenizer)"),
    ({}, 65, VOCAB,
     "gpt_config.block_size must be at most 64 (the context of gpt_config.init_from={dir}), "
     "got 65"),
    ({"bias": False}, 64, VOCAB,
     "gpt_config.bias must be true with gpt_config.init_from={dir}: GPT-2 has biases"),
])
def test_settings_that_contradict_the_weights_are_one_line(mods, gpt2_dir, settings, block,
                                                           vocab, message):
    with pytest.raises(ValueError) as info:
        mods["pretrained"].gpt_config_from(str(gpt2_dir), {**SETTINGS, **settings}, vocab, block,
                                           "bpe")
    assert str(info.value) == message.format(dir=gpt2_dir)
    # Sizes that agree with the weights are fine (tiny() sets exactly these).
    mods["pretrained"].gpt_config_from(str(gpt2_dir), {**SETTINGS, "n_layer": 2, "n_head": 2,
                                                       "n_embd": 32}, VOCAB, 64, "bpe")


def test_models_that_are_not_gpt2_are_refused(mods, gpt2_dir, tmp_path):
    pretrained = mods["pretrained"]
    write_hf_gpt2(tmp_path / "relu", 11, n_layer=1, n_embd=8, activation_function="relu")
    with pytest.raises(ValueError, match=r"^gpt_config.init_from=.*relu has activation_function="
                                         r"'relu'; this GPT supports only 'gelu_new'$"):
        pretrained.hf_config(str(tmp_path / "relu"))
    (tmp_path / "bert").mkdir()  # another architecture altogether
    (tmp_path / "bert/config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ValueError, match=r"^gpt_config.init_from=.*bert is a bert model, not "
                                         r"GPT-2 \(model_type gpt2\)$"):
        pretrained.hf_config(str(tmp_path / "bert"))
    (tmp_path / "tokenizer_only").mkdir()
    (tmp_path / "tokenizer_only/vocab.json").write_text("{}")
    with pytest.raises(ValueError) as info:
        pretrained.hf_config(str(tmp_path / "tokenizer_only"))
    where = tmp_path / "tokenizer_only"
    assert str(info.value) == (f"cannot load gpt_config.init_from={where}: {where} has no "
                               "config.json (not a directory written by save_pretrained)")
    (where / "config.json").write_text((gpt2_dir / "config.json").read_text())
    with pytest.raises(ValueError) as info:  # a config, but no weights
        pretrained.load_pretrained(build_model(mods), str(where))
    assert str(info.value).startswith(f"cannot load gpt_config.init_from={where}: Error no "
                                      "file named model.safetensors")
    assert "\n" not in str(info.value)
    config = mods["config"]
    with pytest.raises(ValueError, match="^gpt_config.init_from must be null, gpt2, gpt2-medium, "
                                         "gpt2-large, gpt2-xl or a directory, got ''$"):
        config.load(["gpt_config.init_from=''"])
    with pytest.raises(ValueError, match=r"^gpt_config: dropout must be in \[0, 1\), got 1.5$"):
        config.load(["gpt_config.init_from=gpt2", "gpt_config.dropout=1.5"])
    # The pretrained model sets the sizes: no n_layer/n_head/n_embd needed in the config.
    config.load(["gpt_config.init_from=gpt2", "gpt_config.model_type=null", "data_config=bpe"])
    # Experts where GPT-2 has one MLP: its weights would not load (the feature matrix found a
    # RuntimeError from load_state_dict on every rank, after the data was read).
    with pytest.raises(ValueError, match=r"^gpt_config.n_expert must be 0 with gpt_config."
                                         r"init_from=gpt2: GPT-2 has one dense MLP per block, "
                                         r"not experts$"):
        config.load(["gpt_config.init_from=gpt2", "gpt_config.model_type=null",
                     "data_config=bpe", "gpt_config.n_expert=4"])


@pytest.fixture(scope="module")
def mingpt(tmp_path_factory):
    return copy_mingpt(tmp_path_factory.mktemp("mingpt_pretrained"))


def one_error_line(proc) -> str:
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return lines[0]


def test_missing_model_or_wrong_data_is_one_error_line(mods, mingpt, gpt2_dir, tmp_path):
    def main(*args: str, in_process: bool = True) -> str:
        args = tiny(*args, f"run_dir={tmp_path}/run")
        # An empty Hugging Face cache, and no downloads: as on a machine without network.
        # huggingface_hub reads these when it is imported: that case needs a fresh process.
        proc = script_in_process(mods["main"], mingpt, *args) if in_process else run(
            [PYTHON, "main.py", *args], cwd=mingpt, check=False, HF_HOME=str(tmp_path / "hf"),
            HF_HUB_OFFLINE="1")
        assert not (tmp_path / "run").exists()  # refused before the run directory exists
        return one_error_line(proc)

    assert main(f"gpt_config.init_from={tmp_path}/nope") == \
        f"error: gpt_config.init_from={tmp_path}/nope: no such directory ({tmp_path}/nope)"
    assert main("gpt_config.init_from=gpt2-xl", in_process=False) == (
        "error: cannot load gpt_config.init_from=gpt2-xl: not a local directory and not in the "
        "Hugging Face cache, and HF_HUB_OFFLINE is set; download it where there is network (hf "
        "download gpt2-xl) and copy the cache (HF_HOME), or set init_from to a directory "
        "written by save_pretrained")
    # The char data's 65 characters are not GPT-2's vocabulary.
    assert main(f"gpt_config.init_from={gpt2_dir}") == (
        f"error: gpt_config.init_from={gpt2_dir} has a vocabulary of 457 tokens, but "
        "data_config=char has 65: the data must be tokenised with the model's own tokenizer "
        "(data_config=bpe, prepared by prepare.py with the same tokenizer)")


@pytest.fixture(scope="module")
def bpe_data(mingpt, gpt2_dir):
    """The first 100 kB of tiny Shakespeare, tokenised with the model's tokenizer."""
    text = mingpt / "data/shakespeare_head.txt"
    text.write_text((MINGPT / "data/input.txt").read_text()[:100000])
    run([PYTHON, "prepare.py", str(text), "--out", "data/tiny_bpe", "--tokenizer", str(gpt2_dir),
         "--workers", "2"], cwd=mingpt)
    return mingpt / "data/tiny_bpe"


# The README's fine-tuning recipe, made tiny: 4 steps of 2 x 8 windows of 32 tokens,
# snapshots at 2 and 4, 4 validation batches; a larger lr, so that 4 steps show.
FINETUNE = ("data_config=shakespeare_gpt2", "data_config.path=data/tiny_bpe",
            "gpt_config.block_size=32", "gpt_config.dropout=0.0",
            "trainer_config.grad_accum_steps=1", "trainer_config.max_steps=4",
            "trainer_config.save_every=2", "trainer_config.log_every=2",
            "trainer_config.eval_every=0", "trainer_config.eval_batches=4",
            "trainer_config.sample_tokens=12", "optimizer_config.lr=1e-3")


def test_finetune_recipe_composes(mods):
    cfg = mods["config"].load(["data_config=shakespeare_gpt2"])
    assert cfg.gpt_config.init_from == "gpt2" and cfg.gpt_config.model_type is None
    assert (cfg.data_config.name, cfg.gpt_config.block_size) == ("bpe", 256)
    assert cfg.optimizer_config.lr == 3e-5


def hf_val_loss(mods, gpt2_dir, bpe_data, world_size: int, seed: int = 1337) -> float:
    """The Hugging Face model's mean loss on the validation windows the trainer evaluates."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"name": "bpe", "path": str(bpe_data), "stride": None})
    _, val, _ = mods["bpe_dataset"].build_datasets(cfg, 32, seed)
    n = max(1, min(len(val), 4 * 8) // world_size) * world_size  # as Trainer.__init__ picks
    chosen = torch.randperm(len(val), generator=torch.Generator().manual_seed(seed))[:n]
    x, y = (torch.stack(t) for t in zip(*(val[i] for i in chosen.tolist()), strict=True))
    hf = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    with torch.no_grad():
        return F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()


def test_finetune_from_pretrained_ddp_fsdp_and_resume_slowest(mods, mingpt, gpt2_dir, bpe_data):
    expected = hf_val_loss(mods, gpt2_dir, bpe_data, world_size=2)
    # Every run starts from the stand-in's weights; two gloo processes each.
    args = (*FINETUNE, f"gpt_config.init_from={gpt2_dir}")
    ddp = run_job(mingpt, 2, *tiny("run_name=ft_ddp", *args))  # torchrun's ranks, forked
    assert f"weights from {gpt2_dir}" in ddp
    assert "model: 41,120 parameters (2 layers, 2 heads, 32 wide, vocab 457, block 32)" in ddp
    # Step 0 evaluates the loaded weights: Hugging Face's loss on the same windows, as the log
    # rounds it (half a unit of its 4th decimal) after the two computations' rounding (logits
    # within 64 ulps, test_init_from_a_directory_gives_hugging_face_logits; the loss, a mean
    # of positive terms, likewise: 64 U of it, 2.4e-5 at 6.26). Measured: 3.7e-5, the log's
    # rounding (unrounded, in TensorBoard: equal), under ATEN_CPU_CAPABILITY=default,
    # avx2 and avx512.
    val = val_losses(ddp)
    assert abs(val[0] - expected) <= LOG_UNIT / 2 + 64 * U * expected, (val, expected)
    assert val[4] < val[0]  # and training lowers it
    assert "sample:\n" in ddp  # decoded with the BPE tokenizer
    # FSDP: the whole model is loaded, then fully_shard turns its weights into DTensors (on
    # one process here: a launch less; 2-rank sharding is test_mingpt_train's): the same start.
    # (05's modules are imported from the repository: its relative data paths mean the
    # repository's folder, so the copy's data is given by its absolute path.)
    here = [a.replace("=data/tiny_bpe", f"={bpe_data}") for a in args]
    fsdp = script_in_process(mods["main"], mingpt, *tiny(
        "run_name=ft_fsdp", *here, "trainer_config.distributed_method=fsdp",
        "trainer_config.max_steps=1", "trainer_config.sample_tokens=0"))
    assert fsdp.returncode == 0, fsdp.stderr
    on_one = hf_val_loss(mods, gpt2_dir, bpe_data, 1)  # the windows one rank evaluates
    assert abs(val_losses(fsdp.stdout)[0] - on_one) <= LOG_UNIT / 2 + 64 * U * on_one
    # A worker killed before step 3 (SIGKILL: the job ends there), then the same command
    # again, as torchrun's restart runs it (test_mingpt_train.py restarts under torchrun): it
    # resumes from the step-2 snapshot, the BPE data position and everything else carried
    # over, so the final weights equal the uninterrupted run's.
    command = tiny("run_name=ft_kill", *args)
    code, killed, _ = ended_job(mingpt, "main.py", command, 2, mingpt / "ft_kill.log",
                                FAULT_AT_STEP="3")
    assert code == -signal.SIGKILL and "FAULT_AT_STEP=3: killing this worker" in killed, killed
    code, resumed, _ = ended_job(mingpt, "main.py", command, 2, mingpt / "ft_kill_again.log",
                                 TORCHELASTIC_RESTART_COUNT="1")
    assert code == 0 and "resumed from" in resumed and "at step 2" in resumed, resumed
    # The restart took the weights from the snapshot alone, not from the pretrained files too.
    assert f"weights from {gpt2_dir}" in killed and f"weights from {gpt2_dir}" not in resumed
    a = read_snapshot(mingpt / "runs/ft_ddp/snapshot")
    b = read_snapshot(mingpt / "runs/ft_kill/snapshot")
    assert a["step"] == b["step"] == 4 and a["data_meta"] == b["data_meta"]
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    # The snapshot samples text through its BPE tokenizer (top-k 1: the likeliest tokens).
    sample = script_in_process(mods["sample"], mingpt, "--snapshot", "runs/ft_ddp/snapshot",
                               "--prompt", "ROMEO:", "--num_tokens", "6", "--top_k", "1")
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("ROMEO:") and len(sample.stdout) > len("ROMEO:\n")


def test_sample_py_from_pretrained_weights(mods, mingpt, gpt2_dir):
    """sample.py --init_from: the released model and its tokenizer, no snapshot; top-k 1
    gives Hugging Face's greedy continuation, decoded by Hugging Face's tokenizer."""
    proc = script_in_process(mods["sample"], mingpt, "--init_from", str(gpt2_dir), "--prompt",
                             "ROMEO: the", "--num_tokens", "10", "--top_k", "1")
    assert proc.returncode == 0, proc.stderr
    # Hugging Face's greedy continuation, token by token, with its own tokenizer.
    tok = transformers.GPT2TokenizerFast.from_pretrained(gpt2_dir)
    hf = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    ids = torch.tensor([tok("ROMEO: the")["input_ids"]])
    with torch.no_grad():
        for _ in range(10):
            ids = torch.cat([ids, hf(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert proc.stdout.rstrip("\n") == tok.decode(ids[0].tolist())
    missing = script_in_process(mods["sample"], mingpt, "--init_from", "/nonexistent/model")
    assert one_error_line(missing) == ("error: gpt_config.init_from=/nonexistent/model: no such "
                                       "directory (/nonexistent/model)")
