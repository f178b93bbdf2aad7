"""Every code block of README.md and docs/ runs as written.

Blocks run in a fresh ``$HERMES_HOME`` holding an empty store (as on a machine where a gateway
has run), with ``$HOME`` pointed at an empty directory that must stay empty:

- ``python``: run by this interpreter in a child process, and (all of them, those not run too)
  checked by ``mypy --strict`` with the project's settings when mypy is installed;
- ``bash``/``shell``/``sh``: every command must be ``hermes-sessions ...`` (or
  ``.venv/bin/hermes-sessions ...``); it runs through the installed console script and must exit 0;
- ``yaml``: a ``config.yaml`` fragment, which must load as a valid configuration;
- ``toml``: must parse;
- ``text`` or no language: output, skipped.

A block that must not run is preceded by ``<!-- not run: <reason> -->``; :data:`NOT_RUN` lists
them, so that marking one is a visible change of this file.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import hermes_core
from conftest import builtins_only
from hermes_core import GatewayConfig, SessionStore
from hermes_core.testing import fresh_plugin_manager
from hermes_hookspecs import SPEC_MODULES

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REPOSITORY = "https://github.com/hermes-sessions/hermes-sessions"
SCRIPT = Path(sys.executable).parent / "hermes-sessions"
OUTPUT = ("", "text")
SHELL = ("bash", "shell", "sh")
NOT_RUN_MARK = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")

NOT_RUN = {
    ("README.md", "installs the package into .venv; CI installs it the same way"),
    ("README.md", "runs this test suite"),
    ("README.md", "installs the development tools and runs the checks; CI does the same"),
    ("docs/runtime.md", "serves until SIGINT or SIGTERM"),
    ("README.md", "serves until SIGINT or SIGTERM"),
    ("docs/cli.md", "reads a payload file the host saved"),
}
"""(document, reason) of every block marked ``<!-- not run: reason -->``."""


@dataclass(frozen=True)
class Block:
    document: str
    line: int
    language: str
    code: str
    not_run: str | None

    def __str__(self) -> str:
        return f"{self.document}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with the not-run reason marked before each."""
    blocks: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    name = str(path.relative_to(ROOT))
    index = 0
    while index < len(lines):
        fence = lines[index].strip()
        if not fence.startswith("```"):
            index += 1
            continue
        start = index
        end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
        before = next((lines[i] for i in range(start - 1, -1, -1) if lines[i].strip()), "")
        mark = NOT_RUN_MARK.search(before)
        code = "\n".join(lines[start + 1 : end]) + "\n"
        blocks.append(
            Block(name, start + 1, fence[3:].strip(), code, mark.group(1) if mark else None)
        )
        index = end + 1
    return blocks


BLOCKS = [block for path in DOCUMENTS for block in _blocks(path)]
RUNNABLE = [block for block in BLOCKS if block.language not in OUTPUT and block.not_run is None]


def _commands(code: str) -> list[str]:
    """The commands of a shell block: comments dropped, continued lines joined."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line.strip() for line in joined.splitlines() if line.strip() and line[0] != "#"]


@pytest.fixture
def environment(hermes_home: Path, tmp_path: Path) -> dict[str, str]:
    """The child's environment: ``$HERMES_HOME`` with an empty store, an empty ``$HOME``."""
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(hermes_home)})
    SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)).close()
    home = tmp_path / "home"
    home.mkdir()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    return builtins_only(environ, HERMES_HOME=str(hermes_home), HOME=str(home))


def _run(argv: list[str], environ: dict[str, str], cwd: Path, block: Block) -> str:
    done = subprocess.run(argv, env=environ, cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, (
        f"{block} failed ({done.returncode}):\n{block.code}\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout


def _shows(printed: str, comment: str) -> bool:
    """Whether an output line is what a ``print(...)  # comment`` says it prints: the comment
    itself, or followed by an explanation (``: ...``, `` (...)``), or its parts around ``...``
    in order."""
    if comment == printed or comment.startswith((f"{printed}: ", f"{printed} (")):
        return True
    pattern = ".*".join(re.escape(part.strip()) for part in comment.split("..."))
    return "..." in comment and re.fullmatch(pattern, printed) is not None


def _check_printed(block: Block, output: str) -> None:
    """Every ``print(...)  # what it prints`` of a Python block printed a line that matches."""
    printed = output.splitlines()
    for comment in re.findall(r"^\s*print\(.*\)\s+#\s*(.+?)\s*$", block.code, re.MULTILINE):
        assert any(_shows(line, comment) for line in printed), (
            f"{block}: no line printed matches the comment {comment!r}; printed:\n{output}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=str)
def test_code_block_runs(block: Block, environment: dict[str, str], tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    if block.language == "python":
        _check_printed(block, _run([sys.executable, "-c", block.code], environment, work, block))
    elif block.language in SHELL:
        for command in _commands(block.code):
            argv = shlex.split(command, comments=True)
            assert argv[0] in ("hermes-sessions", ".venv/bin/hermes-sessions"), (
                f"{block} runs {argv[0]!r}: only hermes-sessions commands run here; mark the "
                "block <!-- not run: reason --> (and list it in NOT_RUN) if it must not run"
            )
            _run([str(SCRIPT), *argv[1:]], environment, work, block)
    elif block.language == "yaml":
        settings = yaml.safe_load(block.code)
        GatewayConfig.from_dict(settings, environ={"HERMES_HOME": environment["HERMES_HOME"]})
    elif block.language == "toml":
        tomllib = pytest.importorskip("tomllib")  # Python 3.11+
        tomllib.loads(block.code)
    else:
        pytest.fail(f"{block}: no way to run a {block.language!r} block; mark it not run")
    assert not list(Path(environment["HOME"]).iterdir()), f"{block} wrote into $HOME"


def test_blocks_that_do_not_run_are_listed() -> None:
    marked = {(block.document, block.not_run) for block in BLOCKS if block.not_run is not None}
    assert marked == NOT_RUN


@pytest.mark.slow
def test_python_blocks_pass_mypy_strict(tmp_path: Path) -> None:
    """Hosts copy these into strictly typed code; blocks that do not run are checked too."""
    pytest.importorskip("mypy", reason="mypy comes with the dev extra")
    files = []
    for number, block in enumerate(b for b in BLOCKS if b.language == "python"):
        path = tmp_path / f"block_{number}.py"
        path.write_text(f"# {block}\n{block.code}", encoding="utf-8")
        files.append(str(path))
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--config-file",
         str(ROOT / "pyproject.toml"), *files],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_package_description_links_absolutely() -> None:
    """README.md is the package index's description, where relative links break."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)]+)\)", readme)
    assert targets
    relative = [t for t in targets if not t.startswith(("https://", "http://"))]
    assert not relative
    assert all(t.startswith(REPOSITORY) for t in targets if "hermes-sessions" in t)


def test_documents_name_no_outside_specification() -> None:
    """The documents stand alone: no section numbers of a specification that is not here."""
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\bSPEC\b|§", text), path.name


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped, spaces
    turned into hyphens, and ``-1``, ``-2``, ... after a repeated one."""
    anchors: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        text = re.sub(r"`|\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        anchor, repeat = slug, 0
        while anchor in anchors:
            repeat += 1
            anchor = f"{slug}-{repeat}"
        anchors.add(anchor)
    return anchors


def test_links_between_documents_resolve() -> None:
    """Every ``[text](page.md#anchor)`` and ``[text](#anchor)`` in docs/ names a page that
    exists and a heading it has."""
    broken = []
    for path in DOCUMENTS[1:]:
        text = path.read_text(encoding="utf-8")
        for page, anchor in re.findall(r"\]\(([\w.-]*\.md|)(?:#([^)\s]*))?\)", text):
            target = path.parent / page if page else path
            if not target.exists():
                broken.append(f"{path.name}: {page}")
            elif anchor and anchor not in _anchors(target):
                broken.append(f"{path.name}: {page}#{anchor}")
    assert not broken


def test_the_sdist_carries_what_the_documents_run() -> None:
    """A ``python -m package.module`` in a document runs from an unpacked sdist too: every such
    package is grafted by MANIFEST.in (or shipped as a package)."""
    manifest = (ROOT / "MANIFEST.in").read_text(encoding="utf-8")
    grafted = set(re.findall(r"^graft\s+(\S+)\s*$", manifest, re.MULTILINE))
    run = {
        package
        for path in DOCUMENTS
        for package in re.findall(r"python -m (\w+)", path.read_text(encoding="utf-8"))
    }
    assert run
    assert run - grafted <= {"hermes_core", "pip", "pytest", "venv"}


REFERENCE = ROOT / "docs" / "reference"
OBJECT = re.compile(r"^\.\. (?:auto|py:)(?:class|exception|function|data):: (\w+)", re.MULTILINE)
MODULE = re.compile(r"^\.\. automodule:: ([\w.]+)", re.MULTILINE)


def test_the_api_reference_documents_every_public_name_once() -> None:
    """docs/reference/ lists the names one by one, grouped by area: a name added to
    ``hermes_core.__all__`` (or a hook module added) must be added there too."""
    names = OBJECT.findall((REFERENCE / "hermes_core.rst").read_text(encoding="utf-8"))
    assert sorted(names) == sorted(hermes_core.__all__)
    modules = MODULE.findall((REFERENCE / "hookspecs.rst").read_text(encoding="utf-8"))
    assert modules == ["hermes_hookspecs", *SPEC_MODULES]
