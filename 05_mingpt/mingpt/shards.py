"""The snapshot format (DCP, `torch.distributed.checkpoint`), for every layout: every rank
writes its own shards into `step_XXXXXXXX/`, rank 0 adds `train_state.pt` and then rewrites
`latest`, the commit; any layout reads them back. snapshot.py and savers.py run these parts.
An older run's snapshot, one torch.save file (load_file), loads through whole_state into any
layout too. Nothing a run keeps stays a view of a file (unmapped).
"""
import io
import os
import tempfile
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils._pytree import tree_leaves

from mingpt import storage
from mingpt.errors import MOVE_IT_AWAY, SnapshotError
from mingpt.optim import build_optimizer, local_optimizer
from mingpt.parallel.strided import checkpointable
from mingpt.parallel.wrappers import unwrap

TRAIN_STATE = "train_state.pt"
LATEST = "latest"


def save_file(url: str, obj: dict, before_commit: Callable[[], None] | None = None) -> None:
    """torch.save(obj) to `url`, atomically (write_bytes_atomic)."""
    if storage.is_local(url):
        # Straight into the temporary file: a buffer would hold a second copy in memory.
        storage.write_atomic(url, lambda f: torch.save(obj, f), before_commit)
        return
    buffer = io.BytesIO()  # an object store: one upload of the finished bytes
    torch.save(obj, buffer)
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
    leaves = tree_leaves(state) if storage.is_local(url) else []
    return {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}


def unmapped(tree: object, mapped: set[int], copies: dict[int, torch.Tensor]) -> object:
    """`tree` with each CPU tensor whose memory is one of `mapped` replaced by a copy (one per
    tensor: `copies`, by id); containers without such a tensor come back as they are."""
    if isinstance(tree, torch.Tensor):
        # Only plain tensors come from the file (a DTensor has no storage of its own to ask).
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


def step_dir(step: int) -> str:
    """The name of step `step`'s directory: zero-padded, so names sort by step."""
    return f"step_{step:08d}"


def is_step_dir(path: str) -> bool:
    return os.path.basename(path.rstrip("/")).startswith("step_")


def clear_step(url: str, name: str) -> None:
    """Rank 0: remove step directory `name`, left by a save of this step that was cut off."""
    fs, path = storage.filesystem(url)
    if dist.get_rank() == 0 and fs.exists(f"{path}/{name}"):
        fs.rm(f"{path}/{name}", recursive=True)


def write_shards(url: str, name: str, state: dict) -> None:
    """Every rank's shards of `state` (dcp_state's) into step directory `name` (dcp.save:
    collective; a failure on any rank is a CheckpointException, naming it, on every rank)."""
    dcp.save(checkpointable(state), storage_writer=storage.writer(f"{url}/{name}"))


def dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              extra: dict | None) -> dict:
    """What DCP writes: the model's and the optimizer's sharded state dicts (ZeRO's: its local
    AdamW's, under parameter names, so a rank reads back whatever it owns then), and the
    replica groups' meetings where they have any (optim.extra_state)."""
    model_sd, optim_sd = get_state_dict(unwrap(model), local_optimizer(optimizer))
    return {"model": model_sd, "optim": optim_sd, **({"replicas": extra} if extra else {})}


def commit_sharded(url: str, name: str, train_state: dict,
                   before_commit: Callable[[], None] | None, keep_last: int) -> None:
    """Rank 0: train_state.pt, then `latest` names step directory `name` (the commit), then
    the older step directories go. One writer commits: `latest` never sees two ranks' writes."""
    fs, path = storage.filesystem(url)
    if dist.get_rank() == 0:
        save_file(f"{url}/{name}/{TRAIN_STATE}", train_state)
        if before_commit:
            before_commit()
        storage.write_bytes_atomic(f"{url}/{LATEST}", name.encode())  # the commit point
        # Keep the newest keep_last - 1 complete snapshots of earlier steps; a cut-off save's
        # directory (no train_state.pt, or a later step) is none to roll back to.
        others = [p.rstrip("/") for p in fs.ls(path, detail=False)
                  if is_step_dir(p) and os.path.basename(p.rstrip("/")) != name]
        earlier = sorted((p for p in others if os.path.basename(p) < name
                          and fs.exists(f"{p}/{TRAIN_STATE}")), reverse=True)
        for old in set(others) - set(earlier[:keep_last - 1]):
            fs.rm(old, recursive=True)


def latest_sharded(url: str) -> str:
    """The step directory `latest` names: the snapshot's newest committed one."""
    try:
        fs, path = storage.filesystem(url)
        name = fs.cat_file(f"{path}/{LATEST}").decode().strip()
    except Exception as e:
        if not (isinstance(e, OSError) or storage.storage_error(url, e)):
            raise
        raise SnapshotError(f"cannot read {url}/{LATEST}: {storage.storage_error(url, e) or e}"
                            ) from None
    if not name.startswith("step_"):
        raise SnapshotError(f"{url}/{LATEST} names {name!r}, not a step directory; the snapshot "
                            f"is corrupt: {MOVE_IT_AWAY}")
    return f"{url}/{name}"


def load_sharded(url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 checkpoint: str | None = None, extra: dict | None = None,
                 no_dist: bool = False) -> None:
    """Each rank reads the pieces of the saved shards that its own need (from `checkpoint`, a
    DCP directory, where given; else the snapshot's newest)."""
    checkpoint = checkpoint or latest_sharded(url)
    # A collective: DCP plans the reads together. `extra`: the meetings' state, read in place.
    state = dcp_state(model, optimizer, extra)
    # DCP saves each group's list of parameter names once, from one rank: where ranks hold
    # different parameters (pipeline stages) it is another's, so this rank's go back after.
    own_names = [list(group["params"]) for group in state["optim"]["param_groups"]]
    try:
        # Into each rank's own rows of TP's q/k/v too: views of the DTensors in `state`.
        storage.load_dcp(checkpointable(state), checkpoint, no_dist)
    # DCP raises CheckpointException, a BaseException, on every rank when any rank fails.
    except (Exception, CheckpointException) as e:  # missing or truncated shards, bad metadata
        raise SnapshotError(f"cannot load sharded snapshot {checkpoint} ({storage.reason(e)}): "
                            f"it is corrupt; {MOVE_IT_AWAY}") from None
    for group, names in zip(state["optim"]["param_groups"], own_names, strict=True):
        group["params"] = names
    # Keyed by parameter name: set_state_dict puts it back under this optimizer's parameters.
    set_state_dict(unwrap(model), local_optimizer(optimizer), model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def whole_model(model_config: dict, name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A whole GPT on the CPU and the saver's kind of optimizer: what one-file state dicts fit."""
    from mingpt.model import GPT, GPTConfig  # noqa: PLC0415 (only these rare paths)
    whole = GPT(GPTConfig(**model_config))
    return whole, build_optimizer(whole, "ddp", 1e-3, name=name)


def whole_state(model_config: dict, weights: dict, optimized: dict, name: str = "adamw",
                extra: dict | None = None) -> dict:
    """dcp_state's dict from the state dicts of a whole model and its optimizer on the CPU (a
    one-file snapshot; xla_main.py's gathered weights): those number the optimizer's state,
    DCP names it, so they go through a whole model and optimizer (one more whole copy)."""
    whole, adamw = whole_model(model_config, name)
    whole.load_state_dict(weights)
    adamw.load_state_dict(optimized)  # the saved groups, decay and lrs included
    model_sd, optim_sd = get_state_dict(whole, adamw)
    return {"model": model_sd, "optim": optim_sd, **({"replicas": extra} if extra else {})}


def load_file_into_shards(state: dict, model: torch.nn.Module,
                          optimizer: torch.optim.Optimizer, extra: dict | None = None) -> None:
    """An older one-file snapshot (a whole model's state dicts) into any layout: whole_state's
    dict becomes a DCP checkpoint in a private folder of this rank, read from there exactly as
    a snapshot is (load_sharded). `extra`: the replica groups' meetings, read in place."""
    whole = whole_state(state["model_config"], state["model"], state["optimizer"],
                        state.get("optimizer_name", "adamw"), state["replicas"] if extra else None)
    with tempfile.TemporaryDirectory(prefix="snapshot-") as folder:
        with warnings.catch_warnings():  # one process's own copy: no group is the point
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save(whole, checkpoint_id=folder, no_dist=True)
        del whole  # in the folder now: not a second copy in memory during the load
        load_sharded(folder, model, optimizer, checkpoint=folder, extra=extra)


def load_sharded_weights(url: str, model: torch.nn.Module) -> None:
    """Only the weights of a snapshot, into a plain model on one process (for sampling)."""
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # no process group: DCP reads every shard here
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            storage.load_dcp(state, latest_sharded(url), no_dist=True)
    except (Exception, CheckpointException) as e:
        raise SnapshotError(f"cannot load sharded snapshot {url} ({storage.reason(e)})") from None
    model.load_state_dict(state["model"])


def read_whole(url: str, model_config: dict, name: str = "adamw") -> tuple[dict, dict]:
    """A snapshot's whole state dicts (model, optimizer), read on this one process (xla_main.py)."""
    whole, adamw = whole_model(model_config, name)
    with warnings.catch_warnings():  # without a process group DCP reads every shard here
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        load_sharded(url, whole, adamw, no_dist=True)
    return whole.state_dict(), adamw.state_dict()
