"""Pipeline parallelism (PP): the blocks split into stages on different ranks, micro-batches
flowing through them by a schedule of torch.distributed.pipelining; alone (pp), or under a
data-parallel flavour (ddp, zero, fsdp) with tp and cp inside each stage.

    stages = split(model, mesh, settings)      # parallel.parallelize: this rank's stages,
    model.pipeline = schedule(model, wrapped, mesh, settings, device)  # as the axes left them

Each rank keeps the GPT that model.py builds, every part another rank runs replaced by an
nn.Identity, so the names are unchanged and any layout resumes a pipeline's snapshot (DCP
reshards by name). The tied embedding (wte = lm_head) is held by the ranks of the first and the
last stage; its two gradients are summed over those two ranks (Megatron-LM's way), so both
copies take the same step. Each of the trainer's micro-steps is one round of the schedule over
`microbatches` micro-batches, each micro-batch's mean loss divided by grad_accum_steps x
microbatches: a one-process run's arithmetic. Each round pays the bubble, (p - 1) / (m + p - 1)
of a rank's time for 1f1b: raise microbatches, not grad_accum_steps (bench/README.md).
"""
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from mingpt.errors import require
from mingpt.model import GPT, AuxLossGrad, MoE
from mingpt.parallel.grads import clip_grad_norm_
from mingpt.parallel.layout import Settings
from mingpt.precision import DTYPES, autocast

# pp_schedule -> torch's class, by name: torch.distributed.pipelining imports torch._dynamo,
# so only a run with pp imports it. Left out: the V schedules (ScheduleZBVZeroBubble,
# ScheduleDualPipeV), whose forward-only eval() fails ("can't steal_bwd_input if this stage
# doesn't have backward"), and the trainer evaluates through the schedule.
SINGLE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
LOOPED = {"interleaved_1f1b": "ScheduleInterleaved1F1B", "looped_bfs": "ScheduleLoopedBFS",
          "interleaved_zb": "ScheduleInterleavedZeroBubble"}
SCHEDULES = {**SINGLE, **LOOPED}


def stages_per_rank(schedule: str, per_rank: int) -> int:
    return 1 if schedule in SINGLE else per_rank


def rank_of_stage(stage: int, pp: int) -> int:
    return stage % pp


def split_blocks(n_layer: int, n_stages: int, split: list[int] | None = None) -> list[range]:
    """The blocks of each stage: `split` (block counts), or as even as possible, the earlier
    stages taking the extra ones (the last runs the head). ValueError where they do not fit."""
    if split is None:
        if n_layer < n_stages:
            raise ValueError(f"pipeline parallelism over {n_stages} stages needs at least "
                             f"{n_stages} blocks (one per stage), got n_layer={n_layer}; use "
                             "fewer stages (pp_size, pp_stages_per_rank) or more layers")
        base, extra = divmod(n_layer, n_stages)
        split = [base + (s < extra) for s in range(n_stages)]
    elif len(split) != n_stages or sum(split) != n_layer or min(split) < 1:
        raise ValueError(f"trainer_config.pp_split={list(split)} must give {n_stages} stages "
                         f"at least one block each, {n_layer} blocks in all (n_layer)")
    starts = [sum(split[:s]) for s in range(n_stages)]
    return [range(start, start + count) for start, count in zip(starts, split, strict=True)]


class Stage(nn.Module):
    """The part of the GPT one stage runs (embeddings first, head last), registering the GPT's
    own modules: the optimizer, the snapshot and this see the same parameters."""

    # The positions of the tokens this rank computes, (seq_len, device) -> (T_kept,); None:
    # all of them. context.apply sets it where cp splits each sequence over ranks.
    positions: Callable[[int, torch.device], torch.Tensor] | None = None
    cp = 1  # ranks each sequence is split over: a later stage's T is the sequence's / cp
    # The GPT's own forward, run on the modules this stage registers (one forward, not two).
    layers, embed, head = GPT.layers, GPT.embed, GPT.head

    def __init__(self, gpt: nn.Module, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.config = gpt.config  # tensor.apply checks its heads and width per TP rank
        # Both halves of the tied weight, on either end: FSDP then shards the one tensor
        # once and sets it on both modules (a module it does not manage would keep the
        # unsharded tensor, and the snapshot a stale copy). Untied: each end its own.
        for name in ("wte", "lm_head"):
            if name in _holds(gpt.config, first, last):
                setattr(self, name, getattr(gpt, name))
        if first:
            self.wpe, self.drop = gpt.wpe, gpt.drop
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in blocks)
        self.aux_scale = 1.0  # 1 / micro-batches per step (Pipeline.start_step)
        if last:
            self.ln_f = gpt.ln_f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: token ids (B, T); others: the residual stream (B, T, C). Returns the
        residual stream (B, T, C), or the last stage's logits (B, T, vocab_size). Under cp,
        T is the kept tokens' count (T / cp) after the first stage."""
        # Every stage knows its tokens' positions (rotary turns q and k by them in each block).
        seq_len = x.size(1) if self.first else x.size(1) * self.cp  # the whole sequence's
        if self.positions is None:
            pos = torch.arange(seq_len, dtype=torch.long, device=x.device)  # (T,)
        else:  # this cp rank's tokens only, at their places in the sequence
            pos = self.positions(seq_len, x.device)  # (T / cp,)
            x = x[:, pos] if self.first else x  # (B, T / cp) on the first stage
        x = self.layers(x, pos, None, self.first)  # (B, T, C): GPT.forward's, on this stage
        moe = [m for m in self.blocks.modules() if isinstance(m, MoE)]
        if moe and self.training and self.config.aux_loss_coef:
            # The balancing loss never reaches the last stage's loss: its gradient rides on this
            # stage's output, weighted as GPT.forward weighs it (aux_scale: / micro-batches).
            aux = torch.stack([m.aux_loss for m in moe]).sum()
            x = AuxLossGrad.apply(x, aux, self.config.aux_loss_coef / self.config.n_layer
                                  * self.aux_scale)
        return self.head(x) if self.last else x  # (B, T, vocab_size) or (B, T, C)


def _holds(config, first: bool, last: bool) -> set[str]:
    """Which of wte and lm_head a rank with the first and/or the last stage holds: both on
    either end where they are one tied weight; else the first wte, the last lm_head."""
    tied = not config.untied_head
    return {name for name, on in (("wte", first or (last and tied)),
                                  ("lm_head", last or (first and tied))) if on}


def _trim(gpt: nn.Module, owned: set[int], first: bool, last: bool) -> None:
    """Replace whatever other ranks run with nn.Identity: no parameters, the names kept."""
    for i in range(len(gpt.blocks)):
        if i not in owned:
            gpt.blocks[i] = nn.Identity()
    if not first and gpt.wpe is not None:
        gpt.wpe = nn.Identity()
    if not last:
        gpt.ln_f = nn.Identity()
    for name in {"wte", "lm_head"} - _holds(gpt.config, first, last):
        setattr(gpt, name, nn.Identity())


class Pipeline:
    """This rank's stages and their schedule: the trainer's step under pp (runner.Runner's three
    methods). Losses come back on every rank of the pipeline, so each logs the same numbers."""

    def __init__(self, stages: list, schedule: str, microbatches: int,
                 mesh: DeviceMesh, last_rank: int, tied: torch.nn.Parameter | None,
                 tied_group: dist.ProcessGroup | None, tied_counted: bool,
                 params: list[torch.nn.Parameter], precision: str = "fp32",
                 average: dist.ProcessGroup | None = None) -> None:
        self.stages, self.microbatches, self.mesh = stages, microbatches, mesh
        # zero: plain stages, whose gradients this averages over these data-parallel ranks.
        self.average = average if average is not None and average.size() > 1 else None
        self.params, self.precision = params, precision  # this rank's, in the GPT's order
        self.group = mesh["pp"].get_group()
        self.last_rank = last_rank  # the pp rank of the last stage
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self.positions = stages[0].submod.positions  # cp: the tokens this rank keeps
        self.tied, self.tied_group = tied, tied_group
        # The tied weight's gradient lives on two ranks: the clip norm counts one of them.
        self.not_counted = set() if tied_counted or tied is None else {id(tied)}
        self.scale = 1  # micro-batches per optimizer step: each loss is divided by it
        self.evaluating = False
        self.losses: list[torch.Tensor] = []  # this step's per-micro-batch means (last stage)
        self.mark: Callable[[str], None] | None = None  # the step timer's, while training
        self.last_phase = "forward"
        for stage in stages:
            self._time(stage)
        from torch.distributed import pipelining  # noqa: PLC0415 (runs with pp only: SINGLE)
        cls = getattr(pipelining, SCHEDULES[schedule])
        # scale_grads=False: _loss divides by the micro-batches itself, as the trainer does.
        self.schedule = cls(stages[0] if schedule in SINGLE else stages, microbatches,
                            loss_fn=self._loss, scale_grads=False)

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                         scaler: torch.amp.GradScaler, mark: Callable[[str], None]
                         ) -> list[tuple[torch.Tensor, int]]:
        """One round of the schedule per micro-step; every micro-batch's (loss, tokens), on
        every rank of the pipeline (`scaler`: unused, config.py refuses fp16 under a pipeline)."""
        self.mark, self.last_phase = mark, "forward"
        try:
            self.start_step(len(micro_batches))
            device = self.stages[0].device
            for x, y in micro_batches:
                with autocast(device, self.precision):
                    self.train_step(x.to(device), y.to(device))
            losses = self.finish_step()  # from the last stage, on every rank
            mark("backward")  # the tied sum and the broadcast close the backward part
        finally:
            self.mark = None
        tokens = micro_batches[0][0].numel() // self.microbatches
        return [(loss, tokens) for loss in losses]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The norm over every stage's gradients on the pipeline's ranks, the tied weight once."""
        return clip_grad_norm_(self.params, max_norm, self.group, self.not_counted)

    def _time(self, stage) -> None:  # noqa: ANN001 (a pipelining.PipelineStage)
        """Mark the step timer's forward and backward around each chunk the schedule runs: the
        time up to a chunk (its sends, the wait for the next input) counts with the chunk
        before it, the time inside it as its own phase."""
        for name, phase in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                            ("backward_weight_one_chunk", "backward")):
            method = getattr(stage, name)

            def timed(*args, _method=method, _phase=phase, **kwargs):
                if self.mark is not None:
                    self.mark(self.last_phase)
                out = _method(*args, **kwargs)
                if self.mark is not None:
                    self.mark(_phase)
                    self.last_phase = _phase
                return out
            setattr(stage, name, timed)  # the schedules call it on the stage object

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The schedule's loss on the last stage: the mean cross-entropy of one micro-batch
        (as GPT.forward), divided by the step's micro-batches; in evaluation the sum."""
        flat = logits.view(-1, logits.size(-1)), y.view(-1)
        if self.evaluating:  # padded rows (-1) add nothing; the caller divides by the tokens
            loss = F.cross_entropy(*flat, ignore_index=-1, reduction="sum")
            self.losses.append(loss.detach().float())
            return loss
        loss = F.cross_entropy(*flat, ignore_index=-1)
        self.losses.append(loss.detach())
        return loss / self.scale

    def _chunks(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        """The round's inputs, pre-split into micro-batches for the stages this rank runs."""
        # Consecutive rows: micro-batch i is what a one-process run's micro-step i would see.
        xs, ys = x.tensor_split(self.microbatches), y.tensor_split(self.microbatches)
        # The first stage keeps its own tokens of x (Stage.forward); the loss, their targets.
        return {"arg_mbs": [(c,) for c in xs] if self.has_first else None,
                "target_mbs": [self._kept(c) for c in ys] if self.has_last else None}

    def _kept(self, y: torch.Tensor) -> torch.Tensor:
        """The targets of the tokens this rank computes: all, or cp's share (B, T / cp)."""
        return y if self.positions is None else y[:, self.positions(y.size(1), y.device)]

    def start_step(self, rounds: int) -> None:
        """Before a step of `rounds` rounds (the trainer's grad_accum_steps)."""
        self.scale, self.losses = rounds * self.microbatches, []
        for stage in self.stages:
            stage.submod.aux_scale = 1.0 / self.scale

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One round: forward and backward of `microbatches` micro-batches of (x, y)."""
        self._keep_last_losses(self.schedule.step, **self._chunks(x, y), return_outputs=False)

    def _keep_last_losses(self, run, **kwargs) -> None:
        """run(**kwargs), keeping the losses of its last `microbatches` calls of the loss: a
        stage's first round calls it once more, to infer the shapes of what it sends."""
        before = len(self.losses)
        run(**kwargs)
        if self.has_last:
            self.losses[before:] = self.losses[-self.microbatches:]

    def finish_step(self) -> torch.Tensor:
        """After the last round: the tied weight's gradients summed (and all averaged where no
        wrapper did: zero); the step's micro-batch losses, broadcast from the last stage."""
        if self.tied_group is not None and self.tied.grad is not None:
            grad = self.tied.grad
            # In place on the local shard (fsdp_pp: both ranks hold the same dp shard).
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad,
                            group=self.tied_group)
        if self.average is not None:
            self._average_grads()
        losses = (torch.stack(self.losses).float() if self.has_last
                  else torch.zeros(self.scale, device=self.stages[0].device))
        dist.broadcast(losses, group=self.group, group_src=self.last_rank)
        return losses

    def _average_grads(self) -> None:
        """Every gradient of this rank's stages averaged over self.average in one all-reduce
        (DDP's arithmetic, one bucket: each divided by the ranks, then summed)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads]).div_(self.average.size())
        dist.all_reduce(flat, group=self.average)
        for grad, mean in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(mean.view_as(grad))

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, rows: int) -> tuple[torch.Tensor,
                                                                                torch.Tensor]:
        """(summed loss, tokens) of one validation batch on the last stage's rank, zeros on
        the others (so an all-reduce over every rank counts each pipeline once). The stages'
        buffers have the training shape: a shorter batch is padded to `rows`, targets -1."""
        pad = rows - x.size(0)
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.size(1))])
            y = torch.cat([y, y.new_full((pad, y.size(1)), -1)])
        self.evaluating, self.losses = True, []
        try:
            with autocast(x.device, self.precision):
                self._keep_last_losses(self.schedule.eval, **self._chunks(x, y))
        finally:
            self.evaluating = False
        if not self.has_last:
            zero = torch.zeros((), device=x.device)
            return zero, zero
        return torch.stack(self.losses).sum(), (self._kept(y) != -1).sum().float()


def _tied_group(mesh: DeviceMesh, first_rank: int, last_rank: int) -> dist.ProcessGroup | None:
    """The group of the two ranks that hold the tied weight (first and last stage) at this
    rank's place on the other axes; None where one rank holds both. Every rank creates every
    group (new_group is collective), in the same order."""
    if first_rank == last_rank:
        return None
    ranks = mesh.mesh.reshape(mesh["pp"].size(), -1)  # (pp, every other axis) global ranks
    mine = None
    for place in range(ranks.size(1)):
        pair = [int(ranks[first_rank, place]), int(ranks[last_rank, place])]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine


def _plan(model: nn.Module, mesh: DeviceMesh, s: Settings) -> tuple[list[range], list[int]]:
    """(blocks of every stage, the stages this rank runs)."""
    pp, pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    n_stages = pp * stages_per_rank(s.pp_schedule, s.pp_stages_per_rank)
    blocks = split_blocks(model.config.n_layer, n_stages, s.pp_split)
    return blocks, [i for i in range(n_stages) if rank_of_stage(i, pp) == pp_rank]


def split(model: nn.Module, mesh: DeviceMesh, s: Settings) -> list[Stage]:
    """`model` trimmed to this rank's stages, and those stages (each a part for the other axes)."""
    blocks, mine = _plan(model, mesh, s)
    first, last = 0 in mine, len(blocks) - 1 in mine
    # Built whole (the same draws as every other layout), then trimmed: the weights equal
    # a one-process model's bit for bit; the whole model exists only while being built.
    _trim(model, {b for i in mine for b in blocks[i]}, first, last)
    return [Stage(model, blocks[i], i == 0, i == len(blocks) - 1) for i in mine]


def schedule(model: nn.Module, stages: list[nn.Module], mesh: DeviceMesh, s: Settings,
             device: torch.device, average: dist.ProcessGroup | None = None) -> Pipeline:
    """This rank's `stages`, as the other axes left them, in torch's PipelineStage and their
    schedule; `average`: the ranks over which it averages the gradients itself (zero.py)."""
    blocks, mine = _plan(model, mesh, s)
    n_stages, pp = len(blocks), mesh["pp"].size()
    first, last = 0 in mine, n_stages - 1 in mine
    group = mesh["pp"].get_group()
    from torch.distributed import pipelining  # noqa: PLC0415 (runs with pp only: SINGLE)
    pipeline_stages = [pipelining.PipelineStage(stage, i, n_stages, device, group=group,
                                     **_static_shapes(model.config, s, i, n_stages, group,
                                                      isinstance(stage, FSDPModule)))
                       for stage, i in zip(stages, mine, strict=True)]
    last_rank = rank_of_stage(n_stages - 1, pp)
    tied = not model.config.untied_head  # every rank alike: _tied_group is collective
    tied_group = _tied_group(mesh, 0, last_rank) if tied else None
    return Pipeline(pipeline_stages, s.pp_schedule, s.microbatches, mesh, last_rank,
                    model.wte.weight if tied and (first or last) else None, tied_group,
                    tied_counted=first, params=list(model.parameters()), precision=s.precision,
                    average=average)


def _static_shapes(config, s: Settings, stage: int, n_stages: int,
                   group: dist.ProcessGroup, fsdp2: bool) -> dict:
    """What a stage receives and sends, given up front on torch's fake process group (the dry
    run), where no first exchange can tell the shapes; empty elsewhere. `fsdp2`: the stage is
    FSDP2's (fsdp, or ddp's replicate), which computes in `precision`."""
    if dist.get_backend(group) != "fake":
        return {}
    rows, seq = s.batch_size // s.microbatches, config.block_size
    kept = seq // max(1, s.cp_size)  # cp: stages pass this rank's share of each sequence
    low = DTYPES[s.precision]
    # The residual stream with its gradient to come back (a received input that did not
    # require grad would keep no backward for its first op); in fp32 unless FSDP2 casts the
    # inputs (autocast keeps the residual additions in fp32). The logits: `precision` always.
    stream = torch.empty(rows, kept, config.n_embd, device="meta", requires_grad=True,
                         dtype=low if fsdp2 else torch.float32)
    inputs = torch.empty(rows, seq, dtype=torch.long, device="meta") if stage == 0 else stream
    outputs = torch.empty(rows, kept, config.vocab_size, device="meta", requires_grad=True,
                          dtype=low) if stage == n_stages - 1 else stream
    # The gradients that flow back: of the stream it sent, of the stream it received.
    return {"input_args": (inputs,), "output_args": (outputs,),
            "output_grads": (None if stage == n_stages - 1 else stream,),
            "input_grads": (None if stage == 0 else stream,)}


def check_config(t: DictConfig) -> None:
    """The pipeline's own rules, one line each (config.validate calls it for pp methods)."""
    require(t.pp_schedule in SCHEDULES, "trainer_config.pp_schedule",
            f"one of {', '.join(SCHEDULES)}", t.pp_schedule)
    require(t.distributed_method != "fsdp_tp_pp" or t.tp_size >= 1, "trainer_config.tp_size",
            ">= 1 with fsdp_tp_pp (processes per TP group inside each stage)", t.tp_size)
    require(t.microbatches >= 1 and t.batch_size % t.microbatches == 0,
            "trainer_config.microbatches", f"a divisor of batch_size ({t.batch_size}): each "
            "micro-step's batch is cut into that many micro-batches", t.microbatches)
    require(t.pp_stages_per_rank >= 2 or t.pp_schedule not in LOOPED,
            "trainer_config.pp_stages_per_rank", f">= 2 with pp_schedule={t.pp_schedule}",
            t.pp_stages_per_rank)
    require(t.precision != "fp16", "trainer_config.precision",
            "fp32 or bf16 with pipeline parallelism (fp16's loss scaling would have to run "
            "inside the schedule)", t.precision)
