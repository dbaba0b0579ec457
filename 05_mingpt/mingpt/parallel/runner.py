"""The step of every layout without a pipeline: a forward and a backward per micro-batch.

The trainer calls its three methods (forward_backward, clip_grad_norm, evaluate) and nothing
else of a layout, so it has one loop for all of them; pipeline.Pipeline is the other runner.
"""
from collections.abc import Callable

import torch
from torch import nn

from mingpt.parallel.grads import clip_grad_norm_, set_grad_sync
from mingpt.precision import autocast


class Runner:
    """Gradient accumulation over micro-batches, with the data-parallel gradient sync only in
    the last one's backward (set_grad_sync: DDP's no_sync, FSDP's switch)."""

    def __init__(self, model: nn.Module, device: torch.device, precision: str) -> None:
        self.model, self.device, self.precision = model, device, precision

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                         scaler: torch.amp.GradScaler, mark: Callable[[str], None]
                         ) -> list[tuple[torch.Tensor, int]]:
        """Forward and backward of each micro-batch, gradients averaged over them; each
        micro-batch's (loss, tokens). `mark(phase)` times the step's phases (StepTimer)."""
        n, out = len(micro_batches), []
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            # Gradients are all-reduced only in the last micro-step's backward; the others
            # just accumulate locally.
            with set_grad_sync(self.model, sync=i == n - 1):
                with autocast(self.device, self.precision):
                    _, loss = self.model(x, y)
                    loss = loss.mean()  # nn.DataParallel returns one loss per GPU
                mark("forward")
                scaler.scale(loss / n).backward()  # mean over the micro-steps
                mark("backward")
            out.append((loss.detach(), x.numel()))
        return out

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` over every gradient, wherever its shards live (grads.py)."""
        return clip_grad_norm_(self.model.parameters(), max_norm)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, rows: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, tokens) of one validation batch on this rank (`rows`: the training
        batch's, which only a pipeline's fixed buffers need)."""
        with autocast(self.device, self.precision):
            _, loss = self.model(x, y)
            loss = loss.mean()  # nn.DataParallel: one loss per GPU
        return loss.float() * y.numel(), torch.tensor(float(y.numel()), device=self.device)
