"""Generate text from a trained snapshot.

    python sample.py --prompt "ROMEO:" --num_tokens 300 --temperature 0.8 --top_k 20
    python sample.py --snapshot runs/<run_name>/snapshot --prompt "O God, O God!"
    python sample.py --snapshot s3://bucket/run1/snapshot   # AWS_* variables as for training
    python sample.py --init_from gpt2 --prompt "Hello, I'm a language model,"  # GPT-2 itself

Without --snapshot it uses the newest runs/*/snapshot here. Any layout's snapshot loads into
one plain model; its vocabulary is the snapshot's (a BPE snapshot names its tokenizer's files).
Nothing in a snapshot runs as it loads: weights_only=True, DCP's pickles as plain data.
"""
import argparse
import glob
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from mingpt import shards, snapshot
from mingpt.data import data_module
from mingpt.devices import pick_device
from mingpt.errors import one_line_errors
from mingpt.log import print0
from mingpt.model import GPT, GPTConfig
from mingpt.parallel.wrappers import unwrap


def generate_text(model: torch.nn.Module, meta: dict, prompt: str, num_tokens: int,
                  temperature: float = 1.0, top_k: int | None = None, seed: int = 0,
                  device: torch.device | None = None) -> str:
    """The prompt and `num_tokens` generated tokens, decoded with the snapshot's vocabulary.
    With FSDP every rank calls it (each forward gathers the weights), with the same seed."""
    device = device or pick_device(0)
    data = data_module(meta["kind"])  # the vocabulary is the snapshot's: meta has it
    idx = torch.tensor([data.encode(prompt, meta)], dtype=torch.long, device=device)  # (1, T)
    was_training = model.training
    model.eval()  # no dropout while generating
    # Sample from our own seed without disturbing the training RNG streams.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        out = model.generate(idx, num_tokens, temperature=temperature, top_k=top_k)  # (1, T+n)
    model.train(was_training)
    return data.decode(out[0].tolist(), meta)


def after_training(cfg: DictConfig, model: torch.nn.Module, meta: dict,
                   device: torch.device) -> None:
    """main.py's end-of-run sample, printed by rank 0. Every rank generates (FSDP's forward
    needs them all), but a pipeline's stages are spread: rank 0 reads the final snapshot."""
    plain = unwrap(model)
    if getattr(plain, "pipeline", None) is not None:
        if dist.get_rank() != 0:
            return
        plain = GPT(plain.config).to(device)
        shards.load_sharded_weights(cfg.trainer_config.snapshot_path, plain)
    # A newline: any BPE encodes it, a char vocabulary may lack it.
    prompt = "\n" if "\n" in meta.get("itos", "\n") else meta["itos"][0]
    text = generate_text(plain, meta, prompt, cfg.trainer_config.sample_tokens,
                         temperature=0.8, top_k=10, device=device)
    print0(f"sample:\n{text.strip()}")


def load_model(path: str, device: torch.device) -> tuple[GPT, dict]:
    """The model the snapshot's config describes, with its weights, and the data meta (any
    data kind: the notebooks load image models with it)."""
    kind = snapshot.snapshot_kind(path)
    if kind is None:
        raise ValueError(f"no snapshot at {path}")
    state = snapshot.load_train_state(path, kind)
    meta = state["data_meta"]
    # The snapshot's own model config, not gpt2_train_cfg.yaml's: the yaml may have changed
    # since, and only the saved config fits the saved weights.
    model = GPT(GPTConfig(**state["model_config"])).to(device)
    if kind == "file":
        model.load_state_dict(state["model"])
    else:  # no process group here: DCP gathers every shard into this one process
        shards.load_sharded_weights(path, model)  # its pickles read safely (storage.load_dcp)
    print(f"loaded {path} ({kind}, step {state['step']}, {model.num_params():,} parameters)",
          file=sys.stderr)
    return model, meta


def newest_snapshot() -> str:
    found = glob.glob(os.path.join("runs", "*", "snapshot"))
    if not found:
        raise ValueError("no runs/*/snapshot here; train first (python main.py) or pass "
                         "--snapshot PATH")
    # By modification time, not by name: run_name can be anything, not only a timestamp.
    return max(found, key=os.path.getmtime)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--snapshot", help="snapshot path or URL (default: newest runs/*/snapshot)")
    parser.add_argument("--init_from", "--init-from",
                        help="GPT-2 weights instead of a snapshot: gpt2, "
                        "gpt2-medium, ... or a save_pretrained directory with its tokenizer")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--num_tokens", "--num-tokens", type=int, default=500,
                        help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=1.0, help="< 1: more conservative")
    parser.add_argument("--top_k", "--top-k", type=int, default=None,
                        help="sample from the k likeliest")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.num_tokens < 0:
        parser.error(f"--num_tokens must be >= 0, got {args.num_tokens}")
    if not args.temperature > 0:
        parser.error(f"--temperature must be > 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        parser.error(f"--top_k must be >= 1, got {args.top_k}")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    device = pick_device(0)
    try:
        if args.init_from:  # pretrained weights as released (pretrained.py)
            from mingpt import pretrained
            model, meta = pretrained.load_for_sampling(args.init_from)
            model, path = model.to(device), args.init_from
        else:
            path = args.snapshot or newest_snapshot()
            if "://" not in path:  # Path would turn s3://bucket into s3:/bucket
                path = str(Path(path))
            model, meta = load_model(path, device)
        if not data_module(meta["kind"]).TEXT:
            raise ValueError(f"{path} was trained on {meta.get('kind')} data; sample.py writes "
                             "text (see notebooks/ for images)")
        text = generate_text(model, meta, args.prompt, args.num_tokens, args.temperature,
                             args.top_k, args.seed, device)
    except ValueError as e:  # includes snapshot.SnapshotError
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
