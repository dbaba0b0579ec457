"""Step 04: the same job on several machines ("nodes"), joined by a rendezvous.

    # on every node (set HOST to the first node's address; snapshot.pt on shared storage):
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv-id=456 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST:29603 04_multinode/train.py 50 10
    bash 04_multinode/run_two_nodes.sh   # two "nodes" on this one machine
"""
import argparse
import os
import sys

import torch
import torch.distributed.nn  # noqa: F401  before init_process_group, or it keeps the group alive
import torch.nn.functional as F
from torch.distributed import all_reduce, destroy_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from datautils import MyTrainDataset
from devices import backend_for, pick_device
from faults import inject_fault
from restarts import join_group, leaving_group_on_failure
from snapshot import SnapshotError, atomic_save, load_snapshot, rng_state, set_rng_state


def ddp_setup(requested: str) -> torch.device:
    # LOCAL_RANK, the number of this process on its machine, picks the GPU; RANK is job-wide.
    device = pick_device(int(os.environ["LOCAL_RANK"]), requested)
    if device.type == "cuda":
        # Before init_process_group: NCCL binds each process to the current GPU.
        torch.cuda.set_device(device)
    join_group(backend_for(device))  # init_process_group, on this torchrun attempt's own keys
    return device


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        save_every: int,
        snapshot_path: str,
    ) -> None:
        self.device = device
        self.rank = torch.distributed.get_rank()  # the global rank, as RANK
        node, local_rank = os.environ["GROUP_RANK"], os.environ["LOCAL_RANK"]
        self.tag = f"node {node} | local {local_rank} | global {self.rank}"
        device_ids = [device.index] if device.type == "cuda" else None  # DDP rejects them on CPU
        # .to() moves the parameters in place, so the optimizer built before still holds them.
        # DDP broadcasts rank 0's weights at construction and all-reduces gradients in backward.
        self.model = DDP(model.to(device), device_ids=device_ids)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0  # the next epoch to run
        # Every rank must see the same snapshot, so it lives on storage all nodes share.
        found = torch.tensor(int(os.path.exists(snapshot_path)), device=device)
        all_reduce(found)
        if 0 < found.item() < torch.distributed.get_world_size():
            raise SnapshotError(f"{snapshot_path} exists for {found.item()} of "
                                f"{torch.distributed.get_world_size()} ranks: use shared storage")
        if found.item():  # every rank loads the same file: weights stay equal
            self._load_snapshot(snapshot_path)

    def _load_snapshot(self, snapshot_path: str) -> None:
        # Loaded to the CPU (map_location="cpu"): load_state_dict copies weights and momentum to
        # this rank's device, and the RNG states stay on the CPU, where set_rng_state needs them.
        keys = ("MODEL_STATE", "OPTIMIZER_STATE", "EPOCHS_RUN", "RNG_STATES")
        snapshot = load_snapshot(snapshot_path, keys, self.model.module)
        self.model.module.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        if len(snapshot["RNG_STATES"]) == torch.distributed.get_world_size():
            set_rng_state(snapshot["RNG_STATES"][self.rank])  # each rank resumes its own RNG
        print(f"[{self.tag}] Resuming training from snapshot at epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad()  # backward() adds to .grad: clear the last batch's gradients
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.detach()  # without its graph: the running sum must not keep it alive

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        self.train_data.sampler.set_epoch(epoch)  # else every epoch repeats epoch 0's order
        # Sum losses on the device; one host sync per epoch instead of one per batch.
        loss_sum = torch.zeros((), device=self.device)
        for step, (source, targets) in enumerate(self.train_data):
            if step == len(self.train_data) // 2:
                inject_fault(epoch)
            source, targets = source.to(self.device), targets.to(self.device)
            loss_sum += self._run_batch(source, targets)
        all_reduce(loss_sum)  # each rank saw its own shard: sum all ranks' losses before logging
        loss = loss_sum.item() / (len(self.train_data) * torch.distributed.get_world_size())
        if self.rank != 0:  # one log line per epoch, not one per rank
            return
        print(f"[{self.tag} | {self.device}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)} | Loss: {loss:.4f}")

    def _save_snapshot(self, epoch: int) -> None:
        # Every rank's RNG state goes into the one file rank 0 writes, so each rank resumes its own.
        rng_states = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(rng_states, rng_state())
        if self.rank != 0:  # only global rank 0 writes: one writer even when nodes share storage
            return
        # .module: the model inside the DDP wrapper, so the saved weights load without DDP.
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "EPOCHS_RUN": epoch + 1,  # the next epoch to run: resume must not redo this one
            "RNG_STATES": rng_states,
        }
        atomic_save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            # Save every `save_every` epochs and after the last one.
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save_snapshot(epoch)


def load_train_objs() -> tuple[Dataset, torch.nn.Module, torch.optim.Optimizer]:
    train_set = MyTrainDataset(2048)  # 64 batches of 32 per epoch on one device
    # (B, 20) features -> (B, 64) hidden -> (B, 1) prediction
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    # Momentum is optimizer state: a run that resumes needs it as much as the weights.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=torch.cuda.is_available(),  # page-locked memory speeds host->GPU copies
        sampler=DistributedSampler(dataset),  # each rank gets its own 1/world_size, shuffled
        generator=torch.Generator().manual_seed(0),  # seeded, never the global RNG: repeatable
    )


def main(args: argparse.Namespace) -> None:
    torch.manual_seed(0)  # the same initial weights on every run
    device = ddp_setup(args.device)
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, args.batch_size)
    trainer = Trainer(model, train_data, optimizer, device, args.save_every, args.snapshot_path)
    trainer.train(args.total_epochs)
    del trainer  # DDP holds the group too: release it, so that destroy_process_group frees it ...
    destroy_process_group()  # ... and joins gloo's threads: none may still run as Python exits


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.error = lambda message: sys.exit(f"error: {message}")  # one line, no usage block
    parser.add_argument("total_epochs", nargs="?", default=50, type=positive_int,
                        help="total epochs to train the model (default: 50)")
    parser.add_argument("save_every", nargs="?", default=10, type=positive_int,
                        help="save every this many epochs, and after the last (default: 10)")
    parser.add_argument("--batch_size", default=32, type=positive_int,
                        help="input batch size on each device (default: 32)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: a GPU when there is one, else the CPU")
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    if "LOCAL_RANK" not in os.environ:
        parser.error(f"launch with torchrun: see the commands at the top of {__file__}")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    try:
        with leaving_group_on_failure():  # a crash (a peer killed): torchrun restarts us all
            main(args)
    except (ValueError, SnapshotError, torch.distributed.DistNetworkError) as e:  # or a busy port
        sys.exit(f"error: {e}")
