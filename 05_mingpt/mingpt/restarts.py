"""What a torchrun worker needs to be restarted: a process group that only this attempt's workers
join, and a failed rank that leaves its group before it exits.

    join_group(backend)                  # init_process_group(backend), restartable
    with leaving_group_on_failure():     # a crash: the group destroyed, then the error goes on
        main(args)

torchrun's agent hosts one TCP store for the whole job and gives it to every attempt's workers
(TORCHELASTIC_USE_AGENT_STORE=True; MASTER_PORT is that store's). init_process_group keys its
rendezvous by the group's name alone, so a restarted worker can read a key that a worker of the
previous attempt wrote: gloo then connects to a dead process and fails, "Gloo connectFullMesh
failed ... Connection refused", or hangs, at every restart (measured on 4 CPU processes: 0 of
6 jobs came back in one restart, README "Pitfalls"). join_group puts each attempt's group under
keys of its own: global rank 0 draws a fresh name, and every other rank asks for it under a
fresh name of its own, which no earlier attempt can have answered.
"""
import contextlib
import gc
import os
import time
import traceback
import uuid
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

KEYS = "attempt"  # the handshake's keys in the agent's store, beside torchrun's own
POLL_S = 0.01  # rank 0 looks for new questions this often: beside a worker's start, nothing


def attempt_store(timeout: timedelta) -> dist.Store | None:
    """The agent's store under a prefix that only this attempt's workers use, or None where
    torchrun shares no store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, not under torchrun): there
    env:// makes a fresh store for each attempt, on a fresh port.

    Not TORCHELASTIC_RESTART_COUNT as the prefix: each node's agent counts its own restarts, and
    an agent whose workers were still healthy when another node's failed restarts them without
    counting, so two nodes can be at different counts in the same attempt."""
    # The agent says whether it shares its store: only then can an earlier attempt's keys be there.
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A client of the agent's store (the agent hosts it: no worker may start a server there).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    name = uuid.uuid4().hex  # never drawn before: no earlier attempt's key can carry it
    if rank == 0:
        answer_every_rank(store, name, world_size, time.monotonic() + timeout.total_seconds())
        attempt = name
    else:
        # An earlier attempt's question under this key is overwritten; rank 0 may still have
        # read it, and answers it under that attempt's name, which no one asks for any more.
        store.set(f"{KEYS}/ask/{rank}", name)
        # Only rank 0 of this attempt has seen this name: the answer is this attempt's.
        attempt = store.get(f"{KEYS}/answer/{name}").decode()  # waits up to `timeout`
        store.add(f"{KEYS}/{attempt}/joined", 1)  # counted under a name no earlier attempt had
    return dist.PrefixStore(f"{KEYS}/{attempt}/", store)


def answer_every_rank(store: dist.Store, attempt: str, world_size: int, deadline: float) -> None:
    """Rank 0: answer each rank's question with this attempt's name until all have taken it.

    A question from an earlier attempt is still in the store and gets answered too, uselessly:
    rank 0 cannot tell it from a new one, but only a new one's asker reads the answer and
    counts itself in."""
    answered: dict[int, bytes] = {}  # rank -> the question answered last: each answered once
    while store.add(f"{KEYS}/{attempt}/joined", 0) < world_size - 1:
        if time.monotonic() > deadline:  # a worker that never came: torchrun restarts the job
            raise dist.DistStoreError(f"not every rank of {world_size} joined the process "
                                      "group's store within the timeout")
        for rank in range(1, world_size):
            key = f"{KEYS}/ask/{rank}"
            # check() does not wait: a rank that has not asked yet must not hold up the others.
            if store.check([key]) and (asked := store.get(key)) != answered.get(rank):
                store.set(f"{KEYS}/answer/{asked.decode()}", attempt)
                answered[rank] = asked
        time.sleep(POLL_S)


def join_group(backend: str, timeout: timedelta | None = None) -> None:
    """init_process_group(backend) with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from
    torchrun's environment, as env:// reads them, on this attempt's own store keys."""
    # The store's waits get the group's timeout: torch's default (30 min) where none is given.
    store = attempt_store(timeout or dist.default_pg_timeout)
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    # With a store given, init_process_group takes rank and world size from its arguments.
    dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


@contextlib.contextmanager
def leaving_group_on_failure() -> Iterator[None]:
    """If the block fails (a peer was killed mid-collective: "Connection reset by peer"), destroy
    the process group, then let the error go on: a traceback and exit status 1, or the caller's
    `error:` line for bad input.

    A group left alive keeps gloo's threads running while Python shuts down, and one still at
    work then aborts the process ("terminate called without an active exception"). The group is
    freed only with its last reference, and DDP holds one: the failed frames' variables (the
    trainer, its model) are dropped first, so that destroy_process_group frees it."""
    try:
        yield
    except Exception as e:
        if dist.is_initialized():  # not yet (a bad argument) or no more: nothing to leave
            traceback.clear_frames(e.__traceback__)  # the line numbers stay for the traceback
            gc.collect()  # what only cycles still held (a module's hooks, DDP's own references)
            dist.destroy_process_group()
        raise  # the error itself is unchanged: torchrun sees this rank fail, and restarts
