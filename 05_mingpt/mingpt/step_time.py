"""How long a training step takes, predicted from a dry run's plan and a machine profile.

    lay, plans = dry_run.plan(cfg)                        # what each rank runs and sends
    profile = step_time.load_profile("bench/comm_lab.json")
    step_time.predict(lay.world, lay.pp, plans, profile, microbatches=4)  # the breakdown

The profile is what bench/comm_lab.py measured on a machine (its JSON): a link model per
collective and group size (latency alpha, seconds per byte beta) and four compute figures,
each measured in one process on one thread: the matmul rate (the median FLOP/s of the three
fp32 matmuls of a small GPT's MLP layer, forward and backward),
the cost of one op in a training step (a chain of small ops, forward and backward, divided by
the ops it dispatched: what Python, the dispatcher and autograd add to each op), what an op on
DTensors costs beyond that (the same chain on a sharded DTensor: its sharding rules and
wrappers run in Python), and the memory bandwidth of an elementwise op on 1 MiB tensors. The
model, for each planned rank:

- work: its step's matmul FLOPs at the matmul rate + its other ops at the cost of one op + its
  DTensor ops at theirs + the bytes the other ops read and write at the bandwidth (WorkCounter
  counts them around
  the dry run's step: forward, backward, recompute, the optimizer; a real step counted the
  same way gives the same numbers, tests/test_mingpt_dry_run.py);
- the pipeline's bubble: under 1F1B a stage idles p - 1 of every m + p - 1 micro-batch slots,
  so its work takes (m + p - 1) / m as long (m micro-batches, p stages);
- communication: for every (axis, kind) the step issued, calls x alpha + S x beta, alpha and
  beta of that collective on a group of that many ranks, S the bytes the lab calls the size
  (the ring share the dry run counts, divided by nccl-tests' bus factor).

A step ends when its slowest rank ends (every step synchronizes), so the prediction is the
largest rank's. Two things the model adds for a machine shared by all ranks (gloo on one
CPU: the lab's and the tests' case): when there are more ranks than cores, the cores bound the
step too (every rank's work divided over the cores, whatever the bubble), and communication
does not overlap compute (both run on the same cores). On GPUs (nccl, one GPU per rank) the
data-parallel gradient reduction would run under the backward pass; this model does not
claim that overlap (bench/README.md, Predicted step time: not checked on GPUs yet).
"""
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

# The ops whose FLOPs count: torch's own formulas (torch.utils.flop_counter: matmuls,
# convolutions, the GPU attention kernels), plus the CPU's flash attention, which torch's
# table lacks (same shapes in, [B, H, T, D], the same count; causal masking skipping the upper
# half is not credited, as torch's formulas do not credit it either).
_aten = torch.ops.aten
FORMULAS = {packet: formula for packet, formula in flop_registry.items()}
FORMULAS[_aten._scaled_dot_product_flash_attention_for_cpu] = \
    lambda q, k, v, *args, out_val=None, **kwargs: sdpa_flop_count(q.shape, k.shape, v.shape)
FORMULAS[_aten._scaled_dot_product_flash_attention_for_cpu_backward] = \
    lambda grad, q, k, v, *args, out_val=None, **kwargs: sdpa_backward_flop_count(
        grad.shape, q.shape, k.shape, v.shape)
COLLECTIVES = ("c10d", "_c10d_functional")  # counted by dry_run.CommCounter, not here
# The dry run's names of the kinds (dry_run.KINDS) -> the lab's (bench/comm_lab.py).
LAB_NAMES = {"all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
             "all-reduce": "all_reduce", "all-to-all": "all_to_all", "broadcast": "broadcast",
             "send/recv": "send_recv"}
# nccl-tests' bus factors, n the ranks, by the lab's names: the ring share of a call of size S
# that each rank's link carries is S x this (bench/comm_lab.py's busbw; the dry run's bytes).
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
              "broadcast": lambda n: 1.0, "send_recv": lambda n: 1.0}


class WorkCounter(TorchDispatchMode):
    """The work of the ops run under it: FLOPs of those FORMULAS knows, and for every other op
    that runs a kernel (not a view) one call and the bytes of its tensors, inputs and outputs;
    ops on DTensors once more, as DTensor's own. Collectives are left to dry_run.CommCounter."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = self.ops = self.dtensor_ops = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # A DTensor's op has its global shapes: let DTensor run it, and count the ops it
            # runs on this rank's local shards (they come back here). What DTensor itself
            # costs (its sharding rules and wrappers, in Python) is counted as one such op.
            self.dtensor_ops += 1
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in COLLECTIVES or func.namespace == "prim":
            return out  # prim: a question about a tensor (its device), which fake tensors ask
        formula = FORMULAS.get(func._overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        elif not func.is_view:  # a view runs no kernel: new metadata on the same storage
            self.ops += 1
            self.bytes += sum(t.numel() * t.element_size() for t in
                              tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor))
        return out

    def table(self) -> dict[str, int]:
        return {"flops": self.flops, "ops": self.ops, "dtensor_ops": self.dtensor_ops,
                "bytes": self.bytes}


# --- the machine's compute figures (bench/comm_lab.py measures them) ----------------------------

def _median_seconds(fn, calls: int) -> float:
    fn()  # untimed: allocations, the first dispatch
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return sorted(times)[2]


def measure_compute() -> dict:
    """This process's compute figures on one thread (module docstring): FLOP/s of a matmul,
    seconds per op in a training step, the same for an op on DTensors, bytes/s of an
    elementwise op. Joins a fake process group for the DTensor figure if none is joined."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank's share when the ranks fill the cores
    joined = not dist.is_initialized()
    if joined:
        dist.init_process_group("fake", rank=0, world_size=2)
    try:
        # The three matmuls of a small GPT's MLP layer on a CPU (768 tokens, 128 -> 512
        # features): forward, the input's gradient, the weight's (a transposed operand);
        # the median of their rates.
        x, w, g = torch.randn(768, 128), torch.randn(512, 128), torch.randn(768, 512)
        rates = [2 * 768 * 128 * 512 / _median_seconds(lambda f=f: f(), 10) for f in (
            lambda: torch.mm(x, w.t()), lambda: torch.mm(g, w), lambda: torch.mm(g.t(), x))]
        matmul = sorted(rates)[1]

        def chain(x: torch.Tensor) -> None:  # 100 small ops forward, their gradients backward
            y = x
            for _ in range(50):
                y = torch.tanh(y * 1.01)
            y.sum().backward()

        x = torch.randn(32, 16, requires_grad=True)
        with WorkCounter() as counter:
            chain(x)
        op = _median_seconds(lambda: chain(x), 5) / counter.ops
        # The same chain on a DTensor sharded over 2 ranks: every op also runs DTensor's own
        # code (sharding rules, wrapping); its cost per op, beyond the local op's.
        mesh = init_device_mesh("cpu", (2,))
        x = distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
        with WorkCounter() as counter:
            chain(x)
        dtensor_op = (_median_seconds(lambda: chain(x), 5) - counter.ops * op) \
            / counter.dtensor_ops

        n = 2**18  # 1 MiB of float32: past the first cache levels, as activations are
        u, v, w = torch.randn(n), torch.randn(n), torch.empty(n)
        bandwidth = 3 * 4 * n / _median_seconds(lambda: torch.add(u, v, out=w), 50)
    finally:
        torch.set_num_threads(threads)
        if joined:
            dist.destroy_process_group()
    return {"matmul_flops_per_s": matmul, "op_s": op, "dtensor_op_s": dtensor_op,
            "bytes_per_s": bandwidth}


# --- the prediction ---------------------------------------------------------------------------

def load_profile(path: str | Path) -> dict:
    """bench/comm_lab.py's JSON; ValueError (one line) where it is missing or lacks a part."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no machine profile at {path}: run python bench/comm_lab.py on the "
                         "machine to plan for")
    profile = json.loads(path.read_text())
    if "model" not in profile or "compute" not in profile:
        raise ValueError(f"{path} has no link model or compute figures: measure it again with "
                         "python bench/comm_lab.py")
    return profile


def link(profile: dict, kind: str, ranks: int) -> dict:
    """The lab's fit of `kind` on `ranks` ranks; where it measured no group of that size, the
    smallest larger one it measured (a ring's time per byte barely grows with its size; its
    latency does, so a larger group's fit errs on the slow side), else its largest."""
    fits = profile["model"].get(LAB_NAMES[kind])
    if not fits:
        raise ValueError(f"the machine profile has no {LAB_NAMES[kind]} measured: run python "
                         "bench/comm_lab.py with it")
    sizes = sorted(int(n) for n in fits)
    size = next((n for n in sizes if n >= ranks), sizes[-1])
    return fits[str(size)]


def comm_seconds(comm: dict, profile: dict) -> dict[str, float]:
    """{"axis kind": seconds} for one rank's step: calls x alpha + S x beta (module docstring)."""
    out = {}
    for axis, counts in comm.items():
        for kind in LAB_NAMES:
            calls = counts.get(f"{kind} calls", 0)
            if not calls:
                continue
            n = counts[f"{kind} ranks"]
            moved = max(counts[f"{kind} sent"], counts[f"{kind} received"])
            size = moved / BUS_FACTOR[LAB_NAMES[kind]](n) if n > 1 else 0
            fit = link(profile, kind, n)
            out[f"{axis} {kind}"] = calls * fit["alpha_s"] + size * fit["beta_s_per_byte"]
    return out


def work_seconds(work: dict, compute: dict) -> float:
    """One rank's compute time on one core: matmuls, other ops, their bytes."""
    return (work["flops"] / compute["matmul_flops_per_s"] + work["ops"] * compute["op_s"]
            + work["dtensor_ops"] * compute["dtensor_op_s"]
            + work["bytes"] / compute["bytes_per_s"])


def check_world(profile: dict, world: int) -> None:
    """ValueError (one line) where `world` ranks exceed what the profile's lab measured on
    one machine: links between machines, which it never saw."""
    largest = max(int(n) for fits in profile["model"].values() for n in fits)
    if world > largest:
        raise ValueError(f"the machine profile measured at most {largest} ranks on one "
                         f"machine; a run of {world} ranks spans others: measure it where it "
                         "runs (python bench/comm_lab.py --worlds ...)")


def predict(world: int, pp: int, plans: dict[int, dict], profile: dict,
            microbatches: int = 1) -> dict:
    """The predicted step of a `world`-rank run with `pp` stages from the plans of its ranks
    (dry_run.plan) and a profile (load_profile): seconds in all, and per rank its compute,
    bubble and communication by "axis kind" (module docstring)."""
    check_world(profile, world)
    compute = profile["compute"]
    shared = profile.get("backend", "gloo") == "gloo"  # every rank on one machine's cores
    cores = profile["machine"]["cores"] if shared else world
    ranks = {}
    for rank, plan in plans.items():
        work = work_seconds(plan["work"], compute)
        stretch = (microbatches + pp - 1) / microbatches if pp > 1 else 1.0
        comm = comm_seconds(plan["comm"], profile)
        ranks[rank] = {"compute": work, "bubble": work * (stretch - 1), "comm": comm,
                       "step": work * stretch + sum(comm.values())}
    # The cores, when fewer than the ranks: all the work divided over them (the planned ranks
    # stand for the others: their mean).
    mean_work = sum(r["compute"] for r in ranks.values()) / len(ranks)
    capacity = mean_work * world / cores if world > cores else 0.0
    slowest = max(ranks, key=lambda r: ranks[r]["step"])
    critical = ranks[slowest]["compute"] + ranks[slowest]["bubble"]
    step = max(critical, capacity) + sum(ranks[slowest]["comm"].values())
    return {"step": step, "slowest rank": slowest, "cores bound": capacity > critical,
            "capacity": capacity, "ranks": ranks}
