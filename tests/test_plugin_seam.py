"""The plugin seam: essential plugins, pluggy's call semantics, survivable conflicts, the default
manager behind ``plugins=None``, and a core that names no platform."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FakeDistribution
from hermes_core import (
    ConfigError,
    GatewayConfig,
    LifecycleEvent,
    PlatformConflictError,
    PlatformSpec,
    PluginError,
    SessionSource,
    SessionStore,
    build_session_context,
    build_session_context_prompt,
    build_session_key,
    create_plugin_manager,
    hookimpl,
)
from hermes_core.cli.main import main
from hermes_core.plugins.manager import default_plugin_manager
from hermes_core.testing import LifecycleRecorder

CORE = Path(__file__).resolve().parents[1] / "hermes_core"
EXAMPLE_SRC = Path(__file__).resolve().parents[1] / "examples" / "hermes-irc" / "src"
STEPS = "jsonl_backlog_replay, fts_rebuild_if_stale, clean_shutdown, stuck_loop, queue_restore"


def _config(hermes_home: Path, data: dict[str, object] | None = None) -> GatewayConfig:
    return GatewayConfig.from_dict(data or {}, environ={"HERMES_HOME": str(hermes_home)})


def _disabling(hermes_home: Path, *names: str) -> GatewayConfig:
    return _config(hermes_home, {"plugins": {"disable": list(names)}})


# -- essential plugins ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("plugin", "lost"),
    [
        ("recovery_steps", f"the recovery steps {STEPS}"),
        ("sql_store", "the storage backend for storage.url (scheme 'sqlite')"),
        ("eviction", "an eviction policy"),
    ],
)
def test_disabling_an_essential_plugin_names_what_is_lost(
    hermes_home: Path, plugin: str, lost: str
) -> None:
    with pytest.raises(ConfigError) as info:
        create_plugin_manager(_disabling(hermes_home, plugin), load_entrypoints=False)
    message = str(info.value)
    assert f"plugins.disable lists {plugin!r}, and no other plugin provides {lost}" in message
    assert f"remove {plugin!r} from plugins.disable" in message
    assert info.value.key == "plugins.disable"


def test_disabled_essential_plugin_is_listed_with_what_it_would_provide(hermes_home: Path) -> None:
    manager = create_plugin_manager(
        _disabling(hermes_home, "recovery_steps"), load_entrypoints=False, check=False
    )
    info = next(info for info in manager.list_plugins() if info.name == "recovery_steps")
    assert info.status == "disabled"
    assert info.provides.steps == tuple(STEPS.split(", "))
    assert "start-up and shutdown would skip them" in info.problems[0]
    with pytest.raises(ConfigError, match="recovery steps"):
        manager.recovery_steps()
    assert "telegram" in manager.platforms()  # other concerns stay usable


_REPLACEMENT_STEPS = """
    from hermes_core import RecoveryStep, hookimpl

    NAMES = ("jsonl_backlog_replay", "fts_rebuild_if_stale", "clean_shutdown", "stuck_loop",
             "queue_restore")

    def run(context):
        context.report.extra.setdefault("ran", []).append("x")

    @hookimpl
    def hermes_register_recovery_steps(config):
        return [RecoveryStep(name=name, order=10 * (index + 1), run=run, critical=True)
                for index, name in enumerate(NAMES)]
"""


def test_an_essential_plugin_may_be_replaced(
    hermes_home: Path, fake_distribution: FakeDistribution
) -> None:
    fake_distribution(
        "hermes-steps", entry_points={"my_steps": "my_steps"},
        modules={"my_steps": _REPLACEMENT_STEPS},
    )  # fmt: skip
    manager = create_plugin_manager(_disabling(hermes_home, "recovery_steps"), strict=True)
    steps = manager.recovery_steps()
    assert [step.order for step in steps] == [10, 20, 30, 40, 50]
    assert all(step.critical for step in steps)


def test_another_store_for_the_configured_scheme_replaces_the_sql_store(hermes_home: Path) -> None:
    class Memory:
        @hookimpl
        def hermes_register_stores(self, config: GatewayConfig) -> list[object]:
            from hermes_core import StoreSpec

            return [StoreSpec(name="memory", schemes=("memory",), open=lambda url, cfg: url)]

    config = _config(
        hermes_home, {"storage": {"url": "memory://x"}, "plugins": {"disable": ["sql_store"]}}
    )
    manager = create_plugin_manager(config, load_entrypoints=False, check=False)
    manager.register(Memory(), name="memory")
    manager.check()
    assert list(manager.stores()) == ["memory"]


# -- pluggy's call semantics ---------------------------------------------------------------------


class _Named:
    def __init__(self, name: str, seen: list[str]) -> None:
        self.name, self.seen = name, seen

    @hookimpl
    def hermes_on_lifecycle_event(self, event: LifecycleEvent) -> None:
        self.seen.append(self.name)


class _First(_Named):
    @hookimpl(tryfirst=True)
    def hermes_on_lifecycle_event(self, event: LifecycleEvent) -> None:
        self.seen.append(self.name)


class _Last(_Named):
    @hookimpl(trylast=True)
    def hermes_on_lifecycle_event(self, event: LifecycleEvent) -> None:
        self.seen.append(self.name)


def test_observers_run_in_pluggys_call_order(hermes_home: Path) -> None:
    manager = create_plugin_manager(_config(hermes_home), load_entrypoints=False)
    seen: list[str] = []
    for observer in (_Last("last", seen), _Named("a", seen), _First("first", seen)):
        manager.register(observer, name=observer.name)
    manager.register(_Named("b", seen), name="b")
    event = LifecycleEvent(kind="session_created")
    manager.hook.hermes_on_lifecycle_event(event=event)  # pluggy's own loop, for reference
    pluggy_order, seen[:] = list(seen), []
    manager.notify(event)
    assert seen == pluggy_order == ["first", "b", "a", "last"]


class _Wrapper:
    @hookimpl(wrapper=True)
    def hermes_on_lifecycle_event(self, event: LifecycleEvent) -> object:
        return (yield)


class _OldWrapper:
    @hookimpl(hookwrapper=True)
    def hermes_on_lifecycle_event(self, event: LifecycleEvent) -> object:
        return (yield)


@pytest.mark.parametrize("plugin", [_Wrapper(), _OldWrapper()], ids=["wrapper", "hookwrapper"])
def test_hook_wrappers_are_refused_at_registration(hermes_home: Path, plugin: object) -> None:
    manager = create_plugin_manager(_config(hermes_home), load_entrypoints=False)
    with pytest.raises(PluginError, match="'wrapping' implements hermes_on_lifecycle_event as a"):
        manager.register(plugin, name="wrapping")
    assert not manager.has_plugin("wrapping")
    assert not manager.observing


def test_wrapper_from_an_entry_point_is_listed_as_failed(
    hermes_home: Path, fake_distribution: FakeDistribution
) -> None:
    fake_distribution(
        "hermes-wrap", entry_points={"wrap": "wrap_plugin"},
        modules={"wrap_plugin": """
            from hermes_core import hookimpl

            @hookimpl(wrapper=True)
            def hermes_on_lifecycle_event(event):
                return (yield)
        """},
    )  # fmt: skip
    manager = create_plugin_manager(_config(hermes_home))
    info = next(info for info in manager.list_plugins() if info.name == "wrap")
    assert (info.status, info.distribution) == ("failed", "hermes-wrap")
    assert "remove wrapper=True / hookwrapper=True" in info.problems[0]
    with pytest.raises(PluginError, match="hook wrapper"):
        create_plugin_manager(_config(hermes_home), strict=True)


def test_failing_observer_does_not_stop_the_others(hermes_home: Path) -> None:
    class Failing:
        @hookimpl(tryfirst=True)
        def hermes_on_lifecycle_event(self, event: LifecycleEvent) -> None:
            raise RuntimeError("boom")

    manager = create_plugin_manager(_config(hermes_home), load_entrypoints=False)
    recorder = LifecycleRecorder()
    manager.register(recorder, name="recorder")
    manager.register(Failing(), name="failing")
    manager.notify(LifecycleEvent(kind="turn_started"))
    assert recorder.kinds == ["turn_started"]


# -- conflicts -----------------------------------------------------------------------------------

_MATRIX = """
    from hermes_core import PlatformSpec, hookimpl

    @hookimpl
    def hermes_register_platforms(config):
        return [PlatformSpec(name="matrix", label="Matrix ({name})", pii_safe=True)]
"""


def _install_matrix(fake_distribution: FakeDistribution, name: str = "acme") -> Path:
    """A third-party plugin ``<name>_matrix`` (distribution ``hermes-<name>-matrix``, version
    2.0) for the platform ``matrix``, which the built-in ``platforms`` gives the generic rule."""
    module = f"{name}_matrix"
    return fake_distribution(
        f"hermes-{name}-matrix", version="2.0", entry_points={module: module},
        modules={module: _MATRIX.replace("{name}", name)},
    )  # fmt: skip


def _conflicting(message: str) -> bool:
    """Whether ``message`` names the two matrix plugins and the fix, and not the built-in."""
    return (
        "platform 'matrix' is registered by plugin" in message
        and "'acme_matrix' (hermes-acme-matrix)" in message
        and "'beta_matrix' (hermes-beta-matrix)" in message
        and "[acme_matrix.matrix]" in message
        and "[beta_matrix.matrix]" in message
        and "platforms.matrix" not in message
    )


def test_a_specific_plugin_replaces_a_generic_builtin_platform(
    hermes_home: Path, fake_distribution: FakeDistribution, capsys: pytest.CaptureFixture[str]
) -> None:
    """matrix, signal, email and sms get only the generic rule from the built-in ``platforms``:
    a plugin for one of them replaces that rule (listed as replaced), and every command runs."""
    _install_matrix(fake_distribution)
    manager = create_plugin_manager(_config(hermes_home), strict=True)
    registry = manager.platforms()
    assert registry.owners["matrix"] == "acme_matrix"
    assert registry["matrix"].label == "Matrix (acme)"
    assert {"local", "signal", "email", "sms", "bluebubbles"} <= set(registry)
    infos = {info.name: info for info in manager.list_plugins()}
    assert infos["platforms"].status == infos["acme_matrix"].status == "loaded"
    assert infos["platforms"].replaced == (("matrix", "acme_matrix"),)
    assert "matrix" not in infos["platforms"].provides.platforms
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert rows["platforms"].split()[1] == "loaded"
    assert rows["platforms"].endswith("; replaced: matrix (by acme_matrix)")
    assert "Problems:" not in out
    assert main(["plugins", "--json"]) == 0
    listed = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert listed["platforms"]["replaced"] == {"matrix": "acme_matrix"}
    assert main(["key", "--platform", "matrix", "--chat-id", "!room"]) == 0
    assert capsys.readouterr().out == "agent:main:matrix:dm:c=!room\n"
    disabled = create_plugin_manager(_disabling(hermes_home, "platforms.matrix"), strict=True)
    assert disabled.platforms().owners["matrix"] == "acme_matrix"


def test_plugins_command_shows_a_platform_conflict(
    fake_distribution: FakeDistribution, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two specific plugins for one platform conflict; the generic built-in is not part of it."""
    _install_matrix(fake_distribution)
    _install_matrix(fake_distribution, "beta")
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.split("\n\n")[0].splitlines()[1:]}
    assert rows["platforms"][1] == "loaded"
    assert rows["acme_matrix"][1:4] == ["conflict", "hermes-acme-matrix", "2.0"]
    assert rows["acme_matrix"][4:] == ["platforms:", "matrix"]
    assert rows["beta_matrix"][1:4] == ["conflict", "hermes-beta-matrix", "2.0"]
    assert rows["telegram"][1] == "loaded"
    problems = out.split("Problems:\n")[1].splitlines()
    assert len(problems) == 1
    assert _conflicting(problems[0])


@pytest.mark.parametrize(
    "argv",
    [
        ["key", "--platform", "telegram", "--chat-id", "1"],
        ["explain", "--platform", "telegram", "--chat-id", "1"],
    ],
)
def test_other_commands_name_the_conflict(
    fake_distribution: FakeDistribution, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    _install_matrix(fake_distribution)
    _install_matrix(fake_distribution, "beta")
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("hermes-sessions: error: platform 'matrix' is registered by")
    assert _conflicting(captured.err)


def test_a_specific_builtin_platform_conflicts(
    hermes_home: Path, fake_distribution: FakeDistribution
) -> None:
    """Only the generic built-in yields: a plugin claiming ``telegram`` conflicts with it."""
    fake_distribution(
        "hermes-acme-telegram", entry_points={"acme_telegram": "acme_telegram"},
        modules={"acme_telegram": _MATRIX.replace('"matrix"', '"telegram"')},
    )  # fmt: skip
    with pytest.raises(PlatformConflictError, match="'telegram' \\(hermes-sessions\\)"):
        create_plugin_manager(_config(hermes_home))
    manager = create_plugin_manager(_disabling(hermes_home, "telegram"), strict=True)
    assert manager.platforms().owners["telegram"] == "acme_telegram"


def test_a_dotted_disable_must_name_a_platform_of_the_plugin(hermes_home: Path) -> None:
    with pytest.raises(ConfigError, match="plugin 'platforms' registers no platform 'matrx'"):
        create_plugin_manager(_disabling(hermes_home, "platforms.matrx"), load_entrypoints=False)


@pytest.mark.slow
def test_conflict_in_a_separate_process(
    hermes_home: Path, fake_distribution: FakeDistribution, installed_plugins: list[str]
) -> None:
    """The console script, in its own interpreter, finds the plugins through their entry points
    (those installed in the environment disabled: the test counts on its own two)."""
    script = Path(sys.executable).parent / "hermes-sessions"
    if not script.exists():
        pytest.skip(f"console script not installed beside the interpreter: {script}")
    sites = [_install_matrix(fake_distribution), _install_matrix(fake_distribution, "beta")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HERMES_", "PYTHON"))}
    env.update(
        HERMES_HOME=str(hermes_home), PYTHONPATH=os.pathsep.join(map(str, sites)),
        PYTHONIOENCODING="utf-8",
    )  # fmt: skip

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(script), *argv], capture_output=True, text=True, encoding="utf-8", env=env,
            timeout=60, check=False,
        )  # fmt: skip

    config = hermes_home / "config.yaml"
    config.write_text(json.dumps({"plugins": {"disable": installed_plugins}}))
    listed = run("plugins")
    assert listed.returncode == 0, listed.stderr
    assert _conflicting(listed.stdout.split("Problems:\n")[1])
    keyed = run("key", "--platform", "matrix", "--chat-id", "!room")
    assert keyed.returncode == 2
    assert _conflicting(keyed.stderr)
    config.write_text(json.dumps({"plugins": {"disable": [*installed_plugins, "beta_matrix"]}}))
    fixed = run("key", "--platform", "matrix", "--chat-id", "!room")
    assert (fixed.returncode, fixed.stdout) == (0, "agent:main:matrix:dm:c=!room\n"), fixed.stderr


# -- plugins=None --------------------------------------------------------------------------------


def test_plugins_none_means_the_default_manager_with_entry_points(
    fake_distribution: FakeDistribution,
) -> None:
    fake_distribution(
        "hermes-irc", version="0.1.0", entry_points={"irc": "hermes_irc"}, extra_path=EXAMPLE_SRC
    )
    source = SessionSource.from_dict({"platform": "irc", "chat_id": "BOB", "scope_id": "oftc"})
    assert build_session_key(source) == "agent:main:irc:dm:s=oftc:c=bob"
    assert default_plugin_manager() is default_plugin_manager()
    assert default_plugin_manager().platforms().owners["irc"] == "irc"


def test_default_manager_is_shared_by_equal_configurations(hermes_home: Path) -> None:
    config = _config(hermes_home)
    store = SessionStore.open(config)
    try:
        assert store.plugins is default_plugin_manager(_config(hermes_home))
    finally:
        store.close()
    other = default_plugin_manager(_disabling(hermes_home, "slack"))
    assert other is not store.plugins
    assert "slack" not in other.platforms()


# -- the core names no platform --------------------------------------------------------------------

_BUILTIN_PLATFORMS = {
    "local", "telegram", "discord", "slack", "whatsapp", "signal", "matrix", "email", "sms",
    "bluebubbles",
}  # fmt: skip
_SAMPLE_DATA = {"demo.py", "testing"}  # the demo's and the test helpers' sample sources


def _platform_literals(tree: ast.AST) -> list[int]:
    """Lines where a built-in platform name is compared against or is a default value."""
    found = []
    for node in ast.walk(tree):
        values: list[ast.expr] = []
        if isinstance(node, ast.Compare):
            values = [node.left, *node.comparators]
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            values = [node.value]
        elif isinstance(node, ast.arguments):
            values = [*node.defaults, *(d for d in node.kw_defaults if d is not None)]
        for value in values:
            elements = value.elts if isinstance(value, (ast.Tuple, ast.List, ast.Set)) else [value]
            found += [
                e.lineno for e in elements
                if isinstance(e, ast.Constant) and e.value in _BUILTIN_PLATFORMS
            ]  # fmt: skip
    return sorted(found)


@pytest.mark.parametrize(
    "path",
    sorted(p for p in CORE.rglob("*.py") if _SAMPLE_DATA.isdisjoint(p.relative_to(CORE).parts)),
    ids=lambda p: str(p.relative_to(CORE)),
)
def test_core_never_branches_on_a_platform_name(path: Path) -> None:
    assert _platform_literals(ast.parse(path.read_text(encoding="utf-8"))) == []


def test_the_check_finds_a_branch_on_a_platform_name() -> None:
    tree = ast.parse('if source.platform == "local":\n    pass\nplatform: str = "telegram"\n')
    assert _platform_literals(tree) == [1, 3]


class _Shell:
    @hookimpl
    def hermes_register_platforms(self, config: GatewayConfig) -> list[PlatformSpec]:
        return [PlatformSpec(name="shell", local_machine=True)]


def test_local_machine_is_a_declared_property(hermes_home: Path) -> None:
    config = _config(
        hermes_home,
        {"plugins": {"disable": ["platforms.local"]}, "platforms": {"telegram": {"enabled": True}}},
    )
    manager = create_plugin_manager(config, load_entrypoints=False, check=False)
    manager.register(_Shell(), name="shell")
    source = SessionSource(platform="shell", chat_id="tty1")
    context = build_session_context(source, config, plugins=manager)
    lines = build_session_context_prompt(context, plugins=manager).splitlines()
    assert "**Source:** Local (the machine running this agent)" in lines
    assert "**Connected Platforms:** shell (files on this machine), telegram: Connected ✓" in lines
    assert '- "origin" → local output (saved to files)' in lines
    targets = [line.split(" → ")[0] for line in lines if "save to local files only" in line]
    assert targets == ['- "shell"']
    assert not any('"local"' in line for line in lines)
