"""Text -> GPT-2 BPE tokens: `train.bin` and `val.bin` (uint16) for data_config=bpe.

    python prepare.py data/input.txt --out data/shakespeare_bpe           # tiny Shakespeare
    python prepare.py a.txt b.txt --out data/mine --tokenizer ~/models/gpt2 --workers 8
    python prepare.py --hf_dataset ~/owt_saved --text_column text --out data/owt

Inputs are UTF-8 text files or a Hugging Face dataset's rows, each one document ending with
`<|endoftext|>`. The first `--train_fraction` of the input trains, the rest validates. Encoding
runs in `--workers` processes, chunk by chunk; the position after every written chunk is saved,
so an interrupted run continues where it stopped. meta.json, written last, marks the end. The
tokenizer is GPT-2's byte-level BPE, run by tiktoken (mingpt/data/bpe.py: load_tokenizer).
"""
import argparse
import json
import os
import re
import sys
from collections import deque
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np

from mingpt.data.bpe import fingerprint, load_tokenizer
from mingpt.errors import one_line_errors

# Where a text may be cut into chunks without changing its tokens: after a newline that sits
# between two visible ASCII characters. GPT-2's pre-tokenizer (bpe.GPT2_PATTERN) makes
# that newline a piece of its own whether the text goes on or ends there; a cut inside a run
# of whitespace would not (`\s+(?!\S)` matches differently at the end of a text).
SAFE_CUT = re.compile(rb"[\x21-\x7e]\n(?=[\x21-\x7e])")
WINDOW = 1 << 20  # bytes read at a time while looking for a safe cut
STATE, META = "prepare_state.json", "meta.json"


def encode_pieces(pieces: list[tuple], enc=None) -> np.ndarray:
    """One chunk's tokens (uint16): each piece is (name, offset, bytes or str, ends a document)."""
    enc = enc or _WORKER["enc"]  # in a worker process: the one _init_worker loaded
    out: list[int] = []
    for name, offset, data, ends_document in pieces:
        if isinstance(data, bytes):  # file chunks are decoded here, in parallel
            try:
                data = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{name} is not UTF-8 text (byte {offset + e.start}: "
                                 f"{data[e.start:e.start + 1]!r})") from None
        out += enc.encode_ordinary(data)  # special-token text in the data is just text
        if ends_document:
            out.append(enc.eot_token)
    return np.array(out, dtype=np.uint16)


_WORKER: dict = {}  # each worker process's tokenizer, loaded once by _init_worker


def _init_worker(spec: str) -> None:
    # By name: each worker builds its own Encoding once, instead of receiving one per chunk.
    _WORKER["enc"] = load_tokenizer(spec)


def last_safe_cut(data: bytes) -> int:
    """The index just after the last newline of `data` where a cut is safe; 0 if none."""
    i = len(data) - 1  # the byte after a newline must be in data
    while (i := data.rfind(b"\n", 0, i)) > 0:
        if 0x21 <= data[i - 1] <= 0x7E and 0x21 <= data[i + 1] <= 0x7E:
            return i + 1
    return 0


def file_chunks(paths: list[str], split_at: tuple[int, int], chunk_bytes: int,
                start: list[int]) -> Iterator[tuple[str, list[int], list[tuple]]]:
    """(split, position after, pieces) for the text files from position [file, byte] on; chunks
    end at safe cuts (SAFE_CUT), at the train/val boundary `split_at` and at file ends."""
    for index in range(start[0], len(paths)):
        offset = start[1] if index == start[0] else 0
        size = os.path.getsize(paths[index])
        with open(paths[index], "rb") as f:
            f.seek(offset)
            while offset < size:
                # A chunk never straddles the split: each one goes to one output file.
                split = "train" if (index, offset) < split_at else "val"
                limit = split_at[1] if split == "train" and index == split_at[0] else size
                data = f.read(min(chunk_bytes, limit - offset))
                while offset + len(data) < limit:  # cut at the last safe place, if there is one
                    cut = last_safe_cut(data)
                    if cut:
                        f.seek(offset + cut)
                        data = data[:cut]
                        break
                    data += f.read(min(WINDOW, limit - offset - len(data)))  # none yet: more
                end = offset + len(data)
                yield split, [index, end], [(paths[index], offset, data, end == size)]
                offset = end


def text_split(paths: list[str], train_fraction: float) -> tuple[int, int]:
    """(file, byte) where validation starts: the first safe cut after train_fraction of the
    bytes, else the last one before it, else the end of that file."""
    sizes = [os.path.getsize(p) for p in paths]
    target = int(sum(sizes) * train_fraction)
    index = 0  # the file holding byte `target` of all the input, and the offset in it
    while index < len(sizes) and target >= sizes[index]:
        target -= sizes[index]
        index += 1
    if index == len(sizes):
        return index, 0
    with open(paths[index], "rb") as f:
        f.seek(pos := target)
        while window := f.read(WINDOW):  # forward, a window at a time
            m = SAFE_CUT.search(window + f.read(1))
            if m:
                return index, pos + m.end()
            f.seek(pos := pos + len(window))
        f.seek(0)
        cut = last_safe_cut(f.read(target + 1))  # backward
    return (index, cut) if cut else (index + 1, 0)


def dataset_chunks(dataset, column: str, split_row: int, start: list[int], rows: int = 1024
                   ) -> Iterator[tuple[str, list[int], list[tuple]]]:
    """(split, position after, pieces) for a datasets.Dataset, from row start[0] on."""
    row = start[0]
    while row < len(dataset):
        # `rows` rows at a time, and never across the split (as for files).
        end = min(row + rows, len(dataset), split_row if row < split_row else len(dataset))
        texts = dataset[row:end][column]  # one column slice: read from Arrow in one go
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"row {row + i} of column {column!r} is {type(text).__name__}, "
                                 "not text")
        pieces = [(f"row {row + i}", 0, text, True) for i, text in enumerate(texts) if text]
        yield "train" if row < split_row else "val", [end], pieces
        row = end


def load_hf_dataset(source: str, split: str, column: str):
    """A datasets.Dataset from a save_to_disk directory, or a local path / cached name."""
    import datasets  # only for --hf_dataset

    try:
        # save_to_disk writes one of these two files; anything else is for load_dataset.
        if (Path(source) / "dataset_dict.json").is_file() or \
                (Path(source) / "state.json").is_file():
            data = datasets.load_from_disk(source)
            data = data[split] if isinstance(data, datasets.DatasetDict) else data
        else:
            data = datasets.load_dataset(source, split=split)
    except Exception as e:  # missing, unreadable, not cached offline, no such split
        raise ValueError(f"cannot load the dataset {source} (split {split}): "
                         f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}") from None
    if column not in data.column_names:
        raise ValueError(f"dataset {source} has no column {column!r}; columns: "
                         f"{', '.join(data.column_names)} (set --text_column)")
    return data


def encoded(chunks: Iterator[tuple], enc, tokenizer: str, workers: int
            ) -> Iterator[tuple[str, list[int], np.ndarray]]:
    """(split, position after, tokens) of every chunk, in input order, encoded by `workers`
    processes (1: in this one, simplest to read and to debug)."""
    if workers == 1:
        for split, position, pieces in chunks:
            yield split, position, encode_pieces(pieces, enc)
        return
    import multiprocessing

    # At most 2 chunks per worker in flight: memory stays bounded however large the input.
    with multiprocessing.Pool(workers, _init_worker, (tokenizer,)) as pool:
        pending: deque = deque()
        for split, position, pieces in chunks:
            pending.append((split, position, pool.apply_async(encode_pieces, (pieces,))))
            while len(pending) >= 2 * workers or (pending and pending[0][2].ready()):
                split_, position_, result = pending.popleft()
                yield split_, position_, result.get()  # a worker's ValueError is raised here
        for split, position, result in pending:
            yield split, position, result.get()


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)  # atomic: the old state or the new one, never half of one


def prepare(out: str, tokenizer: str = "gpt2", files: list[str] | None = None, dataset=None,
            column: str = "text", train_fraction: float = 0.9, workers: int = 1,
            chunk_bytes: int = 1 << 22, source: str = "") -> dict:
    """Encode `files` (or `dataset`) into out/train.bin, out/val.bin, out/meta.json; the meta.
    Resumes from out/prepare_state.json when the inputs and settings are those it recorded."""
    from tqdm import tqdm

    out_dir = Path(out)
    enc = load_tokenizer(tokenizer)
    if enc.n_vocab > 2**16:
        raise ValueError(f"tokenizer {tokenizer} has {enc.n_vocab} tokens: too many for uint16")
    if files is not None:
        files = [os.path.abspath(p) for p in files]
        for p in files:
            if not os.path.isfile(p):
                raise ValueError(f"no such text file: {p}")
        sizes = [os.path.getsize(p) for p in files]
        if not sum(sizes):
            raise ValueError(f"no text to encode: {', '.join(files)} "
                             f"{'is' if len(files) == 1 else 'are'} empty")
        inputs = [[p, size, os.path.getmtime(p)] for p, size in zip(files, sizes, strict=True)]
        chunks = partial(file_chunks, files, text_split(files, train_fraction), chunk_bytes)
        total, start = sum(sizes), [0, 0]
    else:
        inputs = [source, len(dataset), column]
        chunks = partial(dataset_chunks, dataset, column, int(len(dataset) * train_fraction))
        total, start = len(dataset), [0]

    def done_of(position: list[int]) -> int:  # bytes (or rows) before a position
        return sum(sizes[:position[0]]) + position[1] if files is not None else position[0]

    # Everything that decides the output: a state recorded with other values is not resumed.
    key = {"inputs": inputs, "tokenizer": fingerprint(enc), "train_fraction": train_fraction}
    out_dir.mkdir(parents=True, exist_ok=True)
    meta_path, state_path = out_dir / META, out_dir / STATE
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("key") == key:
        print(f"{out_dir} is up to date", file=sys.stderr)
        return json.loads(meta_path.read_text())
    state = json.loads(state_path.read_text()) if state_path.is_file() else None
    if state is None or state["key"] != key:
        meta_path.unlink(missing_ok=True)  # an older preparation is no longer the one here
        state = {"key": key, "position": start, "tokens": {"train": 0, "val": 0}}
    elif state["position"] != start:
        print(f"resuming at {done_of(state['position']):,} of {total:,}", file=sys.stderr)
    outs = {}
    for split in ("train", "val"):  # drop what was written after the last saved position
        path = out_dir / f"{split}.bin.partial"
        done = out_dir / f"{split}.bin"  # renamed already by a finish that was cut off
        if not path.exists() and done.is_file() and done.stat().st_size == 2 * \
                state["tokens"][split]:
            os.replace(done, path)
        outs[split] = open(path, "r+b" if path.exists() else "wb")  # noqa: SIM115
        outs[split].truncate(2 * state["tokens"][split])
        outs[split].seek(0, os.SEEK_END)
    bar = tqdm(total=total, initial=done_of(state["position"]), unit="B" if files else " rows",
               unit_scale=True, disable=None, desc=f"encoding into {out_dir}")
    try:
        for split, position, tokens in encoded(chunks(state["position"]), enc, tokenizer,
                                               workers):
            outs[split].write(tokens.tobytes())
            for f in outs.values():  # the tokens are on disk before the state says so
                f.flush()
                os.fsync(f.fileno())
            bar.update(done_of(position) - done_of(state["position"]))
            state["position"] = position
            state["tokens"][split] += len(tokens)
            _write_json(state_path, state)
    finally:  # also on Ctrl-C or a bad input: the state on disk is where the next run starts
        bar.close()
        for f in outs.values():
            f.close()
    counts = state["tokens"]
    if min(counts.values()) < 2:
        raise ValueError(f"too little text in {source or ', '.join(files)}: {counts['train']} "
                         f"training and {counts['val']} validation tokens")
    for split in ("train", "val"):
        os.replace(out_dir / f"{split}.bin.partial", out_dir / f"{split}.bin")
    meta = {"tokenizer": enc.name,  # a directory as its absolute path
            "tokenizer_sha": key["tokenizer"], "vocab_size": enc.n_vocab, "eot": enc.eot_token,
            "dtype": "uint16", "train_tokens": counts["train"], "val_tokens": counts["val"],
            "key": key}
    _write_json(meta_path, meta)  # the commit point: the .bin files above are complete
    state_path.unlink()
    return meta


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("files", nargs="*", help="UTF-8 text files, each one document")
    parser.add_argument("--hf_dataset", "--hf-dataset",
                        help="a Hugging Face dataset: save_to_disk directory, "
                        "local path or cached name (instead of files)")
    parser.add_argument("--split", default="train", help="the dataset's split to read")
    parser.add_argument("--text_column", "--text-column", default="text",
                        help="the dataset's text column")
    parser.add_argument("--out", required=True, help="output directory (data_config.path)")
    parser.add_argument("--tokenizer", default="gpt2",
                        help="a directory with vocab.json + merges.txt, or a model id (gpt2)")
    parser.add_argument("--train_fraction", "--train-fraction", type=float, default=0.9,
                        help="the first part of the input that trains; the rest validates")
    parser.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)),
                        help="encoding processes")
    args = parser.parse_args(argv)
    if bool(args.files) == bool(args.hf_dataset):
        parser.error("give text files or --hf_dataset (one of the two)")
    if not 0 < args.train_fraction < 1:
        parser.error(f"--train_fraction must be between 0 and 1, got {args.train_fraction}")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    # A directory tokenizer is recorded by its absolute path: training and sampling later
    # load it from meta.json, from whatever folder they run in.
    tokenizer = os.path.abspath(os.path.expanduser(args.tokenizer)) \
        if os.path.isdir(os.path.expanduser(args.tokenizer)) else args.tokenizer
    try:
        if args.hf_dataset:
            dataset = load_hf_dataset(args.hf_dataset, args.split, args.text_column)
            meta = prepare(args.out, tokenizer, dataset=dataset, column=args.text_column,
                           train_fraction=args.train_fraction, workers=args.workers,
                           source=f"{args.hf_dataset}[{args.split}]")
        else:
            meta = prepare(args.out, tokenizer, files=args.files,
                           train_fraction=args.train_fraction, workers=args.workers)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{args.out}: {meta['train_tokens']:,} training and {meta['val_tokens']:,} validation "
          f"tokens (vocab {meta['vocab_size']}, tokenizer {meta['tokenizer']})")


if __name__ == "__main__":
    main(sys.argv[1:])
