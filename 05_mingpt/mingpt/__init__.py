"""minGPT's library: the model, its data, its parallelisms and the training loop.

The scripts beside this package (main.py, sample.py, launch.py, prepare.py, model_size.py)
use it; each module owns one concern (README: Reading order):

    model        the GPT itself, with no distributed code
    config       compose gpt2_train_cfg.yaml with overrides, check every key once
    data/        one module per kind of data, behind one protocol (data/__init__.py)
    parallel/    one module per strategy, and the registry of strategies (parallel/__init__.py)
    optim        AdamW and the learning-rate schedule
    precision    autocast, the fp16 loss scaler, FSDP's mixed-precision policy
    trainer      the training loop; log: what its logs report (mfu, memory: their probes)
    snapshot     the snapshot formats and their commit; storage: local disk or S3
    savers       a save blocking the loop, or written in the background (async_save)
    errors       one `error:` line, agreed by every rank
    devices, faults, pretrained: the device and backend, fault injection, GPT-2 weights
"""
from pathlib import Path

# 05_mingpt/, the folder of the scripts and the yaml configs: relative paths in the config
# (data, runs) are relative to it, wherever a command is started.
ROOT = Path(__file__).resolve().parent.parent
