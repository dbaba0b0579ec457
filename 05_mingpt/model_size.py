"""How big is each GPT preset: parameters, training FLOPs per token, and snapshot size on disk;
with --memory, what one rank holds in training under each strategy.

    python model_size.py                      # every preset, GPT-2 vocabulary and context
    python model_size.py --preset gpt2-xl     # one preset
    python model_size.py --vocab_size 65 --block_size 256
    python model_size.py --memory --preset gpt2-medium --vocab_size 65 --block_size 256 \
        --world_size 2 --tp_size 2 --batch_size 4   # per-rank bytes: ddp, zero, fsdp, tp, fsdp_tp
    python model_size.py --memory --preset gpt-mini --block_size 2048 --cp_size 4  # and cp
    python model_size.py --memory --preset gpt-micro-moe --vocab_size 65 --world_size 4
        # and a MoE preset's expert parameters per rank under each ep_size (MOE.md)

The models are built on the `meta` device: modules get shapes but no storage, so counting the
parameters of the 1.5B-parameter gpt2-xl takes no memory and no time. The memory predictions
are formulas over those shapes (how each strategy splits each parameter), so they do not
depend on mingpt/parallel/; tests/test_mingpt_memory.py compares them with the local shards of
real runs, and bench/bench_memory.py with measured peaks.
"""
import argparse
import math
import sys

import torch

from mingpt.model import GPT, PRESETS, GPTConfig
from mingpt.parallel import STRATEGIES as REGISTRY
from mingpt.parallel import pipeline

# Bytes per parameter. A training snapshot keeps fp32 weights plus AdamW's two fp32 moments
# (exp_avg, exp_avg_sq): 3 x 4 bytes. Mixed precision does not change this: the optimizer
# still updates fp32 master weights.
BYTES_TRAIN_SNAPSHOT = 12
BYTES_FP32 = 4
BYTES_BF16 = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one `error: ...` line instead of usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)  # argparse's code for a usage error; a bad model config exits 1


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description="Parameter count and snapshot size of the GPT presets.")
    parser.add_argument("--vocab_size", type=positive_int, default=50257,
                        help="vocabulary size (default: GPT-2's BPE, 50257)")
    parser.add_argument("--block_size", type=positive_int, default=1024,
                        help="context length (default: 1024)")
    parser.add_argument("--preset", default=None,
                        help=f"show one preset only: {', '.join(PRESETS)}")
    parser.add_argument("--memory", action="store_true",
                        help="per-rank training memory of each strategy instead")
    parser.add_argument("--world_size", type=positive_int, default=2,
                        help="--memory: number of ranks (default: 2)")
    parser.add_argument("--tp_size", type=positive_int, default=2,
                        help="--memory: tensor-parallel group size for tp, fsdp_tp (default: 2)")
    parser.add_argument("--pp_size", type=positive_int, default=2,
                        help="--memory: ranks per pipeline for pp, fsdp_pp, fsdp_tp_pp "
                        "(default: 2; one stage each, 1f1b, microbatches 4)")
    parser.add_argument("--batch_size", type=positive_int, default=4,
                        help="--memory: sequences per rank per micro-step (default: 4)")
    parser.add_argument("--cp_size", type=positive_int, default=2,
                        help="--memory: largest context-parallel group to show (default: 2)")
    args = parser.parse_args(argv)
    if args.memory and args.world_size % args.tp_size:
        parser.error(f"--world_size {args.world_size} must be divisible by --tp_size "
                     f"{args.tp_size}")
    # Checked here rather than with `choices=` so the message lists the presets on one line.
    if args.preset is not None and args.preset not in PRESETS:
        parser.error(f"unknown preset {args.preset!r}; allowed: {', '.join(PRESETS)}")
    return args


def build_on_meta(preset: str, vocab_size: int, block_size: int) -> GPT:
    """The real GPT module for a preset, with meta tensors (shapes only, no memory)."""
    config = GPTConfig(model_type=preset, vocab_size=vocab_size, block_size=block_size)
    # Every tensor created inside this block lands on `meta`; init calls (normal_) are no-ops.
    with torch.device("meta"):
        return GPT(config)


def human_count(n: float) -> str:
    """1234567 -> '1.23M' (k, M, B: thousand, million, billion)."""
    for suffix, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"


def human_bytes(n: float) -> str:
    """1610612736 -> '1.50 GiB' (binary prefixes, as file managers and `du -h` use)."""
    for prefix in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {prefix}" if prefix == "B" else f"{n:.2f} {prefix}"
        n /= 1024
    return f"{n:.2f} TiB"


def size_row(preset: str, vocab_size: int, block_size: int) -> dict[str, object]:
    """One table row: shape of the preset, parameter counts, FLOPs/token and sizes in bytes."""
    # Count from the module itself, not a formula: the table cannot drift from model.py.
    model = build_on_meta(preset, vocab_size, block_size)
    cfg, n_params = model.config, model.num_params()
    return {
        "preset": preset,
        "L/H/C": f"{cfg.n_layer}/{cfg.n_head}/{cfg.n_embd}",
        "params": f"{n_params:,}",
        "non-emb": human_count(model.num_params(non_embedding=True)),
        # A MoE model computes each token with expert_top_k of its experts (model.py).
        "active": human_count(model.num_active_params()),
        "GFLOP/tok": f"{model.flops_per_token() / 1e9:.3f}",
        # bf16: what a bf16 copy for inference needs; fp32: the master weights training keeps.
        "bf16": human_bytes(n_params * BYTES_BF16),
        "fp32": human_bytes(n_params * BYTES_FP32),
        "train snapshot": human_bytes(n_params * BYTES_TRAIN_SNAPSHOT),
    }


def print_table(rows: list[dict[str, object]]) -> None:
    """Print rows as aligned columns: text left, numbers right."""
    headers = list(rows[0])  # dicts keep insertion order: columns as size_row lists them
    widths = [max(len(h), *(len(str(row[h])) for row in rows)) for h in headers]

    def line(cells: list[object]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    print(line(headers))
    print(line(["-" * w for w in widths]))
    for row in rows:
        print(line([row[h] for h in headers]))


# --- per-rank training memory, per strategy (--memory) ----------------------------------------

# The strategies whose memory split the registry describes (parallel.STRATEGIES, `memory`).
MEMORY = {name: s for name, s in REGISTRY.items() if s.memory is not None}
# How tensor parallelism splits a block's weights (mingpt/parallel/tensor.py, Megatron's layout):
# q/k/v and the MLP's widening matmul column-wise (dim 0 of an nn.Linear weight, and its
# bias), both output projections row-wise (dim 1; their biases stay whole). Every other
# parameter (embeddings, LayerNorms, the tied lm_head) is whole on every rank.
TP_DIM = {"attn.c_attn.weight": 0, "attn.c_attn.bias": 0, "mlp.c_fc.weight": 0,
          "mlp.c_fc.bias": 0, "attn.c_proj.weight": 1, "mlp.c_proj.weight": 1}


def chunk(n: int, parts: int, index: int) -> int:
    """Length of part `index` of n cut by torch.chunk, as FSDP2 and DTensor's Shard cut: parts
    of ceil(n / parts), the last one shorter (FSDP pads it for its collectives), maybe empty."""
    size = -(-n // parts)  # ceil(n / parts), in integers
    # Part `index` starts at index * size; parts past the end are empty, not negative.
    return max(0, min(n, (index + 1) * size) - index * size)


def local_shape(name: str, shape: tuple[int, ...], strategy: str, world_size: int,
                tp_size: int, rank: int, ep_size: int = 1) -> tuple[int, ...]:
    """The shape of parameter `name` that `rank` stores under `strategy` (with `ep_size`:
    each MoE block's experts split over groups of ep_size consecutive dp ranks, expert.py)."""
    shape, s = list(shape), MEMORY[strategy]
    dp_rank, tp_rank = divmod(rank, tp_size)  # a (dp, tp) mesh: TP groups are neighbours
    if s.tp:
        dim = next((d for suffix, d in TP_DIM.items() if name.endswith(suffix)), None)
        if dim is not None:
            shape[dim] = chunk(shape[dim], tp_size, tp_rank)
    ep = ep_size if ".mlp.experts." in name else 1
    edp_rank, ep_rank = divmod(dp_rank, ep)  # dp = edp x ep
    shape[0] = chunk(shape[0], ep, ep_rank)  # the experts (dim 0) over the ep group
    # FSDP shards dim 0 of what is left over the ranks that hold the same part: every rank
    # (fsdp), the dp ranks (fsdp_tp and the pipelines), each over ep fewer for the experts.
    if s.memory.shards_over == "world":  # fsdp: dim 0 over all ranks
        shape[0] = chunk(shape[0], world_size // ep, rank // ep)
    if s.memory.shards_over == "dp":  # fsdp_tp: TP inside, then dim 0 of the TP shard over dp
        shape[0] = chunk(shape[0], world_size // tp_size // ep, edp_rank)
    return tuple(shape)


def pipeline_holds(model: GPT, pp_size: int, pp_rank: int, stages_per_rank: int = 1
                   ) -> set[str]:
    """The parameter names pipeline rank `pp_rank` holds (pipeline.py's layout: blocks split
    as evenly as possible over pp_size x stages_per_rank stages, stage s on rank s % pp_size;
    the embeddings with the first stage, the final LayerNorm and the tied head with the last)."""
    n_stages = pp_size * stages_per_rank
    blocks = pipeline.split_blocks(model.config.n_layer, n_stages)
    mine = [s for s in range(n_stages) if pipeline.rank_of_stage(s, pp_size) == pp_rank]
    first, last = 0 in mine, n_stages - 1 in mine
    owned = {f"blocks.{b}." for s in mine for b in blocks[s]}
    held = set()
    for name, _ in model.named_parameters():  # the tied wte/lm_head weight as "wte.weight"
        if any(name.startswith(prefix) for prefix in owned) or \
                (name.startswith("wpe.") and first) or (name.startswith("ln_f.") and last) or \
                (name.startswith("wte.") and (first or last)):
            held.add(name)
    return held


def zero_partition(model: GPT, world_size: int) -> list[set[str]]:
    """Which parameters' optimizer state each rank keeps under ZeroRedundancyOptimizer.

    Its rule: group by group (optim_groups: decayed, then not), largest parameter first, each
    to the rank with the fewest elements so far. Whole parameters, so the split is uneven.
    """
    names = {id(p): name for name, p in model.named_parameters()}
    owned: list[set[str]] = [set() for _ in range(world_size)]
    sizes = [0] * world_size  # elements owned so far, per rank, over all groups
    # The groups main.py builds (the weight-decay value does not matter, only the grouping).
    for group in model.optim_groups(weight_decay=0.1):
        # sorted() is stable: equal sizes keep the model's order, as in ZeRO's own sort.
        for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            rank = sizes.index(min(sizes))  # the first of the least-loaded ranks
            owned[rank].add(names[id(p)])
            sizes[rank] += p.numel()
    return owned


def activation_bytes(model: GPT, batch_size: int, tp_size: int = 1) -> int:
    """A rough estimate of what autograd keeps for backward in one fp32 micro-step.

    Per block and token: 16 fp32 vectors of width C (LayerNorm inputs and outputs, q/k/v,
    attention output, MLP hidden before and after GELU; 12 of them split by TP) and two 1-byte
    dropout masks; attention on the math path (dropout during training) keeps probabilities,
    mask and dropped probabilities per head: 9 bytes x T x T. Outside the blocks: embeddings,
    final LayerNorm, and the logits plus cross-entropy's log-softmax (8 bytes x vocab).
    """
    cfg = model.config
    # TP splits the heads (and the MLP's hidden width) but every rank sees the whole batch.
    tokens, seq, heads = batch_size * cfg.block_size, cfg.block_size, cfg.n_head // tp_size
    block = 4 * tokens * cfg.n_embd * (4 + 12 / tp_size) + 2 * tokens * cfg.n_embd \
        + 9 * batch_size * heads * seq * seq
    outside = 17 * tokens * cfg.n_embd + 8 * tokens * cfg.vocab_size
    return int(cfg.n_layer * block + outside)


def flash_activation_bytes(model: GPT, batch_size: int, cp_size: int = 1) -> int:
    """What autograd keeps for backward in one fp32 micro-step without dropout, per rank, when
    each rank holds 1/cp_size of every sequence (context parallelism; cp_size 1: none).

    Without dropout, attention runs in a flash kernel (no T x T matrix): it keeps q, k, v, its
    output and one fp32 log-sum-exp per head and token. Per block and local token, 16 fp32
    vectors of width C: the LayerNorms' inputs and outputs (4), q/k/v (3), attention's output
    (1), the MLP's hidden layer before and after GELU (8); and two LayerNorms' mean and rstd
    (4 floats). Under cp the ring's merged output is a fresh tensor that the head transpose
    copies once more for c_proj: one vector more. Outside the blocks: token ids and targets
    (int64), positions, the final LayerNorm's input, output and statistics, cross-entropy's
    log-softmax over the vocabulary and its scalar total weight. Every term scales with the
    local tokens, so the whole falls as 1/cp_size; tests/test_mingpt_context.py counts the
    real tensors.
    """
    cfg = model.config
    seq = cfg.block_size // cp_size  # the positions each rank keeps
    tokens = batch_size * seq
    vectors = 16 + (1 if cp_size > 1 else 0)
    block = BYTES_FP32 * tokens * (vectors * cfg.n_embd + 4 + cfg.n_head)
    outside = 8 * (2 * tokens + seq) + BYTES_FP32 * tokens * (2 * cfg.n_embd + 2
                                                              + cfg.vocab_size)
    return cfg.n_layer * block + outside + BYTES_FP32


def buffer_bytes(model: GPT, strategy: str, tp_size: int) -> int:
    """Communication and gathering buffers besides the model state (fp32).

    DDP (and ZeRO, which is DDP plus a sharded optimizer) keeps every gradient a second time in
    its all-reduce buckets. FSDP gathers the root (embeddings, last LayerNorm: whole for the
    whole step), the running block and the prefetched next one, and one block's unsharded
    gradient before its reduce-scatter. TP moves activations only.
    """
    total = model.num_params()
    # All blocks are the same size: FSDP's units are the blocks, plus the root's leftovers.
    block = sum(p.numel() for p in model.blocks[0].parameters())
    s = MEMORY[strategy]
    if s.pipeline and s.memory.buffers == "gathers":  # FSDP over the stage's own blocks only
        return BYTES_FP32 * 3 * block // (tp_size if s.tp else 1)
    if s.memory.buffers == "buckets":
        return BYTES_FP32 * total
    if s.memory.buffers == "gathers":
        root = total - model.config.n_layer * block
        return BYTES_FP32 * (root + 3 * block // (tp_size if s.tp else 1))
    return 0


def memory_row(model: GPT, strategy: str, world_size: int, tp_size: int, batch_size: int,
               rank: int = 0, pp_size: int = 1, microbatches: int = 4, ep_size: int = 1
               ) -> dict[str, int]:
    """Bytes `rank` holds under `strategy`: fp32 parameters and gradients, AdamW's state (two
    moments per element and a 4-byte step per parameter it updates), buffers, activations;
    the experts split over ep_size ranks (buffers and activations: as without)."""
    named = list(model.named_parameters())  # the tied wte/lm_head weight once
    pp = pp_size if MEMORY[strategy].pipeline else 1
    # A (pp, dp, tp) mesh: each pipeline rank holds its stage's parameters, which tp and dp
    # then split as fsdp_tp does over the ranks of one stage.
    pp_rank, rank = divmod(rank, world_size // pp)
    world_size //= pp
    tp_size = tp_size if MEMORY[strategy].tp else 1  # fsdp_pp: dp is every rank of a stage
    if pp > 1 or MEMORY[strategy].pipeline:
        held = pipeline_holds(model, pp, pp_rank)
        named = [(name, p) for name, p in named if name in held]
    # Gradients have their parameters' shapes (and shards); AdamW's moments too, but ZeRO
    # keeps them only for the parameters this rank owns.
    local = {name: math.prod(local_shape(name, tuple(p.shape), strategy, world_size, tp_size,
                                         rank, ep_size)) for name, p in named}
    sharded = MEMORY[strategy].memory.sharded_optimizer  # zero
    updated = zero_partition(model, world_size)[rank] if sharded else set(local)
    row = {
        "parameters": BYTES_FP32 * sum(local.values()),
        "gradients": BYTES_FP32 * sum(local.values()),
        "optimizer": sum(2 * BYTES_FP32 * local[name] + BYTES_FP32 for name in updated),
    }
    row["model state"] = sum(row.values())
    row["buffers"] = buffer_bytes(model, strategy, tp_size)
    row["activations"] = activation_bytes(model, batch_size,
                                          tp_size if MEMORY[strategy].tp else 1)
    if MEMORY[strategy].pipeline:
        # 1F1B: stage r keeps the activations of up to pp - r micro-batches (of batch_size /
        # microbatches sequences) in flight, for its share of the blocks (rough, as above).
        in_flight = min(pp - pp_rank, microbatches)
        share = len({n.split(".")[1] for n in held if n.startswith("blocks.")}) \
            / model.config.n_layer
        row["activations"] = int(row["activations"] * share * in_flight / microbatches)
    row["total"] = row["model state"] + row["buffers"] + row["activations"]
    return row


def cp_rows(model: GPT, batch_size: int, cp_size: int) -> list[dict[str, object]]:
    """Context parallelism: activations per rank for cp 1, 2, 4, ... up to cp_size, where the
    block size splits into 2 x cp chunks (the model state is the data-parallel strategy's)."""
    rows, cp = [], 1
    while cp <= cp_size and model.config.block_size % (2 * cp if cp > 1 else 1) == 0:
        rows.append({"cp_size": cp, "tokens per rank": batch_size * model.config.block_size // cp,
                     "activations": human_bytes(flash_activation_bytes(model, batch_size, cp))})
        cp *= 2
    return rows


def expert_rows(model: GPT, world_size: int, batch_size: int) -> list[dict[str, object]]:
    """A MoE model under ddp and fsdp with its experts over ep_size = 1, 2, 4, ... ranks (those
    dividing n_expert and the world size): rank 0's expert parameters and model state."""
    rows, ep = [], 1
    experts = [name for name, _ in model.named_parameters() if ".mlp.experts." in name]
    while ep <= world_size and model.config.n_expert % ep == 0 and world_size % ep == 0:
        for strategy in ("ddp", "fsdp"):
            held = sum(math.prod(local_shape(name, tuple(p.shape), strategy, world_size, 1, 0,
                                             ep))
                       for name, p in model.named_parameters() if name in experts)
            state = memory_row(model, strategy, world_size, 1, batch_size, ep_size=ep)
            rows.append({"strategy": strategy, "ep_size": ep, "expert params": f"{held:,}",
                         "model state": human_bytes(state["model state"])})
        ep *= 2
    return rows


def memory_rows(model: GPT, world_size: int, tp_size: int, batch_size: int, pp_size: int = 2
                ) -> list[dict[str, object]]:
    """One row per strategy: rank 0's bytes (the largest share where shards are uneven)."""
    rows = []
    # Rank 0 stands for all: FSDP's uneven chunks give it the most, ZeRO's partition nearly so.
    for strategy, s in MEMORY.items():
        if s.tp and (model.config.n_head % tp_size or model.config.n_embd % tp_size):
            continue  # TP needs the heads and the width to split evenly
        pp = pp_size if s.pipeline else 1
        tp = tp_size if s.tp else 1
        if world_size % (pp * tp) or (strategy == "pp" and pp != world_size) \
                or model.config.n_layer < pp:
            continue  # the mesh does not fit these sizes
        layout = f"tp {tp_size} x dp {world_size // tp_size}" if s.tp else f"{world_size} ranks"
        if s.pipeline:
            layout = f"pp {pp} x dp {world_size // (pp * tp)} x tp {tp}"
        sizes = memory_row(model, strategy, world_size, tp_size, batch_size, pp_size=pp)
        # Human-readable sizes for the table; memory_row keeps the exact bytes for tests.
        rows.append({"strategy": strategy, "layout": layout,
                     **{key: human_bytes(value) for key, value in sizes.items()}})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    presets = [args.preset] if args.preset else list(PRESETS)
    try:
        if args.memory:
            for preset in presets:
                model = build_on_meta(preset, args.vocab_size, args.block_size)
                print(f"{preset}: {model.num_params():,} parameters, vocab_size="
                      f"{args.vocab_size}, block_size={args.block_size}, batch_size="
                      f"{args.batch_size} per rank, fp32, AdamW; bytes per rank (rank 0)")
                print_table(memory_rows(model, args.world_size, args.tp_size, args.batch_size,
                                        args.pp_size))
                # Context parallelism (cp_size) splits the sequences, not the model state.
                print("\ncontext parallelism (ddp, zero or fsdp x cp_size; dropout 0): "
                      "activations per rank")
                print_table(cp_rows(model, args.batch_size, args.cp_size))
                if model.config.n_expert:  # expert parallelism splits the experts' state
                    print(f"\nexpert parallelism ({model.config.n_expert} experts per block, "
                          f"{args.world_size} ranks): rank 0's share")
                    print_table(expert_rows(model, args.world_size, args.batch_size))
                print()
            print("model state = parameters + gradients + optimizer (exp_avg, exp_avg_sq); "
                  "buffers: DDP's gradient buckets, FSDP's gathered blocks; activations: a "
                  "rough estimate (model_size.activation_bytes); cp's: counted for dropout 0 "
                  "(model_size.flash_activation_bytes)")
            return 0
        rows = [size_row(p, args.vocab_size, args.block_size) for p in presets]
    except ValueError as err:  # an invalid model config: one line, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 1
    # vocab_size and block_size change the embedding tables, so print what the counts assume.
    print(f"vocab_size={args.vocab_size}  block_size={args.block_size}")
    print_table(rows)
    print("L/H/C: layers / heads / embedding width; params: tied wte/lm_head counted once")
    print("non-emb: params without the position embedding; active: of those, what one token "
          "computes with (MoE: expert_top_k experts per block; N below)")
    print("GFLOP/tok: training FLOPs per token, forward + backward: 6*N + 12*L*C*block_size")
    print("bf16, fp32: weights only; train snapshot: fp32 weights + AdamW's two fp32 moments "
          f"= {BYTES_TRAIN_SNAPSHOT} bytes/param")
    return 0


if __name__ == "__main__":
    sys.exit(main())
