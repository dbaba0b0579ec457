"""Step 01: train a small model on one device (a GPU if there is one, else the CPU).

    python 01_single_gpu/train.py              # 50 epochs, checkpoint every 10
    python 01_single_gpu/train.py 20 5 --batch_size 64 --device cpu
"""
import argparse
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from datautils import MyTrainDataset
from devices import pick_device
from snapshot import atomic_save


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        save_every: int,
        checkpoint_path: str,
    ) -> None:
        self.device = device
        # .to() moves the parameters in place, so the optimizer built before still holds them.
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.checkpoint_path = checkpoint_path

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad()  # backward() adds to .grad: clear the last batch's gradients
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.detach()  # without its graph: the running sum must not keep it alive

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        # Sum losses on the device; one host sync per epoch instead of one per batch.
        loss_sum = torch.zeros((), device=self.device)
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            loss_sum += self._run_batch(source, targets)
        loss = loss_sum.item() / len(self.train_data)
        print(f"[{self.device}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)} | Loss: {loss:.4f}")

    def _save_checkpoint(self, epoch: int) -> None:
        atomic_save(self.model.state_dict(), self.checkpoint_path)
        print(f"Epoch {epoch} | Training checkpoint saved at {self.checkpoint_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            # Save every `save_every` epochs and after the last one.
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save_checkpoint(epoch)


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
        shuffle=True,  # a new order every epoch, drawn from the generator below
        generator=torch.Generator().manual_seed(0),  # seeded, never the global RNG: repeatable
    )


def main(args: argparse.Namespace) -> None:
    torch.manual_seed(0)  # the same initial weights on every run
    device = pick_device(0, args.device)
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, args.batch_size)
    trainer = Trainer(model, train_data, optimizer, device, args.save_every, args.checkpoint_path)
    trainer.train(args.total_epochs)


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
    parser.add_argument("--checkpoint_path", default="checkpoint.pt")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    try:
        main(args)
    except ValueError as e:  # bad input found after parsing (--device cuda without a GPU)
        sys.exit(f"error: {e}")
