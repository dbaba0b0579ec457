"""Snapshots: complete, atomic, tensors loaded with `weights_only=True`, local disk or S3.

    snapshot.save(path, "fsdp", model, optimizer, {**trainer.state_dict(), **meta})
    state = snapshot.load(path, "fsdp", model, optimizer, meta, match_keys)  # None: none yet

This module owns every layout; the trainer only gives and takes its own state dict. Two
layouts, chosen by whether a rank holds the whole model (parallel.snapshot_format):
- ddp (also zero, dp), with no tp_size or pp_size: every rank holds the whole model, so
  global rank 0 writes ONE file at `snapshot_path` (model, optimizer, schedule, scaler, step,
  data position, every rank's RNG, configs). ZeRO's optimizer state is spread over the
  ranks: it is gathered to rank 0 first (consolidate_state_dict), so the file is the same as
  DDP's and either method resumes it.
- fsdp (also tp, fsdp_tp, pp, fsdp_pp, fsdp_tp_pp), and any flavour with tp_size or pp_size:
  no rank holds the whole model.
  `torch.distributed.checkpoint` (DCP) has every rank write its own shards in parallel into
  `snapshot_path/step_XXXXXXXX/`; rank 0 adds `train_state.pt` (everything but model and
  optimizer) and then `snapshot_path/latest`, which names the newest complete step
  directory. DCP reshards on load, so another number of ranks, or another of these methods,
  can resume. ZeRO (zero with pp_size, or reading shards) gives DCP its local AdamW: each
  owner writes the state of its parameters by name, each rank reads what it owns now.
  A step directory that `latest` does not name is an interrupted save: it is never loaded.

Everything is loaded to the CPU; `load_state_dict` then copies weights and optimizer state to
wherever the parameters live. (Mapping a snapshot straight to a GPU would also move the RNG
states, which must stay CPU tensors, and AdamW's step counts, which then cost a host sync per
parameter on every step.)

Paths go through storage.py (fsspec), so `s3://bucket/key` works wherever a local path does.
"""
import io
import os
import random
import shutil
import warnings
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer

from mingpt import errors, storage
from mingpt.optim import (
    build_optimizer,
    extra_state,
    inner,
    keep_own_optimizer_settings,
    load_extra_state,
    local_optimizer,
    own_settings,
    restore_settings,
)
from mingpt.parallel import snapshot_format
from mingpt.parallel.strided import checkpointable
from mingpt.parallel.wrappers import unwrap

T = TypeVar("T")
TRAIN_STATE = "train_state.pt"
LATEST = "latest"
# Model config keys that may differ between a snapshot and the run loading it.
NOT_ARCHITECTURE = ("model_type", "dropout")
# What a training run can do about a snapshot it cannot use, at the end of those messages (a
# command that only reads snapshots, export_hf.py, cuts it off: it has no snapshot_path).
MOVE_IT_AWAY = "move it away or set trainer_config.snapshot_path"


class SnapshotError(ValueError):
    """A snapshot exists but cannot be used; the message says which one and why."""


class SaveError(Exception):
    """A snapshot could not be written (a full disk, a read-only folder, an object store's
    error); the message says so in one line, and that the previous snapshot is intact."""


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


def _tensors(tree: object) -> list[torch.Tensor]:
    """Every tensor in nested dicts, lists and tuples."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    values = tree.values() if isinstance(tree, dict) else tree \
        if isinstance(tree, list | tuple) else ()
    return [t for value in values for t in _tensors(value)]


def _unmapped(tree: object, mapped: set[int], copies: dict[int, torch.Tensor]) -> object:
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
        new = {key: _unmapped(value, mapped, copies) for key, value in tree.items()}
        return tree if all(new[key] is value for key, value in tree.items()) else new
    if isinstance(tree, list | tuple):
        items = [_unmapped(value, mapped, copies) for value in tree]
        return tree if all(a is b for a, b in zip(items, tree, strict=True)) else \
            type(tree)(items)
    return tree


def _unmap_optimizer(optimizer: torch.optim.Optimizer, mapped: set[int]) -> None:
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
                entries[key] = _unmapped(value, mapped, copies)


def _is_step_dir(path: str) -> bool:
    return os.path.basename(path.rstrip("/")).startswith("step_")


@storage.storage_errors(SnapshotError, prefix=True)
def snapshot_kind(url: str) -> str | None:
    """"ddp" for a snapshot file, "fsdp" for a DCP snapshot directory, None when there is none.

    A directory holding only step directories and no `latest` is a first save that was
    interrupted before its commit: no snapshot yet (with a warning), not an error, or every
    restart of the job would stop here.
    """
    fs, path = storage.filesystem(url)
    if fs.isfile(path):
        return "ddp"
    if fs.isdir(path):
        if fs.exists(f"{path}/{LATEST}"):
            return "fsdp"
        entries = fs.ls(path, detail=False)
        if all(_is_step_dir(entry) for entry in entries):
            if entries and (not dist.is_initialized() or dist.get_rank() == 0):  # said once
                warnings.warn(f"{url} holds no committed snapshot (a save was interrupted before "
                              f"'{LATEST}' was written): starting from step 0", stacklevel=2)
            return None
        raise SnapshotError(f"{url} is a directory without a '{LATEST}' file, so not an fsdp "
                            f"snapshot; {MOVE_IT_AWAY}")
    return None


def committed(url: str) -> bool:
    """A committed snapshot is there to resume from (load reads and checks it later, on every
    rank; a foreign or unreadable one is refused there, never trained over)."""
    with warnings.catch_warnings():  # an interrupted first save: load says so, once
        warnings.simplefilter("ignore")
        return snapshot_kind(url) is not None


def rng_state(device: torch.device) -> dict:
    """This process's RNG states as tensors and plain types (so weights_only can load them)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if device.type == "xla":  # the devices' dropout stream (xla_main.py); imported only there
        import torch_xla.core.xla_model as xm
        state["xla"] = xm.get_rng_state(device)  # a seed: a plain int
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    if device.type == "xla" and "xla" in state:
        import torch_xla.core.xla_model as xm
        xm.set_rng_state(state["xla"], device)


def check_compatible(state: dict, model_config: dict, data_meta: dict, url: str,
                     match_keys: tuple[str, ...], optimizer: str = "adamw") -> None:
    """SnapshotError unless the snapshot's model, the data meta keys its data module names
    in `match_keys` (kind, vocabulary, ...), and its optimizer's kind match this run's."""
    # (A snapshot from before optimizer_config.name existed holds AdamW's state.)
    saved_name = state.get("optimizer_name", "adamw")
    if saved_name != optimizer:
        raise SnapshotError(f"snapshot {url} holds {saved_name}'s optimizer state, not "
                            f"{optimizer}'s; set optimizer_config.name={saved_name} or "
                            "trainer_config.snapshot_path to a new path")
    saved = state["model_config"]
    for key, value in model_config.items():
        if key not in NOT_ARCHITECTURE and saved.get(key) != value:
            raise SnapshotError(f"snapshot {url} holds a different model ({key}={saved.get(key)} "
                                f"there, {value} here); set trainer_config.snapshot_path to a new "
                                "path or use the snapshot's gpt_config")
    saved_meta = state["data_meta"]
    for key in ("kind", *match_keys):
        if saved_meta.get(key) != data_meta.get(key):
            raise SnapshotError(f"snapshot {url} was trained on different data ({key} differs); "
                                "set trainer_config.snapshot_path to a new path")


def save_sharded(url: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 train_state: dict, before_commit: Callable[[], None] | None = None,
                 keep_last: int = 1, extra: dict | None = None) -> None:
    """FSDP: all ranks write their shards; rank 0 then commits by rewriting `latest`, and
    removes all but the newest `keep_last` step directories. Each part's outcome is agreed
    (save_part): SaveError on every rank where any rank failed."""
    name = f"step_{step:08d}"
    save_part(url, clear_step, name)  # ... and removed before any rank writes into it again
    # Sharded state dicts: each rank only holds (and writes) its own shards, no gather; TP's
    # strided q/k/v shards too, as row runs DCP records (strided.checkpointable).
    save_part(url, write_shards, name, model, optimizer, extra)
    # dcp.save is collective: it returns only once every rank's shards are written and rank 0
    # (its coordinator) has written .metadata, so the step directory is complete here.
    save_part(url, commit_sharded, name, train_state, before_commit, keep_last)


def clear_step(url: str, name: str) -> None:
    """Rank 0: remove step directory `name`, left by a save of this step that was cut off."""
    fs, path = storage.filesystem(url)
    if dist.get_rank() == 0 and fs.exists(f"{path}/{name}"):
        fs.rm(f"{path}/{name}", recursive=True)


def write_shards(url: str, name: str, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer, extra: dict | None = None) -> None:
    """Every rank's shards into step directory `name` (dcp.save: collective; a failure on any
    rank is a CheckpointException, naming it, on every rank)."""
    dcp.save(checkpointable(dcp_state(model, optimizer, extra)),
             storage_writer=storage.writer(f"{url}/{name}"))


def with_meetings(optimizer: torch.optim.Optimizer, state: dict) -> tuple[dict, dict]:
    """The replica groups' meetings' state (diloco.py; {} for any other optimizer), and
    `state` marked where there is one: train_state.pt says so, a load then reads it in place."""
    extra = extra_state(optimizer)
    return ({**state, "replica_state": True} if extra else state), extra


def dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              extra: dict | None) -> dict:
    """What DCP writes: the model's and the optimizer's sharded state dicts, and the replica
    groups' meetings where they have any (optim.extra_state: DTensors like the weights).
    ZeRO's optimizer is its local AdamW: each owner's state under its parameters' names, so a
    rank reads back the state of whatever it owns then, under any layout."""
    model_sd, optim_sd = get_state_dict(model, local_optimizer(optimizer))
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
        # Keep the newest keep_last - 1 complete snapshots of earlier steps (names sort by
        # step: zero-padded). A save that was cut off left a directory without train_state.pt,
        # or one of a later step than this: neither is a snapshot to roll back to.
        others = [p.rstrip("/") for p in fs.ls(path, detail=False)
                  if _is_step_dir(p) and os.path.basename(p.rstrip("/")) != name]
        earlier = sorted((p for p in others if os.path.basename(p) < name
                          and fs.exists(f"{p}/{TRAIN_STATE}")), reverse=True)
        for old in set(others) - set(earlier[:keep_last - 1]):
            fs.rm(old, recursive=True)


def latest_sharded(url: str) -> str:
    """The newest complete DCP checkpoint directory inside an fsdp snapshot."""
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


def load_train_state(url: str, kind: str) -> dict:
    """Everything but the (sharded) weights; for ddp the one file, which has the weights too."""
    if kind == "ddp":
        return load_file(url)
    return load_file(f"{latest_sharded(url)}/{TRAIN_STATE}")


def load_sharded(url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 checkpoint: str | None = None, extra: dict | None = None) -> None:
    """FSDP: each rank reads the pieces of every saved shard that its own shards need (from
    `checkpoint`, a DCP directory, where given; else the snapshot's newest)."""
    checkpoint = checkpoint or latest_sharded(url)
    # Every rank must call this: DCP plans the reads collectively (the ranks exchange what
    # they need), so a rank that stayed away would leave the others waiting.
    # `extra`: the replica groups' meetings, read in place where the saver had them.
    state = dcp_state(model, optimizer, extra)
    optim_sd = state["optim"]
    # Each param group names its parameters, a plain list that DCP saves once under one key
    # (optim.param_groups.N.params), from one rank. Where ranks hold different parameters (a
    # pipeline's stages), the list loaded is another rank's; this rank's own names go back
    # after the load, beside the saved hyper-parameters (lr, betas, eps, weight_decay).
    own_names = [list(group["params"]) for group in optim_sd["param_groups"]]
    try:
        # Into each rank's own rows of TP's q/k/v too: views of the DTensors in `state`.
        dcp.load(checkpointable(state),
                 storage_reader=storage.reader(checkpoint))
    # DCP raises CheckpointException, a BaseException, on every rank when any rank fails to
    # read (reason() names the first that did): no rank waits for another.
    except (Exception, CheckpointException) as e:  # missing or truncated shards, bad metadata
        raise SnapshotError(f"cannot load sharded snapshot {checkpoint} ({storage.reason(e)}): "
                            f"it is corrupt; {MOVE_IT_AWAY}"
                            ) from None
    for group, names in zip(state["optim"]["param_groups"], own_names, strict=True):
        group["params"] = names
    # The optimizer state is keyed by parameter name; set_state_dict puts it back under this
    # optimizer's own parameters.
    set_state_dict(model, local_optimizer(optimizer), model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def load_file_into_shards(state: dict, model: torch.nn.Module,
                          optimizer: torch.optim.Optimizer, extra: dict | None = None) -> None:
    """A one-file (ddp) snapshot into a layout where no rank holds the whole model.

    The file keeps AdamW's state by parameter number, in the order the whole model's
    optim_groups gives; the sharded path names parameters. So the file goes into a whole
    model and AdamW on the CPU as it was saved (its model_config), becomes a DCP checkpoint
    of their named state in a private folder of this rank, and is read from there exactly as
    a sharded snapshot is (load_sharded: each rank its own shards, TP's q/k/v rows, a
    pipeline's stages). One whole copy per rank while it lasts: what the saving run held.
    `extra`: the replica groups' meetings (optim.extra_state), read in place from the file's."""
    import tempfile  # noqa: PLC0415  (only this rare path needs them)

    from mingpt.model import GPT, GPTConfig  # noqa: PLC0415
    whole = GPT(GPTConfig(**state["model_config"]))
    whole.load_state_dict(state["model"])
    # The saver's kind of optimizer (its groups and state), as build_optimizer builds it.
    adamw = build_optimizer(whole, "ddp", 1e-3, name=state.get("optimizer_name", "adamw"))
    adamw.load_state_dict(state["optimizer"])  # the saved groups, decay and lrs included
    model_sd, optim_sd = get_state_dict(whole, adamw)
    with tempfile.TemporaryDirectory(prefix="snapshot-") as folder:
        with warnings.catch_warnings():  # one process's own copy: no group is the point
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            meetings = {"replicas": state["replicas"]} if extra else {}
            dcp.save({"model": model_sd, "optim": optim_sd, **meetings}, checkpoint_id=folder,
                     no_dist=True)
        del whole, adamw, model_sd, optim_sd
        load_sharded(folder, model, optimizer, checkpoint=folder, extra=extra)


def load_sharded_weights(url: str, model: torch.nn.Module) -> None:
    """Only the weights of an fsdp snapshot, into a plain model on one process (for sampling)."""
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # no process group is the point here, not a mistake
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            # Without a process group, DCP reads every shard into this one process.
            dcp.load(state, storage_reader=storage.reader(latest_sharded(url)), no_dist=True)
    except (Exception, CheckpointException) as e:
        raise SnapshotError(f"cannot load sharded snapshot {url} ({storage.reason(e)})") from None
    model.load_state_dict(state["model"])


def shared_kind(url: str) -> str | None:
    """The layout found at `url` as every rank sees it; SnapshotError unless all ranks agree.

    Each node looks at `url` on its own storage. Without storage that all nodes share, some
    ranks would resume and others start afresh: diverged weights or a hang. A rank's own error
    (a corrupt directory, say) is raised on every rank, so none waits for the others forever.
    """
    try:
        mine = (snapshot_kind(url), None)
    except SnapshotError as e:
        mine = (None, str(e))
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    errors = [error for _, error in seen if error]
    if errors:
        raise SnapshotError(errors[0])
    kinds = [kind for kind, _ in seen]
    if len(set(kinds)) > 1:
        found = [r for r, kind in enumerate(kinds) if kind]
        raise SnapshotError(
            f"{url} holds a snapshot for ranks {found} but not for the other "
            f"{len(kinds) - len(found)}: every rank must see the same snapshot; put "
            "trainer_config.snapshot_path on storage all nodes share (or an s3:// URL)")
    return kinds[0]


def _load_part(function: Callable[..., T], *args) -> T:
    """`function(*args)` on every rank; its SnapshotError on any rank is one on all of them
    (errors.any_failure: naming the rank where only some failed). A collective."""
    try:
        result, error = function(*args), None
    except SnapshotError as e:
        result, error = None, str(e)
    except Exception as e:  # not the snapshot's: a bug, whose traceback this rank shows
        result, error = None, f"cannot load the snapshot ({errors.unexpected(e)})"
    message = errors.any_failure(error)
    if message is not None:
        raise SnapshotError(message)
    return result


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


def save(url: str, method: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         state: dict, before_commit: Callable[[], None] | None = None,
         keep_last: int = 1, gather: Callable | None = None) -> None:
    """Save weights, optimizer and `state` (step, ... and meta) in `method`'s layout; every
    rank calls this. `before_commit` runs once all is written and before it becomes the
    snapshot (a fault-injection point). The `keep_last - 1` snapshots before it are kept
    (URL.1, ... for a file; step directories for a sharded snapshot) for a manual roll-back.
    `gather(model, optimizer)`, where given, returns the whole model's and the optimizer's
    state dicts on the CPU (xla_main.py: from the XLA devices' shards); the snapshot is then
    the one file. SaveError (one line, the same on every rank) when the storage fails on any
    rank; nothing was committed then."""
    state, extra = with_meetings(optimizer, state)
    optimizer = inner(optimizer)  # not a wrapper's step, which all-reduces across groups
    # gather (XLA's hook): the weights come to the CPU, one file whatever the model holds.
    kind = "ddp" if gather is not None else snapshot_format(model, method)
    save_part(url, move_other_format_on_rank_0, kind)
    if kind == "fsdp":
        save_sharded(url, state["step"], model, optimizer, state, before_commit, keep_last,
                     extra)
        return
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        # Collective: every rank sends the state of the parameters it owns to rank 0.
        optimizer.consolidate_state_dict(to=0)
    # Every rank holds the same weights: one writer is enough. The others wait for its
    # outcome: without it they went on while a failed rank 0 left, and met its absence in
    # their next collective (gloo: "connection closed"; NCCL: the collective timeout).
    save_part(url, _write_file, model, optimizer,
                {**state, **({"replicas": extra} if extra else {})}, before_commit, keep_last,
                gather)


def _write_file(url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                state: dict, before_commit: Callable[[], None] | None, keep_last: int,
                gather: Callable | None) -> None:
    """Rank 0: the one-file snapshot, renamed over the old one once written."""
    if dist.get_rank() != 0:
        return
    keep_previous(url, keep_last)
    weights, optimized = gather(model, optimizer) if gather else \
        (unwrap(model).state_dict(), optimizer.state_dict())  # no "module." prefix
    save_file(url, {**state, "model": weights, "optimizer": optimized}, before_commit)


def move_other_format_on_rank_0(url: str, kind: str) -> None:
    if dist.get_rank() == 0:
        move_other_format(url, kind)


def save_part(url: str, part: Callable[..., None], *args) -> None:
    """`part(url, *args)`, a part of a save, then its outcome agreed by every rank: SaveError,
    the same one line on all of them, where it failed on any (errors.any_failure names the rank).
    Every rank calls this, also where only rank 0 does the work."""
    try:
        storage.storage_errors(OSError)(part)(url, *args)  # an object store's: one OSError
        error = None
    # DCP (the sharded format) raises CheckpointException, a BaseException with each rank's.
    except (OSError, CheckpointException) as e:
        error = save_error(url, e)
    except Exception as e:  # not the storage's: a bug, whose traceback this rank shows
        error = errors.unexpected(e, save_error(url, e))
    message = errors.any_failure(error)
    if message is not None:
        raise SaveError(message)


def save_error(url: str, e: BaseException) -> str:
    """A failed save in one line: the storage's words, the file, which rank (DCP's), the fix."""
    failed, error = "", e
    if isinstance(e, CheckpointException):  # every rank has it: name the one(s) that failed
        ranks = sorted(e.failures)
        error = e.failures[ranks[0]][0]
        if dist.get_world_size() > 1:
            others = f" (and {len(ranks) - 1} more)" if len(ranks) > 1 else ""
            failed = f"rank {ranks[0]}{others}: "
    reason = error.strerror if isinstance(error, OSError) and error.strerror else \
        (str(error).strip().splitlines() or [type(error).__name__])[0]
    if isinstance(error, OSError) and error.strerror and error.filename:
        reason += f": {error.filename}"
    # A local disk fills up; an object store's own line already says what to check.
    fix = "free some space" if "://" not in url else "fix what it says"
    # Both layouts commit by a rename (file) or by rewriting `latest` (directory) only once
    # everything is written, so the snapshot from before, if any, is intact.
    return (f"{failed}cannot save the snapshot to {url} ({reason}); the previous snapshot, if "
            f"any, is unchanged: {fix} or set trainer_config.snapshot_path, then run again to "
            "resume")


def move_other_format(url: str, kind: str) -> None:
    """Before the first save after a resume from the other format (one file where shards go, or
    the reverse): the snapshot resumed from moves to URL.ddp or URL.fsdp, kept whole.

    Both cannot live at one path, and overwriting the one that was resumed would lose it if
    this save were cut off. (A cut-off first sharded save then leaves a step directory
    without `latest`: the restart says so and starts afresh; URL.ddp still holds the file.)"""
    other = snapshot_kind(url)
    if other is None or other == kind:
        return
    fs, path = storage.filesystem(url)
    if fs.exists(f"{path}.{other}"):
        raise OSError(f"{url}.{other} exists: the {other} snapshot at {url} cannot move there")
    fs.mv(path, f"{path}.{other}", recursive=True)
    print(f"{url} held a {other} snapshot; this layout writes {kind} snapshots: it is kept as "
          f"{url}.{other}")


def load(url: str, method: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         meta: dict, match_keys: tuple[str, ...]) -> dict | None:
    """Load the snapshot at `url` into model and optimizer and return the rest of its state;
    None when there is none. Every rank calls this. SnapshotError when the ranks disagree, for
    the other format, another model (`meta["model_config"]`) or other data (`match_keys` of
    `meta["data_meta"]`): checked before any weight is touched."""
    kind = shared_kind(url)
    if kind is None:
        return None
    wrapper, optimizer = optimizer, inner(optimizer)  # not a wrapper's step (cross-group)
    mine = snapshot_format(model, method)
    # On the CPU; a rank that cannot read it (its node's own copy is missing or corrupt) stops
    # every rank here, before the all_gather below would wait for it.
    state = _load_part(load_train_state, url, kind)
    steps: list = [None] * dist.get_world_size()
    dist.all_gather_object(steps, state["step"])
    if len(set(steps)) > 1:  # each node has its own, different copy
        raise SnapshotError(f"ranks read {url} at different steps {steps}: put "
                            "trainer_config.snapshot_path on storage all nodes share")
    _load_part(check_compatible, state, meta["model_config"], meta["data_meta"], url,
                 match_keys, meta.get("optimizer_name", "adamw"))
    # A local file is mapped (storage.load_torch): the memory of every tensor read from it. (From
    # an object store they are the process's own: nothing to copy.)
    mapped = {t.untyped_storage().data_ptr() for t in _tensors(state)} if storage.is_local(url) \
        else set()
    own = own_settings(optimizer)  # this run's betas and weight decay, before the load
    if kind == mine == "ddp":  # load_state_dict copies each tensor to where it lives
        # pop: the state returned to the trainer must not keep a second copy of the weights.
        unwrap(model).load_state_dict(state.pop("model"))
        # ZeRO: each rank keeps the state of the parameters it owns from the whole dict.
        optimizer.load_state_dict(state.pop("optimizer"))
        load_extra_state(wrapper, state.pop("replicas", None) or {})
    elif kind == "ddp":  # one file into shards (another layout: fsdp, tp_size, pp_size, ...)
        # The meetings' state where the file has it and this run keeps it: resharded too.
        extra = extra_state(wrapper) if state.get("replicas") else {}
        load_file_into_shards(state, model, optimizer, extra)
        load_extra_state(wrapper, extra)
        del state["model"], state["optimizer"]
        state.pop("replicas", None)
    else:  # shards into shards, or into a whole model (DCP reads any layout into any other)
        # The meetings' state where the saver had it and this run keeps it: read in place.
        extra = extra_state(wrapper) if state.get("replica_state") else {}
        _load_part(load_sharded, url, model, optimizer, None, extra)
        load_extra_state(wrapper, extra)
    # The saved param groups came back with the saving run's kernel choice (fused or not) and
    # ZeRO put AdamW's step counts on the CPU: this run's own choices and devices again.
    keep_own_optimizer_settings(optimizer)
    # And this run's betas and weight decay: the trainer says which differ from the saved.
    state["optimizer_changes"] = restore_settings(optimizer, own)
    _unmap_optimizer(optimizer, mapped)
    # Nothing returned is a view of the file either (RNG states: small), so the file is
    # unmapped once the loaded dicts are gone, when this returns.
    return _unmapped(state, mapped, {})
