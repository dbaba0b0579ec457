"""GPT-2 BPE data: its tokenizer, and windows of the token files prepare.py writes.

`data_config.path` is prepare.py's output: `train.bin` and `val.bin` (uint16 token ids) are
memory-mapped, not read, so billions of tokens cost no memory; `meta.json` names the tokenizer.
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

# GPT-2's pre-tokenizer (tiktoken's r50k): BPE merges bytes within each of these pieces.
GPT2_PATTERN = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++"""
                r"""|\s++$|\s+(?!\S)|\s""")
EOT = "<|endoftext|>"
KEYS = ("name", "path", "stride")  # data_config's keys (data_config/bpe.yaml)
MATCH_KEYS = ("vocab_size", "tokenizer_sha")  # a resume needs the same tokenizer
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
        return {**self.__dict__, "_tokens": None}  # a pickled memmap would carry all its data

    def __len__(self) -> int:
        return (self.n_tokens - self.block_size - 1) // self.stride + 1  # block_size + 1 each

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        start = index * self.stride
        # One slice of the map, copied out as int64 (embedding indices); (block_size + 1,)
        chunk = torch.from_numpy(self.tokens()[start:start + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]  # inputs, and the next token at every position


def check_config(data_cfg: DictConfig) -> None:
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
    """prepare.py's meta.json in `path`, its two token files checked complete; else ValueError."""
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
    # GPT-2's files spell each byte as a printable character: that character -> the byte.
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]  # mapped to chr(256), chr(257), ...
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


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
    """(vocab file, merges file, name) of a directory or a cached model id, else None; ValueError
    (one line) for a directory without them."""
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
    """A tiktoken Encoding from a directory's GPT-2 files, a cached model id's, or tiktoken's own
    gpt2 encoding for GPT-2's ids; ValueError (one line) if none."""
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
    h = hashlib.sha256()  # a short hash of the vocabulary: runs and snapshots compare by it
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
    return tokenizer(meta).encode_ordinary(text)


def decode(ids: list[int], meta: dict) -> str:
    return tokenizer(meta).decode(ids)  # bytes cut mid-character become U+FFFD
