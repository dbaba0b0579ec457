"""Pipeline parallelism (PP): the blocks split into stages on different ranks, micro-batches
flowing through them by a schedule of torch.distributed.pipelining; alone (pp), or under a
data-parallel flavour (ddp, zero, fsdp) with tp and cp inside each stage.

    stages = split(model, mesh, settings)      # parallel.parallelize: this rank's stages,
    model.pipeline = schedule(model, wrapped, mesh, settings, device)  # as the axes left them
    model.pipeline.forward_backward(micro_batches, scaler, mark)  # the trainer's step (runner)

The mesh is (pp, dp, cp, tp), pp outermost and tp innermost, as torchtitan orders it: rank
r = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank. So a TP group is tp consecutive
ranks, inside a node when tp divides the GPUs per node (TP all-reduces every block's
activations: it wants the fast links); a pipeline's stages are dp * cp * tp ranks apart, so PP
crosses nodes, which suits it:
a stage sends one activation per micro-batch to the next, point to point, nothing else.

What each rank holds. Each rank keeps the GPT that model.py builds, with every part owned by
another rank replaced by an nn.Identity (no parameters): its own blocks, the embeddings where
it runs the first stage, the final LayerNorm and the head where it runs the last. The names
of what it keeps are unchanged (`blocks.3.attn.c_attn.weight`), so every other layout, and
any other pp split, resumes a pipeline's snapshot, and it resumes theirs (DCP reshards by
name). The forward of a stage is `Stage.forward` below, the
GPT's own forward cut into pieces (model.py stays free of any of this).

The tied embedding. wte and lm_head share one weight. The first and the last stage both use
it, often on different ranks: both ranks hold it (under both names, as the whole model does),
and after backward its two gradients are summed over those two ranks (Megatron-LM's way), so
both copies take the same AdamW step and stay equal. The clip norm counts it once. An untied
head (gpt_config.untied_head) is two weights: the first stage holds wte, the last lm_head.

Stages per rank. gpipe and 1f1b: one stage per rank (stage s on pp rank s). The looped
schedules (interleaved_1f1b, looped_bfs, interleaved_zb): `pp_stages_per_rank` stages each,
stage s on pp rank s % pp. Blocks are split over the stages as evenly as possible (earlier
stages get the extra ones), or as `pp_split` gives them.

Micro-batches and gradient accumulation. A step is still grad_accum_steps x batch_size
sequences per data-parallel rank, as for every strategy (so runs compare with DDP's). Each of
the trainer's micro-steps is one round of the schedule: its batch_size sequences cut into
`microbatches` micro-batches that fill and drain the pipeline once. Every round pays the
bubble, (p - 1) / (m + p - 1) of each rank's time for 1f1b and gpipe (p stages, m
micro-batches), so raise microbatches, not grad_accum_steps, to shrink it (bench/README.md:
Pipeline bubble). Each micro-batch's mean loss is divided by grad_accum_steps x microbatches
before its backward: the arithmetic of a one-process run with that many micro-steps of
batch_size / microbatches sequences (tests/test_mingpt_pipeline.py holds them equal).

The rest of training. Evaluation runs the schedule forward only (`eval`), validation batches
padded to the training shape. Mixed precision: autocast around the rounds (bf16; fp16's loss
scaling would have to run inside the schedule, so it is refused), FSDP's policy under
fsdp_pp. Activation checkpointing and compile wrap each kept block, as elsewhere. The ranks
of one pipeline see the same data: data_parallel() reads the mesh's dp dimension. Sampling
needs the whole model: main.py reads the final snapshot into one GPT on rank 0. The mesh
order is checked rank by rank in tests/test_mingpt_pipeline.py (2 x 2 x 2 on 8 processes).
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

# pp_schedule -> torch's class. Single: one stage per rank; looped: several, stage s on rank
# s % pp. Left out: the V schedules (ScheduleZBVZeroBubble, ScheduleDualPipeV). They train
# here, but their forward-only eval() fails in torch 2.14.1 ("can't steal_bwd_input if this
# stage doesn't have backward"), and the trainer evaluates through the schedule.
# The classes by name: torch.distributed.pipelining is imported only by a run with pp (it
# imports torch._dynamo, about half a second of every other run's start, on every rank).
SINGLE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
LOOPED = {"interleaved_1f1b": "ScheduleInterleaved1F1B", "looped_bfs": "ScheduleLoopedBFS",
          "interleaved_zb": "ScheduleInterleavedZeroBubble"}
SCHEDULES = {**SINGLE, **LOOPED}


# --- the layout: pure functions --------------------------------------------------------------

def stages_per_rank(schedule: str, per_rank: int) -> int:
    """Stages each rank runs: 1 (gpipe, 1f1b), `per_rank` (the looped ones)."""
    return 1 if schedule in SINGLE else per_rank


def rank_of_stage(stage: int, pp: int) -> int:
    """The pp rank that runs `stage`: stage s on rank s, looping (s % pp) with more stages."""
    return stage % pp


def split_blocks(n_layer: int, n_stages: int, split: list[int] | None = None) -> list[range]:
    """The blocks of each stage: `split` (block counts), or as even as possible, the earlier
    stages taking the extra ones (the last also runs the head: the largest matmul with a real
    vocabulary). ValueError (one line) where they do not fit."""
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


# --- one stage's forward: the GPT's own, cut into pieces ---------------------------------------

class Stage(nn.Module):
    """The part of the GPT one stage runs: the embeddings (first stage), some blocks, the final
    LayerNorm and the head (last stage). It registers the GPT's own modules (shared, not
    copied), so the optimizer, the snapshot and this see the same parameters."""

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
        holds = _holds(gpt.config, first, last)
        if "wte" in holds:
            self.wte = gpt.wte
        if "lm_head" in holds:
            self.lm_head = gpt.lm_head
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
        if self.first and self.positions is not None:
            x = x[:, pos]  # (B, T / cp)
        x = self.layers(x, pos, None, self.first)  # (B, T, C): GPT.forward's, on this stage
        moe = [m for m in self.blocks.modules() if isinstance(m, MoE)]
        if moe and self.training and self.config.aux_loss_coef:
            # The experts' balancing loss never reaches the last stage's loss: its gradient
            # rides on this stage's output, with the weight GPT.forward gives it (a mean over
            # every block, divided by the step's micro-batches as _loss divides the loss).
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


# --- the schedule, and what the trainer calls ----------------------------------------------------

class Pipeline:
    """This rank's stages and their schedule; the trainer's entry points for pp.

    train_step runs one round (backward included); the gradients then need finish() (the
    tied weight's sum) before clipping. Losses come back on every rank of the pipeline
    (broadcast from the last stage), so each rank logs and checks the same numbers."""

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
        # scale_grads=False: _loss divides by the micro-batches itself, as the trainer's
        # gradient accumulation does (loss / n), so the arithmetic is the same.
        self.schedule = (cls(stages[0], microbatches, loss_fn=self._loss, scale_grads=False)
                         if schedule in SINGLE else
                         cls(stages, microbatches, loss_fn=self._loss, scale_grads=False))

    # --- the runner interface (runner.Runner's three methods), which the trainer calls ---------

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                         scaler: torch.amp.GradScaler, mark: Callable[[str], None]
                         ) -> list[tuple[torch.Tensor, int]]:
        """Each micro-step one round of the schedule over its `microbatches` micro-batches;
        every micro-batch's (loss, tokens), on every rank of the pipeline. (`scaler`: unused,
        config.py refuses fp16 under a pipeline.)"""
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
        """The norm over every stage's gradients (squares summed over the pipeline's ranks),
        the tied embedding counted once."""
        return clip_grad_norm_(self.params, max_norm, self.group, self.not_counted)

    def _time(self, stage) -> None:  # noqa: ANN001 (a pipelining.PipelineStage)
        """Mark the step timer's forward and backward around each chunk the schedule runs.

        A schedule interleaves the forward and backward of its micro-batches and waits for
        its neighbours in between: the time up to a chunk counts with the chunk before it
        (its sends and the wait for the next input), the time inside it as its own phase."""
        for name, phase in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                            ("backward_weight_one_chunk", "backward")):
            method = getattr(stage, name, None)
            if method is None:
                continue

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
        # The first stage keeps its own tokens of x (Stage.forward); the loss takes the
        # targets of the same positions.
        ys = [self._kept(c) for c in ys]
        return {"arg_mbs": [(c,) for c in xs] if self.has_first else None,
                "target_mbs": list(ys) if self.has_last else None}

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
        """After the last round: the tied weight's gradients summed, and averaged over the
        data-parallel ranks where no wrapper did (zero); the step's micro-batch losses (on
        every rank of the pipeline: broadcast from the last stage)."""
        if self.tied_group is not None and self.tied.grad is not None:
            grad = self.tied.grad
            # In place on the local shard (fsdp_pp: both ranks hold the same dp shard).
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad,
                            group=self.tied_group)
        if self.average is not None:
            self._average_grads()
        return self._broadcast(self.losses, self.scale)

    def _average_grads(self) -> None:
        """Every gradient of this rank's stages averaged over self.average in one all-reduce
        (DDP's arithmetic, one bucket: each divided by the ranks, then summed)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads]).div_(self.average.size())
        dist.all_reduce(flat, group=self.average)
        for grad, mean in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(mean.view_as(grad))

    def _broadcast(self, values: list[torch.Tensor], n: int) -> torch.Tensor:
        device = self.stages[0].device
        out = torch.stack(values).float() if self.has_last else torch.zeros(n, device=device)
        dist.broadcast(out, group=self.group, group_src=self.last_rank)
        return out

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, rows: int) -> tuple[torch.Tensor,
                                                                                torch.Tensor]:
        """(summed loss, tokens) of one validation batch on the last stage's rank, zeros on
        the others (so an all-reduce over every rank counts each pipeline once).

        The stages' buffers have the training micro-batch's shape: a shorter last batch is
        padded to `rows` sequences with targets -1, which cross_entropy ignores."""
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


# --- split and schedule: parallelize's two calls ------------------------------------------------

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
    """`model` trimmed to this rank's stages, and those stages (each one part for the other
    axes: parallelize applies TP and the data-parallel flavour to each)."""
    blocks, mine = _plan(model, mesh, s)
    n_stages = len(blocks)
    first, last = 0 in mine, n_stages - 1 in mine
    # Built whole (the same draws as every other layout), then trimmed: the weights equal
    # a one-process model's bit for bit; the whole model exists only while being built.
    _trim(model, {b for i in mine for b in blocks[i]}, first, last)
    return [Stage(model, blocks[i], i == 0, i == n_stages - 1) for i in mine]


def schedule(model: nn.Module, stages: list[nn.Module], mesh: DeviceMesh, s: Settings,
             device: torch.device, average: dist.ProcessGroup | None = None) -> Pipeline:
    """This rank's `stages` (as the other axes left them: FSDP roots, replicate, plain) in
    torch's PipelineStage and their schedule: the Pipeline the trainer runs (parallel.runner).
    `average`: the ranks over which the pipeline averages the gradients itself (zero.py)."""
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
    run, mingpt/dry_run.py), where the shapes cannot be learned from a first exchange; empty
    elsewhere (torch infers them in the first round). `fsdp2`: the stage is FSDP2's (fsdp, or
    ddp's replicate), which computes in `precision` (its mixed-precision policy)."""
    if dist.get_backend(group) != "fake":
        return {}
    rows, seq = s.batch_size // s.microbatches, config.block_size
    kept = seq // max(1, s.cp_size)  # cp: stages pass this rank's share of each sequence
    low = DTYPES[s.precision]
    # The residual stream, as a training stage sends it: with its gradient to come back (a
    # received input that did not require grad would keep no backward for its first op). In
    # `precision` where FSDP2 casts the weights and inputs; autocast alone (no FSDP2) leaves
    # the residual additions in fp32. The logits come from a matmul: `precision` either way.
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
    # fp16's GradScaler scales the loss the trainer backpropagates; here the schedule runs
    # backward from inside, on the last stage only.
    require(t.precision != "fp16", "trainer_config.precision",
            "fp32 or bf16 with pipeline parallelism (fp16's loss scaling would have to run "
            "inside the schedule)", t.precision)
