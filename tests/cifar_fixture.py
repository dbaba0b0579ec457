"""A small CIFAR-10 on disk, in the official `cifar-10-batches-py` layout, for offline tests.

The official files are Python 2 pickles: dicts whose keys and strings are Python 2 `str`, so
`pickle.load(f, encoding="bytes")` gives `b"data"` keys and torchvision's
`pickle.load(f, encoding="latin1")` gives `"data"`. `write_cifar10` writes the same pickle opcodes,
so both readers see what they see in the real files:

    data_batch_1 .. data_batch_5, test_batch:
        {b"batch_label": b"training batch 1 of 5", b"labels": [int, ...],
         b"data": uint8 (N, 3072) -- per image 1024 red, then green, then blue values, row-major,
         b"filenames": [b"name.png", ...]}
    batches.meta: {b"label_names": [b"airplane", ...], b"num_cases_per_batch": N,
                   b"num_vis": 3072}

Images are flat colour shapes (background, rectangle, disc) in 8 well-separated base colours, each
pixel moved at most HALF_WIDTH per channel by a gradient and noise: a palette with a colour near
every base colour reconstructs every pixel to within 2 * HALF_WIDTH per channel.
"""
import io
import itertools
import pickle
from pathlib import Path

import numpy as np

LABELS = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
BASE_COLOURS = np.array(list(itertools.product((40, 215), repeat=3)), dtype=np.int16)  # (8, 3)
GRADIENT, NOISE = 6, 3  # per-channel amplitude of the gradient and of the noise
HALF_WIDTH = GRADIENT + NOISE  # no pixel is further than this from its base colour, per channel


class _Py2Str(bytes):
    """Pickled as a Python 2 `str` (SHORT_BINSTRING / BINSTRING), like the official files."""


class _Py2Pickler(pickle._Pickler):  # the pure-Python pickler: its dispatch table is extensible
    def save_py2str(self, obj: _Py2Str) -> None:
        n = len(obj)
        if n < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([n]) + bytes(obj))
        else:
            self.write(pickle.BINSTRING + n.to_bytes(4, "little") + bytes(obj))
        self.memoize(obj)

    dispatch = pickle._Pickler.dispatch.copy()
    dispatch[_Py2Str] = save_py2str


def _dump(obj: object, path: Path) -> None:
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    path.write_bytes(buf.getvalue())


def make_images(n: int, rng: np.random.Generator) -> np.ndarray:
    """n images uint8 (n, 32, 32, 3): a background, a rectangle and a disc of base colours."""
    yy, xx = np.mgrid[0:32, 0:32]
    images = np.empty((n, 32, 32, 3), dtype=np.int16)
    for i in range(n):
        background, box, disc = BASE_COLOURS[rng.choice(len(BASE_COLOURS), 3, replace=False)]
        img = np.broadcast_to(background, (32, 32, 3)).copy()
        y0, x0 = rng.integers(0, 20, size=2)
        h, w = rng.integers(6, 13, size=2)
        img[y0:y0 + h, x0:x0 + w] = box
        cy, cx, r = rng.integers(6, 26), rng.integers(6, 26), rng.integers(3, 7)
        img[(yy - cy) ** 2 + (xx - cx) ** 2 <= r * r] = disc
        # A diagonal gradient in [-GRADIENT, GRADIENT] on every channel, plus uniform noise.
        img += np.rint(GRADIENT * ((yy + xx) / 31.0 - 1.0)).astype(np.int16)[..., None]
        img += rng.integers(-NOISE, NOISE + 1, size=(32, 32, 3), dtype=np.int16)
        images[i] = img
    return images.astype(np.uint8)  # base colours 40/215 +- 9 never leave 0..255


def to_rows(images: np.ndarray) -> np.ndarray:
    """(N, 32, 32, 3) HWC -> (N, 3072) rows as stored: all red values, then green, then blue."""
    return images.transpose(0, 3, 1, 2).reshape(len(images), 3072)


def write_cifar10(root: Path, per_batch: int = 40, n_test: int = 40, seed: int = 0) -> np.ndarray:
    """Write `<root>/cifar-10-batches-py`; return all images, train batches first then test."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    batches = [(f"data_batch_{i}", f"training batch {i} of 5", per_batch) for i in range(1, 6)]
    batches.append(("test_batch", "testing batch 1 of 1", n_test))
    everything = []
    for name, label, n in batches:
        images = make_images(n, rng)
        labels = [int(c) for c in rng.integers(0, 10, size=n)]
        _dump({_Py2Str(b"batch_label"): _Py2Str(label.encode()),
               _Py2Str(b"labels"): labels,
               _Py2Str(b"data"): to_rows(images),
               _Py2Str(b"filenames"): [_Py2Str(f"{LABELS[c]}_s_{name}_{j:06d}.png".encode())
                                       for j, c in enumerate(labels)]},
              folder / name)
        everything.append(images)
    _dump({_Py2Str(b"num_cases_per_batch"): per_batch,
           _Py2Str(b"label_names"): [_Py2Str(s.encode()) for s in LABELS],
           _Py2Str(b"num_vis"): 3072},
          folder / "batches.meta")
    return np.concatenate(everything)


if __name__ == "__main__":
    import sys

    write_cifar10(Path(sys.argv[1]))
