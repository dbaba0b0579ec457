"""Write training state atomically and read it back safely.

`atomic_save` writes to a temporary file, flushes it to disk, then renames it over the old
file. A rename within one filesystem is atomic, so a crash at any moment leaves either the old
snapshot or the new one, never half a file. `load_snapshot` uses `weights_only=True`, which
refuses to run arbitrary pickled code, and turns any unreadable file into one clear error.

`load_snapshot` always loads to the CPU. `load_state_dict` then copies weights and optimizer
buffers to the model's device (and leaves counters such as Adam's `step` on the CPU, where the
optimizer wants them); the RNG states must stay on the CPU for `set_rng_state`.
"""
import contextlib
import os
import random

import numpy as np
import torch


class SnapshotError(ValueError):
    """A snapshot cannot be used or written; the message says which file, why, and what to do.

    A ValueError, like every other bad input: each step's `except ValueError` turns it into one
    `error:` line (01 and 02 too, which write a checkpoint but never read one back)."""


def atomic_save(obj: dict, path: str) -> None:
    # Beside the target, not in /tmp: os.replace is atomic only within one filesystem.
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them visible
        os.replace(tmp, path)  # readers see the old file or the new one, never a mix
    # A full disk, a read-only or missing folder: OSError, or torch's RuntimeError when its
    # zip writer hits the full disk. The old file is untouched (the rename never happened).
    except (OSError, RuntimeError) as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # a partial file would only hold on to the space that ran out
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise SnapshotError(f"cannot write {path} ({reason}); the previous file there, if any, "
                            "is unchanged: free some space or pass a writable path") from None


def load_snapshot(path: str, required: tuple[str, ...],
                  model: torch.nn.Module | None = None) -> dict:
    """Load a snapshot to the CPU; raise SnapshotError unless it is a dict holding every
    `required` key and, given `model`, a MODEL_STATE of exactly that model's tensor shapes."""
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
    if model is not None:
        # Checked before any weight is copied: load_state_dict would raise a many-line
        # RuntimeError, and the run would die halfway through loading.
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        saved = snapshot["MODEL_STATE"]
        found = {k: tuple(v.shape) for k, v in saved.items() if isinstance(v, torch.Tensor)} \
            if isinstance(saved, dict) else {}
        differ = sorted(k for k in {*found, *expected} if found.get(k) != expected.get(k))
        if differ:  # the first difference is enough to say what is wrong
            key = differ[0]
            raise SnapshotError(f"snapshot {path} holds another model ({key}: "
                                f"{found.get(key, 'absent')} there, {expected.get(key, 'absent')} "
                                "here): move it away to start afresh")
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
