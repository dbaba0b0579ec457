"""One torch.save file, written atomically and loaded mapped with `weights_only=True`:
each snapshot's `train_state.pt` (shards.py), and the whole snapshot of older runs, which
snapshot.py still loads (shards.whole_state puts it into any layout). Nothing a run keeps
stays a view of the file (unmapped).
"""
import io
from collections.abc import Callable

import torch

from mingpt import storage
from mingpt.errors import MOVE_IT_AWAY, SnapshotError


def save_file(url: str, obj: dict, before_commit: Callable[[], None] | None = None) -> None:
    """torch.save(obj) to `url`, atomically (write_bytes_atomic)."""
    def write(f: io.BufferedIOBase) -> None:
        torch.save(obj, f)

    if storage.is_local(url):
        # Straight into the temporary file, tensor by tensor: serialising into a buffer first
        # held a second copy of the whole snapshot (weights and both moments) in memory.
        storage.write_atomic(url, write, before_commit)
        return
    buffer = io.BytesIO()  # an object store: one upload of the finished bytes, as before
    write(buffer)
    storage.write_bytes_atomic(url, buffer.getvalue(), before_commit)


def load_file(url: str) -> dict:
    """A snapshot dict on the CPU; weights_only=True refuses pickled code. The tensors of a
    local file are views of it (storage.load_torch): copy those that must outlive it."""
    try:
        state = storage.load_torch(url)
    except Exception as e:  # truncated, corrupt, not a torch file, unreadable
        failed = storage.storage_error(url, e)
        if failed:  # the store failed, not the snapshot
            raise SnapshotError(f"cannot read snapshot {url}: {failed}") from None
        raise SnapshotError(f"cannot load snapshot {url} ({storage.reason(e)}): it is corrupt or "
                            f"not a snapshot: {MOVE_IT_AWAY}") from None
    if not isinstance(state, dict) or "step" not in state:
        raise SnapshotError(f"{url} is not a training snapshot of this trainer; {MOVE_IT_AWAY}")
    return state


def mapped(state: dict, url: str) -> set[int]:
    """The memory (storage addresses) of every tensor of `state` loaded from a local file:
    storage.load_torch maps the file. (From an object store they are the process's own.)"""
    return {t.untyped_storage().data_ptr() for t in tensors(state)} if storage.is_local(url) \
        else set()


def tensors(tree: object) -> list[torch.Tensor]:
    """Every tensor in nested dicts, lists and tuples."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    values = tree.values() if isinstance(tree, dict) else tree \
        if isinstance(tree, list | tuple) else ()
    return [t for value in values for t in tensors(value)]


def unmapped(tree: object, mapped: set[int], copies: dict[int, torch.Tensor]) -> object:
    """`tree` with each CPU tensor whose memory is one of `mapped` (storage addresses) replaced
    by a copy; a tensor met twice gets the same copy (`copies`, by id). Containers without
    such a tensor come back as they are (the optimizer's own lists stay its own)."""
    if isinstance(tree, torch.Tensor):
        # torch.load gives plain tensors (DTensors, parameters: never from the file, and a
        # DTensor has no storage of its own to ask).
        if type(tree) is not torch.Tensor or tree.device.type != "cpu" \
                or tree.untyped_storage().data_ptr() not in mapped:
            return tree
        return copies.setdefault(id(tree), tree.clone())
    if isinstance(tree, dict):
        new = {key: unmapped(value, mapped, copies) for key, value in tree.items()}
        return tree if all(new[key] is value for key, value in tree.items()) else new
    if isinstance(tree, list | tuple):
        items = [unmapped(value, mapped, copies) for value in tree]
        return tree if all(a is b for a, b in zip(items, tree, strict=True)) else \
            type(tree)(items)
    return tree
