"""Start from OpenAI's GPT-2 weights: Hugging Face's GPT2LMHeadModel, copied into our GPT.

    model = GPT(gpt_config_from("gpt2", settings, vocab_size=50257, block_size=256))
    load_pretrained(model, "gpt2")  # a plain model: before DDP/FSDP wrap it

`init_from` is a GPT-2's Hugging Face model id (the local cache first, a download only when it
is not there) or a `save_pretrained` directory (README: GPT-2 weights and BPE data).
"""
import os
from pathlib import Path

import torch

from mingpt import ROOT
from mingpt.model import GPT, OPTIONS, PRESETS, SIZE_KEYS, GPTConfig

# HF's Conv1D keeps its weight as (in, out); nn.Linear as (out, in): these four are transposed.
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Settings of GPT2Config that our model has fixed: any other value computes something else.
FIXED = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "n_inner": (None,),
         "layer_norm_epsilon": (1e-5,), "scale_attn_weights": (True,),
         "scale_attn_by_inverse_layer_idx": (False,), "add_cross_attention": (False,)}


def resolve_source(source: str) -> str:
    """A local directory as an absolute path, or a Hugging Face model id as is."""
    path = Path(source).expanduser()
    path = path if path.is_absolute() else ROOT / path  # relative to 05_mingpt/
    if path.is_dir():
        return str(path)
    if source.startswith(("/", ".", "~")) or source.endswith("/"):  # meant as a path
        raise ValueError(f"gpt_config.init_from={source}: no such directory ({path})")
    return source


def _quiet() -> None:
    """transformers and huggingface_hub print only errors: a bar per rank would bury the log."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as hf_logging
    hub_logging.set_verbosity_error()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _from_pretrained(cls: type, source: str, **kwargs: object) -> object:
    """cls.from_pretrained from a directory or the local cache, else a download; ValueError."""
    where = resolve_source(source)
    local = os.path.isdir(where)
    try:  # the cache first: no network, no retries, when the model is already here
        return cls.from_pretrained(where, local_files_only=True, **kwargs)
    except OSError as e:
        if local:  # a directory, but not one save_pretrained wrote
            raise ValueError(f"cannot load gpt_config.init_from={source}: "
                             f"{str(e).strip().splitlines()[0]}") from None
    reason = "HF_HUB_OFFLINE is set"
    if os.environ.get("HF_HUB_OFFLINE", "0") in ("", "0", "false", "False"):
        try:
            return cls.from_pretrained(where, **kwargs)
        except OSError as e:
            reason = f"the download failed: {str(e).strip().splitlines()[0].rstrip('.')}"
    raise ValueError(f"cannot load gpt_config.init_from={source}: not a local directory and "
                     f"not in the Hugging Face cache, and {reason}; download it where there is "
                     f"network (hf download {source}) and copy the cache (HF_HOME), or set "
                     "init_from to a directory written by save_pretrained") from None


def hf_config(source: str) -> object:
    """The GPT2Config of `source`; ValueError unless our model computes what GPT-2's does."""
    from transformers import AutoConfig  # imported only when init_from is set
    _quiet()
    where = resolve_source(source)
    # Checked here: transformers would fall back to a default config without saying so.
    if os.path.isdir(where) and not os.path.isfile(os.path.join(where, "config.json")):
        raise ValueError(f"cannot load gpt_config.init_from={source}: {where} has no "
                         "config.json (not a directory written by save_pretrained)")
    config = _from_pretrained(AutoConfig, source)  # GPT2Config would take any config as GPT-2's
    if config.model_type != "gpt2":
        raise ValueError(f"gpt_config.init_from={source} is a {config.model_type} model, not "
                         "GPT-2 (model_type gpt2)")
    for key, allowed in FIXED.items():
        if getattr(config, key, allowed[0]) not in allowed:
            raise ValueError(f"gpt_config.init_from={source} has {key}="
                             f"{getattr(config, key)!r}; this GPT supports only {allowed[0]!r}")
    return config


def check_architecture(source: str, settings: dict) -> None:
    """ValueError (one line) unless gpt_config asks for GPT-2's own architecture."""
    if settings.get("bias") is False:
        raise ValueError(f"gpt_config.bias must be true with gpt_config.init_from={source}: "
                         "GPT-2 has biases")
    if settings.get("n_expert"):  # its weights would not load: experts where GPT-2 has an MLP
        raise ValueError(f"gpt_config.n_expert must be 0 with gpt_config.init_from={source}: "
                         "GPT-2 has one dense MLP per block, not experts")
    for key, has in OPTIONS.items():
        if settings.get(key):
            raise ValueError(f"gpt_config.{key} must be false with gpt_config.init_from="
                             f"{source}: GPT-2 has {has}")


def gpt_config_from(source: str, settings: dict, vocab_size: int, block_size: int,
                    data_name: str) -> GPTConfig:
    """Our GPTConfig for `source`'s weights; ValueError (one line) unless `settings` fit them."""
    hf = hf_config(source)
    pretrained = {"n_layer": hf.n_layer, "n_head": hf.n_head, "n_embd": hf.n_embd}
    asked = dict(PRESETS.get(settings.get("model_type"), {}))  # a preset's sizes, if one is set
    asked.update({key: settings[key] for key in SIZE_KEYS if settings.get(key) is not None})
    wrong = [key for key in SIZE_KEYS if key in asked and asked[key] != pretrained[key]]
    if wrong:
        given = ", ".join(f"{key}={asked[key]}" for key in wrong)
        sizes = ", ".join(f"{key}={value}" for key, value in pretrained.items())
        raise ValueError(f"gpt_config.init_from={source} has {sizes}, but gpt_config asks for "
                         f"{given} (model_type={settings.get('model_type')}): set "
                         "gpt_config.model_type=null and leave the sizes unset")
    if vocab_size != hf.vocab_size:
        raise ValueError(f"gpt_config.init_from={source} has a vocabulary of {hf.vocab_size} "
                         f"tokens, but data_config={data_name} has {vocab_size}: the data must be "
                         "tokenised with the model's own tokenizer (data_config=bpe, prepared "
                         "by prepare.py with the same tokenizer)")
    if block_size > hf.n_positions:
        raise ValueError(f"gpt_config.block_size must be at most {hf.n_positions} (the context "
                         f"of gpt_config.init_from={source}), got {block_size}")
    check_architecture(source, settings)
    # The sizes as explicit numbers; model_type only names them (snapshots ignore it).
    return GPTConfig(**{**settings, "model_type": None, **pretrained, "vocab_size": vocab_size,
                        "block_size": block_size})


def hf_to_ours(hf_state: dict[str, torch.Tensor], block_size: int) -> dict[str, torch.Tensor]:
    """A GPT2LMHeadModel state dict under our names, Conv1D weights transposed, wpe cropped."""
    state = {}
    for name, tensor in hf_state.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # old transformers versions keep the causal mask as a buffer
        # transformer.h.3.attn.c_attn.weight -> blocks.3.attn.c_attn.weight
        key = name.removeprefix("transformer.")
        key = f"blocks.{key[2:]}" if key.startswith("h.") else key
        if key.endswith(CONV1D):
            tensor = tensor.t()  # (in, out) -> (out, in)
        elif key == "wpe.weight":
            tensor = tensor[:block_size]  # (n_positions, C) -> (block_size, C): a shorter context
        state[key] = tensor
    return state


@torch.no_grad()
def load_pretrained(model: GPT, source: str) -> None:
    """Copy `source`'s GPT-2 weights into `model` (a plain GPT, on any device, not wrapped yet)."""
    from transformers import GPT2LMHeadModel  # imported only when init_from is set
    cfg = model.config
    hf_config(source)  # the same one-line errors as gpt_config_from, if called on its own
    hf = _from_pretrained(GPT2LMHeadModel, source, dtype=torch.float32)  # precision: the trainer's
    hf_cfg = hf.config
    found = (hf_cfg.n_layer, hf_cfg.n_head, hf_cfg.n_embd, hf_cfg.vocab_size)
    ours = (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size)
    if found != ours or cfg.block_size > hf_cfg.n_positions:
        raise ValueError(f"gpt_config.init_from={source} is (n_layer, n_head, n_embd, vocab) "
                         f"{found} with context {hf_cfg.n_positions}, the model {ours} with "
                         f"{cfg.block_size}")
    state = hf_to_ours(hf.state_dict(), cfg.block_size)
    state.setdefault("lm_head.weight", state["wte.weight"])  # tied: some versions list wte's only
    # Views of Hugging Face's tensors: a CPU model's weights are held twice until this returns.
    model.load_state_dict(state, strict=True)  # copies to the parameters' device


def load_for_sampling(source: str) -> tuple[GPT, dict]:
    """`source` as released (whole context, no dropout), and a data meta naming its tokenizer."""
    from mingpt.data.bpe import load_tokenizer
    hf = hf_config(source)
    where = resolve_source(source)
    enc = load_tokenizer(where)  # before the weights: a missing tokenizer fails fast
    if enc.n_vocab != hf.vocab_size:
        raise ValueError(f"the tokenizer of {source} has {enc.n_vocab} tokens, the model "
                         f"{hf.vocab_size}")
    model = GPT(GPTConfig(model_type=None, n_layer=hf.n_layer, n_head=hf.n_head,
                          n_embd=hf.n_embd, vocab_size=hf.vocab_size, block_size=hf.n_positions,
                          dropout=0.0))
    load_pretrained(model, source)
    return model, {"kind": "bpe", "vocab_size": hf.vocab_size, "tokenizer": where}
