"""How big is each GPT preset: parameters, training FLOPs per token, and snapshot size on disk.

    python model_size.py                      # every preset, GPT-2 vocabulary and context
    python model_size.py --preset gpt2-xl     # one preset
    python model_size.py --vocab_size 65 --block_size 256

The models are built on the `meta` device: modules get shapes but no storage, so counting the
parameters of the 1.5B-parameter gpt2-xl takes no memory and no time.
"""
import argparse
import sys

import torch

from model import GPT, PRESETS, GPTConfig

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
    args = parser.parse_args(argv)
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    presets = [args.preset] if args.preset else list(PRESETS)
    try:
        rows = [size_row(p, args.vocab_size, args.block_size) for p in presets]
    except ValueError as err:  # an invalid model config: one line, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 1
    # vocab_size and block_size change the embedding tables, so print what the counts assume.
    print(f"vocab_size={args.vocab_size}  block_size={args.block_size}")
    print_table(rows)
    print("L/H/C: layers / heads / embedding width; params: tied wte/lm_head counted once")
    print("non-emb: params without the position embedding (N below)")
    print("GFLOP/tok: training FLOPs per token, forward + backward: 6*N + 12*L*C*block_size")
    print("bf16, fp32: weights only; train snapshot: fp32 weights + AdamW's two fp32 moments "
          f"= {BYTES_TRAIN_SNAPSHOT} bytes/param")
    return 0


if __name__ == "__main__":
    sys.exit(main())
