"""Character-level language modelling data: any UTF-8 text file becomes next-character samples
(`data_config.path`: a local path or any URL fsspec knows, s3://...).
"""
from pathlib import Path

import fsspec
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset

from mingpt import ROOT

KEYS = ("name", "path", "train_fraction")  # data_config's keys (data_config/char.yaml)
MATCH_KEYS = ("vocab_size", "itos")  # a resume needs the same vocabulary
TEXT = True


class CharDataset(Dataset):
    """Every position of a token sequence starts one (block_size,) sample."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens = tokens  # (N,) int64 token ids
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.tokens) - self.block_size  # a sample takes block_size + 1 tokens

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[index : index + self.block_size + 1]  # (block_size + 1,)
        return chunk[:-1], chunk[1:]  # inputs, and the next character at every position


def resolve_path(path: str) -> str:
    """A URL as is; a relative local path relative to 05_mingpt/, wherever the command runs."""
    return path if "://" in path or Path(path).is_absolute() else str(ROOT / path)


def read_text(path: str) -> str:
    """The whole file as text; ValueError with one clear line for every way it can be unusable."""
    try:
        with fsspec.open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ValueError(f"data file not found: {path} (set data_config.path)") from None
    except (OSError, ValueError) as e:  # permissions, a directory, an unknown URL protocol ...
        raise ValueError(f"cannot read data file {path}: {e}") from None
    if not raw:
        raise ValueError(f"data file {path} is empty; set data_config.path to a UTF-8 text file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        # Binary files (an archive, an image) land here too: their bytes are rarely valid UTF-8.
        raise ValueError(f"data file {path} is not UTF-8 text (byte {e.start}: "
                         f"{raw[e.start:e.start + 1]!r}); convert it (iconv -t UTF-8) or set "
                         "data_config.path to a text file") from None


def check_config(data_cfg: DictConfig) -> None:
    unknown = sorted(set(data_cfg) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown key data_config.{unknown[0]}; allowed: {', '.join(KEYS)}")
    fraction = data_cfg.get("train_fraction")
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) \
            or not 0.0 < fraction < 1.0:
        raise ValueError(f"data_config.train_fraction must be between 0 and 1, got {fraction!r}")
    if not isinstance(data_cfg.get("path"), str):
        raise ValueError(f"data_config.path must be a path or URL, got {data_cfg.get('path')!r}")


def build_datasets(data_cfg: DictConfig, block_size: int, seed: int
                   ) -> tuple[CharDataset, CharDataset, dict]:
    """The first `train_fraction` of the text trains, the rest validates: unlike a random split
    of overlapping windows, no validation character is ever trained on."""
    del seed  # same interface as the image data, whose palette sampling is seeded
    check_config(data_cfg)
    path, fraction = resolve_path(data_cfg.path), float(data_cfg.train_fraction)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"gpt_config.block_size must be a positive integer, got {block_size!r}")
    text = read_text(path)
    chars = sorted(set(text))  # the vocabulary, sorted: ids do not depend on the file's order
    stoi = {ch: i for i, ch in enumerate(chars)}
    tokens = torch.tensor([stoi[ch] for ch in text], dtype=torch.long)  # (N,)
    n_train = int(len(tokens) * fraction)
    train_tokens, val_tokens = tokens[:n_train], tokens[n_train:]
    if block_size >= min(len(train_tokens), len(val_tokens)):
        raise ValueError(f"gpt_config.block_size ({block_size}) must be smaller than each split of "
                         f"{path} (train {len(train_tokens)}, val {len(val_tokens)} characters); "
                         "use a longer text or a smaller block_size")
    meta = {"kind": "char", "vocab_size": len(chars), "block_size": block_size, "itos": chars,
            "path": path}
    return CharDataset(train_tokens, block_size), CharDataset(val_tokens, block_size), meta


def encode(text: str, meta: dict) -> list[int]:
    """Characters to ids with the snapshot's vocabulary; ValueError for one it never saw."""
    stoi = {ch: i for i, ch in enumerate(meta["itos"])}
    unknown = sorted(set(text) - set(stoi))
    if unknown:
        raise ValueError(f"the prompt has characters the model never saw: {''.join(unknown)!r}")
    return [stoi[ch] for ch in text]


def decode(ids: list[int], meta: dict) -> str:
    return "".join(meta["itos"][i] for i in ids)
