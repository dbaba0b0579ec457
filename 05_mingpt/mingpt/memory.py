"""What a rank holds, measured: peak memory, model state from its tensors, saved activations.
The dry run (dry_run.py) plans each of these; its tests compare the two."""
import resource
import sys
import weakref
from contextlib import contextmanager, suppress

import torch
import torch.distributed as dist

from mingpt.optim import local_optimizer


def reset_peak_memory(device: torch.device | list[torch.device]) -> None:
    """Start a new peak, so that training's peak is not the setup's (building, loading): the
    CUDA allocator's, of each device given; on Linux the resident set's high-water mark."""
    devices = device if isinstance(device, list) else [device]
    if devices[0].type == "cuda":
        for d in devices:  # the caching allocator's own counter: what tensors used
            torch.cuda.reset_peak_memory_stats(d)
        return
    # 5: "reset the peak resident set size" (man 5 proc); the process's own file, no root.
    # Not Linux (or /proc not mounted): the peak goes on from the process start.
    with suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_kib() -> int:
    """The process's peak resident set since the last reset, in KiB: on Linux VmHWM, not
    ru_maxrss (the kernel folds the peak into it whenever a thread exits, past any reset)."""
    try:
        with open("/proc/self/status") as f:  # "VmHWM:    123456 kB"
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss // 1024 if sys.platform == "darwin" else rss  # macOS: bytes, Linux: KiB


def peak_memory_mb(device: torch.device | list[torch.device]) -> list[float]:
    """Peak MiB since the last reset, per GPU (CPU: per rank, its RSS) of every rank; collective."""
    devices = device if isinstance(device, list) else [device]
    mb = ([torch.cuda.max_memory_allocated(d) / 2**20 for d in devices]
          if devices[0].type == "cuda" else [_peak_rss_kib() / 1024])
    # Every rank's values on every rank: rank 0 logs them all (one TensorBoard curve per GPU).
    mine = torch.tensor(mb, device=devices[0])
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return torch.cat(gathered).tolist()


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for `tensor` (a DTensor's local shard, not its global size)."""
    if hasattr(tensor, "to_local"):  # a DTensor (FSDP, TP)
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def storage_key(tensor: torch.Tensor) -> int:
    """Which storage `tensor` lives in (views share one): its address, which fake tensors have."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard
    return local.untyped_storage()._cdata


@contextmanager
def saved_activations(model: torch.nn.Module):
    """What autograd keeps for backward while the block runs: {"total", "peak"} bytes of the
    tensors it saves, every storage once, parameters left out; "peak" is the most held at once
    (a pipeline keeps several micro-batches in flight)."""
    # The parameters' storages, held: a key is an address, and a storage freed while counting
    # (FSDP's lazy init re-pads an uneven shard) could hand its address to an activation's
    # storage, which would then be taken for a parameter and not counted.
    params = {storage_key(p): (p.to_local() if hasattr(p, "to_local") else p).untyped_storage()
              for p in model.parameters()}
    live: dict[int, list[int]] = {}  # storage -> [bytes, saved tensors alive]
    out = {"total": 0, "peak": 0, "now": 0}

    class Saved:
        """One saved tensor and its storage; given back when backward unpacks it, or, if it
        never does, when autograd drops it. Not when the tensor object dies: in a reference cycle
        that waits for Python's collector, maybe past the next micro-batch saving it again."""

        def __init__(self, t: torch.Tensor, key: int) -> None:
            self.t, self.key = t, [key]  # the key, None once given back (by either way)
            weakref.finalize(self, release, self.key)

        def unpack(self) -> torch.Tensor:
            release(self.key)
            return self.t

    def release(holder: list[int | None]) -> None:
        key, holder[0] = holder[0], None
        if key is None:
            return
        entry = live[key]
        entry[1] -= 1
        if entry[1] == 0:
            out["now"] -= entry[0]
            del live[key]

    def pack(t: torch.Tensor):
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's own shard
        if isinstance(t, torch.nn.Parameter) or local.device.type == "meta":
            return t  # model state (FSDP's gathered weights are Parameters too)
        key = storage_key(local)
        # A Linear's view of one of FSDP's gathered weights: model state in a communication buffer.
        if isinstance(local._base, torch.nn.Parameter) or key in params:
            return t
        if key not in live:
            live[key] = [local.untyped_storage().nbytes(), 0]
            out["now"] += live[key][0]
            out["total"] += live[key][0]
            out["peak"] = max(out["peak"], out["now"])
        live[key][1] += 1
        return Saved(t, key)

    def unpack(saved):
        return saved.unpack() if isinstance(saved, Saved) else saved
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield out


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                      ) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state, from its tensors."""
    local = local_optimizer(optimizer)
    # DDP and FSDP wrap the model: their parameters() are the ones the optimizer updates.
    params = list(model.parameters())  # each tied tensor once
    return {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        # AdamW: exp_avg and exp_avg_sq (each the parameter's size) and a scalar step.
        "optimizer": sum(local_bytes(v) for state in local.state.values()
                         for v in state.values() if isinstance(v, torch.Tensor)),
    }
