"""The kinds of training data, each a module behind one protocol (`DataModule`).

    data = data_module(cfg.data_config.name)              # "char", "bpe" or "cifar10"
    data.check_config(cfg.data_config)                    # its own keys, one-line errors
    train, val, meta = data.build_datasets(cfg.data_config, block_size, seed)
    text = data.decode(model.generate(...)[0].tolist(), meta)   # TEXT kinds only

Adding a kind: a module here with the members below, one entry in KINDS, and a yaml in
data_config/ (README: Extending).
"""
import importlib
from typing import Protocol

from omegaconf import DictConfig
from torch.utils.data import Dataset

# data_config.name -> the module that reads that data: the only list of data kinds.
KINDS = {"char": "mingpt.data.char", "cifar10": "mingpt.data.image", "bpe": "mingpt.data.bpe"}


class DataModule(Protocol):
    """What main.py, sample.py and the snapshots need of a kind of data."""

    # Keys of the data meta a snapshot must share with a run to resume (the vocabulary...).
    MATCH_KEYS: tuple[str, ...]
    # Whether samples are text: encode() and decode() turn a prompt into ids and back.
    TEXT: bool

    def check_config(self, data_cfg: DictConfig) -> None:
        """ValueError (one line) unless data_config's keys and values are this kind's."""

    def build_datasets(self, data_cfg: DictConfig, block_size: int, seed: int
                       ) -> tuple[Dataset, Dataset, dict]:
        """(train, val, meta): datasets of (x, y) pairs of (block_size,) token ids, and the
        meta a snapshot keeps: "kind", "vocab_size", "block_size" and whatever decoding needs.
        A collective in a distributed run, where the kind needs one (image: rank 0's palette)."""

    # Text kinds only: the vocabulary comes from `meta` (the snapshot's), not from the data
    # files, so sample.py needs nothing but the snapshot.
    def encode(self, text: str, meta: dict) -> list[int]: ...

    def decode(self, ids: list[int], meta: dict) -> str: ...


def data_module(name: str) -> DataModule:
    """The module of data_config.name's kind (imported only when that kind is used)."""
    # By name, on first use: torchvision and scikit-learn (image), tiktoken (bpe) load only
    # for runs of that kind.
    return importlib.import_module(KINDS[name])
