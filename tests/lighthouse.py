"""torchft's lighthouse, as its `torchft_lighthouse` command runs it (the same Rust entry point,
the same flags), with only torchft's compiled extension loaded: the command imports the torchft
package first, and with it torch, about 3 s of CPU that a lighthouse never uses; the tests
start some 35 of them. (FAULT_TOLERANCE.md and bench_diloco.py run the command itself.)"""
import importlib.util
import sys
from pathlib import Path

if __name__ == "__main__":
    package = Path(importlib.util.find_spec("torchft").submodule_search_locations[0])
    built, = package.glob("_torchft.*.so")
    spec = importlib.util.spec_from_file_location("torchft._torchft", built)
    extension = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extension)
    # It parses the process's own arguments, as after the command's name: `python lighthouse.py
    # FLAGS` has the same ones.
    sys.exit(extension.lighthouse_main())
