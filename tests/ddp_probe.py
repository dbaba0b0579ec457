"""Run one step's own training code under torchrun, then dump what each rank ended up with.

    torchrun --standalone --nproc_per_node=2 tests/ddp_probe.py STEP_DIR OUT_DIR [train.py args]

The step's `Trainer.train` is wrapped so that, after the real training loop, every rank saves
its final weights to OUT_DIR/rank<R>.pt; `atomic_save` is wrapped to record which ranks write.
Everything else is the step's unchanged code path.
"""
import inspect
import os
import sys
from pathlib import Path

import torch

step_dir, out_dir, argv = Path(sys.argv[1]).resolve(), Path(sys.argv[2]), sys.argv[3:]
sys.path.insert(0, str(step_dir))
import train  # noqa: E402  (the step's own train.py)

real_train, real_save = train.Trainer.train, train.atomic_save


def train_and_dump(self, max_epochs: int) -> None:
    real_train(self, max_epochs)
    torch.save(self.model.module.state_dict(), out_dir / f"rank{self.rank}.pt")


def recording_save(obj, path) -> None:
    (out_dir / f"writer_rank{os.environ['RANK']}").touch()
    real_save(obj, path)


train.Trainer.train, train.atomic_save = train_and_dump, recording_save
args = train.parse_args(argv)
if len(inspect.signature(train.main).parameters) == 3:  # step 02: main(rank, world_size, args)
    train.main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
else:
    train.main(args)
