"""The notebooks run top to bottom (papermill) with small parameters and draw their figures.

Only the parameters cell changes: a tiny model and a few steps, the offline CIFAR-10 fixture, and
run directories in tmp_path. Every other cell is the code a user runs, training included
(torchrun with 2 CPU processes).
"""
import re
import textwrap
from pathlib import Path

import nbformat
import papermill
import pytest

from cifar_fixture import HALF_WIDTH, write_cifar10
from conftest import PYTHON, REPO, run

NOTEBOOKS = REPO / "notebooks"
# Logged by the trainer, streamed into the training cells.
TRAIN_LOG = re.compile(r"^step (\d+)/(\d+) \| loss", re.M)
VAL_LOG = re.compile(r"^step (\d+) \| val loss", re.M)
CHAR_TINY = ["gpt_config.n_layer=2", "gpt_config.n_head=2", "gpt_config.n_embd=32",
             "gpt_config.model_type=null", "gpt_config.block_size=32",
             "trainer_config.batch_size=8", "trainer_config.max_steps=10",
             "trainer_config.warmup_steps=2", "trainer_config.log_every=5",
             "trainer_config.eval_every=5", "trainer_config.eval_batches=2",
             "trainer_config.save_every=0", "trainer_config.sample_tokens=0"]


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    # The kernel (and the torchrun it starts) inherits these, as conftest.child_env does:
    # the CPU path even where a GPU exists, and one thread per process on a busy machine.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def execute(name: str, out: Path, **parameters) -> nbformat.NotebookNode:
    """Run a notebook as Jupyter would (the python3 kernel of this venv, cwd notebooks/).

    papermill raises PapermillExecutionError, with the traceback, when any cell fails.
    """
    papermill.execute_notebook(NOTEBOOKS / name, out, parameters=parameters,
                               kernel_name="python3", cwd=NOTEBOOKS, progress_bar=False)
    return nbformat.read(out, as_version=4)


def cell(nb: nbformat.NotebookNode, snippet: str) -> nbformat.NotebookNode:
    """The one code cell whose source contains snippet."""
    found = [c for c in nb.cells if c.cell_type == "code" and snippet in c.source]
    assert len(found) == 1, snippet
    return found[0]


def text(c: nbformat.NotebookNode) -> str:
    """Everything a cell printed (stdout and stderr streams)."""
    return "".join(o.text for o in c.outputs if o.output_type == "stream")


def pngs(c: nbformat.NotebookNode) -> int:
    return sum("image/png" in o.get("data", {}) for o in c.outputs)


def assert_no_errors(nb: nbformat.NotebookNode) -> None:
    for c in nb.cells:
        if c.cell_type == "code":
            assert not [o for o in c.outputs if o.output_type == "error"], c.source


def test_play_image(tmp_path):
    root = tmp_path / "cifar"
    write_cifar10(root)  # 200 training and 40 test images, official layout
    run_dir = tmp_path / "run"
    nb = execute("play_image.ipynb", tmp_path / "play_image.ipynb",
                 PRESET="cifar10_tiny", DATA_ROOT=str(root), DOWNLOAD=False, CHECK_MD5=False,
                 RUN_DIR=str(run_dir), NPROC=2,
                 OVERRIDES=["trainer_config.max_steps=6", "trainer_config.log_every=2",
                            "trainer_config.eval_every=3", "trainer_config.eval_batches=1",
                            "trainer_config.warmup_steps=2", "trainer_config.batch_size=4"])
    assert_no_errors(nb)
    assert f"preset cifar10_tiny, run dir {run_dir}" in text(cell(nb, "nbutils.compose_config"))

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
    assert "torchrun --standalone --nproc_per_node=2 main.py data_config=cifar10_tiny" in train
    assert "world size 2" in train and "final val loss" in train
    train_steps = [int(s) for s, _ in TRAIN_LOG.findall(train)]
    assert train_steps == [2, 4, 6]
    assert (run_dir / "snapshot").is_file()

    sampled = cell(nb, "sample_sequences(")
    assert "sampled 32 images of 32x32 pixels" in text(sampled)
    assert pngs(sampled) == 1
    assert pngs(cell(nb, "model.wpe.weight")) == 1

    losses = cell(nb, "read_scalars(RUN_DIR)")
    # One point per log line of the run, read back from its TensorBoard files.
    assert f"train/loss: {len(train_steps)} points" in text(losses)
    assert f"val/loss: {len(VAL_LOG.findall(train))} points" in text(losses)
    assert pngs(losses) == 1

    # The cached sampler used above draws what model.generate draws (the same tokens for the
    # same seed), on the snapshot the notebook trained. And running the training cell again
    # uses the finished snapshot instead of training.
    overrides = ["data_config=cifar10_tiny", f"data_config.root={root}",
                 "data_config.download=false", "trainer_config.max_steps=6"]
    check = textwrap.dedent(f"""
        import torch, nbutils
        nbutils.train({overrides!r}, nbutils.Path({str(run_dir)!r}))
        model, meta = nbutils.load_model(nbutils.Path({str(run_dir / "snapshot")!r}), "cpu")
        first = torch.tensor([0, 3, 7, 15])
        for kw in ({{"do_sample": False}}, {{"top_k": 5}}, {{"temperature": 2.0}}):
            torch.manual_seed(0)
            a = nbutils.sample_sequences(model, first, 50, **kw)
            torch.manual_seed(0)
            b = model.generate(first.view(-1, 1), 49, **kw)
            assert a.shape == (4, 50) and torch.equal(a, b), kw
        print("same")
    """)
    out = run([PYTHON, "-c", check], cwd=NOTEBOOKS, timeout=120).stdout
    assert out.splitlines() == [f"{run_dir}/snapshot has finished training (step 6 of 6): using "
                                f"it. Delete {run_dir} to train again.", "same"]


def test_play_char(tmp_path):
    runs = tmp_path / "runs"
    nb = execute("play_char.ipynb", tmp_path / "play_char.ipynb", NPROC=2, RUNS_DIR=str(runs),
                 OVERRIDES=CHAR_TINY, PROMPTS=["ROMEO:", "\n"], NUM_TOKENS=20)
    assert_no_errors(nb)
    logs = {}
    for method in ("ddp", "fsdp"):
        out = text(cell(nb, f"distributed_method={method}\"]"))
        assert f"distributed_method: {method}" in out and "world size 2" in out
        logs[method] = out
        assert [int(s) for s, _ in TRAIN_LOG.findall(out)] == [5, 10]
    assert (runs / "ddp" / "snapshot").is_file()
    assert (runs / "fsdp" / "snapshot" / "latest").is_file()  # a sharded (DCP) snapshot

    generated = text(cell(nb, "generate_text("))
    for prompt in ("ROMEO:", "\n"):
        # The prompt and NUM_TOKENS characters after it.
        sample = generated.split(f"--- {prompt!r}\n", 1)[1]
        assert sample.startswith(prompt) and len(sample.split("\n\n--- ")[0]) >= 20 + len(prompt)
    assert "from the FSDP snapshot\nROMEO:" in generated

    curve = cell(nb, "scalars = {method")
    assert f"train/loss: {len(TRAIN_LOG.findall(logs['ddp']))} points" in text(curve)
    assert f"val/loss: {len(VAL_LOG.findall(logs['ddp']))} points" in text(curve)
    assert pngs(curve) == 1

    compare = cell(nb, "ax_mem")
    assert pngs(compare) == 1
    header, *rows = text(compare).strip().splitlines()
    assert header.endswith("rank 0 MB   rank 1 MB")  # one memory bar per rank, per run
    table = {row.split()[0]: [float(v) for v in row.split()[1:]] for row in rows}
    assert set(table) == {"ddp", "fsdp"}
    for values in table.values():
        val, speed, *memory = values
        assert len(memory) == 2 and min(memory) > 0 and speed > 0
    # Same seed and data: FSDP computes what DDP computes, up to float rounding.
    assert abs(table["ddp"][0] - table["fsdp"][0]) < 0.005, text(compare)
