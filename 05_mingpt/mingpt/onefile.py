"""The one-file snapshot (ddp, zero, dp: every rank holds the whole model): rank 0 writes it,
atomically, and keeps the ones before it for a roll-back by hand; it loads mapped, with
`weights_only=True`, and nothing the run keeps stays a view of the file. snapshot.py decides
when; shards.py reads such a file into a layout where no rank holds the whole model.
"""
import io
import os
import shutil
from collections.abc import Callable

import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem

from mingpt import storage
from mingpt.errors import MOVE_IT_AWAY, SnapshotError
from mingpt.optim import local_optimizer
from mingpt.parallel.wrappers import unwrap


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


def unmap_optimizer(optimizer: torch.optim.Optimizer, mapped: set[int]) -> None:
    """Give the optimizer its own copy of any state that is still a view of the snapshot file.

    load_state_dict keeps a saved tensor as it is when it already has the parameter's device
    and dtype: on the CPU AdamW's moments (on a GPU its step counts) would stay views of the
    mapped file, which would then stay mapped for the whole run (the disk space of a deleted
    snapshot never freed; a file overwritten in place changing under it, or SIGBUS)."""
    copies: dict[int, torch.Tensor] = {}
    # ZeRO: its own state and its local AdamW's hold the same tensors; both get one copy.
    local = local_optimizer(optimizer)
    for opt in {id(o): o for o in (optimizer, local)}.values():
        for entries in [*opt.state.values(), *opt.param_groups]:
            for key, value in entries.items() if isinstance(entries, dict) else ():
                entries[key] = unmapped(value, mapped, copies)


def keep_previous(url: str, keep_last: int) -> None:
    """Before a snapshot file is replaced: URL.1 .. URL.{keep_last-1} keep the ones before it.

    Each older copy moves up one number; the current file is linked (locally) or copied as
    URL.1, so URL itself stays in place until the new one replaces it atomically."""
    fs, path = storage.filesystem(url)
    if keep_last < 2 or not fs.isfile(path):
        return
    for i in range(keep_last - 1, 1, -1):  # .1 -> .2, ..., oldest dropped
        if fs.exists(f"{path}.{i - 1}"):
            fs.mv(f"{path}.{i - 1}", f"{path}.{i}")
    if fs.exists(f"{path}.1"):
        fs.rm(f"{path}.1")
    if not isinstance(fs, LocalFileSystem):
        fs.copy(path, f"{path}.1")
        return
    try:
        os.link(path, f"{path}.1")  # no copy: the replace below gives `path` a new file
    except OSError:
        # Object-store mounts (gcsfuse, blobfuse, ...) and some network filesystems have no
        # hard links (EPERM, ENOTSUP, ENOSYS, EXDEV, ...): every save would fail. A copy of
        # the bytes instead (copyfile: such mounts may refuse copy2's metadata), under a
        # temporary name, so that a cut-off copy never poses as the previous snapshot.
        shutil.copyfile(path, f"{path}.1.tmp")
        os.replace(f"{path}.1.tmp", f"{path}.1")


def write_file(url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               state: dict, before_commit: Callable[[], None] | None, keep_last: int,
               gather: Callable | None) -> None:
    """Rank 0: the one-file snapshot, renamed over the old one once written."""
    if dist.get_rank() != 0:
        return
    keep_previous(url, keep_last)
    weights, optimized = gather(model, optimizer) if gather else \
        (unwrap(model).state_dict(), optimizer.state_dict())  # no "module." prefix
    save_file(url, {**state, "model": weights, "optimizer": optimized}, before_commit)
