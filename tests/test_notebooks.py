"""The notebooks run top to bottom (papermill) with their default parameters and draw their
figures; launch.py's functions, which start their training runs, have a fast unit test.

Only sizes change in the parameters cell: a tiny model, a few steps, short samples. Everything
else keeps its default, NPROC (None: what launch.py picks) included, so each notebook runs in a
copy of notebooks/ and 05_mingpt/ (its default run and data directories are in 05_mingpt/). The
CIFAR-10 stand-in is a small dataset in the official layout at the default DATA_ROOT; it is not
the official release, hence CHECK_MD5=False. Every other cell is the code a user runs, training
included (torchrun with CPU processes).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from cifar_fixture import HALF_WIDTH, write_cifar10
from conftest import PYTHON, REPO, run
from mingpt_helpers import is_mingpt_module, mingpt_imported

if TYPE_CHECKING:
    from nbformat import NotebookNode

NOTEBOOKS = REPO / "notebooks"
MINGPT = REPO / "05_mingpt"
# Logged by the trainer, streamed into the training cells.
TRAIN_LOG = re.compile(r"^step (\d+)/(\d+) \| loss", re.M)
VAL_LOG = re.compile(r"^step (\d+) \| val loss", re.M)
CHAR_TINY = ["gpt_config.n_layer=2", "gpt_config.n_head=2", "gpt_config.n_embd=32",
             "gpt_config.model_type=null", "gpt_config.block_size=32",
             "trainer_config.batch_size=8", "trainer_config.max_steps=10",
             "trainer_config.warmup_steps=2", "trainer_config.log_every=5",
             "trainer_config.eval_every=5", "trainer_config.eval_batches=2",
             "trainer_config.save_every=0", "trainer_config.sample_tokens=0"]
IMAGE_TINY = ["trainer_config.max_steps=6", "trainer_config.log_every=2",
              "trainer_config.eval_every=3", "trainer_config.eval_batches=1",
              "trainer_config.warmup_steps=2", "trainer_config.batch_size=4"]


def load_launch():
    """05_mingpt/launch.py, imported from its file under a name of its own (05_mingpt/ is not
    on this test process's sys.path)."""
    spec = importlib.util.spec_from_file_location("mingpt_launch", MINGPT / "launch.py")
    module = importlib.util.module_from_spec(spec)
    with mingpt_imported():  # launch.py imports mingpt.errors, as 05_mingpt's scripts do
        spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def nbutils_imported(notebooks: Path):
    """notebooks/nbutils.py of a checkout, imported here with the 05_mingpt modules it imports
    (it puts its 05_mingpt/ on sys.path); afterwards sys.path and sys.modules are as before,
    so modules of the same names (the steps', the repository's 05) are untouched."""
    before, path = dict(sys.modules), list(sys.path)
    sys.path.insert(0, str(notebooks))
    for name in [n for n in sys.modules if is_mingpt_module(n) or n == "nbutils"]:
        sys.modules.pop(name)  # imported from elsewhere
    try:
        yield importlib.import_module("nbutils")
    finally:
        sys.path[:] = path
        root = notebooks.parent
        for name, module in list(sys.modules.items()):
            if root in Path(getattr(module, "__file__", None) or "/").parents:
                del sys.modules[name]
        sys.modules.update({n: m for n, m in before.items() if n not in sys.modules})


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    # The kernel (and the torchrun it starts) inherits these, as conftest.child_env does:
    # the CPU path even where a GPU exists, and one thread per process on a busy machine.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


@pytest.fixture
def checkout(tmp_path) -> Path:
    """notebooks/ and 05_mingpt/ side by side, without earlier runs or data: the notebooks'
    default run and data directories (relative to 05_mingpt/) land in tmp_path."""
    shutil.copytree(NOTEBOOKS, tmp_path / "notebooks", ignore=shutil.ignore_patterns(
        "__pycache__", ".ipynb_checkpoints"))
    shutil.copytree(MINGPT, tmp_path / "05_mingpt", ignore=shutil.ignore_patterns(
        "__pycache__", "runs", "outputs", "cifar10"))
    return tmp_path


def execute(checkout: Path, name: str, **parameters) -> NotebookNode:
    """Run the copy of a notebook as Jupyter would (the python3 kernel of this venv, cwd its
    notebooks/), with these parameters changed and every other one at its default.

    papermill raises PapermillExecutionError, with the traceback, when any cell fails.
    """
    import papermill  # imported here, not at collection: see read()

    folder = checkout / "notebooks"
    out = checkout / f"out_{name}"
    papermill.execute_notebook(folder / name, out, parameters=parameters,
                               kernel_name="python3", cwd=folder, progress_bar=False)
    nb = read(out)
    injected = [c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])]
    # papermill injects a cell only for parameters given; NPROC is never one (it stays None).
    assert len(injected) == (1 if parameters else 0)
    assert not any("NPROC" in c.source for c in injected)
    return nb


def read(path: Path) -> NotebookNode:
    # nbformat takes 3 s to import here (its schema checker builds a URI grammar); imported
    # at collection, every pytest worker would pay it, not only the one that runs this file.
    import nbformat

    return nbformat.read(path, as_version=4)


def cell(nb: NotebookNode, snippet: str) -> NotebookNode:
    """The one code cell whose source contains snippet."""
    found = [c for c in nb.cells if c.cell_type == "code" and snippet in c.source]
    assert len(found) == 1, snippet
    return found[0]


def text(c: NotebookNode) -> str:
    """Everything a cell printed (stdout and stderr streams)."""
    return "".join(o.text for o in c.outputs if o.output_type == "stream")


def pngs(c: NotebookNode) -> int:
    return sum("image/png" in o.get("data", {}) for o in c.outputs)


def assert_no_errors(nb: NotebookNode) -> None:
    for c in nb.cells:
        if c.cell_type == "code":
            assert not [o for o in c.outputs if o.output_type == "error"], c.source


def test_play_image(checkout):
    mingpt = checkout / "05_mingpt"
    root = mingpt / "data/cifar10"  # the default DATA_ROOT
    write_cifar10(root)  # 200 training and 40 test images, official layout
    nproc = load_launch().default_nproc(cpu=True)  # NPROC = None without a GPU
    nb = execute(checkout, "play_image.ipynb", CHECK_MD5=False, OVERRIDES=IMAGE_TINY)
    assert_no_errors(nb)
    # PRESET = "auto" without a GPU, and the default RUN_DIR in (the copy of) 05_mingpt.
    run_dir = mingpt / "runs/notebook_cifar10_tiny"
    assert f"preset cifar10_tiny, run dir {run_dir}, device cpu" in text(
        cell(nb, "nbutils.compose_config"))

    data = cell(nb, "build_datasets")
    assert "200 training and 40 validation images, 16 colours" in text(data)
    # The fixture's pixels lie within HALF_WIDTH of 8 colours: 16 k-means colours are closer.
    error = float(re.search(r"quantisation: ([\d.]+) of 255", text(data))[1])
    assert 0 < error < HALF_WIDTH
    assert pngs(data) == 2  # before and after quantisation
    assert (root / "palette_k16_n200_p5_s1337.npy").is_file()  # next to the data

    train_cell = cell(nb, "nbutils.train(")
    train = text(train_cell)
    bars = [o.data["text/plain"] for o in train_cell.outputs if o.output_type == "display_data"]
    assert len(bars) == 1 and bars[0].startswith("steps:")  # the progress bar (a widget)
    # The command launch.py builds, with its default process count for a CPU.
    assert train.splitlines()[0] == " ".join([
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", "--max-restarts=0", str(mingpt / "main.py"),
        "data_config=cifar10_tiny", "data_config.root=data/cifar10", "data_config.download=true",
        "data_config.check_md5=false", *IMAGE_TINY, f"run_dir={run_dir}"])
    assert f"world size {nproc}" in train and "final val loss" in train
    train_steps = [int(s) for s, _ in TRAIN_LOG.findall(train)]
    assert train_steps == [2, 4, 6]
    assert (run_dir / "snapshot" / "latest").is_file()

    sampled = cell(nb, "model.generate(")
    assert "sampled 32 images of 32x32 pixels" in text(sampled)
    assert "warning:" not in text(sampled)  # a ddp snapshot file: weights_only=True
    assert pngs(sampled) == 1
    assert pngs(cell(nb, "model.wpe.weight")) == 1

    losses = cell(nb, "read_scalars(RUN_DIR)")
    # One point per log line of the run, read back from its TensorBoard files.
    assert f"train/loss: {len(train_steps)} points" in text(losses)
    assert f"val/loss: {len(VAL_LOG.findall(train))} points" in text(losses)
    assert pngs(losses) == 1

    # model.generate, with its KV cache, draws what generating by running the whole sequence
    # for every new pixel draws (the same tokens for the same seed), on the snapshot the
    # notebook trained. And running the training cell again uses the finished snapshot
    # instead of training. (nbutils in this process, as the notebook's kernel imports it.)
    overrides = ["data_config=cifar10_tiny", "data_config.check_md5=false",
                 "trainer_config.max_steps=6"]
    with nbutils_imported(checkout / "notebooks") as nbutils, \
            contextlib.redirect_stdout(io.StringIO()) as out, torch.random.fork_rng():
        nbutils.train(overrides, run_dir)
        model, meta = nbutils.load_model(run_dir / "snapshot", "cpu")
        next_token = sys.modules["mingpt.model"].next_token
        first = torch.tensor([0, 3, 7, 15])
        for kw in ({"do_sample": False}, {"top_k": 5}, {"temperature": 2.0}):
            torch.manual_seed(0)
            a = model.generate(first.view(-1, 1), 49, **kw)
            torch.manual_seed(0)
            b = first.view(-1, 1)
            with torch.no_grad():
                for _ in range(49):
                    logits, _ = model(b)
                    b = torch.cat((b, next_token(logits[:, -1, :], **kw)), dim=1)
            assert a.shape == (4, 50) and torch.equal(a, b), kw
    assert out.getvalue().splitlines() == [
        f"{run_dir}/snapshot has finished training (step 6 of 6): using it. Delete {run_dir} "
        "to train again."]


def test_play_char(checkout):
    mingpt = checkout / "05_mingpt"
    runs = mingpt / "runs/notebook_char"  # the default RUNS_DIR
    nproc = load_launch().default_nproc(cpu=True)  # NPROC = None without a GPU
    nb = execute(checkout, "play_char.ipynb", OVERRIDES=CHAR_TINY, NUM_TOKENS=20)
    assert_no_errors(nb)
    assert f"runs in {runs}, device cpu" in text(cell(nb, "RUNS = {method"))
    logs = {}
    for method in ("ddp", "fsdp"):
        out = text(cell(nb, f"distributed_method={method}\"]"))
        assert out.splitlines()[0] == " ".join([
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "--max-restarts=0", str(mingpt / "main.py"), *CHAR_TINY,
            f"trainer_config.distributed_method={method}", f"run_dir={runs / method}"])
        assert f"distributed_method: {method}" in out and f"world size {nproc}" in out
        logs[method] = out
        assert [int(s) for s, _ in TRAIN_LOG.findall(out)] == [5, 10]
    assert (runs / "ddp" / "snapshot" / "latest").is_file()  # DCP's, as every layout's
    assert (runs / "fsdp" / "snapshot" / "latest").is_file()

    generated = text(cell(nb, "generate_text("))
    for prompt in ("ROMEO:", "O God, O God!", "\n"):  # the default PROMPTS
        # The prompt and NUM_TOKENS characters after it.
        sample = generated.split(f"--- {prompt!r}\n", 1)[1]
        assert sample.startswith(prompt) and len(sample.split("\n\n--- ")[0]) >= 20 + len(prompt)
    assert "from the FSDP snapshot\nROMEO:" in generated
    # Neither load warns: DCP's pickles are read as safely as the file (storage.load_dcp).
    assert not [line for line in generated.splitlines() if line.startswith("warning:")], generated

    curve = cell(nb, "scalars = {method")
    assert f"train/loss: {len(TRAIN_LOG.findall(logs['ddp']))} points" in text(curve)
    assert f"val/loss: {len(VAL_LOG.findall(logs['ddp']))} points" in text(curve)
    assert pngs(curve) == 1

    compare = cell(nb, "ax_mem")
    assert pngs(compare) == 1
    header, *rows = text(compare).strip().splitlines()
    # One memory bar per rank, per run.
    assert header.endswith("   ".join(f"rank {r} MB" for r in range(nproc)))
    table = {row.split()[0]: [float(v) for v in row.split()[1:]] for row in rows}
    assert set(table) == {"ddp", "fsdp"}
    for values in table.values():
        val, speed, *memory = values
        assert len(memory) == nproc and min(memory) > 0 and speed > 0
    # Same seed and data: FSDP computes what DDP computes, up to float rounding.
    assert abs(table["ddp"][0] - table["fsdp"][0]) < 0.005, text(compare)


def test_play_char_states_its_default_run():
    """The timing note names the model and steps the default parameters really train."""
    defaults = OmegaConf.load(MINGPT / "gpt2_train_cfg.yaml")
    intro = read(NOTEBOOKS / "play_char.ipynb").cells[0].source
    assert (f"The default parameters train `{defaults.gpt_config.model_type}`" in intro
            and f"for {defaults.trainer_config.max_steps} steps per run" in intro), intro


def processes_with(variable: str, value: str) -> list[str]:
    """`pid cmdline` of every process (but this one) whose environment has variable=value:
    the descendants of a process that had it, wherever they were re-parented to."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            if f"{variable}={value}".encode() in environ:
                found.append(f"{proc.name} {(proc / 'cmdline').read_bytes()!r}")
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


def test_pitfalls(checkout, monkeypatch):
    """pitfalls.ipynb with its defaults: every section asserts what it shows in the notebook
    itself (a failed assert fails the run); here, the numbers it printed, its figures, its
    time, and that no process it started outlives it."""
    shutil.copytree(REPO / "02_multigpu", checkout / "02_multigpu",  # its helpers use step 02
                    ignore=shutil.ignore_patterns("__pycache__", "*.pt"))
    # Every process the kernel starts inherits this: any left afterwards is the notebook's.
    token = f"{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("PITFALLS_TEST_RUN", token)
    started = time.monotonic()
    nb = execute(checkout, "pitfalls.ipynb")
    seconds = time.monotonic() - started
    assert_no_errors(nb)
    # papermill has shut the kernel down; the fork server and its workers must be gone too
    # (a few seconds of grace: an exiting process can still be listed for a moment).
    deadline = time.monotonic() + 10
    while (left := processes_with("PITFALLS_TEST_RUN", token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left
    accum = int(re.search(r"^ACCUM = (\d+)", cell(nb, "ACCUM =").source, re.M)[1])

    hang = text(cell(nb, "ph.launch(ph.hang"))
    assert hang.count("Timed out waiting") >= 1 and hang.count("finished") == 2, hang
    assert "#1 differs: rank 0 #1 all_reduce [[]] Float; rank 1 #1 barrier []" in hang

    counts = {(m[1], m[2]): int(m[3]) for m in re.finditer(
        r"(ddp|fsdp) +sync (every|backward only|last) *: +(\d+) all-reduces",
        text(cell(nb, "ph.accumulate")))}
    # DDP: one bucket for the tiny GPT; FSDP2: 2 blocks and the root, each reduced once.
    assert counts == {("ddp", "every"): accum, ("ddp", "backward only"): accum,
                      ("ddp", "last"): 1, ("fsdp", "every"): 3 * accum, ("fsdp", "last"): 3}

    uneven = text(cell(nb, "ph.uneven"))
    for line in ("no Join rank 0: 4 of 5 batches", "no Join rank 1: 4 of 4 batches",
                 "Join    rank 0: 5 of 5 batches", "Join    rank 1: 4 of 4 batches"):
        assert line in uneven, uneven

    batches = text(cell(nb, "ph.step02_train"))
    losses = {m[1]: (int(m[2]), [float(v) for v in m[3].split(", ")]) for m in re.finditer(
        r"^(.+?): (\d+) steps per epoch, losses \[(.+)\]$", batches, re.M)}
    assert [steps for steps, _ in losses.values()] == [64, 64, 16], batches
    # Printed to 4 decimals: the same global batch within one unit of the last one.
    same = np.array(losses["1 rank x 32"][1]) - np.array(losses["4 ranks x 8"][1])
    assert np.abs(same).max() <= 1.5e-4 and len(same) == 3, batches

    spread = text(cell(nb, "ph.replicas"))
    by_hand, ddp = (re.search(rf"^{name} *: (.+)$", spread, re.M)[1].split()
                    for name in ("by hand", "DDP"))
    assert len(set(by_hand)) == 1 and float(by_hand[0]) > 0.1, spread
    assert ddp[0] == by_hand[0] and set(ddp[1:]) == {"0"}, spread

    interface = text(cell(nb, "GLOO_SOCKET_IFNAME"))
    assert "Unable to find address for" in interface
    assert "all-reduce of 1 + 2 = [3.0, 3.0]" in interface

    reshard = text(cell(nb, "ph.reshard_save"))
    loaded = re.search(r"loaded on 3 ranks: (\d+) of (\d+) tensors bit for bit", reshard)
    assert loaded[1] == loaded[2] and int(loaded[1]) > 0, reshard

    fit = text(cell(nb, "ph.launch(ph.fit"))
    held = re.findall(r"held (\{.+\})", fit)
    assert len(held) == 4 and held == re.findall(r"predicted (\{.+\})", fit), fit

    resume = text(cell(nb, "ph.epoch_orders"))
    ways = {m[1]: tuple(int(v) for v in m.groups()[1:]) for m in re.finditer(
        r"^(.+?) *: +(\d+) samples once, +(\d+) twice, +(\d+) never$", resume, re.M)}
    # The notebook's sizes: 40 samples; 2 ranks x 3 steps x 4 trained 24 before the restart.
    size, trained, world, skipped = 40, 24, 3, 3 * 4
    # From the start: the 24 again, and the rest but the last size % world (drop_last).
    # Skipping 3 batches of the 13 each rank is now dealt leaves 1 each (positions 36-38 of
    # the permutation, none among the first 24). rank_indices: the 16 left, dealt to 3 ranks.
    after = world * (size // world - skipped)
    assert ways == {
        "from the start": (size - trained - size % world, trained, size % world),
        "skip trained batches": (trained + after, 0, size - trained - after),
        "rank_indices": (size - (size - trained) % world, 0, (size - trained) % world)}, resume

    for snippet in ("ph.accumulate", "ph.sampler_orders", "ph.step02_train", "ph.replicas",
                    "ph.reshard_save", "ph.launch(ph.fit", "ph.epoch_orders"):
        assert pngs(cell(nb, snippet)) == 1, snippet
    end = text(cell(nb, "ph.shutdown()"))
    ran = int(re.search(r"child processes left: 0; the notebook ran (\d+) s", end)[1])
    # The notebook's budget: under 5 minutes on a 2-core CPU, the kernel's start included.
    assert ran <= seconds < 300, (ran, seconds)


def test_comm_lab(checkout):
    """comm_lab.ipynb with its defaults: each section asserts in the notebook what it shows
    (busbw climbing with size, the all-reduce's bytes as a reduce-scatter's and an
    all-gather's, fewer calls for larger buckets, half the bytes for fp16 and bf16, PowerSGD's
    compression, buckets overlapping backward); here, that it ran and what it printed and
    drew."""
    shutil.copytree(REPO / "02_multigpu", checkout / "02_multigpu",  # pitfalls_helpers' imports
                    ignore=shutil.ignore_patterns("__pycache__", "*.pt"))
    nb = execute(checkout, "comm_lab.ipynb")
    assert_no_errors(nb)
    assert pngs(cell(nb, "ch.sizes_sweep")) == 1
    buckets = text(cell(nb, "ch.bucket_sweep"))
    assert len(re.findall(r"^bucket_cap_mb +\d+: +\d+ all-reduces", buckets, re.M)) == 4, buckets
    hooks = text(cell(nb, "ch.hooks"))
    ratios = {m[1]: float(m[2]) for m in re.finditer(r"(powersgd\d): .* ([0-9.]+)x compressed",
                                                      hooks)}
    assert sorted(ratios) == ["powersgd1", "powersgd4"], hooks
    first = re.findall(r"^bucket_cap_mb +\d+: .* % of it under .* the first started +(\d+) % "
                       r"into it", text(cell(nb, "ch.overlap")), re.M)
    assert len(first) == 2, first
    # Its time is printed, not bounded here (timings stay out of tests: notebooks/README.md).
    assert re.search(r"the notebook ran \d+ s", text(cell(nb, "ch.shutdown")))


def test_links_to_pitfalls_sections_resolve():
    """Every `pitfalls.ipynb#name` link in the docs names an anchor the notebook has."""
    source = "\n".join("".join(c.source) for c in read(NOTEBOOKS / "pitfalls.ipynb").cells
                       if c.cell_type == "markdown")
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', source))
    markdown = [p for p in REPO.rglob("*.md") if not {".venv", ".venv-xla"} & set(p.parts)
                and ".pytest_cache" not in p.parts]
    links = [(p.relative_to(REPO), name) for p in markdown
             for name in re.findall(r"pitfalls\.ipynb#([\w-]+)", p.read_text())]
    assert len(links) >= 10, links  # the step READMEs' Pitfalls sections link their sections
    assert all(name in anchors for _, name in links), [link for link in links
                                                       if link[1] not in anchors]
    # And the notebook's own table of contents.
    assert set(re.findall(r"\]\(#([\w-]+)\)", source)) == anchors


def test_launch_functions(monkeypatch, tmp_path):
    """What `python launch.py` and the notebooks start: process count, environment, command."""
    launch = load_launch()
    # Without a GPU: 2 to 4 processes, whatever the core count.
    for cores, nproc in ((None, 2), (1, 2), (2, 2), (3, 3), (4, 4), (64, 4)):
        monkeypatch.setattr(launch.os, "cpu_count", lambda cores=cores: cores)
        assert launch.default_nproc(cpu=True) == nproc, cores
        assert launch.process_count(None, cpu=True) == nproc, cores
    assert launch.process_count(3, cpu=True) == 3
    with pytest.raises(ValueError, match=r"^--nproc must be >= 1, got 0$"):
        launch.process_count(0, cpu=True)
    # CPU when asked for, or when there is no GPU.
    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: True)
    assert not launch.on_cpu(["trainer_config.max_steps=5"])
    assert launch.on_cpu(["trainer_config.device=cpu"])
    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: False)
    assert launch.on_cpu([])

    # CPU processes: the 8 cores split between 3 processes (nothing about restarts: each
    # attempt's group has keys of its own, tests/test_restarts.py); values the caller set win.
    # A GPU run gets the caller's environment unchanged.
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 8)
    assert launch.worker_env(3, cpu=True, env={"PATH": "/bin"}) == {
        "PATH": "/bin", "OMP_NUM_THREADS": "2"}
    assert launch.worker_env(16, cpu=True, env={})["OMP_NUM_THREADS"] == "1"
    assert launch.worker_env(3, cpu=True, env={"OMP_NUM_THREADS": "5"})["OMP_NUM_THREADS"] == "5"
    assert launch.worker_env(3, cpu=False, env={"PATH": "/bin"}) == {"PATH": "/bin"}
    monkeypatch.setenv("LAUNCH_TEST", "1")  # the default: this process's environment
    assert launch.worker_env(3, cpu=False)["LAUNCH_TEST"] == "1"

    assert launch.torchrun_command(3, 1, ["a=1", "b=2"]) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
        "--max-restarts=1", str(MINGPT / "main.py"), "a=1", "b=2"]

    # launch.py refuses a bad count with argparse's one-line error, before starting anything.
    proc = run([PYTHON, str(MINGPT / "launch.py"), "--nproc", "0"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["error: --nproc must be >= 1, got 0"]  # one line
