"""Helpers shared by the notebooks: train with 05_mingpt's trainer, read its logs and snapshots.

    import nbutils                       # also puts 05_mingpt/ on sys.path: `import mingpt` works
    cfg = nbutils.compose_config(["data_config=cifar10_tiny"])   # the config main.py will see
    nbutils.train(["data_config=cifar10_tiny"], run_dir, nproc=2)  # torchrun main.py ...
    scalars = nbutils.read_scalars(run_dir)  # {"train/loss": (steps, values), ...}

The notebooks run the trainer exactly as a user does on the command line (`torchrun ... main.py
overrides`), and only read what it leaves behind: the snapshot and the TensorBoard logs.
"""
import re
import subprocess
import sys
from pathlib import Path

MINGPT = Path(__file__).resolve().parent.parent / "05_mingpt"
# 05_mingpt holds the scripts and the `mingpt` package: both import from that folder.
sys.path.insert(0, str(MINGPT))

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import launch  # noqa: E402
import sample  # noqa: E402
from mingpt import config, snapshot  # noqa: E402
from mingpt.model import GPT  # noqa: E402

# The trainer's log lines: "training steps 0..200: ..." once, "step 20/200 | loss ..." per log.
START_LINE = re.compile(r"training steps (\d+)\.\.(\d+)")
STEP_LINE = re.compile(r"step (\d+)/(\d+) \| loss")


def compose_config(overrides: list[str]) -> DictConfig:
    """The config main.py composes from these overrides; ValueError (one line) on a mistake."""
    return config.load(overrides)  # main.py's own composition and checks


def snapshot_step(path: Path) -> int | None:
    """The next step a snapshot would train; None if none exists."""
    kind = snapshot.snapshot_kind(str(path))
    if kind is None:
        return None
    return snapshot.load_train_state(str(path), kind)["step"]


def torchrun(overrides: list[str], nproc: int | None = None) -> None:
    """`torchrun --standalone --nproc_per_node=N main.py *overrides` in 05_mingpt, built by
    launch.py's own functions as `python launch.py` builds it: N (None: one per GPU, else 2 to
    4 CPU processes), the workers' environment and the command line; no restarts here.

    The output is streamed into the cell line by line, with a progress bar over the steps; a
    failed run raises RuntimeError (the trainer's `error: ...` line is the last one printed).
    """
    cpu = launch.on_cpu(overrides)
    nproc = launch.process_count(nproc, cpu)
    command = launch.torchrun_command(nproc, 0, overrides)  # 0: no restarts
    print(" ".join(command), flush=True)
    env = {**launch.worker_env(nproc, cpu), "PYTHONUNBUFFERED": "1"}  # lines as they come
    bar = None
    with subprocess.Popen(command, cwd=MINGPT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            if start := START_LINE.search(line):
                bar = tqdm(total=int(start[2]), initial=int(start[1]), desc="steps",
                           unit="step")
            elif bar is not None and (step := STEP_LINE.search(line)):
                bar.update(int(step[1]) - bar.n)
            print(line, end="", flush=True)
    if bar is not None:
        bar.close()
    if proc.returncode != 0:
        raise RuntimeError(f"training failed with exit code {proc.returncode}; see its output")


def train(overrides: list[str], run_dir: Path, nproc: int | None = None) -> None:
    """Train into run_dir (snapshot and TensorBoard logs), unless its snapshot is finished.

    A run stopped half-way resumes from its snapshot: main.py does that by itself.
    """
    overrides = [*overrides, f"run_dir={run_dir}"]
    max_steps = compose_config(overrides).trainer_config.max_steps
    step = snapshot_step(run_dir / "snapshot")
    if step is not None and step >= max_steps:
        print(f"{run_dir / 'snapshot'} has finished training (step {step} of {max_steps}): "
              f"using it. Delete {run_dir} to train again.")
        return
    torchrun(overrides, nproc)


def load_model(path: Path, device: torch.device) -> tuple[GPT, dict]:
    """The model in a snapshot (any layout's), in eval mode, and its data meta."""
    model, meta = sample.load_model(str(path), device)
    return model.eval(), meta


def read_scalars(run_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Every scalar the trainer logged: {tag: (steps, values)}, steps ascending."""
    # size_guidance 0 keeps every event (the default keeps a sample of 10,000 per tag).
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()  # reads every event file in the folder: a resumed run adds one more
    scalars = {}
    for tag in events.Tags()["scalars"]:
        # A resumed or re-evaluated run can log a step twice: keep the newest value.
        by_step = {e.step: e.value for e in events.Scalars(tag)}
        steps = sorted(by_step)
        scalars[tag] = (steps, [by_step[s] for s in steps])
    return scalars


def peak_memory_mb(scalars: dict) -> list[float]:
    """The peak memory of each rank over the whole run (the trainer logs a running maximum)."""
    ranks = sorted(int(tag.removeprefix("memory/peak_mb_rank")) for tag in scalars
                   if tag.startswith("memory/peak_mb_rank"))
    return [max(scalars[f"memory/peak_mb_rank{r}"][1]) for r in ranks]


def show_images(images: torch.Tensor | np.ndarray, rows: int, cols: int, title: str = "",
                size: float = 1.2) -> plt.Figure:
    """uint8 images (N, 32, 32, 3), N = rows * cols, as one grid figure."""
    fig, axes = plt.subplots(rows, cols, figsize=(cols * size, rows * size + 0.4),
                             squeeze=False)
    for ax, image in zip(axes.flat, np.asarray(images), strict=True):
        ax.imshow(image, interpolation="nearest")  # nearest: show pixels, do not blur them
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
