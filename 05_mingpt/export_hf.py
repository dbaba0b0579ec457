"""Export a snapshot as a Hugging Face GPT-2: a `save_pretrained` directory of GPT2LMHeadModel.

    python export_hf.py runs/<run_name>/snapshot hf/my-gpt    # either format, any strategy
    python export_hf.py s3://bucket/run1/snapshot hf/my-gpt   # AWS_* variables as for training
    python main.py gpt_config.init_from=hf/my-gpt gpt_config.model_type=null ...  # train on

OUT_DIR gets config.json, model.safetensors (fp32), generation_config.json and a BPE run's
tokenizer; a char model's token i is the i-th character of `characters` in config.json
(README: GPT-2 weights and BPE data). Any layout's snapshot loads whole into this one process.
A model GPT-2 cannot compute and an OUT_DIR that is not empty are refused in one `error:` line.
"""
import argparse
import os
import shutil
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

import torch

from mingpt import shards, snapshot
from mingpt.errors import one_line_errors
from mingpt.model import GPT, OPTIONS, GPTConfig
from mingpt.pretrained import CONV1D, _quiet

# Our snapshot's model config: the keys GPTConfig has. Any other key (experts, say, from a
# later model) is a part GPT2LMHeadModel has no place for.
OUR_KEYS = tuple(f.name for f in fields(GPTConfig))


def check_out_dir(out_dir: str) -> Path:
    """OUT_DIR as an absolute path; ValueError if something is there already (never replaced)."""
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        what = "is not empty" if out.is_dir() else "is a file"
        raise ValueError(f"{out_dir} exists and {what}: give a new or empty directory (nothing "
                         "there is overwritten)")
    return out


def read_train_state(url: str) -> tuple[str, dict]:
    """The snapshot's kind ("dcp", or "file" for an older run's) and its state: everything but
    the weights; for a file the weights too (memory-mapped). ValueError unless a snapshot."""
    try:
        kind = snapshot.snapshot_kind(url)
        if kind is None:
            raise ValueError(f"no snapshot at {url}: give a snapshot file or directory "
                             "(runs/<run_name>/snapshot)")
        return kind, snapshot.load_train_state(url, kind)
    except snapshot.SnapshotError as e:
        # Its message ends with what a training run can do (snapshot_path): not ours to say.
        message = str(e)
        for separator in ("; ", ": "):
            message = message.removesuffix(separator + snapshot.MOVE_IT_AWAY)
        raise ValueError(message) from None


def check_representable(url: str, model_config: dict) -> None:
    """ValueError unless GPT2LMHeadModel computes what this model computes."""
    extra = sorted(key for key in model_config if key not in OUR_KEYS and model_config[key])
    if extra:
        raise ValueError(f"{url} holds a model with {extra[0]}={model_config[extra[0]]!r}, which "
                         "GPT-2 (GPT2LMHeadModel) cannot represent")
    if model_config.get("n_expert"):  # a router and n_expert MLPs where GPT-2 has one MLP
        raise ValueError(f"{url} holds a mixture of experts (gpt_config.n_expert="
                         f"{model_config['n_expert']}), which GPT-2 (GPT2LMHeadModel) cannot "
                         "represent: it has one dense MLP per block")
    for key, has in OPTIONS.items():  # a snapshot from before the options has none of them
        if model_config.get(key):
            raise ValueError(f"{url} holds a model with gpt_config.{key}=true, which GPT-2 "
                             f"(GPT2LMHeadModel) cannot represent: it has {has}")
    if model_config.get("bias") is False:
        raise ValueError(f"{url} holds a model without biases (gpt_config.bias=false), which "
                         "GPT-2 (GPT2LMHeadModel) cannot represent: it has a bias in every "
                         "Linear and LayerNorm")


def read_weights(url: str, kind: str, state: dict, config: GPTConfig) -> dict[str, torch.Tensor]:
    """The model's state dict, on the CPU, under our names, each tensor held once."""
    if kind == "file":
        # Views of the memory-mapped file: pages are read as each tensor is converted.
        weights = state.pop("model")
    else:
        # Storage for one whole model, uninitialised (no draws: DCP overwrites every value),
        # then every shard read into it. The tied head is tied again: to_empty gave it its own.
        with torch.device("meta"):
            model = GPT(config)
        model.to_empty(device="cpu")
        model.lm_head.weight = model.wte.weight
        try:
            shards.load_sharded_weights(url, model)
        except snapshot.SnapshotError as e:
            raise ValueError(str(e)) from None
        weights = model.state_dict()
    # Every weight our GPT has, no more: a part of another model would be dropped silently.
    with torch.device("meta"):
        names = set(GPT(config).state_dict())
    unknown, missing = sorted(set(weights) - names), sorted(names - set(weights))
    if unknown:
        raise ValueError(f"{url} holds a weight {unknown[0]}, which GPT-2 (GPT2LMHeadModel) "
                         "cannot represent")
    if missing:
        raise ValueError(f"{url} has no weight {missing[0]}: not a whole model")
    if not torch.equal(weights["lm_head.weight"], weights["wte.weight"]):
        raise ValueError(f"{url} holds an output layer apart from the token embedding, which "
                         "GPT-2 (GPT2LMHeadModel, tie_word_embeddings) cannot represent")
    return weights


def to_gpt2_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's state dict from ours (pretrained.hf_to_ours's inverse), emptying
    `weights` as it goes: at most one transposed Conv1D weight is held twice."""
    hf = {}
    for name in list(weights):
        tensor = weights.pop(name)
        if name == "lm_head.weight":
            continue  # tied: GPT2LMHeadModel saves wte's only and ties the head on load
        if name.endswith(CONV1D):
            tensor = tensor.t().contiguous()  # safetensors writes contiguous tensors only
        # blocks.3.attn.c_attn.weight -> transformer.h.3.attn.c_attn.weight
        key = f"h.{name.removeprefix('blocks.')}" if name.startswith("blocks.") else name
        hf[f"transformer.{key}"] = tensor
    return hf


def gpt2_config(model_config: dict, meta: dict):
    """GPT2Config for our model: its sizes, GPT-2's fixed choices (pretrained.FIXED checks them
    on the way back), the data's end-of-text token for BPE, the characters for char data."""
    from transformers import GPT2Config

    extra = {}
    if meta.get("kind") == "bpe":
        extra.update(bos_token_id=meta["eot"], eos_token_id=meta["eot"])
    else:  # no such token: GPT2Config's default 50256 would lie outside a 65-token vocabulary
        extra.update(bos_token_id=None, eos_token_id=None)
    if meta.get("kind") == "char":
        # What token i means, for whoever encodes text for it (README): saved in config.json.
        extra["characters"] = "".join(meta["itos"])
    dropout = model_config.get("dropout", 0.0)
    return GPT2Config(
        vocab_size=model_config["vocab_size"], n_positions=model_config["block_size"],
        n_embd=model_config["n_embd"], n_layer=model_config["n_layer"],
        n_head=model_config["n_head"], n_inner=None,  # 4 * n_embd, as our MLP
        # Our GELU is the tanh approximation (nn.GELU(approximate="tanh")): GPT-2's gelu_new.
        activation_function="gelu_new", layer_norm_epsilon=1e-5,  # nn.LayerNorm's default
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        tie_word_embeddings=True, **extra)


def gpt2_tokenizer(meta: dict):
    """The data's BPE tokenizer as GPT2Tokenizer, from the same files it was prepared with;
    ValueError when they are gone or changed (bpe.tokenizer checks its fingerprint)."""
    from transformers import GPT2Tokenizer

    from mingpt.data import bpe

    enc = bpe.tokenizer(meta)  # the files of prepare.py's tokenizer, as they were then
    files = bpe.tokenizer_files(meta["tokenizer"])
    if files is None:  # tiktoken's own gpt2 files: the Hugging Face model's are the same
        try:
            tokenizer = GPT2Tokenizer.from_pretrained(meta["tokenizer"])
        except OSError as e:
            raise ValueError(f"cannot write the tokenizer {meta['tokenizer']}: not in the Hugging "
                             f"Face cache and not downloaded ({str(e).splitlines()[0]}); run "
                             f"hf download {meta['tokenizer']} vocab.json merges.txt") from None
    else:
        tokenizer = GPT2Tokenizer(vocab=str(files[0]), merges=str(files[1]))
    if len(tokenizer) != enc.n_vocab:
        raise ValueError(f"tokenizer {meta['tokenizer']} has {len(tokenizer)} tokens in "
                         f"transformers, {enc.n_vocab} in the data")
    return tokenizer


def export(url: str, out_dir: str) -> Path:
    """Write the snapshot at `url` to `out_dir` as save_pretrained does; return the directory.
    Written beside it, then renamed: a failure halfway leaves no OUT_DIR behind."""
    out = check_out_dir(out_dir)
    kind, state = read_train_state(url)
    model_config, meta = state["model_config"], state["data_meta"]
    check_representable(url, model_config)
    from transformers import GPT2LMHeadModel  # only here: the checks above need none of it

    _quiet()  # no progress bars: one line of our own says what was written
    config = gpt2_config(model_config, meta)
    # Before the weights: a tokenizer that is gone fails in a second, not after the read.
    tokenizer = gpt2_tokenizer(meta) if meta.get("kind") == "bpe" else None
    ours = GPTConfig(**{key: model_config[key] for key in OUR_KEYS if key in model_config})
    weights = to_gpt2_names(read_weights(url, kind, state, ours))
    del state  # the rest of a one-file snapshot (AdamW's moments) stays on disk, never read
    # A model without storage (meta) gives save_pretrained its config, generation config and
    # tied names; the weights come from `weights`, so none is copied into a second model.
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        # mkdtemp makes it private (0700); the model is to be shared: what mkdir would give.
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
    except OSError as e:
        raise ValueError(f"cannot write {out_dir} ({e.strerror or e})") from None
    try:
        model.save_pretrained(tmp, state_dict=weights)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)  # tokenizer.json and tokenizer_config.json
            # And GPT-2's vocab.json + merges.txt, which transformers 5 no longer saves: older
            # versions, tiktoken (prepare.py, sample.py --init_from) and other tools read them.
            tokenizer.backend_tokenizer.model.save(str(tmp))
        os.replace(tmp, out)  # an empty OUT_DIR is replaced; one filled meanwhile: OSError
    except OSError as e:  # a full disk, say
        raise ValueError(f"cannot write {out_dir} ({e.strerror or e}); nothing was written "
                         "there") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("snapshot", help="snapshot file or directory, or its s3:// URL")
    parser.add_argument("out_dir", help="new (or empty) directory for the Hugging Face model")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    url = args.snapshot if "://" in args.snapshot else str(Path(args.snapshot))
    try:
        out = export(url, args.out_dir)
    except ValueError as e:  # includes snapshot.SnapshotError
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out}: GPT2LMHeadModel ({', '.join(sorted(os.listdir(out)))})")


if __name__ == "__main__":
    main(sys.argv[1:])
