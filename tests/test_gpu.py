"""The GPU paths (CUDA + NCCL), run where a GPU exists and skipped, saying so, where none does.

The rest of the suite forces the CPU (CUDA_VISIBLE_DEVICES=""); these tests give the GPUs back.
"""
import os
import re

import pytest
import torch

from conftest import PYTHON, REPO, TORCHRUN, run
from mingpt_helpers import copy_mingpt, tiny, val_losses

GPUS = torch.cuda.device_count()
pytestmark = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU (none on this machine)")
VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(GPUS)))


def test_step02_nccl_one_process_per_gpu(tmp_path):
    proc = run([PYTHON, str(REPO / "02_multigpu/train.py"), "3", "1", "--device", "cuda"],
               cwd=tmp_path, CUDA_VISIBLE_DEVICES=VISIBLE)
    assert f"[cuda:0] Epoch 2 | Batchsize: 32 | Steps: {2048 // 32 // GPUS}" in proc.stdout
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True, map_location="cpu")
    assert all(t.device.type == "cpu" for t in state.values())


def test_step03_nccl_resume(tmp_path):
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={GPUS}",
           str(REPO / "03_torchrun_fault_tolerance/train.py"), "--device", "cuda"]
    run([*cmd, "2", "1"], cwd=tmp_path, CUDA_VISIBLE_DEVICES=VISIBLE)
    proc = run([*cmd, "3", "1"], cwd=tmp_path, CUDA_VISIBLE_DEVICES=VISIBLE)
    assert "Resuming training from snapshot at epoch 2" in proc.stdout


@pytest.mark.parametrize("method", ["ddp", "fsdp"])
def test_mingpt_bf16_on_gpu(tmp_path, method):
    mingpt = copy_mingpt(tmp_path)
    proc = run([TORCHRUN, "--standalone", f"--nproc_per_node={GPUS}", "main.py",
                *tiny(f"run_name={method}", f"trainer_config.distributed_method={method}",
                      "trainer_config.precision=bf16", "trainer_config.eval_every=5")],
               cwd=mingpt, CUDA_VISIBLE_DEVICES=VISIBLE)
    assert re.search(r"device cuda", proc.stdout), proc.stdout[:2000]
    losses = val_losses(proc.stdout)  # {step: val loss}
    assert losses[max(losses)] < losses[0]
    assert "backend nccl" in proc.stdout
