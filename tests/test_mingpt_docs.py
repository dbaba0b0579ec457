"""05_mingpt's README says what the code does, and stays short enough to read.

Every list of choices it gives is the code's own list (strategies, data kinds, presets), every
`error:` line it quotes is one the code prints, every code excerpt is copied from the file it
names, its reading order names every module, and the yaml documents every key. No training,
no process group: a few config checks in this process.
"""
import ast
import importlib
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from mingpt_helpers import MINGPT, is_mingpt_module
from test_docs import MARKDOWN, comments_of

README = MINGPT / "README.md"
BENCH_README = MINGPT / "bench" / "README.md"
CONFIG = MINGPT / "gpt2_train_cfg.yaml"
MAX_LINES = 360  # a learner reads it in one sitting; measurements live in bench/README.md
# main.py is the page a reader starts on: the run's story, each concern in its own module.
MAIN_MAX_LINES = 169
# The reading order's spine, in the order a learner should meet the files.
SPINE = ("main.py", "mingpt/config.py", "mingpt/data/__init__.py", "mingpt/model.py",
         "mingpt/parallel/__init__.py", "mingpt/optim.py", "mingpt/trainer.py",
         "mingpt/snapshot.py", "mingpt/errors.py")
# 05's own sources: the scripts, the package and the benchmarks (not runs/ or data/).
SOURCES = sorted(p for p in MINGPT.rglob("*.py") if "__pycache__" not in p.parts
                 and p.relative_to(MINGPT).parts[0] not in ("runs", "data", "outputs"))


@pytest.fixture(scope="module")
def m():
    """Only the modules that hold the registries and the config check (faster than all of
    mingpt_imported's); sys.modules and sys.path are restored as mingpt_imported does."""
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if is_mingpt_module(name)}
    sys.path.insert(0, str(MINGPT))
    try:
        yield {name: importlib.import_module(f"mingpt.{name}")
               for name in ("config", "data", "model", "parallel")}
    finally:
        sys.path.remove(str(MINGPT))
        for name in [name for name in sys.modules if is_mingpt_module(name)]:
            sys.modules.pop(name)
        sys.modules.update(saved)


def text(path: Path = README) -> str:
    return path.read_text()


def section(title: str, path: Path = README) -> str:
    """The body of the `## <title>...` section, up to the next `## ` heading."""
    found = re.search(rf"^## {re.escape(title)}[^\n]*\n(.*?)(?=^## |\Z)", text(path),
                      re.M | re.S)
    assert found, f"{path.relative_to(REPO)} has no section '## {title}'"
    return found.group(1)


def bold_items(body: str) -> list[str]:
    """The names of a section's `- **name**: ...` list."""
    return re.findall(r"^- \*\*([\w-]+)\*\*[: ]", body, re.M)


def links(body: str) -> list[str]:
    """Relative link targets, in order, without anchors."""
    return [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", body)
            if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def fences(body: str, language: str) -> list[tuple[int, list[str]]]:
    """(start offset, lines) of every ```language fence."""
    return [(f.start(), f.group(1).splitlines()) for f in
            re.finditer(rf"^```{language}\n(.*?)^```", body, re.M | re.S)]


def test_readme_stays_short():
    lines = len(text().splitlines())
    assert lines <= MAX_LINES, f"05_mingpt/README.md has {lines} lines (at most {MAX_LINES}); " \
        "move measurements to bench/README.md and let gpt2_train_cfg.yaml document the keys"


def test_main_py_stays_short():
    lines = len((MINGPT / "main.py").read_text().splitlines())
    assert lines <= MAIN_MAX_LINES, f"05_mingpt/main.py has {lines} lines (at most " \
        f"{MAIN_MAX_LINES}): give a concern to the module that owns it"


def test_the_strategies_are_the_registrys(m):
    """The map's rows (`| **name** | ...`) are the registry's strategies, each once, and
    context parallelism's key, which composes with them."""
    named = re.findall(r"^\| \*\*([\w-]+)\*\* \|", section("Strategies"), re.M)
    assert sorted(named) == sorted(m["parallel"].STRATEGIES), named
    assert re.search(r"^\| \*\*`cp_size`\*\* \|", section("Strategies"), re.M)


def test_the_data_kinds_are_the_registrys(m):
    named = bold_items(section("Data kinds"))
    kinds = m["data"].KINDS
    assert sorted(named) == sorted(kinds), named
    for path in (MINGPT / "data_config").glob("*.yaml"):  # every data config names a kind
        config = yaml.safe_load(path.read_text())
        config = config.get("data_config", config)  # `@package _global_` files nest it
        assert config["name"] in kinds, (path.name, config["name"])


def test_every_preset_named_exists(m):
    for path in (README, BENCH_README):
        # A preset as a word of its own (not gpt2_train_cfg.yaml or shakespeare_gpt2).
        named = set(re.findall(r"(?<![\w/.-])(gpt-[a-z]+|gpt2(?:-[a-z]+)?|gopher-\w+)(?![\w.-])",
                               text(path)))
        assert named, path
        assert named <= set(m["model"].PRESETS), (path.name, named - set(m["model"].PRESETS))


def literal_strings() -> list[str]:
    """Every string literal of 05's sources; an f-string gives each literal part between its
    {fields} on its own, so a quoted fragment cannot span a value the code fills in."""
    parts: list[str] = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                piece = ""
                for value in node.values:
                    if isinstance(value, ast.Constant):
                        piece += value.value
                    else:
                        parts.append(piece)
                        piece = ""
                parts.append(piece)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                parts.append(node.value)
    return parts


def quoted_errors() -> tuple[list[tuple[list[str], str]], list[str]]:
    """([(main.py overrides, error line)], [other quoted error lines]) of the README.

    An `error:` line right after `$ python main.py ARGS` in a text fence is what those
    arguments print; any other one (in a fence or inline) may elide with `...`."""
    body = text()
    commanded, other = [], []
    for _, lines in fences(body, "text"):
        command = None
        for line in lines:
            if line.startswith("$ "):
                command = shlex.split(line[2:])
            elif line.startswith("error: "):
                if command and command[:2] == ["python", "main.py"]:
                    commanded.append((command[2:], line))
                else:
                    other.append(line)
    other += re.findall(r"`(error: [^`]+)`", re.sub(r"^```.*?^```", "", body, flags=re.M | re.S))
    return commanded, other


def test_error_lines_after_a_command_are_what_it_prints(m):
    commanded, _ = quoted_errors()
    assert len(commanded) >= 2, "the README quotes main.py's config errors in Run it"
    for overrides, line in commanded:
        with pytest.raises(ValueError) as e:
            m["config"].load(overrides)
        assert line == f"error: {e.value}", overrides


def test_other_quoted_errors_are_made_of_the_codes_words():
    _, other = quoted_errors()
    assert other, "no elided error quotes found: the parser or the README changed"
    literals = literal_strings()
    for line in other:
        for piece in (p.strip() for p in line.removeprefix("error: ").split("...")):
            if piece:
                assert any(piece in s for s in literals), \
                    f"{piece!r} (from {line!r}) is in no string of 05_mingpt's sources"


@pytest.mark.parametrize("path", [README], ids=lambda p: str(p.relative_to(REPO)))
def test_code_excerpts_are_copied_from_the_file_they_name(path):
    body = text(path)
    starts = fences(body, "python")
    assert starts, "the README shows real code"
    previous_end = 0
    for start, lines in starts:
        named = [t for t in links(body[previous_end:start]) if t.endswith(".py")]
        assert named, f"no link to a .py file before the excerpt {lines[0]!r}"
        source = (path.parent / named[-1]).read_text().splitlines()
        # `...` lines skip code; every run of lines between them is in the file, in order.
        chunks = re.split(r"\n\s*\.\.\.\s*\n", "\n" + "\n".join(lines) + "\n")
        at = 0
        for chunk in (c.strip("\n").splitlines() for c in chunks):
            if not chunk:
                continue
            found = next((i for i in range(at, len(source) - len(chunk) + 1)
                          if source[i:i + len(chunk)] == chunk), None)
            assert found is not None, f"not verbatim in {named[-1]}: {chunk[0]!r}"
            at = found + len(chunk)
        previous_end = start + 1


def test_the_reading_order_names_every_module_in_order():
    named = links(section("Reading order"))
    for target in named:
        assert (MINGPT / target).exists(), f"the reading order names missing {target}"
    missing = [s for s in SPINE if s not in named]
    assert not missing, f"the reading order lacks {missing}"
    positions = [named.index(s) for s in SPINE]
    assert positions == sorted(positions), f"read in this order: {' -> '.join(SPINE)}"
    modules = [str(p.relative_to(MINGPT)) for p in SOURCES
               if p.parent == MINGPT or p.relative_to(MINGPT).parts[0] == "mingpt"]
    unnamed = sorted(set(modules) - set(named))
    assert not unnamed, f"the reading order does not name {unnamed}"


def yaml_keys(path: Path) -> list[tuple[str, bool]]:
    """(dotted key, whether it has a comment) for every key line of a yaml file: a comment on
    its own line, or on the line just above it."""
    keys, stack, previous = [], [], ""
    for line in path.read_text().splitlines():
        found = re.match(r"^( *)(?:- )?([A-Za-z_]\w*):", line)
        if found:
            indent = len(found.group(1))
            stack = [(i, k) for i, k in stack if i < indent] + [(indent, found.group(2))]
            commented = " #" in line or previous.lstrip().startswith("#")
            keys.append((".".join(k for _, k in stack), commented))
        if line.strip():
            previous = line
    return keys


def flatten(tree: dict, prefix: str = "") -> set[str]:
    names = set()
    for key, value in tree.items():
        names.add(prefix + key)
        if isinstance(value, dict):
            names |= flatten(value, f"{prefix}{key}.")
    return names


def test_every_key_of_the_training_config_has_a_comment():
    keys = yaml_keys(CONFIG)
    found = {key for key, _ in keys}
    # The parse saw every key yaml sees (plus the defaults list's data_config entry).
    assert flatten(yaml.safe_load(CONFIG.read_text())) <= found, found
    bare = [key for key, commented in keys if not commented]
    assert not bare, f"gpt2_train_cfg.yaml: no comment on {bare}"


def readme_sections(path: Path) -> list[str]:
    return [h.strip() for h in re.findall(r"^#{2,4} (.+)$", text(path), re.M)]


def test_readme_references_in_code_and_configs_name_real_sections():
    # "README: Speed" from bench/ means bench/README.md; from anywhere else, 05's README;
    # "bench/README.md: Speed" means bench's from anywhere.
    files = [*SOURCES, CONFIG, *(MINGPT / "data_config").glob("*.yaml")]
    for path in files:
        body = path.read_text()
        for bench, name in re.findall(r"(bench/)?README(?:\.md)?: ([A-Z][^).;:,\"\n]*)", body):
            readme = BENCH_README if bench or path.parent.name == "bench" else README
            assert any(h.lower().startswith(name.strip().lower())
                       for h in readme_sections(readme)), \
                f"{path.relative_to(REPO)} points to '{name}' in {readme.relative_to(REPO)}"
    for path in [CONFIG, *(MINGPT / "data_config").glob("*.yaml")]:
        comments = " ".join(re.findall(r"#(.*)$", path.read_text(), re.M))
        for name in re.findall(r"([\w/]+\.py)\b", comments):
            assert (MINGPT / name).exists(), f"{path.name} names missing {name}"


def test_tests_named_in_the_docs_exist():
    defined = set()
    for path in (REPO / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(), re.M))
    for path in (README, BENCH_README):
        for name in re.findall(r"\b(test_\w+)\b", text(path)):
            if (REPO / "tests" / f"{name}.py").exists():
                continue  # a test file, named as tests/test_<name>.py
            assert name in defined, f"{path.name} names {name}, which no test defines"
        for name in re.findall(r"tests/(test_\w+\.py)", text(path)):
            assert (REPO / "tests" / name).exists(), f"{path.name} names missing tests/{name}"


def test_bench_readme_shows_every_result_and_script():
    linked = set(links(text(BENCH_README)))
    results = sorted(p.name for p in BENCH_README.parent.iterdir()
                     if p.suffix in (".json", ".png", ".py"))
    unlinked = [name for name in results if name not in linked]
    assert not unlinked, f"bench/README.md does not link {unlinked}"


def test_the_configs_figures_are_the_readmes():
    """The default run's figures have one home, the README's "Run it": gpt2_train_cfg.yaml's
    header points there, and any time or loss it does quote is the README's."""
    header = " ".join(line.lstrip("# ") for line in text(CONFIG).split("\ndefaults:")[0]
                      .splitlines())
    run_it = section("Run it")
    for seconds in re.findall(r"\b(\d+(?:\.\d+)?) s\b", header):
        assert f"{seconds} s in training" in run_it, (
            f"gpt2_train_cfg.yaml says {seconds} s; the README's Run it does not: quote neither "
            "or the same")
    (final,) = re.findall(r"^final val loss (\d\.\d+)", run_it, re.M)
    for loss in re.findall(r"validation loss of about (\d\.\d+)", header):
        assert round(float(final), len(loss) - 2) == float(loss), (loss, final)


def prose() -> list[tuple[Path, str]]:
    """Where the series speaks of its strategies: every markdown file, 05's yaml files, and
    the comments and docstrings of 05's sources."""
    return [(path, comments_of(path)) for path in
            [*MARKDOWN, CONFIG, *(MINGPT / "data_config").glob("*.yaml"), *SOURCES]]


def test_strategy_counts_are_the_registrys(m):
    """A doc that counts the strategies counts the registry's (one name each)."""
    words = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
             "twelve"]
    count = len(m["parallel"].STRATEGIES)
    for path in MARKDOWN:
        for number in re.findall(rf"\b({'|'.join(words)}|\d+) (?:[a-z-]+ )?strategies\b",
                                 text(path), re.I):
            said = int(number) if number.isdigit() else words.index(number.lower()) + 2
            assert said == count, (
                f"{path.relative_to(REPO)} says {number} strategies; the registry has {count}")
