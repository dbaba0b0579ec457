"""The workers of pitfalls.ipynb: each mistake and its fix, run in a small gloo process group.

    import pitfalls_helpers as ph
    run = ph.launch(ph.hang, 2, False, timeout_s=3)   # 2 ranks; one result or error per rank
    run.results[0], run.errors[1], run.seconds        # what each rank returned, or its error
    ph.shutdown()                                     # the fork server too: no process is left

A process started with `spawn` unpickles the function it runs by its module and name, and a
function defined in a notebook cell has neither: so every worker lives here. The processes
come from one fork server that imported torch, 05_mingpt's package and step 02's train.py
once (and torch._dynamo, below: about 4 s of CPU); a group of 4 ranks then starts in a tenth
of a second, not 4 s per process.
Each worker gets its rank and the world size first, in a gloo group that `launch` created
(unless group=False: step 02's own code creates its group itself).
"""
import contextlib
import gc
import importlib.util
import io
import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before any group exists, or it keeps the group alive
from torch.distributed.algorithms.join import Join
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

REPO = Path(__file__).resolve().parent.parent
MINGPT = REPO / "05_mingpt"
STEP02 = REPO / "02_multigpu"
# 05_mingpt holds the `mingpt` package and model_size.py; 02_multigpu holds the modules its
# train.py imports (datautils, devices, snapshot). Neither folder shares a module name.
for folder in (MINGPT, STEP02):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import analyze_hang  # noqa: E402, F401  the notebook reads the hang's traces with it
import model_size  # noqa: E402
from mingpt import distributed, forensics, memory, snapshot  # noqa: E402
from mingpt.model import GPT, GPTConfig  # noqa: E402
from mingpt.optim import build_optimizer  # noqa: E402
from mingpt.parallel import parallelize  # noqa: E402
from mingpt.parallel.fsdp import init_sharded  # noqa: E402
from mingpt.parallel.grads import set_grad_sync  # noqa: E402
from mingpt.trainer import rank_indices  # noqa: E402


def _load_step02():
    """02_multigpu/train.py as a module of its own name (`train` would be any step's)."""
    spec = importlib.util.spec_from_file_location("step02_train", STEP02 / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


step02 = _load_step02()
# Fork server: the workers are forks of a process that has imported all of the above, and
# nothing else (forking the notebook's kernel itself would copy its threads' locks). And
# torch._dynamo, which torch imports at the first call of any function it keeps from the
# compiler (an optimizer's step, DDP's forward): about 1 s of CPU in every worker otherwise.
SERVER_IMPORTS = ["torch._dynamo"]
CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload([__name__, *SERVER_IMPORTS])
CPU = torch.device("cpu")
# A tiny GPT for the sections that use 05's code: odd sizes, so FSDP's shards are uneven.
TINY = dict(model_type=None, n_layer=2, n_head=2, n_embd=18, vocab_size=11, block_size=8,
            dropout=0.0)


@dataclass
class Launch:
    """What one group of processes did: per rank its result or its error (one line)."""
    results: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    output: list = field(default_factory=list)  # what each rank printed
    seconds: float = 0.0  # from the first start to the last exit
    killed: list = field(default_factory=list)  # ranks still alive at the deadline


def free_port() -> int:
    """A TCP port that is free right now on 127.0.0.1 (the rank-0 store listens there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_line(error: BaseException) -> str:
    """`Type: first line`: gloo's messages carry a source path and several lines."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _release() -> None:
    """Leave the group, if any: 05's release drops the meshes FSDP keeps, then destroys it."""
    if dist.is_initialized():
        distributed.release()
    gc.collect()


def _rank_main(worker, rank: int, world_size: int, port: int, timeout_s: float, env: dict,
               group: bool, results: mp.Queue, args: tuple) -> None:
    """One rank: join the group, run `worker`, put (rank, result, error, output) on the queue."""
    # The fork server's imports (torch, mingpt: 370,000 objects) are shared with this process
    # until written: a garbage collection would visit, and so copy, every one of them (about
    # a second per rank and launch). Frozen, the collector ignores them.
    gc.freeze()
    os.environ.update(env)
    torch.set_num_threads(1)  # the ranks share two cores: more threads would only spin
    out = io.StringIO()
    result, error = None, None
    try:
        with contextlib.redirect_stdout(out):  # a child's prints would miss the cell
            if group:
                # The store's own timeout covers the start; `timeout` is every collective's.
                store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0,
                                      timeout=timedelta(seconds=60))
                dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                        timeout=timedelta(seconds=timeout_s))
            result = worker(rank, world_size, *args)
    except Exception as e:  # the error is the result: the notebook shows and checks it
        error = one_line(e)
    finally:
        _release()
    results.put((rank, result, error, out.getvalue()))


def launch(worker, world_size: int, *args, timeout_s: float = 60.0, env: dict | None = None,
           group: bool = True) -> Launch:
    """Run `worker(rank, world_size, *args)` in `world_size` processes, joined in a gloo group
    whose collectives time out after `timeout_s`; wait for all, kill any still alive at the
    deadline (timeout_s plus a minute for a loaded machine), and report each rank."""
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(env or {})}
    results = CONTEXT.Queue()
    started = time.monotonic()
    processes = [CONTEXT.Process(target=_rank_main, args=(
        worker, rank, world_size, port, timeout_s, env, group, results, args))
        for rank in range(world_size)]
    for p in processes:
        p.start()
    deadline = started + timeout_s + 60
    run = Launch(results=[None] * world_size, errors=[None] * world_size,
                 output=[""] * world_size)
    done = 0
    # Read before joining: a process whose result still sits in the pipe cannot exit.
    while done < world_size and time.monotonic() < deadline:
        try:
            rank, result, error, output = results.get(timeout=0.2)
        except queue.Empty:
            if not any(p.is_alive() for p in processes):
                break  # every rank is gone: a result that never came will not come now
            continue
        run.results[rank], run.errors[rank], run.output[rank] = result, error, output
        done += 1
    for rank, p in enumerate(processes):
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():  # never expected: each hang here ends by its own timeout
            p.kill()
            p.join()
            run.killed.append(rank)
        elif run.errors[rank] is None and run.results[rank] is None and p.exitcode:
            run.errors[rank] = f"exit code {p.exitcode}"
    results.close()
    results.join_thread()
    run.seconds = time.monotonic() - started
    return run


def shutdown() -> None:
    """Stop the fork server and multiprocessing's resource tracker, which would otherwise
    live as long as the kernel (private API: Python has no public way to stop them)."""
    multiprocessing.forkserver._forkserver._stop()
    multiprocessing.resource_tracker._resource_tracker._stop()


# --- the Flight Recorder ----------------------------------------------------------------------

def flight_recorder() -> list[dict]:
    """This rank's Flight Recorder entries (the env TORCH_FR_BUFFER_SIZE turns it on): one per
    collective it issued, with its sequence number, op and state."""
    trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    return [{"seq": e["collective_seq_id"], "op": e["profiling_name"].removeprefix("gloo:"),
             "state": e["state"], "sizes": e["input_sizes"]} for e in trace.get("entries", [])]


FLIGHT_RECORDER = {"TORCH_FR_BUFFER_SIZE": "2000"}  # entries per rank: more than any section


# --- 1. a collective that only some ranks reach ----------------------------------------------

def hang(rank: int, world_size: int, fixed: bool, dump_dir: str | None = None) -> dict:
    """Average a loss for rank 0's log line, then meet at a barrier (as before a checkpoint).
    The mistake: the all-reduce inside `if rank == 0`; the fix: every rank calls it."""
    loss = torch.tensor(float(rank + 1))
    started, error = time.monotonic(), None
    try:
        if fixed:
            dist.all_reduce(loss)  # every rank: a collective is a meeting of all of them
        if rank == 0:
            if not fixed:
                dist.all_reduce(loss)  # the mistake: the others never come
            print(f"mean loss {loss.item() / world_size:.2f}")
        dist.barrier()
    except RuntimeError as e:  # gloo's timeout, or its peer closing after its own timeout
        error = one_line(e)
        if dump_dir is not None:  # 05's trace files: what analyze_hang.py reads
            forensics.dump(dump_dir, error, traceback.format_stack())
    return {"seconds": time.monotonic() - started, "error": error,
            "entries": flight_recorder()}


# --- 2. gradient accumulation: one all-reduce per optimizer step ----------------------------

def _tiny_gpt(seed: int = 0) -> GPT:
    """The tiny GPT, built after seeding, in float64 (see accumulate)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**TINY)).double()


def _batch(seed: int, size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets of one micro-batch, from a seed of its own."""
    g = torch.Generator().manual_seed(seed)
    shape = (size, TINY["block_size"])
    return (torch.randint(0, TINY["vocab_size"], shape, generator=g),
            torch.randint(0, TINY["vocab_size"], shape, generator=g))


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: FSDP's are DTensors sharded over the ranks (a collective)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def accumulate(rank: int, world_size: int, strategy: str, mode: str, accum: int) -> dict:
    """One optimizer step of `accum` micro-steps under 05's ddp or fsdp strategy; the
    collectives each kind of gradient sync issued (Flight Recorder) and the gradients.

    mode "every": sync in every micro-step; "last": 05's set_grad_sync (DDP's no_sync, FSDP2's
    set_requires_gradient_sync) for all but the last; "backward only": no_sync around the
    backward alone, the forward outside it (DDP decides in the forward)."""
    # float64: the modes add the same numbers in other orders; the bound on what that can
    # change (`magnitude`, below) is then far below any real difference.
    model = parallelize(_tiny_gpt(), CPU, strategy)
    before = len(flight_recorder())
    for i in range(accum):
        x, y = _batch(1000 * rank + i)
        last = i == accum - 1
        if mode == "backward only":
            _, loss = model(x, y)  # outside no_sync: DDP has already planned its all-reduce
            with model.no_sync() if not last else contextlib.nullcontext():
                (loss / accum).backward()
        else:
            with set_grad_sync(model, sync=last or mode == "every"):
                _, loss = model(x, y)
                (loss / accum).backward()
    entries = flight_recorder()[before:]  # this step's collectives, before any of ours below
    ops: dict = {}
    for e in entries:
        ops[e["op"]] = ops.get(e["op"], 0) + 1
    grads = torch.cat([_full(p.grad).flatten() for p in model.parameters()])
    # Each gradient element is a sum of accum x world_size terms (one per rank and micro-
    # step, each scaled by 1/(accum x world_size): exact for powers of two). Every mode adds
    # the same terms, in its own order; a sum of n terms in float is within (n - 1) x u x
    # sum(|term|) of the exact sum (u = eps / 2), so two orders differ by at most
    # (n - 1) x eps x sum(|term|). The terms, recomputed on a plain copy of the model:
    plain = _tiny_gpt()
    magnitude = [torch.zeros_like(p) for p in plain.parameters()]
    for i in range(accum):
        plain.zero_grad()
        x, y = _batch(1000 * rank + i)
        (plain(x, y)[1] / (accum * world_size)).backward()
        for total, p in zip(magnitude, plain.parameters(), strict=True):
            total += p.grad.abs()
    magnitude = torch.cat([m.flatten() for m in magnitude])
    dist.all_reduce(magnitude)  # over the ranks too
    return {"ops": ops, "grads": grads.numpy(), "magnitude": magnitude.numpy(),
            "terms": accum * world_size,
            "units": sum(1 for m in model.modules() if hasattr(m, "reshard"))}


# --- 3. uneven inputs: one rank has fewer batches ---------------------------------------------

def _mlp(seed: int = 0) -> torch.nn.Module:
    """Step 02's model, (B, 20) -> (B, 1), in float64."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 1)).double()


def uneven(rank: int, world_size: int, batches: list[int], join: bool) -> dict:
    """Rank r trains batches[r] batches under DDP, then meets the others at a barrier (as
    before rank 0 writes a checkpoint); with `join`, inside torch's Join context."""
    model = DDP(_mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    started, error, done = time.monotonic(), None, 0
    try:
        # Join: a rank that runs out of batches shadows the others' all-reduces (with zeros)
        # until every rank has left the loop, so none waits for a peer that is done.
        with Join([model]) if join else contextlib.nullcontext():
            for _ in range(batches[rank]):
                x = torch.randn(8, 20, generator=g, dtype=torch.float64)
                loss = model(x).square().mean()
                optimizer.zero_grad()
                loss.backward()  # DDP's all-reduce: every rank must be here
                optimizer.step()
                done += 1
        dist.barrier()
    except RuntimeError as e:
        error = one_line(e)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    return {"seconds": time.monotonic() - started, "error": error, "batches": done,
            "weights": weights, "entries": flight_recorder()}


# --- 4. set_epoch: step 02's sampler ---------------------------------------------------------

def sampler_orders(rank: int, world_size: int, size: int, epochs: int, set_epoch: bool
                   ) -> list[list[int]]:
    """The sample indices this rank's DataLoader of step 02 deals out in each epoch, with or
    without the `sampler.set_epoch(epoch)` that step 02's _run_epoch calls."""
    loader = step02.prepare_dataloader(step02.MyTrainDataset(size), batch_size=4)
    orders = []
    for epoch in range(epochs):
        if set_epoch:
            loader.sampler.set_epoch(epoch)
        orders.append(list(loader.sampler))  # the order the loader's batches follow
    return orders


# --- 5. 1 rank against 4: step 02's own training -----------------------------------------------

def step02_train(rank: int, world_size: int, argv: list[str]) -> list[float]:
    """Step 02's train.py as its own spawn would run this rank (its spawn_rank and main, which
    create and destroy the group themselves); rank 0 returns the epoch losses it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        step02.spawn_rank(rank, world_size, step02.parse_args(argv))
    print(out.getvalue(), end="")
    return [float(line.rsplit("Loss: ", 1)[1]) for line in out.getvalue().splitlines()
            if "| Loss: " in line]


# --- 6. replicas that start from different weights ----------------------------------------------

def _spread(model: torch.nn.Module) -> float:
    """The largest difference between any two ranks' copies of any weight (a collective)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return (high - low).max().item()


def replicas(rank: int, world_size: int, use_ddp: bool, steps: int) -> list[float]:
    """Each rank seeds with its rank before building the model (the mistake), then trains
    `steps` steps on its own data: averaging the gradients by hand, or under DDP. The spread
    of the replicas' weights after building, after wrapping, and after each step."""
    model = _mlp(seed=rank)
    spreads = [_spread(model)]
    if use_ddp:
        model = DDP(model)  # broadcasts rank 0's weights and buffers to every rank
    spreads.append(_spread(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(16, 20, generator=g, dtype=torch.float64)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        if not use_ddp:  # data parallel by hand: the same averaged gradient on every rank
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world_size
        optimizer.step()
        spreads.append(_spread(model))
    return spreads


# --- 7. the network interface ----------------------------------------------------------------

def interfaces() -> dict[str, list[str]]:
    """This machine's network interfaces and their IPv4 addresses (gloo's candidates)."""
    found: dict[str, list[str]] = {name: [] for _, name in socket.if_nameindex()}
    with contextlib.suppress(ImportError):  # psutil: addresses; without it, names only
        import psutil

        for name, addresses in psutil.net_if_addrs().items():
            found[name] = [a.address for a in addresses if a.family == socket.AF_INET]
    return found


def reduce_sum(rank: int, world_size: int) -> float:
    """All-reduce each rank's rank + 1: the group works when the sum arrives."""
    value = torch.tensor(float(rank + 1))
    dist.all_reduce(value)
    return value.item()


# --- 8. a checkpoint resharded to another world size: 05's DCP snapshots ----------------------

def _fsdp_gpt(seed: int = 5) -> torch.nn.Module:
    """The tiny GPT as 05's main.py builds it for fsdp: on meta, sharded, then init_sharded."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = GPT(GPTConfig(**TINY))
    model = parallelize(model, CPU, "fsdp")
    init_sharded(model, CPU)
    return model


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    """One AdamW step on this rank's batch: the optimizer then holds state to save."""
    x, y = _batch(7 + rank, size=3)
    model(x, y)[1].backward()
    optimizer.step()
    optimizer.zero_grad()


SNAPSHOT_META = {"model_config": {**TINY}, "data_meta": {"kind": "pitfalls"}}


def reshard_save(rank: int, world_size: int, folder: str) -> dict:
    """FSDP on `world_size` ranks, one step, then saved twice: each rank's local shards with
    torch.save (the mistake), and 05's snapshot.save (DCP: shards plus their global layout)."""
    model = _fsdp_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, optimizer, rank)
    local = {name: t.to_local() for name, t in model.state_dict().items()}
    torch.save(local, os.path.join(folder, f"rank{rank}.pt"))
    snapshot.save(os.path.join(folder, "snapshot"), model, optimizer,
                  {"step": 1, **SNAPSHOT_META})
    return _weights_and_rows(model, optimizer)


def _weights_and_rows(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The whole weights and AdamW moments (collectives), and this rank's rows of wte."""
    moments = [optimizer.state[p]["exp_avg"] for p in model.parameters()]
    return {"weights": {name: _full(t).numpy() for name, t in model.state_dict().items()},
            "exp_avg": [_full(m).numpy() for m in moments],
            "wte_rows": model.wte.weight.to_local().shape[0]}


def reshard_load(rank: int, world_size: int, folder: str, naive: bool) -> dict:
    """Load on `world_size` ranks: each rank's file of the same number (the mistake), or 05's
    snapshot.load, which has each rank read the parts of the saved shards that it now holds."""
    model = _fsdp_gpt(seed=99)  # other weights: only a load can make them equal
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, optimizer, rank)  # AdamW's state exists, as in a run that resumes
    if naive:
        saved = torch.load(os.path.join(folder, f"rank{rank}.pt"), weights_only=True)
        for name, t in model.state_dict().items():
            t.to_local().copy_(saved[name])  # this rank's shard, from that rank's file
        return {}
    snapshot.load(os.path.join(folder, "snapshot"), model, optimizer, SNAPSHOT_META,
                  ())
    return _weights_and_rows(model, optimizer)


# --- 9. will it fit: the dry run against the tensors a rank holds ---------------------------

FIT_METHODS = ("ddp", "fsdp")
MODEL_STATE = ("parameters", "gradients", "optimizer")


def fit(rank: int, world_size: int, batch: int = 3) -> dict:
    """05's ddp and fsdp on the tiny GPT, one step of 05's AdamW each: the bytes of
    parameters, gradients and optimizer state this rank holds (memory.model_state_bytes,
    counted from its tensors)."""
    held = {}
    for method in FIT_METHODS:
        torch.manual_seed(5)
        model = _fsdp_gpt() if method == "fsdp" else \
            parallelize(GPT(GPTConfig(**TINY)), CPU, method)
        optimizer = build_optimizer(model, method, lr=1e-3)
        x, y = _batch(7 + rank, size=batch)
        model(x, y)[1].backward()
        optimizer.step()  # gradients kept: model_state_bytes counts them until zero_grad
        held[method] = memory.model_state_bytes(model, optimizer)
        del model, optimizer
    return held


def fit_predicted(world_size: int, batch: int = 3) -> list[dict]:
    """What the dry run plans for each rank of `fit`'s runs (model_size.predict: the same
    layouts and one training step on fake tensors), per rank and method. Called from the
    notebook's own process: the dry run starts a process per rank, which it may do only from
    a main process, not from one of launch's ranks."""
    with torch.device("meta"):
        shapes = GPT(GPTConfig(**TINY))  # shapes only: the dry run lays them out itself
    plans = model_size.predict(
        shapes, {m: [f"trainer_config.distributed_method={m}"] for m in FIT_METHODS},
        world_size, batch, ranks=tuple(range(world_size)))
    return [{m: {k: plans[m][rank][k] for k in MODEL_STATE} for m in FIT_METHODS}
            for rank in range(world_size)]


# --- 10. resuming in the middle of an epoch: 05's rank_indices --------------------------------

def epoch_orders(rank: int, world_size: int, size: int, batch: int, steps_done: int,
                 start: int) -> dict:
    """The samples of epoch 0 that this group's ranks train, gathered on every rank: before a
    restart ("first steps": `steps_done` batches each) and after it, three ways, when
    `steps_done` steps that trained `start` samples were done before the restart."""
    # Step 02's sampler: one seeded permutation, rank r takes every world_size-th sample
    # (drop_last: no sample repeated to even out the ranks).
    dealt = list(DistributedSampler(range(size), world_size, rank, seed=0, drop_last=True))
    ways = {
        "first steps": dealt[:steps_done * batch],
        # The epoch from its beginning: the sampler knows nothing of the snapshot.
        "from the start": dealt,
        # Skip as many batches as each rank trained: right only on the same world size.
        "skip trained batches": dealt[steps_done * batch:],
        # 05's trainer: the same permutation, dealt out from global position `start` on.
        "rank_indices": rank_indices(size, 0, 0, start, rank, world_size),
    }
    gathered = {}
    for way, mine in ways.items():
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, mine)
        gathered[way] = sorted(i for order in everyone for i in order)
    return gathered
