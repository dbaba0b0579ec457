"""What a rank holds, measured: peak memory, model state from its tensors, saved activations.

    setup = peak_memory_mb(device); reset_peak_memory(device)  # then train: a training peak
    model_state_bytes(model, optimizer)  # this rank's parameters, gradients, optimizer state
    with saved_activations(model) as kept: ...  # what autograd keeps for backward
The dry run (dry_run.py) plans each of these; its tests compare the two.
"""
import resource
import sys
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist

from mingpt.optim import local_optimizer


def reset_peak_memory(device: torch.device | list[torch.device]) -> None:
    """Start a new peak, so that training's peak is not the setup's (building, loading).

    CUDA: the allocator's counter, of each device given (nn.DataParallel drives several). CPU
    (Linux): writing 5 to /proc/self/clear_refs resets the kernel's high-water mark of the
    resident set (VmHWM) to the current RSS.
    Elsewhere the CPU peak stays the peak since the process started.
    """
    devices = device if isinstance(device, list) else [device]
    if devices[0].type == "cuda":
        for d in devices:  # the caching allocator's own counter: what tensors used
            torch.cuda.reset_peak_memory_stats(d)
        return
    try:
        # 5: "reset the peak resident set size" (man 5 proc); the process's own file, no root.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux (or /proc not mounted): the peak goes on from the process start


def _peak_rss_kib() -> int:
    """The process's peak resident set since the last reset, in KiB.

    Linux: VmHWM, the high-water mark that /proc/self/clear_refs resets. Not ru_maxrss: the
    kernel also folds the peak into it whenever a thread exits, and a reset cannot undo that.
    Elsewhere ru_maxrss (KiB on Linux, bytes on macOS) is all there is.
    """
    try:
        # "VmHWM:    123456 kB"
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        # macOS reports bytes, Linux KiB.
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss // 1024 if sys.platform == "darwin" else rss


def peak_memory_mb(device: torch.device | list[torch.device]) -> list[float]:
    """Peak memory since the last reset_peak_memory, one value per GPU of every rank (per rank
    on a CPU), a collective: CUDA allocations of each device given (nn.DataParallel drives
    several from one process), or peak RSS on a CPU (what the process touched; see README)."""
    devices = device if isinstance(device, list) else [device]
    if devices[0].type == "cuda":
        mb = [torch.cuda.max_memory_allocated(d) / 2**20 for d in devices]
    else:
        mb = [_peak_rss_kib() / 1024]
    # Every rank's values on every rank: rank 0 logs them all (one TensorBoard curve per GPU).
    mine = torch.tensor(mb, device=devices[0])
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return torch.cat(gathered).tolist()


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for `tensor`: a DTensor's numel() is the global size, its
    to_local() the rank's own shard."""
    if hasattr(tensor, "to_local"):  # a DTensor (FSDP, TP)
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def storage_key(tensor: torch.Tensor) -> int:
    """Which storage `tensor` lives in (views share one): the storage object's own address,
    which a fake tensor (the dry run's, mingpt/dry_run.py) has too; its data pointer is 0."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard
    return local.untyped_storage()._cdata


@contextmanager
def saved_activations(model: torch.nn.Module):
    """What autograd keeps for backward while the block runs: {"total", "peak"} bytes, counted
    from the tensors it saves: every storage once (views share one), parameters left out
    (Linear layers save their weight: model state, not activations), each storage's bytes
    given back when its last saved tensor is, so "peak" is the most held at once (a pipeline
    keeps several micro-batches in flight). The dry run counts its step with it too."""
    # The parameters' storages, held: a key is an address, and a storage freed while counting
    # (FSDP's lazy init, at the first forward, re-pads an uneven shard into a new one) could
    # hand its address to an activation's storage, which would then be taken for a parameter
    # and not counted (the dry run's counts fell 2 KiB short on some runs).
    params = {storage_key(p): (p.to_local() if hasattr(p, "to_local") else p).untyped_storage()
              for p in model.parameters()}
    live: dict[int, list[int]] = {}  # storage -> [bytes, saved tensors alive]
    out = {"total": 0, "peak": 0, "now": 0}

    class Saved:
        """One saved tensor and its storage; given back when backward unpacks it, or, if it
        never does, when autograd drops it. Not when the tensor object dies: an object in a
        reference cycle dies whenever Python's collector runs, and a storage saved again in
        the next micro-batch (a pipeline's receive buffer) was then found still alive and
        not counted again, on some runs only."""

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
        # FSDP swaps its gathered (unsharded) weights in while a block runs: a Linear saves
        # a view of one (its transpose), which is model state in a communication buffer, not
        # an activation.
        if isinstance(local._base, torch.nn.Parameter):
            return t
        key = storage_key(local)
        if key in params:
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
    """This rank's bytes of parameters, gradients and optimizer state, counted from the
    tensors it holds (local shards), not from a formula: the dry run counts the same.

    Gradients count only while they exist (between backward and zero_grad). ZeRO's optimizer
    keeps the state of this rank's parameters in its local optimizer (`.optim`).
    """
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
