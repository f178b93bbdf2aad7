"""Shared fixtures: every test runs with its own ``$HERMES_HOME`` and no stray HERMES_* settings."""

from __future__ import annotations

import importlib.metadata
import os
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.config_files import CONFIG_VARIABLES

POSTGRES_URL = os.environ.get("HERMES_TEST_POSTGRES_URL", "")
POSTGRES_SKIP_REASON = (
    "set HERMES_TEST_POSTGRES_URL (e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test) to "
    "run the PostgreSQL store tests"
)

CRASH_TABLE: list[tuple[str, int, int, int, int]] = []
"""Crash-suite rows: point, restarts, messages acknowledged, lost, duplicate deliveries."""

_CONFIG_ENV = (*CONFIG_VARIABLES, "HERMES_CRASH_AT")


@pytest.fixture(autouse=True)
def hermes_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh state directory as ``$HERMES_HOME``; the developer's settings never leak in."""
    home = tmp_path / "hermes-home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("HERMES_HOME", str(home))
    for name in _CONFIG_ENV:
        monkeypatch.delenv(name, raising=False)
    return home


FakeDistribution = Callable[..., Path]

OWN_DISTRIBUTION = "hermes-sessions"


VISIBLE_DISTRIBUTIONS = {OWN_DISTRIBUTION}
"""The distributions whose entry points the suite sees: hermes-sessions, and the fake ones a
running test installed (:func:`fake_distribution`)."""


def _visible_entry_points(*, group: str) -> importlib.metadata.EntryPoints:
    found = importlib.metadata.entry_points(group=group)
    return importlib.metadata.EntryPoints(
        entry for entry in found
        if entry.dist is not None and entry.dist.name in VISIBLE_DISTRIBUTIONS
    )  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    """The suite counts on the built-in plugins alone: from collection on, the plugin manager
    and the agent loader do not see the entry points of third-party distributions installed in
    the environment, only those of :data:`VISIBLE_DISTRIBUTIONS`. Child processes do not
    inherit this: a test that starts one says what it loads (``HERMES_PLUGINS_AUTOLOAD=0``, or
    the :func:`installed_plugins` disabled)."""
    from hermes_core.gateway import agent_loading
    from hermes_core.plugins import manager as plugins

    plugins.entry_points = _visible_entry_points  # type: ignore[attr-defined,assignment]
    agent_loading.entry_points = _visible_entry_points  # type: ignore[attr-defined,assignment]


def builtins_only(environ: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """A child process's environment (``environ``, else this process's, with ``extra``) in
    which it loads the built-in plugins alone, whatever is installed beside them."""
    return {**(os.environ if environ is None else environ), **extra, "HERMES_PLUGINS_AUTOLOAD": "0"}


@pytest.fixture
def installed_plugins() -> list[str]:
    """The entry-point names of the third-party plugins installed in this environment (taken
    before the test installs fake ones), for the ``plugins.disable`` of a child process that
    must load entry points but count on no installed plugin."""
    return sorted(
        entry.name
        for entry in importlib.metadata.entry_points(group="hermes.plugins")
        if entry.dist is not None and entry.dist.name != OWN_DISTRIBUTION
    )


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A state directory's path, not created (a test module may define its own)."""
    return tmp_path / "home"


@pytest.fixture
def fresh_config_warnings() -> Iterator[None]:
    """The config's once-per-process warnings count as not yet logged, before and after."""
    from hermes_core.config import schema as config

    config._reset_warnings()
    yield
    config._reset_warnings()


@pytest.fixture
def fake_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeDistribution]:
    """Install a fake distribution (dist-info + modules) on ``sys.path`` for entry-point tests.

    ``fake_distribution(name, entry_points={"ep": "module"}, modules={"module": "source"})``
    returns the site directory; importlib.metadata discovers it like a pip-installed package.
    The entry points go in ``group`` (default ``hermes.plugins``).
    """
    counter = iter(range(1000))
    installed: list[str] = []
    names: list[str] = []

    def install(
        name: str,
        *,
        entry_points: dict[str, str],
        modules: dict[str, str] | None = None,
        version: str = "1.0",
        extra_path: Path | None = None,
        group: str = "hermes.plugins",
    ) -> Path:
        site = tmp_path / f"site-{next(counter)}"
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8"
        )
        lines = "\n".join(f"{ep} = {target}" for ep, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[{group}]\n{lines}\n", encoding="utf-8")
        for module, source in (modules or {}).items():
            (site / f"{module}.py").write_text(textwrap.dedent(source), encoding="utf-8")
        installed.extend([*(modules or {}), *entry_points.values()])
        VISIBLE_DISTRIBUTIONS.add(name)
        names.append(name)
        monkeypatch.syspath_prepend(str(site))
        if extra_path is not None:
            monkeypatch.syspath_prepend(str(extra_path))
        return site

    yield install
    VISIBLE_DISTRIBUTIONS.difference_update(names)
    for module in installed:  # the next test's fake module of the same name must be imported anew
        sys.modules.pop(module.split(":")[0], None)


@pytest.fixture
def local_timezone() -> Iterator[Callable[[str], None]]:
    """Switch the process's local time zone (``TZ`` + ``tzset``); restored afterwards."""
    previous = os.environ.get("TZ")

    def switch(name: str) -> None:
        os.environ["TZ"] = name
        time.tzset()

    yield switch
    if previous is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = previous
    time.tzset()


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest) -> str | None:
    """A CLI test's store URL: None for the state directory's SQLite database, or the emptied
    PostgreSQL test database."""
    if request.param == "postgresql":
        return str(request.getfixturevalue("empty_database"))
    return None


@pytest.fixture
def empty_database() -> str:
    """The PostgreSQL test database with an empty ``public`` schema (dropped and recreated)."""
    if not POSTGRES_URL:
        pytest.skip(POSTGRES_SKIP_REASON)
    from sqlalchemy import create_engine

    engine = create_engine(POSTGRES_URL)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP SCHEMA IF EXISTS public CASCADE")
        conn.exec_driver_sql("CREATE SCHEMA public")
    engine.dispose()
    return POSTGRES_URL


@pytest.fixture
def stores(tmp_path: Path, empty_database: str) -> Iterator[Callable[..., Any]]:
    """Open the shared store (``storage.instances: shared`` on :func:`empty_database`) of a
    named process, each with its own ``$HERMES_HOME`` and so its own instance id; by default
    its leases last half a second and its scan runs rarely. Each is closed at the end."""
    from support.shared_driver import configure

    from hermes_core import create_plugin_manager
    from hermes_core.store import SessionStore

    opened: list[SessionStore] = []

    def open_store(name: str, lease_secs: float = 0.5) -> SessionStore:
        config = configure(tmp_path / name, empty_database, lease_secs=lease_secs, scan_secs=3600)
        plugins = create_plugin_manager(config, load_entrypoints=False, strict=True)
        store = SessionStore.open(config, plugins=plugins)
        opened.append(store)
        return store

    yield open_store
    for store in opened:
        store.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the crash suite's table when it ran."""
    if not CRASH_TABLE:
        return
    terminalreporter.write_sep("-", "crash suite")
    width = max(24, *(len(row[0]) for row in CRASH_TABLE))
    header = f"{'crash point':{width}} {'restarts':>8} {'acked':>6} {'lost':>5} {'duplicates':>10}"
    terminalreporter.write_line(header)
    for point, restarts, acked, lost, duplicates in CRASH_TABLE:
        terminalreporter.write_line(
            f"{point:{width}} {restarts:8d} {acked:6d} {lost:5d} {duplicates:10d}"
        )


@pytest.fixture
def state(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A populated state directory (``support.populate``) and its lanes' keys by name."""
    from support.populate import populate

    home = tmp_path / "state"
    return home, populate(home)


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The storage settings of each backend: ``{}`` for the state directory's SQLite database,
    or the PostgreSQL test database, emptied (skipped without ``HERMES_TEST_POSTGRES_URL``)."""
    if request.param == "postgresql":
        request.getfixturevalue("empty_database")
        return {"storage": {"url": POSTGRES_URL}}
    return {}


@pytest.fixture
def open_store(settings: dict[str, Any], tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Opens stores over one state directory on each backend (:func:`settings`), the settings
    it is given over the backend's (``open_store(gateway={...})``); all are closed at the end."""
    from hermes_core import GatewayConfig
    from hermes_core.store import SessionStore
    from hermes_core.testing import fresh_plugin_manager

    home = tmp_path / "home"
    opened: list[SessionStore] = []

    def open_(**given: Any) -> SessionStore:
        config = GatewayConfig.from_dict({**settings, **given}, environ={"HERMES_HOME": str(home)})
        store = SessionStore.open(config, plugins=fresh_plugin_manager(home))
        opened.append(store)
        return store

    yield open_
    for store in opened:
        store.close()
