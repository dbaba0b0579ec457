"""Small local stand-ins for GPT-2's tokenizer and weights (the real ones need the network).

`write_tokenizer` learns a few BPE merges from a text and writes them in GPT-2's file layout
(`vocab.json` + `merges.txt`, as `save_pretrained` writes them), which both tiktoken (through
prepare.py) and Hugging Face's GPT2TokenizerFast read. `write_hf_gpt2` saves a random
GPT2LMHeadModel of that vocabulary next to it: one directory is then a whole "pretrained model".
"""
import json
import re
from collections import Counter
from pathlib import Path

import torch

EOT = "<|endoftext|>"


def byte_encoder() -> dict[int, str]:
    """GPT-2's byte -> printable character map, in GPT-2's id order (ids 0..255)."""
    # Printable bytes stand for themselves; the others (controls, space, ...) are moved to
    # chr(256), chr(257), ... so that every token is a string of visible characters.
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def write_tokenizer(dest: Path, text: str, n_merges: int) -> int:
    """vocab.json + merges.txt in `dest` with up to n_merges merges learnt from `text`;
    returns the vocabulary size (256 bytes + merges + <|endoftext|>)."""
    dest.mkdir(parents=True, exist_ok=True)
    enc = byte_encoder()
    # Words roughly as GPT-2 cuts them (a leading space stays with its word).
    words = Counter(re.findall(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+", text))
    seqs = {w: [enc[b] for b in w.encode()] for w in words}  # each word as byte symbols
    vocab = {c: i for i, c in enumerate(enc.values())}  # ids 0..255: the single bytes
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for word, count in words.items():
            for pair in zip(seqs[word], seqs[word][1:], strict=False):
                pairs[pair] += count
        # The most frequent pair whose merge is a new token (ties: the larger pair, so the
        # result does not depend on dict order); a token reachable twice would break tiktoken.
        fresh = [(count, pair) for pair, count in pairs.items() if pair[0] + pair[1] not in vocab]
        if not fresh:
            break
        a, b = max(fresh)[1]
        merges.append((a, b))
        vocab[a + b] = len(vocab)
        for word, seq in seqs.items():  # apply the merge to every word
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[word] = out
    vocab[EOT] = len(vocab)  # GPT-2's only special token, the last id
    # merges.txt: a version line, then one merge per line in rank order (GPT-2's layout).
    (dest / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (dest / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                     encoding="utf-8")
    return len(vocab)


def hf_gpt2(vocab: int, n_layer: int = 2, n_head: int = 2, n_embd: int = 32, block: int = 64,
            seed: int = 0, **kw):
    """A random GPT2LMHeadModel, every tensor perturbed so that no weight is at its init value."""
    import transformers

    torch.manual_seed(seed)
    # GPT-2's own settings but for the sizes; no dropout, so outputs can be compared exactly.
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=block, n_embd=n_embd,
                                     n_layer=n_layer, n_head=n_head, bos_token_id=vocab - 1,
                                     eos_token_id=vocab - 1, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, **kw)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # LayerNorms and biases too: a mapping that drops one shows up
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def write_hf_gpt2(dest: Path, vocab: int, **kw):
    """hf_gpt2(...) saved with save_pretrained into `dest`; returns the model."""
    model = hf_gpt2(vocab, **kw)
    model.save_pretrained(dest)  # config.json + model.safetensors, as from the hub
    return model
