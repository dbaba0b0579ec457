"""How long a training step takes, predicted from a dry run's plan and a machine profile
(bench/comm_lab.py's JSON: latency alpha and seconds per byte beta per collective and group
size, compute figures measured on one thread). DRY_RUN.md, Predicted step time, says how."""
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

# The ops whose FLOPs count: torch's own formulas (torch.utils.flop_counter), plus the CPU's
# flash attention, which its table lacks (the same count: causal masking is not credited).
_aten = torch.ops.aten
FORMULAS = {packet: formula for packet, formula in flop_registry.items()}
FORMULAS[_aten._scaled_dot_product_flash_attention_for_cpu] = \
    lambda q, k, v, *args, out_val=None, **kwargs: sdpa_flop_count(q.shape, k.shape, v.shape)
FORMULAS[_aten._scaled_dot_product_flash_attention_for_cpu_backward] = \
    lambda grad, q, k, v, *args, out_val=None, **kwargs: sdpa_backward_flop_count(
        grad.shape, q.shape, k.shape, v.shape)
COLLECTIVES = ("c10d", "_c10d_functional")  # counted by dry_run.CommCounter, not here
# The dry run's names of the kinds (dry_run.KINDS) -> the lab's (bench/comm_lab.py): "all_gather".
LAB_NAMES = {kind: kind.replace("-", "_").replace("/", "_") for kind in (
    "all-gather", "reduce-scatter", "all-reduce", "all-to-all", "broadcast", "send/recv")}
# nccl-tests' bus factors, n the ranks, by the lab's names: the ring share of a call of size S
# that each rank's link carries is S x this (bench/comm_lab.py's busbw; the dry run's bytes).
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
              "broadcast": lambda n: 1.0, "send_recv": lambda n: 1.0}


class WorkCounter(TorchDispatchMode):
    """The work of the ops run under it: FLOPs of those FORMULAS knows; for every other op that
    runs a kernel, one call and the bytes of its inputs and outputs; DTensor ops counted apart."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = self.ops = self.dtensor_ops = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # A DTensor's op has its global shapes: count the ops DTensor runs on this rank's
            # local shards (they come back here), and DTensor's own Python as one such op.
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
    """This process's compute figures on one thread: matmul FLOP/s, seconds per op in a training
    step and per DTensor op beyond that, bytes/s of an elementwise op (fake group if none)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank's share when the ranks fill the cores
    joined = not dist.is_initialized()
    if joined:
        dist.init_process_group("fake", rank=0, world_size=2)
    try:
        # The median rate of a small GPT MLP layer's three matmuls: forward and both gradients.
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
        # The same chain on a DTensor over 2 ranks: what DTensor's own code adds to each op.
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
    """The lab's fit of `kind` on `ranks` ranks, else on the next larger group, else its largest."""
    fits = profile["model"].get(LAB_NAMES[kind])
    if not fits:
        raise ValueError(f"the machine profile has no {LAB_NAMES[kind]} measured: run python "
                         "bench/comm_lab.py with it")
    sizes = sorted(int(n) for n in fits)
    return fits[str(next((n for n in sizes if n >= ranks), sizes[-1]))]


def comm_seconds(comm: dict, profile: dict) -> dict[str, float]:
    """{"axis kind": seconds} for one rank's step: calls x alpha + S x beta (S: the lab's size)."""
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
    """ValueError (one line) where `world` ranks exceed what the profile measured on one machine."""
    largest = max(int(n) for fits in profile["model"].values() for n in fits)
    if world > largest:
        raise ValueError(f"the machine profile measured at most {largest} ranks on one "
                         f"machine; a run of {world} ranks spans others: measure it where it "
                         "runs (python bench/comm_lab.py --worlds ...)")


def predict(world: int, pp: int, plans: dict[int, dict], profile: dict,
            microbatches: int = 1) -> dict:
    """The predicted step of a `world`-rank run with `pp` stages from its ranks' plans and a
    profile: seconds, and per rank its compute, 1F1B bubble and communication by "axis kind"."""
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
    # Fewer cores than ranks: all the work (the planned ranks' mean, for all) over the cores.
    mean_work = sum(r["compute"] for r in ranks.values()) / len(ranks)
    capacity = mean_work * world / cores if world > cores else 0.0
    slowest = max(ranks, key=lambda r: ranks[r]["step"])
    critical = ranks[slowest]["compute"] + ranks[slowest]["bubble"]
    step = max(critical, capacity) + sum(ranks[slowest]["comm"].values())
    return {"step": step, "slowest rank": slowest, "cores bound": capacity > critical,
            "capacity": capacity, "ranks": ranks}
