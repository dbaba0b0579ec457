"""The docs and the tree are tested like code: copies agree, diffs are small, links resolve."""
import difflib
import filecmp
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

from conftest import PYTHON, REPO, ROBUSTNESS_FILES

STEPS = ["01_single_gpu", "02_multigpu", "03_torchrun_fault_tolerance", "04_multinode"]
# Helpers copied into every step that uses them, so each step folder reads on its own.
# The first folder listed holds the master copy.
COPIED_HELPERS = {
    "datautils.py": STEPS,
    "devices.py": [*STEPS, "05_mingpt/mingpt"],
    "snapshot.py": STEPS,
    "faults.py": ["03_torchrun_fault_tolerance", "04_multinode"],
    "restarts.py": ["03_torchrun_fault_tolerance", "04_multinode", "05_mingpt/mingpt"],
}
# Helpers of the same name that differ from the steps' copy on purpose, and why.
FORKED_HELPERS = {
    "05_mingpt/mingpt/snapshot.py": "snapshots on any fsspec URL (S3) and sharded DCP "
                                    "snapshots; rng_state/set_rng_state take the device (the "
                                    "CUDA RNG of this rank's GPU); layouts per strategy, "
                                    "keep_last, storage errors as one line",
    "05_mingpt/mingpt/faults.py": "counts optimizer steps rather than epochs, and can also "
                                  "crash in the middle of a snapshot save (FAULT_AT_SAVE) "
                                  "and make one rank stall or skip a collective",
}
# Changed lines (added + removed, blank lines not counted) of train.py against the previous
# step: CONTRIBUTING.md allows about 60 per step, and step 03, whose README splits its diff into two
# ideas (torchrun, snapshots), up to two steps' worth. Each budget is what the step reaches
# today, so any growth is a decision taken here, not drift.
DIFF_BUDGET = {"02_multigpu": 59, "03_torchrun_fault_tolerance": 80, "04_multinode": 26}
# Not the virtual environments' files: .venv, and .venv-xla (tests/test_xla.py builds it).
VENVS = {".venv", ".venv-xla"}
MARKDOWN = sorted(p for p in REPO.rglob("*.md") if not VENVS & set(p.parts)
                  and ".pytest_cache" not in p.parts)


def changed_lines(a: Path, b: Path) -> int:
    diff = difflib.unified_diff(a.read_text().splitlines(), b.read_text().splitlines(), n=0)
    return sum(1 for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")
               and line[1:].strip())


@pytest.mark.parametrize("helper", sorted(COPIED_HELPERS))
def test_copied_helpers_are_identical(helper):
    master, *copies = (REPO / d / helper for d in COPIED_HELPERS[helper])
    for copy in copies:
        assert filecmp.cmp(master, copy, shallow=False), (
            f"{copy.relative_to(REPO)} differs from {master.relative_to(REPO)}; "
            f"fix with: cp {master.relative_to(REPO)} {copy.relative_to(REPO)}")


SOURCES = sorted(p for folder in [*STEPS, "05_mingpt", "notebooks"]
                 for p in (REPO / folder).rglob("*.py") if "runs" not in p.parts)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_comment_lines_are_at_least_a_tenth(path):
    # `#` comments (docstrings not counted): the why next to the code, as CONTRIBUTING.md asks.
    source = path.read_text()
    comments = {token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
                if token.type == tokenize.COMMENT}
    lines = [i for i, line in enumerate(source.splitlines(), 1) if line.strip()]
    ratio = len(comments & set(lines)) / len(lines)
    assert ratio >= 0.10, f"{path.relative_to(REPO)}: {ratio:.1%} comment lines (at least 10%)"


def test_every_helper_is_a_copy_or_a_recorded_fork():
    folders = [*STEPS, "05_mingpt/mingpt"]
    for helper, copies in COPIED_HELPERS.items():
        for folder in folders:
            path = f"{folder}/{helper}"
            if (REPO / path).exists() and folder not in copies:
                assert path in FORKED_HELPERS, (
                    f"{path} shares a helper's name but is not a copy: make it one, or record "
                    "why it differs in FORKED_HELPERS")
    for path in FORKED_HELPERS:
        assert (REPO / path).exists(), f"{path} is recorded as a fork but does not exist"


@pytest.mark.parametrize("step", list(DIFF_BUDGET))
def test_step_diff_stays_small_and_readme_table_is_current(step):
    previous = STEPS[STEPS.index(step) - 1]
    n = changed_lines(REPO / previous / "train.py", REPO / step / "train.py")
    assert n <= DIFF_BUDGET[step], f"{step}/train.py changes {n} lines (budget {DIFF_BUDGET[step]})"
    row = next(line for line in (REPO / "README.md").read_text().splitlines()
               if line.startswith(f"| [{step}]"))
    assert row.rstrip(" |").endswith(f"| {n}"), f"README table says otherwise for {step}: {row}"


def diff_fences(md: Path) -> list[list[str]]:
    return [m.group(1).splitlines() for m in
            re.finditer(r"```diff\n(.*?)```", md.read_text(), flags=re.S)]


@pytest.mark.parametrize("md", [p for p in MARKDOWN if diff_fences(p)],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_readme_diff_fences_match_the_code(md):
    for fence in diff_fences(md):
        assert fence[0].startswith("--- ") and fence[1].startswith("+++ "), (
            f"{md}: a diff fence must start with '--- old' and '+++ new' file lines")
        old = (md.parent / fence[0][4:].split()[0]).read_text().splitlines()
        new = (md.parent / fence[1][4:].split()[0]).read_text().splitlines()
        for line in fence[2:]:
            if line.startswith("@@") or line.strip() in ("", "...") :
                continue
            sign, text = line[0], line[1:]
            where = {"+": [new], "-": [old], " ": [new, old]}[sign]
            assert any(text in f for f in where), f"{md.name}: stale diff line {line!r}"


@pytest.mark.parametrize("md", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(md):
    for target in re.findall(r"\]\(([^)\s]+)\)", md.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (md.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{md.relative_to(REPO)} links to missing {target}"


SHELL_SCRIPTS = sorted(p for p in REPO.rglob("*.sh") if not VENVS & set(p.parts)) + [
    REPO / ".ci/run"]


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_shell_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_paths_in_slurm_scripts_exist():
    scripts = sorted((REPO / "slurm_scripts").glob("*.sh"))
    assert scripts
    for script in scripts:
        named = re.findall(r"\b((?:0[1-5]_[a-z_]+|slurm_scripts)/[\w./-]+)", script.read_text())
        assert named, f"{script.name} names no file of the series"
        for rel in named:
            assert (REPO / rel).exists(), f"{script.name} names missing {rel}"


def test_ruff_is_clean():
    proc = subprocess.run([PYTHON, "-m", "ruff", "check", "."], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def index_of_tests_readme() -> dict[str, list[str]]:
    """tests/README.md's index: each `### ` group of "The test files" -> the files it lists."""
    text = (REPO / "tests/README.md").read_text()
    section = text.split("\n## The test files\n", 1)[1].split("\n## ")[0]
    groups = {}
    for block in section.split("\n### ")[1:]:
        title, body = block.split("\n", 1)
        groups[title.strip()] = re.findall(r"^- \[`([^`]+)`\]", body, flags=re.M)
    return groups


def test_tests_readme_lists_every_test_file_in_its_group():
    groups = index_of_tests_readme()
    usage, robustness = groups["Usage tests"], groups["Robustness tests"]
    on_disk = {p.name for p in (REPO / "tests").glob("test_*.py")}
    listed = usage + robustness
    assert len(listed) == len(set(listed)), f"a test file is listed twice: {sorted(listed)}"
    assert not on_disk - set(listed), (
        f"tests/README.md has no line for {sorted(on_disk - set(listed))}: add one under "
        '"Usage tests" or "Robustness tests" saying what it guards')
    assert not set(listed) - on_disk, f"tests/README.md lists missing {set(listed) - on_disk}"
    # The marker and the docs group the files from one list (conftest.ROBUSTNESS_FILES).
    assert set(robustness) == set(ROBUSTNESS_FILES), (
        "tests/README.md's Robustness tests and conftest.ROBUSTNESS_FILES differ: "
        f"{sorted(set(robustness) ^ set(ROBUSTNESS_FILES))}")


def test_tests_readme_lists_every_helper():
    helpers = index_of_tests_readme()["Helpers"]
    on_disk = {p.name for p in (REPO / "tests").iterdir()
               if p.suffix in (".py", ".c") and not p.name.startswith("test_")}
    assert not on_disk - set(helpers), f"tests/README.md has no line for {on_disk - set(helpers)}"
    for name in helpers:
        assert (REPO / "tests" / name).exists(), f"tests/README.md lists missing {name}"
