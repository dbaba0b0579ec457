"""GPT-2 BPE data: its tokenizer, and windows of the token files prepare.py writes.

    python prepare.py data/input.txt --out data/shakespeare_bpe   # once
    enc = load_tokenizer("gpt2")  # or a directory with vocab.json + merges.txt (prepare.py)
    train, val, meta = build_datasets(cfg.data_config, block_size=256, seed=0)
    x, y = train[0]  # (block_size,) token ids each; y is x shifted left by one token

`data_config.path` is prepare.py's output directory (relative paths are relative to this
folder): `train.bin` and `val.bin` hold uint16 token ids, `meta.json` the tokenizer and counts.
The files are memory-mapped, not read: a sample is one slice of the file, so a dataset of
billions of tokens costs no memory, and each DataLoader worker maps the file on its own.
Sample i is the window starting at token i * stride; the trainer's sampler decides the order
(seeded, disjoint across ranks, resumable), exactly as for the char data.
"""
import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset

from mingpt.data.char import resolve_path

# GPT-2's pre-tokenizer (tiktoken's r50k pattern): text is cut into these pieces, then BPE
# merges bytes within each piece.
GPT2_PATTERN = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++"""
                r"""|\s++$|\s+(?!\S)|\s""")
EOT = "<|endoftext|>"
# The keys of data_config for this kind (data_config/bpe.yaml).
KEYS = ("name", "path", "stride")
# The data meta keys a snapshot must share with this run to resume: the same tokenizer.
MATCH_KEYS = ("vocab_size", "tokenizer_sha")
TEXT = True


class TokenWindows(Dataset):
    """Sample i: tokens [i * stride, i * stride + block_size] of a uint16 file, as (x, y)."""

    def __init__(self, path: str, n_tokens: int, block_size: int, stride: int) -> None:
        self.path, self.n_tokens = path, n_tokens
        self.block_size, self.stride = block_size, stride
        self._tokens: np.memmap | None = None  # mapped at first use, in the process using it

    def tokens(self) -> np.memmap:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=np.uint16, mode="r", shape=(self.n_tokens,))
        return self._tokens

    def __getstate__(self) -> dict:
        # A pickled memmap carries its whole data: DataLoader workers map the file themselves.
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        # A window needs block_size + 1 tokens: block_size inputs, and one more target.
        return (self.n_tokens - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        start = index * self.stride
        # One slice of the map, copied out as int64 (embedding indices); (block_size + 1,)
        chunk = torch.from_numpy(self.tokens()[start:start + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]  # inputs, and the next token at every position


def check_config(data_cfg: DictConfig) -> None:
    """ValueError (one line) unless data_config has exactly this kind's keys, with usable values."""
    unknown = sorted(set(data_cfg) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown key data_config.{unknown[0]}; allowed: {', '.join(KEYS)}")
    if not isinstance(data_cfg.get("path"), str):
        raise ValueError(f"data_config.path must be a directory made by prepare.py, got "
                         f"{data_cfg.get('path')!r}")
    stride = data_cfg.get("stride")
    if stride is not None and (isinstance(stride, bool) or not isinstance(stride, int)
                               or stride < 1):
        raise ValueError(f"data_config.stride must be a positive integer or null (block_size), "
                         f"got {stride!r}")


def read_meta(path: str, given: str) -> dict:
    """prepare.py's meta.json in `path` (data_config.path `given`), and the two token files
    complete; else ValueError."""
    meta_file = Path(path) / "meta.json"
    if not meta_file.is_file():
        raise ValueError(f"no prepared data in {path} (no meta.json): run python prepare.py "
                         f"TEXT_FILE --out {given} (or set data_config.path)")
    meta = json.loads(meta_file.read_text())
    for split in ("train", "val"):
        file, expected = Path(path) / f"{split}.bin", 2 * meta[f"{split}_tokens"]
        if not file.is_file() or file.stat().st_size != expected:
            raise ValueError(f"{file} is missing or not the {expected} bytes meta.json says: "
                             "run prepare.py again")
    return meta


def build_datasets(data_cfg: DictConfig, block_size: int, seed: int
                   ) -> tuple[TokenWindows, TokenWindows, dict]:
    """(train, val, meta) from prepare.py's output in data_cfg.path; the same on every rank."""
    del seed  # same interface as the image data, whose palette sampling is seeded
    check_config(data_cfg)
    path = resolve_path(data_cfg.path)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"gpt_config.block_size must be a positive integer, got {block_size!r}")
    prepared = read_meta(path, data_cfg.path)
    stride = data_cfg.get("stride") or block_size  # default: windows side by side, no overlap
    n_train, n_val = prepared["train_tokens"], prepared["val_tokens"]
    if block_size >= min(n_train, n_val):
        raise ValueError(f"gpt_config.block_size ({block_size}) must be smaller than each split of "
                         f"{path} (train {n_train}, val {n_val} tokens); use more text or a "
                         "smaller block_size")
    meta = {"kind": "bpe", "vocab_size": prepared["vocab_size"], "block_size": block_size,
            "tokenizer": prepared["tokenizer"], "tokenizer_sha": prepared["tokenizer_sha"],
            "eot": prepared["eot"], "path": path}
    return (TokenWindows(str(Path(path) / "train.bin"), n_train, block_size, stride),
            TokenWindows(str(Path(path) / "val.bin"), n_val, block_size, stride), meta)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's files spell each byte as a printable character: that character -> the byte."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    decoder = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in printable]  # mapped to chr(256), chr(257), ...
    decoder.update({chr(256 + i): b for i, b in enumerate(others)})
    return decoder


def tokenizer_from_files(vocab_file: Path, merges_file: Path, name: str):
    """A tiktoken Encoding from GPT-2-style vocab (token -> id) and merges files."""
    import tiktoken

    decode = _byte_decoder()
    vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    merges = [line.split() for line in merges_file.read_text(encoding="utf-8").splitlines()[1:]
              if line.strip()]  # the first line is a '#version' header
    specials = {token: i for token, i in vocab.items() if token.startswith("<|")}
    ranks = {bytes(decode[c] for c in token): i for token, i in vocab.items()
             if token not in specials}
    # tiktoken merges by rank: a merged token's id must be its merge's place in merges.txt,
    # after the 256 single bytes (true of GPT-2's files, not of every BPE trainer's).
    expected = {bytes([b]): i for i, b in enumerate(decode[c] for c in decode)}
    for i, (a, b) in enumerate(merges):
        expected[bytes(decode[c] for c in a + b)] = 256 + i
    if ranks != expected or EOT not in specials:
        raise ValueError(f"{vocab_file} and {merges_file} are not a GPT-2 tokenizer tiktoken can "
                         f"run (ids in merge order after the 256 bytes, and an {EOT} token)")
    return tiktoken.Encoding(name=name, pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={EOT: specials[EOT]})


def tokenizer_files(spec: str) -> tuple[Path, Path, str] | None:
    """The vocabulary and merges files `spec` names, in GPT-2's layout (a directory's, or the
    Hugging Face cache's for a model id), and the tokenizer's name; None for a model id whose
    files are not cached. ValueError (one line) for a directory without them."""
    path = Path(spec).expanduser()
    if path.is_dir():
        for vocab, merges in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
            if (path / vocab).is_file() and (path / merges).is_file():
                return path / vocab, path / merges, str(path.resolve())
        raise ValueError(f"tokenizer directory {spec} holds neither vocab.json + merges.txt nor "
                         "encoder.json + vocab.bpe")
    if spec.startswith(("/", ".", "~")):
        raise ValueError(f"tokenizer {spec}: no such directory")
    from huggingface_hub import try_to_load_from_cache  # the local cache only: no network

    files = [try_to_load_from_cache(spec, name) for name in ("vocab.json", "merges.txt")]
    if all(isinstance(f, str) for f in files):
        return Path(files[0]), Path(files[1]), spec
    return None


def load_tokenizer(spec: str):
    """The tiktoken Encoding `spec` names (module docstring); ValueError (one line) if none."""
    files = tokenizer_files(spec)
    if files is not None:
        return tokenizer_from_files(*files)
    if spec.removeprefix("openai-community/") not in ("gpt2", "gpt2-medium", "gpt2-large",
                                                       "gpt2-xl"):
        raise ValueError(f"tokenizer {spec} is not a directory and not in the Hugging Face cache")
    import tiktoken  # every GPT-2 size has the same tokenizer: tiktoken's gpt2 encoding
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # no network (requests' ConnectionError), a bad cache, ...
        raise ValueError(f"no GPT-2 tokenizer here: {spec} is not in the Hugging Face cache and "
                         f"tiktoken could not fetch its gpt2 files ({type(e).__name__}); give a "
                         "directory with vocab.json + merges.txt (any saved GPT-2), or set "
                         "TIKTOKEN_CACHE_DIR to a tiktoken cache filled elsewhere") from None


def fingerprint(enc) -> str:
    """A short hash of the vocabulary: runs and snapshots compare tokenizers by it."""
    h = hashlib.sha256()
    for i in range(enc.n_vocab):
        token = enc.decode_single_token_bytes(i)
        h.update(len(token).to_bytes(4, "little") + token)
    return h.hexdigest()[:16]


def tokenizer(meta: dict):
    """The run's tokenizer (tiktoken), for prompts and samples; ValueError if it is gone."""
    return _tokenizer(meta["tokenizer"], meta.get("tokenizer_sha"))


@functools.cache  # built once per process: encoding the prompt and decoding share it
def _tokenizer(spec: str, sha: str | None):
    enc = load_tokenizer(spec)
    if sha is not None and fingerprint(enc) != sha:  # the same name, other files
        raise ValueError(f"tokenizer {spec} is not the one the data was prepared with (its "
                         "vocabulary differs)")
    return enc


def encode(text: str, meta: dict) -> list[int]:
    """GPT-2 BPE ids, with the tokenizer the data was prepared with (the snapshot names it)."""
    return tokenizer(meta).encode_ordinary(text)


def decode(ids: list[int], meta: dict) -> str:
    return tokenizer(meta).decode(ids)  # bytes cut mid-character become U+FFFD
