"""A dry run: what each rank of an N-rank job would hold and send, planned on one machine: a few
ranks that stand for all each run one real training step on torch's fake process group, the
model as fake tensors (shapes without memory), counted (DRY_RUN.md)."""
import gc
import itertools
import logging
import multiprocessing
from collections import defaultdict
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import nullcontext

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mingpt import ROOT, distributed, memory, step_time
from mingpt.model import GPT, GPTConfig
from mingpt.optim import build_optimizer
from mingpt.parallel import Settings, ddp, layout, parallelize, runner
from mingpt.parallel.wrappers import unwrap

CPU = torch.device("cpu")
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "broadcast", "send/recv")
# The c10d ops (dist.* calls, FSDP2's own) and functional collectives (DTensor, TP, CP), by
# what they move; each rank's share assumes ring algorithms (DRY_RUN.md gives them).
_OPS = {
    "_allgather_base_": "all-gather", "allgather_": "all-gather",
    "allgather_into_tensor_coalesced_": "all-gather", "all_gather_into_tensor": "all-gather",
    "_reduce_scatter_base_": "reduce-scatter", "reduce_scatter_": "reduce-scatter",
    "reduce_scatter_tensor_coalesced_": "reduce-scatter",
    "reduce_scatter_tensor": "reduce-scatter",
    "allreduce_": "all-reduce", "allreduce_coalesced_": "all-reduce", "all_reduce": "all-reduce",
    "alltoall_base_": "all-to-all", "all_to_all_single": "all-to-all",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "send": "send/recv", "recv_": "send/recv",
}


class CommCounter(TorchDispatchMode):
    """Calls and bytes this rank sends and receives per (axis, kind), as the dispatcher sees."""

    def __init__(self, axes: dict[str, str]) -> None:
        super().__init__()
        self.axes = axes  # process group name, or its ranks -> axis ("dp", "tp", ...)
        # (axis, kind) -> [calls, bytes sent, bytes received, largest buffer, group size]
        self.counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
        self.ddp_buckets = 0  # DDP's bucket bytes (measure_step)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor run it: the collectives it issues inside come back here on local
            # tensors (handled here instead, they would run with this mode off, uncounted).
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in step_time.COLLECTIVES and func._opname in _OPS:
            self._count(func._opname, _OPS[func._opname], args)
        return out

    def _count(self, name: str, kind: str, args: tuple) -> None:
        flat = tree_flatten(list(args))[0]
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        group = next((a for a in flat if isinstance(a, torch.ScriptObject)
                      and "ProcessGroup" in str(a._type())), None)
        group = dist.ProcessGroup.unbox(group) if group is not None \
            else _resolve_process_group(args[-1])  # a functional collective names its group
        n = group.size()
        if name in ("_allgather_base_", "_reduce_scatter_base_", "alltoall_base_"):
            tensors = tensors[1:] if kind != "all-gather" else tensors[:1]  # (output, input)
        elif name in ("allgather_into_tensor_coalesced_", "reduce_scatter_tensor_coalesced_",
                      "allgather_"):
            half = len(tensors) // 2  # outputs, then inputs
            tensors = tensors[:half] if kind == "all-gather" else tensors[half:]
        elif name == "all_gather_into_tensor":  # the input: the output is n times it
            tensors = [tensors[0]] * n
        elif name == "reduce_scatter_":
            tensors = tensors[len(tensors) // (n + 1):]  # the inputs, one per rank
        payload = sum(t.numel() * t.element_size() for t in tensors)
        axis = self.axes.get(group.group_name) or self.axes.get(ranks_of(group), "world")
        self.add(axis, kind, n, payload, receive=name == "recv_")

    def add(self, axis: str, kind: str, n: int, payload: int, receive: bool = False) -> None:
        """One op of `kind` over `n` ranks moving `payload` bytes (the whole buffer)."""
        share = {"all-reduce": 2 * payload * (n - 1) // n, "broadcast": payload,
                 "send/recv": payload}.get(kind, payload * (n - 1) // n)
        entry = self.counts[(axis, kind)]
        entry[0] += 1
        entry[2 if receive else 1] += share
        if kind != "send/recv":
            entry[2] += share  # a collective receives as much as it sends
        entry[3] = max(entry[3], payload)
        entry[4] = n

    def table(self) -> dict[str, dict[str, int]]:
        """{axis: {"kind calls", "kind sent", "kind received" (bytes), "kind ranks": int}}."""
        out: dict[str, dict[str, int]] = defaultdict(dict)
        for (axis, kind), (calls, sent, received, _, n) in sorted(self.counts.items()):
            out[axis].update({f"{kind} calls": calls, f"{kind} sent": sent,
                              f"{kind} received": received, f"{kind} ranks": n})
        return dict(out)

    def buffers(self) -> int:
        """The communication buffers a rank holds at once, at most: the largest all-gather
        twice (FSDP prefetches the next block), the largest reduce-scatter input, DDP's buckets."""
        largest = {kind: max((c[3] for (_, k), c in self.counts.items() if k == kind),
                             default=0) for kind in KINDS}
        return 2 * largest["all-gather"] + largest["reduce-scatter"] + self.ddp_buckets


def ranks_of(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def group_axes(model: torch.nn.Module) -> dict[str | tuple[int, ...], str]:
    """Process group name, and its ranks, -> axis name, for the mesh parallelize() built (by
    ranks: a real run's tp beside a pipeline, dp 1, may use another group of the same ranks)."""
    mesh = unwrap(model).mesh
    # dp_cp first: where dp is 1 it is the cp group itself, which the mesh's name then labels.
    names = (["dp_cp"] if "cp" in mesh.mesh_dim_names else []) + list(mesh.mesh_dim_names)
    groups = [(layout.axis(mesh, name).get_group(), name) for name in names]
    pipeline = getattr(unwrap(model), "pipeline", None)
    if pipeline is not None and pipeline.tied_group is not None:
        groups.append((pipeline.tied_group, "pp"))  # the tied embedding's pair, across stages
    return {key: name for group, name in groups for key in (group.group_name, ranks_of(group))}


def representative_ranks(lay: layout.Layout) -> list[int]:
    """Ranks that stand for all: the first, second and last pipeline stage, each with its first
    and last data-parallel rank (FSDP's last chunk is the shortest); cp and tp shards are equal."""
    pp = sorted({0, min(1, lay.pp - 1), lay.pp - 1})
    dp = sorted({0, lay.dp - 1})
    # Rank r = ((pp_rank x dp + dp_rank) x cp + cp_rank) x tp + tp_rank (layout.py).
    return [(p * lay.dp + d) * lay.cp * lay.tp for p, d in itertools.product(pp, dp)]


def plan_rank(cfg: DictConfig, gpt_config: GPTConfig, world: int, rank: int) -> dict:
    """One rank of a `world`-rank run on the fake process group: its bytes (see the module)."""
    # DTensor warns of each norm it reduces over two mesh dimensions: once per rank is noise.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("fake", rank=rank, world_size=world)
    try:
        return _step(cfg, gpt_config)
    except ValueError:
        raise  # a layout that does not fit: its one line, for main.py's `error:`
    except Exception as err:  # as text: some of torch's errors cannot be pickled back
        raise RuntimeError(f"the dry run of rank {rank} failed: {type(err).__name__}: "
                           f"{err}") from None
    finally:
        distributed.release()


def measure_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, t: DictConfig,
                 micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """One training step as the trainer runs it, counted: comm, work, activations, model state."""
    step = runner(model, CPU, t.precision)
    counter, work = CommCounter(group_axes(model)), step_time.WorkCounter()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with counter, work, memory.saved_activations(model) as acts:
        step.forward_backward(micro_batches, scaler, lambda phase: None)
        if t.grad_clip > 0:
            step.clip_grad_norm(t.grad_clip)
        optimizer.step()
    if isinstance(model, DistributedDataParallel):  # its buckets hold every gradient again
        counter.ddp_buckets = sum(p.numel() * p.element_size() for p in model.parameters()
                                  if p.requires_grad)
    state = memory.model_state_bytes(model, optimizer)
    forwards = len(micro_batches) * max(1, t.microbatches if hasattr(step, "stages") else 1)
    result = {**state, "model state": sum(state.values()), "buffers": counter.buffers(),
              "activations / micro-batch": acts["total"] // forwards,
              "peak activations": acts["peak"]}
    result["predicted peak"] = result["model state"] + result["buffers"] + acts["peak"]
    return {**result, "comm": counter.table(), "work": work.table()}


def _ddp_on_fake(model: torch.nn.Module, comm_hook: str = "none") -> None:
    """The fake backend's futures carry no value, which DDP's reducer needs: a hook that issues
    the same all-reduce (the run's `comm_hook`'s) and hands the bucket back itself."""
    if isinstance(model, DistributedDataParallel):
        dtype = ddp.COMPRESSED.get(comm_hook)

        def hand_back(group, bucket):
            buffer = bucket.buffer()
            if dtype is None:
                dist.all_reduce(buffer, group=group)
            else:  # as torch's compress hooks: cast, divide, all-reduce, copy back
                compressed = buffer.to(dtype).div_(group.size())
                dist.all_reduce(compressed, group=group)
                buffer.copy_(compressed)
            future = torch.futures.Future()
            future.set_result(buffer)
            return future
        model.register_comm_hook(model.process_group, hand_back)


def _to_empty(model: torch.nn.Module) -> None:
    """model.to_empty(device="cpu"), keeping tied parameters (wte, lm_head) one tensor."""
    places: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((module, name))
    model.to_empty(device=CPU)
    for (owner, name), *others in places.values():
        for module, other in others:
            setattr(module, other, getattr(owner, name))


def _step(cfg: DictConfig, gpt_config: GPTConfig) -> dict:
    t = cfg.trainer_config
    # The communication hook is the fake group's own (_ddp_on_fake): DDP takes only one.
    settings = {**{key: t[key] for key in Settings._fields}, "comm_hook": "none"}
    torch.manual_seed(t.seed)
    if gpt_config.n_expert:
        model, mode = _real_shards(cfg, gpt_config, settings), nullcontext()
    else:
        # Built whole as fake tensors, then laid out outside the mode: the mesh is made of
        # real tensors (fake tensors carry their mode with them). The step runs inside it.
        mode = _PlanningMode(allow_non_fake_inputs=True)
        with mode:
            model = GPT(gpt_config)
        model = parallelize(model, CPU, t.distributed_method, **settings)
    # From here on as the trainer would: the real optimizer (ZeRO's own for zero), one step.
    _ddp_on_fake(model, t.comm_hook)
    o = cfg.optimizer_config
    optimizer = build_optimizer(model, t.distributed_method, o.lr, o.betas, o.weight_decay,
                                o.name, o.muon_lr)
    with mode:
        return measure_step(model, optimizer, t, batches(t, gpt_config))


class _PlanningMode(FakeTensorMode):
    """Fake tensors whose value, read back into Python (`.item()`), is 0 where the fake tensor
    has none: in a dense step only TP's dropout seed (tensor.py), which picks the masks' bits."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and \
                getattr(args[0], "constant", None) is None:  # AdamW's step count has one
            return 0
        return super().__torch_dispatch__(func, types, args, kwargs)


def _real_shards(cfg: DictConfig, gpt_config: GPTConfig, settings: dict) -> torch.nn.Module:
    """The model with real storage for the rank's own shards only: a mixture of experts reads
    its all-to-all's split sizes from the router's values, which fake tensors lack."""
    t = cfg.trainer_config
    lay = layout.resolve(t.distributed_method, dist.get_world_size(), **layout.degrees(t))
    with torch.device("meta"):
        model = GPT(gpt_config)  # shapes only
    if lay.whole:
        # Every rank holds the whole model, and DDP's constructor reads real tensors.
        _to_empty(model)
    model = parallelize(model, CPU, t.distributed_method, **settings)
    # Storage for this rank's own shards only; swapped in place, so every reference the
    # layout kept (the pipeline's parameters, the tied weight) stays the rank's parameter.
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion("pp" in lay.sizes())
    try:
        if not lay.whole:
            _to_empty(model)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    with torch.no_grad():  # small weights: no overflow, no denormals slowing the step down
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).normal_(0.0, 0.02)
    return model


def batches(t: DictConfig, gpt_config: GPTConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One step's micro-batches of random token ids, in the shape the data loader gives."""
    g = torch.Generator().manual_seed(t.seed)
    shape = (t.batch_size, gpt_config.block_size)
    return [(torch.randint(0, gpt_config.vocab_size, shape, generator=g),
             torch.randint(0, gpt_config.vocab_size, shape, generator=g))
            for _ in range(t.grad_accum_steps)]


def model_config(cfg: DictConfig) -> GPTConfig:
    """The model a run of `cfg` builds, with the data's vocabulary (no batches are made)."""
    from mingpt import config  # noqa: PLC0415  (config imports the parallel package)
    from mingpt.data import data_module  # noqa: PLC0415
    _, _, meta = data_module(cfg.data_config.name).build_datasets(
        cfg.data_config, cfg.gpt_config.block_size, cfg.trainer_config.seed)
    return config.model_config(cfg, meta)[0]


# --- the entry point (main.py) and the table ---------------------------------------------------

def plan(cfg: DictConfig, gpt_config: GPTConfig | None = None,
         ranks: list[int] | None = None) -> tuple[layout.Layout, dict[int, dict]]:
    """The layout of a trainer_config.dry_run-rank run and the plan of each of `ranks` (default:
    representative_ranks); ValueError (one line) where the data, model or layout does not fit."""
    t = cfg.trainer_config
    gpt_config = gpt_config or model_config(cfg)
    lay = layout.resolve(t.distributed_method, t.dry_run, **layout.degrees(t))
    ranks = representative_ranks(lay) if ranks is None else ranks
    plans = plan_ranks([(cfg, gpt_config, t.dry_run, r) for r in ranks])
    return lay, dict(zip(ranks, plans, strict=True))


GUARD_NEEDED = ("a script that calls the dry run needs multiprocessing's "
                "`if __name__ == \"__main__\":` guard")


def plan_ranks(jobs: list[tuple[DictConfig, GPTConfig, int, int]],
               keep_refusals: bool = False) -> list[dict | ValueError]:
    """plan_rank(*job) for each job, two at a time, each in a process of its own; with
    keep_refusals, a job's ValueError in its place instead of ending them all."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # A child re-running an unguarded script's top level (multiprocessing's own flag):
        # stop before a pool, whose locks would leave a warning after the caller's error.
        raise RuntimeError(GUARD_NEEDED)
    # Forks of the fork server (which imports torch once), not of this process: a fork of a
    # process with threads (gloo's, a test runner's) can inherit a lock one of them holds.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["mingpt.dry_run", "torch._dynamo"])
    try:
        # A fresh process per job (max_tasks_per_child=1): no mesh cached from another rank.
        # gc.freeze: the server's heap is shared until written, and a full collection would
        # visit, and so copy, all of it; frozen, the collector leaves it alone.
        with ProcessPoolExecutor(2, mp_context=context, max_tasks_per_child=1,
                                 initializer=gc.freeze) as pool:
            futures = [pool.submit(plan_rank, *job) for job in jobs]
            return [_outcome(future, keep_refusals) for future in futures]
    except BrokenProcessPool:
        raise RuntimeError(f"a dry-run process died before it finished; {GUARD_NEEDED}") from None


def _outcome(future: Future, keep_refusals: bool) -> dict | ValueError:
    try:
        return future.result()
    except ValueError as err:
        if keep_refusals:
            return err
        raise


def human(n: float) -> str:
    """Bytes with a binary prefix: 1536 -> '1.50 KiB'."""
    for prefix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or prefix == "TiB":
            return f"{n:.0f} {prefix}" if prefix == "B" else f"{n:.2f} {prefix}"
        n /= 1024
    return ""


def position(lay: layout.Layout, rank: int) -> str:
    """Where `rank` sits: "pp 0, dp 31"."""
    coords, rest = {}, rank
    for axis in reversed(layout.AXES):  # tp innermost
        rest, coords[axis] = divmod(rest, getattr(lay, axis))
    return ", ".join(f"{axis} {coords[axis]}" for axis in ("pp", "dp") if axis in lay.sizes())


MEMORY_KEYS = ("parameters", "gradients", "optimizer", "buffers", "activations / micro-batch",
               "peak activations", "predicted peak")


def report(lay: layout.Layout, plans: dict[int, dict]) -> str:
    """The table main.py prints: memory per rank, then bytes per step by axis and kind."""
    ranks = list(plans)
    heads = [f"rank {r}" for r in ranks]
    lines = [f"dry run: {lay.describe()} ({lay.world} ranks), one training step per rank",
             "rank positions: " + "; ".join(f"rank {r} = {position(lay, r)}" for r in ranks),
             "", "memory per rank".ljust(28) + "".join(h.rjust(14) for h in heads)]
    for key in MEMORY_KEYS:
        lines.append(key.ljust(28) + "".join(human(plans[r][key]).rjust(14) for r in ranks))
    lines += ["", "bytes per step (sent / received)".ljust(28)
              + "".join(h.rjust(28) for h in heads)]
    rows = sorted({(axis, kind) for p in plans.values() for axis, kinds in p["comm"].items()
                   for kind in KINDS if f"{kind} calls" in kinds})
    for axis, kind in rows:
        cells = [f"{c[f'{kind} calls']}x {human(c[f'{kind} sent'])} / "
                 f"{human(c[f'{kind} received'])}" if c.get(f"{kind} calls") else "-"
                 for c in (plans[r]["comm"].get(axis, {}) for r in ranks)]
        lines.append(f"{axis} {kind}".ljust(28) + "".join(c.rjust(28) for c in cells))
    lines.append("(ring shares: an all-gather or reduce-scatter of B bytes over n ranks moves "
                 "B(n-1)/n per rank each way, an all-reduce twice that; DRY_RUN.md)")
    return "\n".join(lines)


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms"


def time_report(plans: dict[int, dict], predicted: dict, profile: dict, where: str) -> str:
    """The predicted step's table (step_time.predict), then the step and what bounds it."""
    ranks = list(plans)
    m = profile["machine"]
    lines = [f"predicted step, for {m['cpu']} ({m['cores']} cores, {profile['backend']}; "
             f"{where})".ljust(28) + "".join(f"rank {r}".rjust(14) for r in ranks)]
    rows = {"compute": {r: predicted["ranks"][r]["compute"] for r in ranks}}
    if any(predicted["ranks"][r]["bubble"] for r in ranks):
        rows["pipeline bubble"] = {r: predicted["ranks"][r]["bubble"] for r in ranks}
    for r in ranks:
        for name, seconds in predicted["ranks"][r]["comm"].items():
            rows.setdefault(name, {})[r] = seconds
    for name, by_rank in rows.items():
        lines.append(name.ljust(28) + "".join(
            (ms(by_rank[r]) if r in by_rank else "-").rjust(14) for r in ranks))
    slowest = predicted["slowest rank"]
    bound = (f"every rank's work over {m['cores']} cores, {ms(predicted['capacity'])}"
             if predicted["cores bound"] else "its compute and bubble")
    lines.append(f"predicted step: {ms(predicted['step'])} (rank {slowest}, the slowest: "
                 f"{bound}, then its communication; step_time.py says how)")
    return "\n".join(lines)


# With trainer_config.compile the plan is the eager step's (the dry run's fake step runs the
# layout's modules as eager ones do): what a compiled step keeps differs, unplanned.
COMPILE_LINE = ("compile: the plan above is the eager step's; a compiled step keeps for "
                "backward what AOTAutograd's partitioner chooses (it recomputes cheap ops), "
                "which the dry run does not plan")


def replica_line(t: DictConfig, plans: dict[int, dict]) -> str:
    """What each planned rank sends the other replica groups: every parameter it holds, once
    per interval, as it holds them (ft.py's step: one all-reduce of its gradients; torchft's
    LocalSGD and DiLoCo: the weights, or the outer gradients, a fragment at each meeting)."""
    every = 1 if t.ft_sync == "step" else t.ft_sync_every
    when = "every step" if every == 1 else f"every {every} steps"
    if t.ft_fragments > 1:
        when += (f", {t.ft_fragments} fragments in turn (one every "
                 f"{every // t.ft_fragments} steps)")
    interval = "step" if every == 1 else f"{every} steps"
    sent = ", ".join(f"rank {r} {plans[r]['parameters']:,} bytes" for r in plans)
    return (f"replica groups: the plan above is one of trainer_config.ft_replicas="
            f"{t.ft_replicas} groups; they meet {when} (ft_sync={t.ft_sync}), each rank with "
            f"the same rank of the other groups through torchft's all-reduce, per {interval}: "
            f"{sent}")


def run(cfg: DictConfig) -> tuple[layout.Layout, dict[int, dict]]:
    """main.py with trainer_config.dry_run=N: print the plan and, with a machine profile, the
    predicted step; ValueError (one line) where a real run would be refused. As plan()."""
    lay, plans = plan(cfg)
    print(report(lay, plans))
    t = cfg.trainer_config
    if t.ft_replicas:  # each group is a job of its own: the plan is one group's
        print(replica_line(t, plans))
    if t.compile:
        print(COMPILE_LINE)
    path = ROOT / t.dry_run_profile  # a relative path: from 05_mingpt/, as every path
    try:
        profile = step_time.load_profile(path)
        predicted = step_time.predict(lay.world, lay.pp, plans, profile, t.microbatches)
    except ValueError as err:  # the plan stands without it
        print(f"\npredicted step: none ({err})")
        return lay, plans
    print("\n" + time_report(plans, predicted, profile, t.dry_run_profile))
    return lay, plans
