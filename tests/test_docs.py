"""The docs and the tree are tested like code: copies agree, diffs are small, links resolve,
every file the docs and comments name exists, and quoted stack lines are the code's."""
import ast
import difflib
import filecmp
import fnmatch
import io
import json
import os
import re
import subprocess
import tokenize
from pathlib import Path

import pytest
import torch

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
    "05_mingpt/mingpt/snapshot.py": "snapshots on any fsspec URL (S3), as DCP shards for "
                                    "every layout (shards.py, older one-file snapshots "
                                    "too); the RNG states are the trainer's "
                                    "(trainer.rng_state takes the device); keep_last, storage "
                                    "errors as one line",
    "05_mingpt/mingpt/faults.py": "counts optimizer steps rather than epochs, and can also "
                                  "crash in the middle of a snapshot save (FAULT_AT_SAVE), "
                                  "make one rank stall or skip a collective, fail one rank's "
                                  "storage; installed at one seam (install)",
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
# The root README is the series' front page: what it is, the steps, the Quickstart, where to
# go next. It was 83 lines and grew to 198 in one round of features; topics live in docs/.
ROOT_README_MAX_LINES = 120


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


def test_root_readme_stays_short_and_links_every_topic_page():
    readme = (REPO / "README.md").read_text()
    lines = len(readme.splitlines())
    assert lines <= ROOT_README_MAX_LINES, (
        f"README.md has {lines} lines (at most {ROOT_README_MAX_LINES}): move a topic to a page "
        "of its own in docs/ and link it from 'Where next'")
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


def series_files() -> set[str]:
    """The series' files, relative to the root: what a fresh clone holds (git's list, with
    new files not yet committed), so run outputs and downloads on this machine do not count."""
    proc = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                          cwd=REPO, capture_output=True, text=True)
    if proc.returncode == 0:
        return {f for f in proc.stdout.splitlines() if (REPO / f).is_file()}
    found = set()  # not a git checkout: walk the tree, without environments and outputs
    skip = VENVS | {".git", "__pycache__", ".pytest_cache", ".ruff_cache", "runs", "outputs"}
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in skip]
        found |= {str((Path(folder) / f).relative_to(REPO)) for f in files}
    return found


def comments_of(path: Path) -> str:
    """The prose of a file: a Python file's `#` comments and docstrings; a shell script's, a
    Dockerfile's or an ignore file's `#` comments; all of a markdown or yaml file; a
    notebook's markdown cells and the `#` comments of its code cells."""
    source = path.read_text()
    if path.suffix == ".ipynb":
        cells = json.loads(source)["cells"]
        return "\n".join("".join(c["source"]) if c["cell_type"] == "markdown" else
                         "\n".join(re.findall(r"#(.*)$", "".join(c["source"]), re.M))
                         for c in cells)
    if path.suffix == ".md":
        return source.replace("\\_", "_")  # markdown's escaped underscores: \_\_init\_\_
    if path.suffix in (".yaml", ".yml"):
        return source  # values name files too (a data config's path)
    if path.suffix == ".py":
        prose = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
                 if t.type == tokenize.COMMENT]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                prose.append(ast.get_docstring(node, clean=False) or "")
        return "\n".join(prose)
    return "\n".join(m.group(1) for m in re.finditer(r"(?:^|\s)#(.*)$", source, re.M))


# Where the series names files: docs, configs, notebooks, the comments of code and scripts.
PROSE_SUFFIXES = (".md", ".yaml", ".yml", ".py", ".sh", ".ipynb")
PROSE_NAMES = ("Dockerfile", ".dockerignore", ".gitignore", ".ci/run")
# A file name: a word, a known extension, and optionally the folders before it (`../` too).
FILE_NAME = re.compile(r"(?<![\w.*/<>{}$~@:-])((?:\.\.?/)*(?:[\w.-]+/)*[\w-][\w.-]*"
                       r"\.(?:py|md|sh|yaml|yml|json|png|ipynb|txt|toml|c))(?![\w/*-])")
# Words that stand for any folder or file of a kind: `STEP/train.py`, `data_config/NAME.yaml`.
PLACEHOLDERS = re.compile(r"\b(?:STEP|NAME)\b")
# Names the docs and comments use that are no file of the series, and why.
NOT_SERIES_FILES = {
    "config.yaml": "main.py writes it into each run's folder: the config the run used",
    "meta.json": "prepare.py writes it into its --out folder, beside the tokens",
    "prepare_state.json": "prepare.py's record of finished chunks in its --out folder",
    **dict.fromkeys(["vocab.json", "merges.txt", "encoder.json", "config.json"],
                    "GPT-2's tokenizer and model files as published (Hugging Face, OpenAI)"),
    **dict.fromkeys(["generation_config.json", "tokenizer.json", "tokenizer_config.json"],
                    "what transformers' save_pretrained writes, in export_hf.py's output folder"),
    "storm.json": "tests/crash_storm.py's --json output",
    "out.ipynb": "the executed copy papermill writes, in a notebook's example command",
    "name.png": "an image's name inside a CIFAR-10 batch file",
    **dict.fromkeys(["a.txt", "b.txt", "100_chars.txt", "empty.txt", "latin1.txt", "short.txt",
                     "other.txt", "no/such.txt", "notes.txt"],
                    "a user's text file in an example command (the tests write their own)"),
}
# torch's own files, quoted from tracebacks and stacks: they are looked for in torch itself.
TORCH_ROOT = Path(torch.__file__).parent.parent


def prose_files(files: set[str]) -> list[Path]:
    return sorted(REPO / f for f in files
                  if f.endswith(PROSE_SUFFIXES) or f.endswith(PROSE_NAMES))


def names_a_file(name: str, where: Path, files: set[str]) -> bool:
    """Whether `name`, as written in `where`, is a file: a bare name anywhere in the series;
    a path from where's folder, any folder above it, or 05_mingpt/; torch/... in torch."""
    if name.startswith("torch/"):
        return (TORCH_ROOT / name).is_file()
    pattern = PLACEHOLDERS.sub("*", name)
    if "/" not in name.removeprefix("./"):
        return any(fnmatch.fnmatch(f.rsplit("/", 1)[-1], pattern) for f in files)
    bases = [where.parent, *where.parent.parents, REPO / "05_mingpt"]
    for base in bases:
        if REPO not in (base, *base.parents):
            continue
        rel = os.path.relpath(os.path.normpath(base / pattern), REPO)
        if any(fnmatch.fnmatch(f, rel) for f in files):
            return True
    return False


def test_files_named_in_docs_configs_and_comments_exist():
    """A file the docs, a yaml or a code comment names exists: `mingpt/snapshot.py`,
    `trainer.py`, `../docs/LOGS.md`. What is no file of the series is in NOT_SERIES_FILES."""
    files = series_files()
    missing = []
    for path in prose_files(files):
        for name in sorted(set(FILE_NAME.findall(comments_of(path)))):
            if name in NOT_SERIES_FILES or name.rsplit("/", 1)[-1] in NOT_SERIES_FILES:
                continue
            if not names_a_file(name, path, files):
                missing.append(f"{path.relative_to(REPO)} names {name}")
    assert not missing, "no such file:\n" + "\n".join(missing)


# Stack frames quoted in the docs, innermost first: analyze_hang.py's one-line stacks
# (`faults.py:56 inject_fault < trainer.py:220 _run_epoch`) and py-spy's dump lines
# (`    Trainer._run_epoch (mingpt/trainer.py:220)`).
HANG_STACK = re.compile(r"[\w/.]+\.py:\d+ \w+(?: < [\w/.]+\.py:\d+ \w+)+")
HANG_FRAME = re.compile(r"([\w/.]+\.py):(\d+) (\w+)")
PY_SPY_FRAME = re.compile(r"^ +([\w.]+) \(([\w/.]+\.py):(\d+)\)$", re.M)


def quoted_stacks(text: str) -> list[list[tuple[str, int, str]]]:
    """Every stack a doc quotes, as (file, line, function) innermost first."""
    stacks = [[(f, int(n), fn) for f, n, fn in HANG_FRAME.findall(m.group(0))]
              for m in HANG_STACK.finditer(text)]
    stack, last_end = [], -1
    for m in PY_SPY_FRAME.finditer(text):  # consecutive lines make one stack
        if m.start() != last_end + 1 and stack:
            stacks.append(stack)
            stack = []
        stack.append((m.group(2), int(m.group(3)), m.group(1)))
        last_end = m.end()
    return [*stacks, *([stack] if stack else [])]


def function_at(tree: ast.Module, line: int) -> str:
    """The qualified name (`Trainer._run_epoch`) of the innermost function holding `line`."""
    found = ""

    def visit(node: ast.AST, prefix: str) -> None:
        nonlocal found
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                if child.lineno <= line <= child.end_lineno:
                    if not isinstance(child, ast.ClassDef):
                        found = name
                    visit(child, name + ".")

    visit(tree, "")
    return found


def test_quoted_stack_lines_are_the_codes():
    """A stack a doc quotes names lines the code has today: line N of the file is in the
    function the frame names, and calls the frame above it (its callee). torch's own frames
    are left out: their lines are torch's version's."""
    files = series_files()
    checked, wrong = 0, []
    for md in MARKDOWN:
        for stack in quoted_stacks(md.read_text()):
            for i, (name, line, function) in enumerate(stack):
                if name.startswith("torch/"):
                    continue
                # The file: the one of that name in the doc's folder, else in the series.
                folder = str(md.parent.relative_to(REPO)).removeprefix(".")
                matches = [f for f in files if f == name or f.endswith("/" + name)]
                near = [f for f in matches if f.startswith(folder)] or matches
                assert len(near) == 1, f"{md.relative_to(REPO)}: {name} is {near or 'missing'}"
                source = (REPO / near[0]).read_text()
                lines = source.splitlines()
                where = f"{md.relative_to(REPO)} quotes {name}:{line} {function}"
                actual = function_at(ast.parse(source), line)
                if not (actual == function or actual.endswith("." + function)):
                    wrong.append(f"{where}, but line {line} is in {actual or 'no function'}")
                    continue
                checked += 1
                if i == 0:
                    continue  # the innermost frame quoted: what it calls is not shown
                callee = stack[i - 1][2].split(".")[-1]
                call = re.compile(rf"\b{callee}\(")
                if not call.search(lines[line - 1]):
                    at = [n for n, text in enumerate(lines, 1) if call.search(text)
                          and function_at(ast.parse(source), n) == actual]
                    wrong.append(f"{where}, but {callee}() is called at line(s) {at}")
    assert not wrong, "stale stack lines:\n" + "\n".join(wrong)
    assert checked >= 8, f"only {checked} frames found: has the stack format changed?"


def test_the_quick_check_names_files_and_tests_that_exist():
    """conftest's quick check (`-m quick`): every file it names is a test file, none of them a
    robustness file, and every test it names is defined once in a usage file."""
    from conftest import QUICK_FILES, QUICK_TESTS  # noqa: PLC0415

    tests = REPO / "tests"
    assert all((tests / name).is_file() for name in QUICK_FILES), QUICK_FILES
    assert not set(QUICK_FILES) & set(ROBUSTNESS_FILES)
    for name in QUICK_TESTS:
        defined = [p.name for p in tests.glob("test_*.py")
                   if re.search(rf"^def {name}\(", p.read_text(), re.M)]
        assert len(defined) == 1 and defined[0] not in ROBUSTNESS_FILES, (name, defined)


def test_test_names_in_the_docs_are_defined():
    """Every test a page names in backticks (a test function, with or without its case in
    brackets, or a test file) is a test function or a test file under tests/: a renamed test
    leaves no reader looking for one that is gone."""
    tests = sorted((REPO / "tests").glob("test_*.py"))
    defined = {p.stem for p in tests} | {name for p in tests for name in
                                         re.findall(r"^def (test_\w+)\(", p.read_text(), re.M)}
    named = {(md.relative_to(REPO).as_posix(), name) for md in MARKDOWN for name in
             re.findall(r"`(test_\w+)(?:\.py)?(?:\[[^`]*\])?`", md.read_text())}
    assert len(named) > 50, f"only {len(named)} test names found: has the format changed?"
    missing = sorted((md, name) for md, name in named if name not in defined)
    assert not missing, f"tests named in the docs but not defined: {missing}"
