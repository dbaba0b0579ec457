"""CIFAR-10 as sequences of colour tokens, for a GPT that models images pixel by pixel.

Every pixel becomes the index of its nearest colour in a k-means palette of `palette_size`
colours, so a 32x32 image is 1024 tokens. Global rank 0 computes the palette once, saves it next
to the data and sends it to every rank. Images are read with torchvision's CIFAR10.
"""
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from scipy.spatial import cKDTree
from sklearn.cluster import MiniBatchKMeans
from torch.utils.data import Dataset
from torchvision.datasets import CIFAR10

from mingpt import ROOT, errors

SIDE = 32  # CIFAR-10 images are 32x32 RGB
SEQ_LEN = SIDE * SIDE  # 1024 tokens per image; the model sees 1023 and predicts the next
MATCH_KEYS = ("vocab_size", "palette", "permutation")  # a resume needs the same colour tokens
TEXT = False  # decode() gives images (notebooks/play_image.ipynb), not text
DEFAULTS = {"name": "cifar10", "root": "data/cifar10", "download": True, "check_md5": True,
            "palette_size": 512, "pixels_per_image": 5, "max_train_images": None,
            "max_val_images": None, "permute": False}


class ImageTokens(Dataset):
    """One image per item: (x, y) = its 1024 tokens without the last, and without the first."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens  # (N, 1024) palette indices, int16 to keep 50k images at 100 MB

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self.tokens[index].long()  # (1024,)
        return seq[:-1], seq[1:]  # (1023,) each: inputs, and the next pixel at every position


class _UncheckedCIFAR10(CIFAR10):
    """torchvision's CIFAR10 without its md5 sums (check_md5=false): only the files' presence."""

    train_list = [[name, None] for name, _ in CIFAR10.train_list]
    test_list = [[name, None] for name, _ in CIFAR10.test_list]
    meta = {**CIFAR10.meta, "md5": None}


def load_images(root: Path, train: bool, download: bool, check_md5: bool = True) -> np.ndarray:
    """The CIFAR-10 train or test images as a uint8 array (N, 32, 32, 3); ValueError if absent."""
    folder = root / CIFAR10.base_folder
    cls = CIFAR10 if check_md5 else _UncheckedCIFAR10
    try:
        return cls(str(root), train=train, download=download).data  # (N, 32, 32, 3) uint8, HWC
    except RuntimeError:  # torchvision: "Dataset not found or corrupted"
        files = [name for name, _ in CIFAR10.train_list + CIFAR10.test_list]
        missing = [name for name in files if not (folder / name).is_file()]
        if missing:
            raise ValueError(f"CIFAR-10 not found: no {folder / missing[0]}; set "
                             "data_config.download=true to fetch it, or extract "
                             f"cifar-10-python.tar.gz into {root}") from None
        raise ValueError(f"CIFAR-10 files in {folder} do not match the official checksums; "
                         "delete them to download again, or set data_config.check_md5=false "
                         "to use them as they are") from None
    except OSError as e:  # download=true without a network, a full disk, ...
        raise ValueError(f"cannot download CIFAR-10 into {root}: {e}; copy "
                         f"cifar-10-batches-py there instead") from None


def compute_palette(images: np.ndarray, palette_size: int, pixels_per_image: int,
                    seed: int) -> np.ndarray:
    """k-means colours (palette_size, 3) uint8 from `pixels_per_image` random pixels per image."""
    seed %= 2**32  # numpy and scikit-learn take seeds in [0, 2**32)
    rng = np.random.default_rng(seed)
    n = len(images)
    flat = images.reshape(n, SEQ_LEN, 3)
    where = rng.integers(0, SEQ_LEN, size=(n, pixels_per_image))  # random positions, per image
    pixels = flat[np.arange(n)[:, None], where].reshape(-1, 3).astype(np.float32)  # (n*p, 3)
    distinct = len(np.unique(pixels, axis=0))
    if distinct < palette_size:
        raise ValueError(f"data_config.palette_size ({palette_size}) is more than the {distinct} "
                         "distinct colours sampled; lower it or sample more pixels/images")
    # MiniBatchKMeans: many times faster than KMeans, for a palette nearly as good.
    kmeans = MiniBatchKMeans(n_clusters=palette_size, batch_size=4096, n_init=1,
                             random_state=seed, compute_labels=False).fit(pixels)
    # Whole numbers: dequantised images are exact uint8, and distances between integers exact.
    return np.clip(np.rint(kmeans.cluster_centers_), 0, 255).astype(np.uint8)


def read_palette(path: Path, palette_size: int) -> np.ndarray:
    """A saved palette, checked: ValueError if it is unreadable or not uint8 (palette_size, 3)."""
    try:
        palette = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):  # truncated, or not .npy (np.load's pickle refusal)
        raise ValueError(f"palette file {path} is not a readable .npy array; delete it to "
                         "recompute it") from None
    if palette.dtype != np.uint8 or palette.shape != (palette_size, 3):
        raise ValueError(f"palette file {path} holds {palette.dtype} {palette.shape}, expected "
                         f"uint8 ({palette_size}, 3); delete it to recompute it")
    return palette


def write_palette(path: Path, palette: np.ndarray) -> None:
    """Write atomically: a crash leaves the old file or none, never half a palette."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, palette)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def quantise(images: np.ndarray | torch.Tensor, palette: np.ndarray,
             dtype: torch.dtype = torch.long) -> torch.Tensor:
    """uint8 images (N, 32, 32, 3) -> (N, 1024) index of the nearest palette colour per pixel."""
    images = np.asarray(images)
    pixels = images.reshape(-1, 3)  # (N*1024, 3) row by row, as the model reads them
    step = 1 << 20  # pixels (or colours) per chunk: bounds the temporary arrays

    def codes(start: int) -> np.ndarray:  # each colour as one 24-bit number 0xRRGGBB
        rgb = pixels[start:start + step].astype(np.int32)
        return (rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2]
    # Images repeat colours: each distinct colour's nearest palette entry once, then a lookup.
    seen = np.zeros(1 << 24, dtype=bool)
    for start in range(0, len(pixels), step):
        seen[codes(start)] = True
    colours = np.flatnonzero(seen)  # (U,) the distinct colours present
    lookup = np.zeros(1 << 24, dtype=np.int16)  # colour -> palette index (palette <= 32768)
    tree = cKDTree(palette.astype(np.float64))
    for start in range(0, len(colours), step):
        c = colours[start:start + step]
        rgb = np.stack([c >> 16, (c >> 8) & 255, c & 255], axis=1)  # (chunk, 3)
        lookup[c] = tree.query(rgb, workers=torch.get_num_threads())[1]
    out = torch.empty(len(pixels), dtype=dtype)
    for start in range(0, len(pixels), step):
        out[start:start + step] = torch.from_numpy(lookup[codes(start)])
    return out.view(len(images), SEQ_LEN)


def dequantise(indices: torch.Tensor, palette: np.ndarray | list) -> torch.Tensor:
    """(N, 1024) palette indices -> uint8 images (N, 32, 32, 3)."""
    colours = torch.as_tensor(np.asarray(palette, dtype=np.uint8))  # (K, 3)
    return colours[indices.long()].view(-1, SIDE, SIDE, 3)


def make_permutation(seed: int) -> torch.Tensor:
    """A fixed random order of the 1024 pixel positions (the same for every image and rank)."""
    return torch.randperm(SEQ_LEN, generator=torch.Generator().manual_seed(seed))


def permute(seqs: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Reorder (N, 1024) sequences: position j of the result is pixel perm[j]."""
    return seqs[:, perm]


def unpermute(seqs: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Undo `permute`: pixel p sits at position argsort(perm)[p] of the permuted sequence."""
    return seqs[:, torch.argsort(perm)]


def decode(seqs: torch.Tensor, meta: dict) -> torch.Tensor:
    """Model sequences (N, 1024) -> uint8 images (N, 32, 32, 3), using only the stored meta."""
    if meta["permutation"] is not None:
        seqs = unpermute(seqs, torch.tensor(meta["permutation"]))
    return dequantise(seqs, meta["palette"])


def check_config(data_cfg: DictConfig | dict) -> None:
    options(data_cfg)


def options(data_cfg: DictConfig | dict) -> dict:
    """data_config with defaults filled in; ValueError naming the first bad key or value."""
    given = OmegaConf.to_container(data_cfg) if isinstance(data_cfg, DictConfig) else dict(data_cfg)
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown key data_config.{unknown[0]}; allowed: {', '.join(DEFAULTS)}")
    opts = DEFAULTS | given

    def need(ok: bool, key: str, allowed: str) -> None:
        if not ok:
            raise ValueError(f"data_config.{key} must be {allowed}, got {opts[key]!r}")

    def whole(key: str, low: int, high: int = 1 << 62) -> bool:
        value = opts[key]  # bool is an int subclass in Python: reject it explicitly
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    for key in ("download", "check_md5", "permute"):
        need(isinstance(opts[key], bool), key, "true or false")
    need(whole("palette_size", 2, 32768), "palette_size", "an integer from 2 to 32768")
    need(whole("pixels_per_image", 1, SEQ_LEN), "pixels_per_image",
         f"an integer from 1 to {SEQ_LEN}")
    for key in ("max_train_images", "max_val_images"):
        need(opts[key] is None or whole(key, 1), key, "null (all images) or a positive integer")
    need(isinstance(opts["root"], str) and "://" not in opts["root"], "root", "a local folder")
    opts["root"] = ROOT / Path(opts["root"]).expanduser()  # relative to 05_mingpt/
    return opts


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def build_datasets(data_cfg: DictConfig | dict, block_size: int, seed: int
                   ) -> tuple[ImageTokens, ImageTokens, dict]:
    """CIFAR-10's train and test images as colour tokens; after `init_process_group`, if any."""
    opts = options(data_cfg)
    if block_size != SEQ_LEN - 1:
        raise ValueError(f"cifar10 needs gpt_config.block_size={SEQ_LEN - 1} (32x32 pixels less "
                         f"the one predicted), got {block_size}")
    root, size = opts["root"], opts["palette_size"]
    # Nodes need not share a filesystem: each node's first process makes sure of its own copy
    # while the others wait, and every rank hears of a node that failed (errors.together).
    node_first = os.environ.get("LOCAL_RANK", "0") == "0"
    train_images = errors.together(
        lambda: load_images(root, True, opts["download"], opts["check_md5"]) if node_first
        else None)
    palette = error = None
    if _rank() == 0:
        try:
            train_images = train_images[:opts["max_train_images"]]
            # Everything the palette depends on is in its name, so no stale palette is reused.
            path = root / (f"palette_k{size}_n{len(train_images)}_"
                           f"p{opts['pixels_per_image']}_s{seed}.npy")
            if path.exists():
                palette = read_palette(path, size)
                print(f"palette: {size} colours from {path}", flush=True)
            else:
                start = time.perf_counter()
                palette = compute_palette(train_images, size, opts["pixels_per_image"], seed)
                write_palette(path, palette)
                print(f"palette: computed {size} colours in {time.perf_counter() - start:.1f} s, "
                      f"saved to {path}", flush=True)
        except (ValueError, OSError) as e:  # OSError: e.g. a read-only root for the palette
            error = str(e)
    # Every rank raises rank 0's error, so a bad path stops the whole job with the same line.
    shared = [palette, error]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(shared, src=0)
    palette, error = shared
    if error is not None:
        raise ValueError(error)
    if train_images is None:  # other ranks: their node's first rank made sure of the files
        train_images = load_images(root, True, False, opts["check_md5"])
    train_images = train_images[:opts["max_train_images"]]
    val_images = load_images(root, False, False, opts["check_md5"])[:opts["max_val_images"]]
    start = time.perf_counter()
    # int16 holds any palette index (palette_size <= 32768) at a quarter of int64's memory.
    train_tokens = quantise(train_images, palette, torch.int16)  # (N_train, 1024)
    val_tokens = quantise(val_images, palette, torch.int16)  # (N_val, 1024)
    perm = make_permutation(seed) if opts["permute"] else None
    if perm is not None:
        train_tokens, val_tokens = permute(train_tokens, perm), permute(val_tokens, perm)
    if _rank() == 0:
        print(f"quantised {len(train_tokens)} train and {len(val_tokens)} val images in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    meta = {"kind": "cifar10", "vocab_size": size, "block_size": block_size,
            "palette": palette.tolist(),  # [[r, g, b], ...]: decoding needs only the snapshot
            "permutation": None if perm is None else perm.tolist(),
            "image_size": SIDE, "root": str(root)}
    return ImageTokens(train_tokens), ImageTokens(val_tokens), meta
