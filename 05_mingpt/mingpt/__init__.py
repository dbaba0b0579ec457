"""minGPT's library: the model, its data, its parallelisms and the training loop, used by the
scripts beside this package; each module owns one concern (README: Reading order).
"""
import atexit
import gc
from pathlib import Path

# 05_mingpt/, the folder of the scripts and the yaml configs: relative paths in the config
# (data, runs) are relative to it, wherever a command is started.
ROOT = Path(__file__).resolve().parent.parent

# At its exit the interpreter garbage-collects every object still alive, the hundreds of
# thousands torch's import made among them: about 1 s of CPU in each rank of a finished run,
# 0.2 s with them frozen (bench/README.md: Snapshots and start-up). Frozen by an exit handler,
# which runs before the interpreter's own teardown, they are skipped. Nothing is lost: every
# script closes what it writes (snapshots, logs, TensorBoard) before it returns, the other
# exit handlers still run, and Python flushes stdout and stderr itself.
atexit.register(gc.freeze)
