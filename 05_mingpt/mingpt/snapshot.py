"""Snapshots: complete, atomic, loaded with no code run (weights_only=True), local disk or S3.

    snapshot.save(path, model, optimizer, {**trainer.state_dict(), **meta})
    state = snapshot.load(path, model, optimizer, meta, match_keys)  # None: none yet

This module owns the protocol, shards.py the format (a step directory `latest` does not name is
never loaded), storage.py the storage. Every part of a save or a load ends with every rank
agreeing on its outcome (errors.save_part, load_part).
"""
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from mingpt import errors, optim, shards, storage
from mingpt.errors import MOVE_IT_AWAY, SnapshotError
from mingpt.shards import load_file

# Model config keys that may differ between a snapshot and the run loading it.
NOT_ARCHITECTURE = ("model_type", "dropout")


@storage.storage_errors(SnapshotError, prefix=True)
def snapshot_kind(url: str) -> str | None:
    """"dcp" for a snapshot directory, "file" for an older one-file snapshot, None for none
    (also, with a warning, for a first save cut off before its commit: else each restart stops)."""
    fs, path = storage.filesystem(url)
    if fs.isfile(path):
        return "file"
    if fs.isdir(path):
        if fs.exists(f"{path}/{shards.LATEST}"):
            return "dcp"
        entries = fs.ls(path, detail=False)
        if all(shards.is_step_dir(entry) for entry in entries):
            if entries and (not dist.is_initialized() or dist.get_rank() == 0):  # said once
                warnings.warn(f"{url} holds no committed snapshot (a save was interrupted before "
                              f"'{shards.LATEST}' was written): starting from step 0", stacklevel=2)
            return None
        raise SnapshotError(f"{url} is a directory without a '{shards.LATEST}' file, so not a "
                            f"snapshot; {MOVE_IT_AWAY}")
    return None


def committed(url: str) -> bool:
    """A committed snapshot is there to resume from (load reads and checks it later, on every
    rank; a foreign or unreadable one is refused there, never trained over)."""
    with warnings.catch_warnings():  # an interrupted first save: load says so, once
        warnings.simplefilter("ignore")
        return snapshot_kind(url) is not None


def check_compatible(state: dict, model_config: dict, data_meta: dict, url: str,
                     match_keys: tuple[str, ...], optimizer: str = "adamw") -> None:
    """SnapshotError unless the snapshot's model, the data meta keys its data module names
    in `match_keys` (kind, vocabulary, ...), and its optimizer's kind match this run's."""
    saved_name = state.get("optimizer_name", "adamw")  # older snapshots hold AdamW's
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
    for key in ("kind", *match_keys):
        if state["data_meta"].get(key) != data_meta.get(key):
            raise SnapshotError(f"snapshot {url} was trained on different data ({key} differs); "
                                "set trainer_config.snapshot_path to a new path")


def load_train_state(url: str, kind: str) -> dict:
    """Everything but the (sharded) weights; an older snapshot's one file has them too."""
    return load_file(url if kind == "file" else
                     f"{shards.latest_sharded(url)}/{shards.TRAIN_STATE}")


def shared_kind(url: str) -> str | None:
    """The kind of snapshot at `url` as every rank sees it; SnapshotError unless all agree
    (without storage all nodes share, some ranks would resume and others start afresh) or
    where any rank's look failed (on every rank: none waits for the others)."""
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


def save(url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict,
         before_commit: Callable[[], None] | None = None, keep_last: int = 1,
         gather: Callable | None = None) -> None:
    """Save weights, optimizer and `state` (step, ... and meta) on every rank; rank 0 keeps the
    newest `keep_last` step directories. `before_commit`: a fault-injection point before the
    commit. `gather(model, optimizer)`: the whole state dicts on the CPU (xla_main.py).
    SaveError (one line, on every rank) where any rank failed; nothing is committed then."""
    name, state, written = begin_save(url, model, optimizer, state, gather)
    errors.save_part(url, shards.write_shards, name, written)
    # dcp.save is collective: it returns only once every rank's shards are written and rank 0
    # (its coordinator) has written .metadata, so the step directory is complete here.
    errors.save_part(url, shards.commit_sharded, name, state, before_commit, keep_last)


def begin_save(url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict,
               gather: Callable | None = None) -> tuple[str, dict, dict]:
    """What a save, blocking or asynchronous (savers.py), does before its write: an older
    one-file snapshot moved aside, a cut-off save of this step removed. Returns the step
    directory's name, the train state to commit and the state dicts DCP writes."""
    extra = optim.extra_state(optimizer)  # the replica groups' meetings (diloco.py), or {}
    # Marked in train_state.pt where there are some: a load then reads them in place.
    state = {**state, "replica_state": True} if extra else state
    optimizer = optim.inner(optimizer)  # not a wrapper's step (it all-reduces across groups)
    name = shards.step_dir(state["step"])
    errors.save_part(url, move_file_on_rank_0)
    errors.save_part(url, shards.clear_step, name)
    # Sharded state dicts: each rank writes only its own shards, no gather.
    written = shards.whole_state(state["model_config"], *gather(model, optimizer),
                                 state.get("optimizer_name", "adamw"), extra) if gather \
        else shards.dcp_state(model, optimizer, extra)
    return name, state, written


def move_file_on_rank_0(url: str) -> None:
    """Before the first save after a resume from an older one-file snapshot: that file moves to
    URL.pt (a directory cannot live at its path; overwriting would lose it to a cut-off save)."""
    if dist.get_rank() != 0 or snapshot_kind(url) != "file":
        return
    fs, path = storage.filesystem(url)
    if fs.exists(f"{path}.pt"):
        raise OSError(f"{url}.pt exists: the one-file snapshot at {url} cannot move there")
    fs.mv(path, f"{path}.pt")
    print(f"{url} held a one-file snapshot; snapshots are directories now: it is kept as "
          f"{url}.pt")


def load(url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict,
         match_keys: tuple[str, ...]) -> dict | None:
    """Load the snapshot at `url` into model and optimizer and return the rest of its state;
    None when there is none. Every rank calls this. SnapshotError when the ranks disagree, or
    for another model or other data (`meta`, `match_keys`): before any weight is touched."""
    kind = shared_kind(url)
    if kind is None:
        return None
    wrapper, optimizer = optimizer, optim.inner(optimizer)  # not a wrapper's step (cross-group)
    # On the CPU; a rank that cannot read it (its node's own copy is missing or corrupt) stops
    # every rank here, before the all_gather below would wait for it.
    state = errors.load_part(load_train_state, url, kind)
    steps: list = [None] * dist.get_world_size()
    dist.all_gather_object(steps, state["step"])
    if len(set(steps)) > 1:  # each node has its own, different copy
        raise SnapshotError(f"ranks read {url} at different steps {steps}: put "
                            "trainer_config.snapshot_path on storage all nodes share")
    errors.load_part(check_compatible, state, meta["model_config"], meta["data_meta"], url,
                     match_keys, meta.get("optimizer_name", "adamw"))
    mapped = shards.mapped(state, url)  # a local file's memory, which nothing may keep
    own = optim.own_settings(optimizer)  # this run's betas and weight decay, before the load
    # The meetings' state where the saver had it and this run keeps it: read in place.
    extra = optim.extra_state(wrapper) if state.get("replicas") or state.get("replica_state") \
        else {}
    if kind == "file":  # an older snapshot's one file (whole state dicts) into this layout
        shards.load_file_into_shards(state, model, optimizer, extra)
        del state["model"], state["optimizer"]
        state.pop("replicas", None)
    else:  # DCP reads any layout's shards into any other
        errors.load_part(shards.load_sharded, url, model, optimizer, None, extra)
    optim.load_extra_state(wrapper, extra)
    # The saved groups carry the saving run's kernel choice (fused or not) and devices: this
    # run's again, and its betas and weight decay (the trainer says which differ).
    optim.keep_own_optimizer_settings(optimizer)
    state["optimizer_changes"] = optim.restore_settings(optimizer, own)
    # Nothing returned is a view of the file (RNG states: small): unmapped once this returns.
    return shards.unmapped(state, mapped, {})
