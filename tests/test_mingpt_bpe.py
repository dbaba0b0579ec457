"""05_mingpt's BPE data: prepare.py (text -> tiktoken tokens -> train.bin / val.bin) and
mingpt/data/bpe.py (windows of the memory-mapped tokens), with a small tokenizer learnt here in
GPT-2's file layout (the real GPT-2 files need the network)."""
import json
import pickle

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from bpe_fixture import write_tokenizer
from mingpt_helpers import MINGPT, mingpt_imported, script_in_process

# Whitespace runs, tabs, a no-break space, digits, contractions, accents, an emoji and a
# 4-byte character: the places where a careless chunking or byte mapping changes the tokens.
TRICKY = ("Hello  world!\n\n  Indented\tline 12345 it's we'll café 😀 \u00a0nbsp  \n\n"
          "End   \nx\n\ny \n z\u2028w\n")
OWN = ("prepare", "bpe_dataset")


@pytest.fixture(scope="module")
def mods():
    """config, prepare and bpe_dataset as the scripts import them (and removed afterwards)."""
    with mingpt_imported(*OWN) as modules:
        yield modules


@pytest.fixture(scope="module")
def shakespeare() -> str:
    return (MINGPT / "data/input.txt").read_text()[:60000]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, shakespeare):
    path = tmp_path_factory.mktemp("tokenizer")
    assert write_tokenizer(path, shakespeare, 200) == 457  # 256 bytes + 200 merges + EOT
    return path


def test_tokenizer_files_give_hugging_face_gpt2_tokens(mods, tokenizer_dir, shakespeare):
    transformers = pytest.importorskip("transformers")
    enc = mods["bpe_dataset"].load_tokenizer(str(tokenizer_dir))
    # Hugging Face's own reading of the same two files: the reference for every id.
    hf = transformers.GPT2TokenizerFast.from_pretrained(tokenizer_dir)
    for text in (TRICKY, shakespeare[:20000]):
        ids = enc.encode_ordinary(text)
        assert ids == hf(text)["input_ids"]
        assert enc.decode(ids) == text
    assert enc.n_vocab == 457 and enc.eot_token == 456
    assert enc.encode_ordinary(" the") == [hf.convert_tokens_to_ids("Ġthe")]  # a merged token
    # tiktoken's own gpt2 encoding uses the same pre-tokenizer pattern.
    assert mods["bpe_dataset"].GPT2_PATTERN == pytest.importorskip(
        "tiktoken_ext.openai_public").r50k_pat_str


def expected_tokens(enc, texts: list[str]) -> list[int]:
    """The tokens of whole documents, each followed by <|endoftext|>."""
    return [t for text in texts for t in [*enc.encode_ordinary(text), enc.eot_token]]


@pytest.mark.parametrize("workers", [1, 2])
def test_prepare_chunks_in_parallel_without_changing_tokens(mods, tokenizer_dir, tmp_path,
                                                           shakespeare, workers):
    prepare = mods["prepare"]
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(TRICKY * 20)
    b.write_text(shakespeare[:3000])
    # 64-byte chunks: a few hundred cuts, each where the tokens cannot change.
    meta = prepare.prepare(str(tmp_path / "out"), str(tokenizer_dir), files=[str(a), str(b)],
                           train_fraction=0.8, workers=workers, chunk_bytes=64)
    enc = mods["bpe_dataset"].load_tokenizer(str(tokenizer_dir))
    split = prepare.text_split([str(a), str(b)], 0.8)
    # 80% of the bytes lies inside b.txt; validation starts after a newline there.
    assert split[0] == 1 and b.read_bytes()[split[1] - 2:split[1]].endswith(b"\n")
    cut = b.read_bytes()[:split[1]].decode()
    train = np.fromfile(tmp_path / "out/train.bin", dtype=np.uint16).tolist()
    val = np.fromfile(tmp_path / "out/val.bin", dtype=np.uint16).tolist()
    # a.txt whole, then b.txt up to the split point; the rest of b.txt validates.
    assert train == expected_tokens(enc, [TRICKY * 20]) + enc.encode_ordinary(cut)
    assert val == expected_tokens(enc, [b.read_text()[len(cut):]])
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))
    assert meta["vocab_size"] == 457 and meta["eot"] == 456
    assert meta["tokenizer"] == str(tokenizer_dir.resolve())
    assert json.loads((tmp_path / "out/meta.json").read_text()) == meta
    assert not (tmp_path / "out/prepare_state.json").exists()


def test_prepare_resumes_where_it_stopped(mods, tokenizer_dir, tmp_path, shakespeare,
                                          monkeypatch, capsys):
    prepare = mods["prepare"]
    text = tmp_path / "text.txt"
    text.write_text(shakespeare[:8000])
    args = dict(tokenizer=str(tokenizer_dir), files=[str(text)], chunk_bytes=256)
    reference = prepare.prepare(str(tmp_path / "ref"), **args)
    encode, calls, stop_at = prepare.encode_pieces, [], [10]

    def interrupted(pieces, enc=None):
        calls.append(len(calls))
        if len(calls) == stop_at[0]:  # Ctrl-C while encoding the 10th chunk, once
            stop_at[0] = 0
            raise KeyboardInterrupt
        return encode(pieces, enc)

    monkeypatch.setattr(prepare, "encode_pieces", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare(str(tmp_path / "out"), **args)
    state = json.loads((tmp_path / "out/prepare_state.json").read_text())
    # Some tokens are saved, and the data is not marked finished.
    assert state["tokens"]["train"] > 0 and not (tmp_path / "out/meta.json").exists()
    with open(tmp_path / "out/train.bin.partial", "ab") as f:
        f.write(b"\x01\x02" * 7)  # written after the last saved position: must be dropped
    calls.clear()
    capsys.readouterr()
    meta = prepare.prepare(str(tmp_path / "out"), **args)
    n_chunks = 9 + len(calls)  # 9 chunks were done before the interruption
    assert f"resuming at {state['position'][1]:,} of 8,000" in capsys.readouterr().err
    assert meta == reference
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
    # The reference run needed as many chunks in all: nothing was encoded twice.
    calls.clear()
    prepare.prepare(str(tmp_path / "again"), **args)
    assert len(calls) == n_chunks
    # Finished and unchanged: nothing to do.
    calls.clear()
    assert prepare.prepare(str(tmp_path / "out"), **args) == reference and calls == []


def test_prepare_reads_a_saved_hugging_face_dataset(mods, tokenizer_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = ["First doc.\nline two", "", "Second doc", "third doc is here"] * 5
    datasets.Dataset.from_dict({"text": rows, "id": list(range(20))}).save_to_disk(
        tmp_path / "ds")
    prepare = mods["prepare"]
    dataset = prepare.load_hf_dataset(str(tmp_path / "ds"), "train", "text")
    # Two workers, one chunk of rows: the parallel path on a dataset.
    meta = prepare.prepare(str(tmp_path / "out"), str(tokenizer_dir), dataset=dataset,
                           workers=2, source="ds")
    enc = mods["bpe_dataset"].load_tokenizer(str(tokenizer_dir))
    train = np.fromfile(tmp_path / "out/train.bin", dtype=np.uint16).tolist()
    val = np.fromfile(tmp_path / "out/val.bin", dtype=np.uint16).tolist()
    # Rows are documents (empty ones add nothing); the first 18 of 20 rows train.
    assert train == expected_tokens(enc, [r for r in rows[:18] if r])
    assert val == expected_tokens(enc, [r for r in rows[18:] if r])
    assert meta["train_tokens"] == len(train)
    with pytest.raises(ValueError) as info:
        prepare.load_hf_dataset(str(tmp_path / "ds"), "train", "body")
    assert str(info.value) == (f"dataset {tmp_path / 'ds'} has no column 'body'; columns: "
                               "text, id (set --text_column)")


def one_error_line(proc) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_prepare_errors_are_one_line(mods, tokenizer_dir, tmp_path):
    empty, latin1, short = tmp_path / "empty.txt", tmp_path / "latin1.txt", tmp_path / "s.txt"
    empty.write_text("")
    latin1.write_bytes("Hello\ncafé\n".encode("latin-1"))
    short.write_text("a")

    def prepare(*args: str) -> str:
        # `python prepare.py ARGS`, run in this process (each case stops at its error)
        return one_error_line(script_in_process(mods["prepare"], MINGPT, *args, "--out",
                                                str(tmp_path / "o"), "--workers", "1"))

    tok = ["--tokenizer", str(tokenizer_dir)]
    # é in Latin-1 is the single byte 0xE9, not valid UTF-8: its offset is named.
    assert prepare(str(empty), *tok) == f"error: no text to encode: {empty} is empty"
    assert prepare(str(latin1), *tok) == f"error: {latin1} is not UTF-8 text (byte 9: b'\\xe9')"
    assert prepare(str(tmp_path / "nope.txt"), *tok) == \
        f"error: no such text file: {tmp_path / 'nope.txt'}"
    # One character and <|endoftext|>, all before the split: nothing validates.
    assert prepare(str(short), *tok) == \
        f"error: too little text in {short}: 2 training and 0 validation tokens"
    assert prepare(str(short), "--tokenizer", str(tmp_path / "none")) == \
        f"error: tokenizer {tmp_path / 'none'}: no such directory"
    assert prepare(str(short), "--tokenizer", str(tmp_path)) == \
        (f"error: tokenizer directory {tmp_path} holds neither vocab.json + merges.txt nor "
         "encoder.json + vocab.bpe")


def test_gpt2_tokenizer_without_network_is_one_clear_error(mods, monkeypatch):
    tiktoken = pytest.importorskip("tiktoken")

    def offline(name):
        raise ConnectionError("Max retries exceeded (Name or service not known)")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    # Nothing in the Hugging Face cache either (prepare imports the function when it runs).
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a: None)
    with pytest.raises(ValueError) as info:
        mods["bpe_dataset"].load_tokenizer("gpt2")
    assert str(info.value) == (
        "no GPT-2 tokenizer here: gpt2 is not in the Hugging Face cache and tiktoken could not "
        "fetch its gpt2 files (ConnectionError); give a directory with vocab.json + merges.txt "
        "(any saved GPT-2), or set TIKTOKEN_CACHE_DIR to a tiktoken cache filled elsewhere")
    with pytest.raises(ValueError, match="^tokenizer someone/model is not a directory and not "
                                         "in the Hugging Face cache$"):
        mods["bpe_dataset"].load_tokenizer("someone/model")


@pytest.fixture(scope="module")
def prepared(mods, tokenizer_dir, tmp_path_factory, shakespeare):
    out = tmp_path_factory.mktemp("prepared")
    mods["prepare"].prepare(str(out), str(tokenizer_dir), files=[str(MINGPT / "data/input.txt")],
                            workers=1)
    return out


def data_cfg(path, **kw):
    return OmegaConf.create({"name": "bpe", "path": str(path), "stride": None, **kw})


def test_bpe_windows_are_slices_of_the_token_file(mods, prepared):
    bpe = mods["bpe_dataset"]
    tokens = np.fromfile(prepared / "train.bin", dtype=np.uint16).astype(np.int64)
    train, val, meta = bpe.build_datasets(data_cfg(prepared), block_size=32, seed=0)
    assert meta["kind"] == "bpe" and meta["vocab_size"] == 457 and meta["block_size"] == 32
    # Default stride = block_size: windows side by side, each token once per epoch.
    assert len(train) == (len(tokens) - 33) // 32 + 1
    for i in (0, 1, len(train) - 1):
        x, y = train[i]
        assert x.dtype == torch.long and x.shape == y.shape == (32,)
        assert x.tolist() == tokens[32 * i:32 * i + 32].tolist()
        assert y.tolist() == tokens[32 * i + 1:32 * i + 33].tolist()
    with pytest.raises(IndexError):  # the DataLoader's samplers never ask, but a user might
        train[len(train)]
    # stride 1: every position starts a window, as in the char data.
    every, _, _ = bpe.build_datasets(data_cfg(prepared, stride=1), block_size=32, seed=0)
    assert len(every) == len(tokens) - 32 and every[5][0].tolist() == tokens[5:37].tolist()
    # A pickled dataset (DataLoader workers under spawn) carries the path, not the tokens.
    assert len(pickle.dumps(train)) < 1000 and pickle.loads(pickle.dumps(train))[3][0].equal(
        train[3][0])
    assert len(val) == (meta_tokens(prepared, "val") - 33) // 32 + 1


def meta_tokens(path, split: str) -> int:
    return json.loads((path / "meta.json").read_text())[f"{split}_tokens"]


def test_bpe_data_errors_are_one_line(mods, prepared, tmp_path):
    bpe, config = mods["bpe_dataset"], mods["config"]
    with pytest.raises(ValueError, match=f"^no prepared data in {tmp_path} \\(no meta.json\\): "
                                         f"run python prepare.py TEXT_FILE --out {tmp_path} "):
        bpe.build_datasets(data_cfg(tmp_path), 32, 0)
    with pytest.raises(ValueError, match=r"block_size \(100000\) must be smaller than each split"):
        bpe.build_datasets(data_cfg(prepared), 100000, 0)
    with pytest.raises(ValueError, match=r"^data_config.stride must be a positive integer or "
                                         r"null \(block_size\), got 0$"):
        config.load(["data_config=bpe", "data_config.stride=0"])
    config.load(["data_config=bpe", "data_config.stride=1"])
    # A snapshot of a run on other tokens (another tokenizer of the same size) is refused.
    _, _, meta = bpe.build_datasets(data_cfg(prepared), 32, 0)
    saved = {"model_config": {}, "data_meta": {**meta, "tokenizer_sha": "0123456789abcdef"}}
    with pytest.raises(ValueError, match=r"was trained on different data \(tokenizer_sha "
                                         r"differs\)"):
        mods["snapshot"].check_compatible(saved, {}, meta, "snap", bpe.MATCH_KEYS)
    # A finished meta.json beside a cut-off token file: refused, not read past its end.
    (tmp_path / "meta.json").write_text((prepared / "meta.json").read_text())
    (tmp_path / "train.bin").write_bytes((prepared / "train.bin").read_bytes()[:100])
    with pytest.raises(ValueError, match="train.bin is missing or not the .* bytes meta.json "
                                         "says: run prepare.py again$"):
        bpe.build_datasets(data_cfg(tmp_path), 32, 0)
