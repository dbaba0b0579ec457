"""The kinds of training data, each a module behind one protocol (`DataModule`).

    data = data_module(cfg.data_config.name)              # "char", "bpe" or "cifar10"
    data.check_config(cfg.data_config)                    # its own keys, one-line errors
    train, val, meta = data.build_datasets(cfg.data_config, block_size, seed)
    text = data.decode(model.generate(...)[0].tolist(), meta)   # TEXT kinds only

Adding a kind (README: Extending): a module with the members below, a KINDS entry, a yaml.
"""
import importlib
from typing import Protocol

from omegaconf import DictConfig
from torch.utils.data import Dataset

# data_config.name -> the module that reads that data: the only list of data kinds.
KINDS = {"char": "mingpt.data.char", "cifar10": "mingpt.data.image", "bpe": "mingpt.data.bpe"}


class DataModule(Protocol):
    """What main.py, sample.py and the snapshots need of a kind of data."""

    MATCH_KEYS: tuple[str, ...]  # the data meta's keys a resumed run must share (vocabulary...)
    TEXT: bool  # whether samples are text: encode() and decode() turn a prompt into ids and back

    def check_config(self, data_cfg: DictConfig) -> None:
        """ValueError (one line) unless data_config's keys and values are this kind's."""

    def build_datasets(self, data_cfg: DictConfig, block_size: int, seed: int
                       ) -> tuple[Dataset, Dataset, dict]:
        """(train, val, meta), alike on every rank: datasets of (x, y) pairs of (block_size,)
        token ids, and the meta a snapshot keeps (kind, vocab_size, block_size, decode's needs)."""

    # Text kinds only, with the snapshot's vocabulary (`meta`): sample.py needs nothing else.
    def encode(self, text: str, meta: dict) -> list[int]: ...

    def decode(self, ids: list[int], meta: dict) -> str: ...


def data_module(name: str) -> DataModule:
    # Imported on first use: torchvision, scikit-learn (image) and tiktoken (bpe) only if used.
    return importlib.import_module(KINDS[name])
