"""Write training state atomically and read it back safely.

`atomic_save` writes to a temporary file, flushes it to disk, then renames it over the old
file. A rename within one filesystem is atomic, so a crash at any moment leaves either the old
snapshot or the new one, never half a file. `load_snapshot` uses `weights_only=True`, which
refuses to run arbitrary pickled code, and turns any unreadable file into one clear error.

`load_snapshot` always loads to the CPU. `load_state_dict` then copies weights and optimizer
buffers to the model's device (and leaves counters such as Adam's `step` on the CPU, where the
optimizer wants them); the RNG states must stay on the CPU for `set_rng_state`.
"""
import os
import random

import numpy as np
import torch


class SnapshotError(RuntimeError):
    """A snapshot exists but cannot be used; the message says which file and why."""


def atomic_save(obj: dict, path: str) -> None:
    # Beside the target, not in /tmp: os.replace is atomic only within one filesystem.
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the rename makes them visible
    os.replace(tmp, path)  # readers see the old file or the new one, never a mix


def load_snapshot(path: str, required: tuple[str, ...]) -> dict:
    """Load a snapshot to the CPU; raise SnapshotError unless it is a dict holding every
    `required` key."""
    try:
        # map_location="cpu", never the GPU: a GPU-mapped numpy RNG key cannot be set again.
        snapshot = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, corrupt, unreadable, or holds non-tensor objects
        raise SnapshotError(f"cannot load snapshot {path} ({type(e).__name__}): it is corrupt, "
                            "truncated or not a snapshot; move it away to start afresh") from e
    missing = [k for k in required if not isinstance(snapshot, dict) or k not in snapshot]
    if missing:
        raise SnapshotError(f"snapshot {path} lacks {', '.join(missing)}: not a snapshot of "
                            "this script; move it away to start afresh")
    return snapshot


def rng_state() -> dict:
    """This process's RNG states as tensors and plain types (loadable with weights_only)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        # numpy's key as a tensor: weights_only=True loads tensors and plain types, not arrays.
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # random ops on the current GPU draw from it
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"].cpu())  # it takes a CPU ByteTensor, wherever it was loaded
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
