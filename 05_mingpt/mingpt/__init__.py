"""minGPT's library: the model, its data, its parallelisms and the training loop, used by the
scripts beside this package; each module owns one concern (README: Reading order).
"""
from pathlib import Path

# 05_mingpt/, the folder of the scripts and the yaml configs: relative paths in the config
# (data, runs) are relative to it, wherever a command is started.
ROOT = Path(__file__).resolve().parent.parent
