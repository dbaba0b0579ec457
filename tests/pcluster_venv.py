"""aws-parallelcluster's venv for tests/test_cluster.py, built once and kept in
.venv/aws-parallelcluster-VERSION (its pins would move the series' own stack: tests/README.md).

`python tests/pcluster_venv.py` builds it. conftest.py starts that in the background when a run
includes test_cluster.py and the venv is missing: pip's download (most of the 85 s it took with
nothing in its cache) then overlaps other tests instead of holding up the worker that reaches
the file.
The fixture calls build() too: the file lock makes it wait for a build in progress and find it
done, or build it itself. No torch here: the background process imports nothing heavy.
"""
import fcntl
import shutil
import subprocess
import sys
from pathlib import Path

PCLUSTER_VERSION = "3.16.1"
VENV = Path(__file__).resolve().parents[1] / ".venv" / f"aws-parallelcluster-{PCLUSTER_VERSION}"
PYTHON = VENV / "bin/python"


def missing() -> bool:
    return not PYTHON.exists()


def build() -> str | None:
    """Build the venv unless it exists; None once it does, else pip's error (no registry
    reachable). Under a file lock: xdist's workers, and the background build, may ask at
    once; the first builds, the others wait and find it done. Built in a temporary folder and
    renamed into place, so that an install cut short is never taken for a finished one."""
    VENV.parent.mkdir(exist_ok=True)
    with open(VENV.parent / f"{VENV.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if PYTHON.exists():
            return None
        building = VENV.with_name(VENV.name + ".building")
        shutil.rmtree(building, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(building)], check=True)
        proc = subprocess.run(
            # --no-compile: no bytecode for the thousands of modules installed, only for the
            # few the schema imports, on first import (pip's cache warm: 27 s against 47 s
            # and 25 s of CPU against 33, the Xeon, 2 cores)
            [str(building / "bin/python"), "-m", "pip", "install", "-q", "--no-compile",
             "--disable-pip-version-check", f"aws-parallelcluster=={PCLUSTER_VERSION}"],
            capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            shutil.rmtree(building, ignore_errors=True)
            return proc.stderr[-500:]
        building.rename(VENV)
        return None


if __name__ == "__main__":
    sys.exit(1 if build() else 0)
