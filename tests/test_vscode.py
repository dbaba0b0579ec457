"""The VS Code debug configurations (.vscode/launch.json) start what they name: every program,
module, script and working folder exists, and 05's configurations pass main.py's own checks."""
import importlib.util
import json

import pytest

from conftest import PYTHON, REPO, run

LAUNCH = REPO / ".vscode/launch.json"
CONFIGS = json.loads(LAUNCH.read_text())["configurations"]


def resolve(value: str) -> str:
    """VS Code's ${workspaceFolder}; ${file} (the open file) stands for step 01's train.py."""
    return value.replace("${workspaceFolder}", str(REPO)).replace(
        "${file}", str(REPO / "01_single_gpu/train.py"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["name"])
def test_every_configuration_names_what_exists(config):
    assert config["type"] == "debugpy" and config["request"] == "launch"
    cwd = resolve(config["cwd"])
    assert (REPO / cwd).is_dir(), cwd
    assert resolve(config["python"]) == str(REPO / ".venv/bin/python")  # the Quickstart's venv
    if "program" in config:
        assert (REPO / resolve(config["program"])).is_file(), config["program"]
    else:  # torchrun as a module: the script it starts is relative to cwd
        assert importlib.util.find_spec(config["module"]) is not None, config["module"]
        script = next(a for a in config["args"] if not a.startswith("-"))
        assert (REPO / cwd / script).is_file(), script
        assert config["subProcess"], "torchrun's workers are child processes: debug them too"


@pytest.mark.parametrize("config", [c for c in CONFIGS if "05_mingpt" in c["cwd"]],
                         ids=lambda c: c["name"])
def test_05_configurations_pass_main_pys_checks(config, tmp_path):
    # `--cfg job` composes and checks the overrides, then exits: a stale key fails here.
    overrides = [a for a in config["args"] if "=" in a and not a.startswith("-")]
    proc = run([PYTHON, "main.py", "--cfg", "job", *overrides], cwd=REPO / "05_mingpt")
    for override in overrides:
        key, value = override.split("=", 1)
        assert f"{key.rpartition('.')[2]}: {value}" in proc.stdout, (override, proc.stdout)
