"""05_mingpt/mingpt/data/image.py on a small CIFAR-10 in the official on-disk layout (offline)."""
import importlib.util
import json
import math
import pickle
import re
import sys
import textwrap

import numpy as np
import pytest
import torch
from torchvision.datasets import CIFAR10

from cifar_fixture import BASE_COLOURS, HALF_WIDTH, write_cifar10
from conftest import REPO, TORCHRUN, run
from mingpt_helpers import mingpt_imported, read_snapshot, script_in_process

MINGPT = REPO / "05_mingpt"


sys.path.insert(0, str(MINGPT))  # as 05's scripts import it
im = importlib.import_module("mingpt.data.image")
PALETTE = 32  # 32 colours for 8 base colours: several per colour group


def cfg(root, **kw) -> dict:
    # check_md5=false: the fixture has the official layout but, of course, not the official bytes.
    return {"root": str(root), "download": False, "check_md5": False,
            "palette_size": PALETTE} | kw


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    images = write_cifar10(root)  # 5 x 40 train images, then 40 test images
    train, val, meta = im.build_datasets(cfg(root), block_size=1023, seed=0)
    return root, images[:200], images[200:], train, val, meta


def test_fixture_has_the_official_layout_and_loads_through_torchvision(data):
    root, train_images, test_images, *_ = data
    folder = root / "cifar-10-batches-py"
    with open(folder / "data_batch_1", "rb") as f:  # the reader on the CIFAR-10 web page
        raw = pickle.load(f, encoding="bytes")
    assert set(raw) == {b"batch_label", b"labels", b"data", b"filenames"}
    assert raw[b"data"].dtype == np.uint8 and raw[b"data"].shape == (40, 3072)
    # Row layout: 1024 red values (row-major), then 1024 green, then 1024 blue.
    assert raw[b"data"][3, 1024 + 5 * 32 + 7] == train_images[3, 5, 7, 1]
    with open(folder / "batches.meta", "rb") as f:
        assert pickle.load(f, encoding="latin1")["label_names"][0] == "airplane"
    # torchvision's own class refuses the files only because of its hard-coded md5 sums ...
    with pytest.raises(RuntimeError, match="not found or corrupted"):
        CIFAR10(str(root), train=True, download=False)
    with pytest.raises(ValueError, match="official checksums.*check_md5=false"):
        im.build_datasets(cfg(root, check_md5=True), 1023, 0)
    # ... and check_md5=false changes nothing but those sums: no method is overridden.
    unchecked = im._UncheckedCIFAR10
    assert issubclass(unchecked, CIFAR10)
    assert not [k for k, v in vars(unchecked).items() if callable(v) and not k.startswith("__")]
    assert np.array_equal(im.load_images(root, True, False, check_md5=False), train_images)
    assert np.array_equal(im.load_images(root, False, False, check_md5=False), test_images)


def test_quantise_round_trip_is_bounded_and_exact_on_palette_colours(data):
    _, train_images, test_images, _, _, meta = data
    palette = np.array(meta["palette"], dtype=np.uint8)
    assert palette.shape == (PALETTE, 3)
    images = np.concatenate([train_images, test_images])
    rebuilt = im.dequantise(im.quantise(images, palette), palette).numpy()
    error = np.abs(rebuilt.astype(int) - images.astype(int))
    # Every pixel is within HALF_WIDTH (per channel) of one of 8 base colours; with a palette
    # colour in each such box the nearest colour is at most 2 * HALF_WIDTH away per channel.
    assert error.max() <= 2 * HALF_WIDTH
    # 32 k-means colours must reconstruct at least as well as the 8 colours the images came from.
    base = BASE_COLOURS.astype(np.uint8)
    base_error = im.dequantise(im.quantise(images, base), base).numpy().astype(int) - images
    assert (error ** 2).mean() <= (base_error ** 2).mean()
    # Every pixel gets a nearest colour (squared distance), checked by brute force on 2 images.
    noise = np.random.default_rng(1).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    got = im.quantise(noise, palette).numpy().reshape(-1)
    dist2 = ((noise.reshape(-1, 1, 3).astype(int) - palette[None].astype(int)) ** 2).sum(-1)
    assert np.array_equal(dist2[np.arange(2048), got], dist2.min(1))
    # Images made only of palette colours come back exactly, whatever their arrangement.
    indices = torch.randint(0, PALETTE, (5, 1024), generator=torch.Generator().manual_seed(0))
    exact = im.dequantise(indices, palette)
    assert exact.dtype == torch.uint8 and exact.shape == (5, 32, 32, 3)
    assert torch.equal(im.dequantise(im.quantise(exact, palette), palette), exact)


def test_items_are_next_pixel_pairs_and_meta_is_plain(data, capsys):
    root, train_images, test_images, train, val, meta = data
    assert (len(train), len(val)) == (200, 40)
    palette = np.array(meta["palette"], dtype=np.uint8)
    for dataset, images in ((train, train_images), (val, test_images)):
        for i in (0, len(dataset) - 1):
            x, y = dataset[i]
            assert x.shape == y.shape == (1023,) and x.dtype == y.dtype == torch.int64
            assert torch.equal(x[1:], y[:-1])  # y is x shifted left by one pixel
            seq = torch.cat([x, y[-1:]])
            assert torch.equal(seq, im.quantise(images[i:i + 1], palette)[0])
    assert json.loads(json.dumps(meta)) == meta  # plain types only: safe in a weights_only load
    assert meta | {"palette": None} == {
        "kind": "cifar10", "vocab_size": PALETTE, "block_size": 1023, "palette": None,
        "permutation": None, "image_size": 32, "root": str(root)}
    # A second build reads the saved palette instead of computing another one.
    path = root / f"palette_k{PALETTE}_n200_p5_s0.npy"
    mtime = path.stat().st_mtime_ns
    capsys.readouterr()
    small_train, small_val, again = im.build_datasets(
        cfg(root, max_train_images=200, max_val_images=7), 1023, 0)
    assert path.stat().st_mtime_ns == mtime and again["palette"] == meta["palette"]
    assert f"palette: {PALETTE} colours from {path}" in capsys.readouterr().out
    assert (len(small_train), len(small_val)) == (200, 7)
    # Fewer training images: another palette file, since the palette depends on them.
    fewer, _, _ = im.build_datasets(cfg(root, max_train_images=50), 1023, 0)
    assert len(fewer) == 50 and (root / f"palette_k{PALETTE}_n50_p5_s0.npy").is_file()


def test_permutation_is_fixed_and_undone_for_display(data):
    root, train_images, *_ = data
    train, _, meta = im.build_datasets(cfg(root, permute=True), 1023, 0)
    perm = torch.tensor(meta["permutation"])
    assert sorted(meta["permutation"]) == list(range(1024))
    assert torch.equal(perm, im.make_permutation(0))  # the same on every rank and every run
    x, y = train[1]
    seq = torch.cat([x, y[-1:]])[None]  # (1, 1024) in the model's (permuted) order
    plain = im.quantise(train_images[1:2], np.array(meta["palette"], dtype=np.uint8))
    assert not torch.equal(seq, plain)
    assert torch.equal(im.unpermute(seq, perm), plain)
    assert torch.equal(im.decode(seq, meta), im.dequantise(plain, meta["palette"]))
    tokens = torch.arange(3 * 1024).view(3, 1024)
    assert torch.equal(im.unpermute(im.permute(tokens, perm), perm), tokens)


def test_bad_input_is_one_clear_error(data, tmp_path):
    root = data[0]
    with pytest.raises(ValueError, match=r"CIFAR-10 not found: no .*nowhere.*data_batch_1.*"
                                         r"download=true"):
        im.build_datasets(cfg(tmp_path / "nowhere"), 1023, 0)
    assert not (tmp_path / "nowhere").exists()  # nothing created when nothing is downloaded
    with pytest.raises(ValueError, match="block_size=1023.*got 64"):
        im.build_datasets(cfg(root), 64, 0)
    with pytest.raises(ValueError, match="unknown key data_config.palete_size; allowed: name"):
        im.build_datasets(cfg(root, palete_size=16), 1023, 0)
    for key, value in (("palette_size", 1), ("palette_size", True), ("max_train_images", 0),
                       ("download", "yes"), ("root", "s3://bucket/cifar")):
        with pytest.raises(ValueError, match=f"data_config.{key} must be"):
            im.build_datasets(cfg(root) | {key: value}, 1023, 0)
    with pytest.raises(ValueError, match=r"palette_size \(4096\) is more than the \d+ distinct"):
        im.build_datasets(cfg(root, palette_size=4096, pixels_per_image=1), 1023, 0)
    # A damaged palette file is reported, and left as it is for the user to look at.
    path = root / "palette_k16_n200_p5_s9.npy"
    for content, message in ((b"not a palette", "is not a readable"), (None, "holds float64")):
        if content is None:
            np.save(path, np.zeros((16, 3)))
        else:
            path.write_bytes(content)
        before = path.read_bytes()
        with pytest.raises(ValueError, match=f"palette file {path} {message}.*delete it"):
            im.build_datasets(cfg(root, palette_size=16), 1023, 9)
        assert path.read_bytes() == before


WORKER = """
    import json, os, sys
    import torch.distributed as dist
    sys.path.insert(0, {mingpt!r})
    from mingpt.data import image as im

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    computed = []  # count this rank's k-means runs
    compute = im.compute_palette
    im.compute_palette = lambda *a, **k: computed.append(1) or compute(*a, **k)
    cfg = {{"root": {root!r}, "download": False, "check_md5": False, "palette_size": 16}}
    train, val, meta = im.build_datasets(cfg, 1023, 5)
    train2, _, meta2 = im.build_datasets(cfg, 1023, 5)  # the saved palette this time
    try:
        im.build_datasets(cfg | {{"root": {root!r} + "/missing"}}, 1023, 5)
        error = None
    except ValueError as e:
        error = str(e)
    out = {{"palette": meta["palette"], "palette2": meta2["palette"], "computed": len(computed),
           "first": train[0][0].tolist(), "last_val": val[len(val) - 1][1].tolist(),
           "error": error}}
    with open(os.path.join({root!r}, f"rank{{rank}}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
"""


def test_two_ranks_use_one_palette_computed_by_rank_0(tmp_path):
    root = tmp_path / "cifar"
    write_cifar10(root)
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER.format(mingpt=str(MINGPT), root=str(root))))
    proc = run([TORCHRUN, "--standalone", "--nproc_per_node=2", str(script)], timeout=120)
    r0, r1 = (json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (r0["computed"], r1["computed"]) == (1, 0)  # k-means ran once, on rank 0
    assert proc.stdout.count("palette: computed") == 1
    saved = np.load(root / "palette_k16_n200_p5_s5.npy")
    for r in (r0, r1):
        assert r["palette"] == r["palette2"] == saved.tolist()
    assert r0["first"] == r1["first"] and r0["last_val"] == r1["last_val"]
    # Rank 0's error reaches every rank, so the whole job stops with the same line.
    assert r0["error"] == r1["error"] and "CIFAR-10 not found" in r0["error"]


def test_presets_pass_the_trainer_config_checks():
    # The preset files are composed and validated as main.py does before training.
    with mingpt_imported() as m:
        sizes = {}
        for preset in ("cifar10", "cifar10_tiny"):
            cfg = m["config"].load([f"data_config={preset}"])
            settings = {k: v for k, v in cfg.gpt_config.items() if k != "init_from"}
            gpt = m["model"].GPT(m["model"].GPTConfig(
                **settings, vocab_size=cfg.data_config.palette_size))
            sizes[preset] = (gpt.num_params(), cfg.data_config.palette_size,
                             cfg.optimizer_config.lr)
    assert 9.5e6 < sizes["cifar10"][0] < 10.5e6 and sizes["cifar10"][1:] == (512, 0.003)
    assert sizes["cifar10_tiny"][0] < 100_000


def test_main_trains_the_tiny_preset_on_the_fixture(tmp_path):
    # The user's command with the tiny preset, pointed at the fixture: CIFAR-10 in, loss down.
    root = tmp_path / "cifar"
    write_cifar10(root)
    # In this process (the notebook test runs the same preset end to end, under torchrun).
    with mingpt_imported("main") as modules:
        proc = script_in_process(modules["main"], tmp_path, "data_config=cifar10_tiny",
                                 f"data_config.root={root}", "data_config.download=false",
                                 "data_config.check_md5=false", "trainer_config.max_steps=30",
                                 "trainer_config.eval_every=30", "run_name=img")
        assert proc.returncode == 0, proc.stderr[-2000:]
        # sample.py writes text: it refuses an image snapshot with one line, not a traceback.
        refused = script_in_process(modules["sample"], tmp_path, "--snapshot",
                                    "runs/img/snapshot")
    losses = [float(v) for v in re.findall(r"val loss (\d+\.\d+)", proc.stdout)]
    # Guessing uniformly among 16 colours costs ln 16 = 2.77; neighbouring pixels of the
    # fixture's flat shapes share a colour, which a model learns within a few dozen steps.
    assert abs(losses[0] - math.log(16)) < 0.5 and losses[-1] < 1.8, proc.stdout
    state = read_snapshot(tmp_path / "runs/img/snapshot")
    saved = np.load(root / "palette_k16_n200_p5_s1337.npy")
    assert state["data_meta"]["kind"] == "cifar10"
    assert state["data_meta"]["palette"] == saved.tolist()  # decodable from the snapshot alone
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith("was trained on cifar10 data; sample.py writes "
                                           "text (see notebooks/ for images)"), refused.stderr
