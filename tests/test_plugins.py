"""Plugin manager: built-ins, entry points, validation, typed getters, failure policies."""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import pytest
from pluggy import HookImpl, Result

from conftest import FakeDistribution
from hermes_core import (
    EvictionPolicy,
    GatewayConfig,
    InvalidValueError,
    LifecycleEvent,
    PlatformConflictError,
    PlatformSpec,
    PluginConflictError,
    PluginError,
    RecoveryContext,
    RecoveryStep,
    SessionSource,
    StoreSpec,
    UnknownPlatformError,
    build_session_key,
    create_plugin_manager,
    hookimpl,
)
from hermes_core.testing import LifecycleRecorder, RecoveryStepsPlugin
from hermes_hookspecs import SPEC_MODULES

EXAMPLE_SRC = Path(__file__).resolve().parents[1] / "examples" / "hermes-irc" / "src"
BUILTINS = [
    "platforms", "telegram", "discord", "slack", "whatsapp", "sql_store", "recovery_steps",
    "eviction",
]  # fmt: skip


def _config(
    hermes_home: Path, data: dict[str, object] | None = None, **environ: str
) -> GatewayConfig:
    return GatewayConfig.from_dict(data or {}, environ={"HERMES_HOME": str(hermes_home), **environ})


def _install_irc(fake_distribution: FakeDistribution) -> None:
    fake_distribution(
        "hermes-irc", version="0.1.0", entry_points={"irc": "hermes_irc"}, extra_path=EXAMPLE_SRC
    )


def test_builtins_are_listed_with_distribution(hermes_home: Path) -> None:
    manager = create_plugin_manager(_config(hermes_home), load_entrypoints=False)
    infos = manager.list_plugins()
    assert [info.name for info in infos] == BUILTINS
    assert all(info.builtin and info.distribution == "hermes-sessions" for info in infos)
    hooks = {info.name: info.hooks for info in infos}
    assert hooks["telegram"] == ("hermes_register_connectors", "hermes_register_platforms")
    assert hooks["sql_store"] == ("hermes_register_stores",)
    assert hooks["recovery_steps"] == ("hermes_register_recovery_steps",)
    assert hooks["eviction"] == ("hermes_eviction_policy",)
    assert set(manager.stores()) == {
        "sqlite",
        "sqlite+pysqlite",
        "postgresql",
        "postgresql+psycopg",
    }
    assert [step.name for step in manager.recovery_steps()] == [
        "jsonl_backlog_replay", "fts_rebuild_if_stale", "clean_shutdown", "stuck_loop",
        "queue_restore",
    ]  # fmt: skip
    assert set(manager.platforms()) == {
        "local", "telegram", "discord", "slack", "whatsapp", "signal", "matrix", "email", "sms",
        "bluebubbles",
    }  # fmt: skip
    pii_safe = {name for name, spec in manager.platforms().items() if spec.pii_safe}
    assert pii_safe == {"telegram", "whatsapp", "signal", "bluebubbles"}


def test_example_plugin_is_discovered_through_its_entry_point(
    hermes_home: Path, fake_distribution: FakeDistribution
) -> None:
    _install_irc(fake_distribution)
    manager = create_plugin_manager(_config(hermes_home), strict=True)
    irc = next(info for info in manager.list_plugins() if info.name == "irc")
    assert (irc.distribution, irc.version, irc.builtin) == ("hermes-irc", "0.1.0", False)
    assert manager.platforms().owners["irc"] == "irc"
    source = SessionSource(
        platform="irc", chat_id="#hermes", chat_type="group", scope_id="libera", user_id="Alice[m]"
    )
    key = build_session_key(source, plugins=manager)
    assert key == "agent:main:irc:group:s=libera:c=#hermes:u=alice{m}"
    dm = SessionSource(platform="irc", chat_id="BOB", scope_id="oftc")
    assert build_session_key(dm, plugins=manager) == "agent:main:irc:dm:s=oftc:c=bob"


def test_plugins_installed_beside_the_suite_are_not_seen(
    hermes_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A third-party plugin installed in the test environment (here: a distribution on
    ``sys.path`` that :func:`fake_distribution` did not install) does not reach the tests, which
    count on the built-ins alone (tests/conftest.py)."""
    site = tmp_path / "site-packages"
    info = site / "hermes_stray-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hermes-stray\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[hermes.plugins]\nstray = stray_plugin\n")
    (site / "stray_plugin.py").write_text(
        "from hermes_core import PlatformSpec, hookimpl\n\n\n@hookimpl\n"
        "def hermes_register_platforms(config):\n"
        "    return [PlatformSpec(name='telegram'), PlatformSpec(name='stray')]\n"
    )
    monkeypatch.syspath_prepend(str(site))
    manager = create_plugin_manager(_config(hermes_home), strict=True)
    assert [info.name for info in manager.list_plugins()] == BUILTINS
    assert "stray" not in manager.platforms()


def test_entry_points_are_skipped_when_not_loaded(
    hermes_home: Path, fake_distribution: FakeDistribution
) -> None:
    _install_irc(fake_distribution)
    for manager in (
        create_plugin_manager(_config(hermes_home), load_entrypoints=False),
        create_plugin_manager(_config(hermes_home, {"plugins": {"autoload": False}})),
        create_plugin_manager(_config(hermes_home, HERMES_PLUGINS_AUTOLOAD="0")),
        create_plugin_manager(_config(hermes_home, HERMES_DISABLE_PLUGINS="irc, other")),
    ):
        assert "irc" not in manager.platforms()
        source = SessionSource(platform="irc", chat_id="x")
        with pytest.raises(UnknownPlatformError, match="'irc' is not a registered platform"):
            build_session_key(source, plugins=manager)


def test_disabled_builtin_is_not_registered_and_listed_as_disabled(hermes_home: Path) -> None:
    manager = create_plugin_manager(_config(hermes_home, {"plugins": {"disable": ["slack"]}}))
    slack = next(info for info in manager.list_plugins() if info.name == "slack")
    assert (slack.status, slack.hooks) == ("disabled", ())
    assert not manager.has_plugin("slack")
    assert "slack" not in manager.platforms()


def test_broken_plugin_is_skipped_with_a_warning_naming_it(
    hermes_home: Path, fake_distribution: FakeDistribution, caplog: pytest.LogCaptureFixture
) -> None:
    fake_distribution(
        "hermes-broken", entry_points={"broken": "broken_plugin"},
        modules={"broken_plugin": "raise ImportError('missing dependency frobnicate')\n"},
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="hermes_core.plugins.manager"):
        manager = create_plugin_manager(_config(hermes_home))
    assert "telegram" in manager.platforms()
    message = caplog.text
    assert "'broken' (hermes-broken)" in message
    assert "frobnicate" in message
    with pytest.raises(PluginError, match=r"'broken' \(hermes-broken\).*frobnicate"):
        create_plugin_manager(_config(hermes_home), strict=True)


def test_platform_claimed_twice_names_both_plugins(
    hermes_home: Path, fake_distribution: FakeDistribution
) -> None:
    fake_distribution(
        "hermes-dup",
        entry_points={"dup": "dup_plugin"},
        modules={
            "dup_plugin": """
                from hermes_core import PlatformSpec, hookimpl

                @hookimpl
                def hermes_register_platforms(config):
                    return [PlatformSpec(name="telegram")]
            """
        },
    )
    with pytest.raises(PlatformConflictError) as info:
        create_plugin_manager(_config(hermes_home))
    message = str(info.value)
    assert "'telegram' (hermes-sessions)" in message
    assert "'dup' (hermes-dup)" in message


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        (
            "@hookimpl\ndef hermes_register_platfroms(config):\n    return []\n",
            "unknown hooks hermes_register_platfroms",
        ),
        (
            "@hookimpl\ndef hermes_register_platforms(config):\n    return 'telegram'\n",
            "must return a list of PlatformSpec",
        ),
        (
            "@hookimpl\ndef hermes_register_platforms(config):\n    raise RuntimeError('boom')\n",
            "raised RuntimeError",
        ),
    ],
    ids=["misspelled-hook", "wrong-return", "raises"],
)
def test_bad_third_party_plugin_policy(
    hermes_home: Path,
    fake_distribution: FakeDistribution,
    caplog: pytest.LogCaptureFixture,
    source: str,
    problem: str,
) -> None:
    fake_distribution(
        "hermes-bad", entry_points={"bad": "bad_plugin"},
        modules={"bad_plugin": "from hermes_core import hookimpl\n" + source},
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="hermes_core.plugins.manager"):
        manager = create_plugin_manager(_config(hermes_home))
    assert problem in caplog.text
    assert "'bad' (hermes-bad)" in caplog.text
    assert "telegram" in manager.platforms()
    with pytest.raises(PluginError, match=problem):
        create_plugin_manager(_config(hermes_home), strict=True)


class _FailingObserver:
    @hookimpl
    def hermes_on_lifecycle_event(self, event: LifecycleEvent) -> None:
        raise RuntimeError("observer exploded")


def test_failing_observer_is_logged_and_others_still_run(
    hermes_home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = create_plugin_manager(_config(hermes_home), load_entrypoints=False)
    first, second = LifecycleRecorder(), LifecycleRecorder()
    manager.register(first, name="first")
    manager.register(_FailingObserver(), name="failing")
    manager.register(second, name="second")
    with caplog.at_level(logging.ERROR, logger="hermes_core.plugins.manager"):
        manager.notify(LifecycleEvent(kind="session_created", session_key="k", session_id="s"))
    assert first.kinds == second.kinds == ["session_created"]
    assert "'failing'" in caplog.text
    assert "observer exploded" in caplog.text


def test_hook_calls_are_seen_by_pluggys_monitoring(hermes_home: Path) -> None:
    """Every implementation is called through a pluggy hook caller, one plugin at a time, so
    ``add_hookcall_monitoring`` (and ``enable_tracing``) see each call and whose it is."""
    manager = create_plugin_manager(_config(hermes_home), load_entrypoints=False)
    manager.register(LifecycleRecorder(), name="first")
    manager.register(_FailingObserver(), name="failing")
    seen: list[tuple[str, list[str], str]] = []

    def before(name: str, impls: Sequence[HookImpl], kwargs: Mapping[str, object]) -> None:
        pass

    def after(
        outcome: Result[object], name: str, impls: Sequence[HookImpl], kwargs: Mapping[str, object]
    ) -> None:
        failed = outcome.exception is not None
        seen.append((name, [impl.plugin_name for impl in impls], "raised" if failed else "ok"))

    undo = manager.add_hookcall_monitoring(before, after)
    try:
        manager.notify(LifecycleEvent(kind="session_created", session_key="k", session_id="s"))
        manager.platforms()
    finally:
        undo()
    assert seen[:2] == [
        ("hermes_on_lifecycle_event", ["failing"], "raised"),
        ("hermes_on_lifecycle_event", ["first"], "ok"),
    ]
    platform_calls = [impls for name, impls, _ in seen if name == "hermes_register_platforms"]
    assert platform_calls == [["whatsapp"], ["slack"], ["discord"], ["telegram"], ["platforms"]]


def _step(name: str, order: int, phase: Literal["startup", "shutdown"] = "startup") -> RecoveryStep:
    def run(context: RecoveryContext) -> None:
        context.report.extra[name] = order

    return RecoveryStep(name=name, order=order, run=run, phase=phase)


def test_recovery_steps_sorted_by_order_then_name(hermes_home: Path) -> None:
    manager = create_plugin_manager(_config(hermes_home), load_entrypoints=False)
    manager.register(RecoveryStepsPlugin(_step("b", 200), _step("z", 100)), name="one")
    manager.register(
        RecoveryStepsPlugin(_step("a", 200), _step("flush", 50, "shutdown")), name="two"
    )
    assert [step.name for step in manager.recovery_steps()] == [
        "jsonl_backlog_replay", "z", "a", "b", "fts_rebuild_if_stale", "clean_shutdown",
        "stuck_loop", "queue_restore",
    ]  # fmt: skip
    assert [step.name for step in manager.recovery_steps("shutdown")] == ["flush"]
    manager.register(RecoveryStepsPlugin(_step("a", 1)), name="three")
    with pytest.raises(PluginConflictError, match="recovery step 'a' is registered by plugin"):
        manager.recovery_steps()


class _Policy:
    def __init__(self, name: str) -> None:
        self.policy = EvictionPolicy(name=name, plan=lambda candidates, reason, limit: [])

    @hookimpl
    def hermes_eviction_policy(self, config: GatewayConfig) -> EvictionPolicy:
        return self.policy


def test_one_eviction_policy_replaces_and_two_conflict(hermes_home: Path) -> None:
    manager = create_plugin_manager(_config(hermes_home), load_entrypoints=False)
    builtin = manager.eviction_policy()
    assert builtin is not None
    assert builtin.name == "lru"
    manager.register(_Policy("mine"), name="mine")
    policy = manager.eviction_policy()
    assert policy is not None
    assert policy.name == "mine"
    manager.register(_Policy("theirs"), name="theirs")
    with pytest.raises(PluginError, match="only one eviction policy"):
        manager.eviction_policy()


class _Stores:
    def __init__(self, name: str, *schemes: str) -> None:
        self.spec = StoreSpec(name=name, schemes=schemes, open=lambda url, config: (name, url))

    @hookimpl
    def hermes_register_stores(self, config: GatewayConfig) -> list[StoreSpec]:
        return [self.spec]


def test_stores_by_scheme_and_scheme_conflict(hermes_home: Path) -> None:
    manager = create_plugin_manager(_config(hermes_home), load_entrypoints=False)
    manager.register(_Stores("mem", "memory", "mem"), name="mem")
    stores = manager.stores()
    assert stores["memory"].open("memory://x", manager.config) == ("mem", "memory://x")
    assert stores["mem"] is stores["memory"]
    manager.register(_Stores("other", "mem"), name="other")
    with pytest.raises(PluginConflictError, match="storage scheme 'mem' is registered by plugin"):
        manager.stores()


class _Platforms:
    def __init__(self, *names: str) -> None:
        self.names = names

    @hookimpl
    def hermes_register_platforms(self, config: GatewayConfig) -> list[PlatformSpec]:
        return [PlatformSpec(name=name) for name in self.names]


def test_registry_is_rebuilt_when_plugins_change(hermes_home: Path) -> None:
    manager = create_plugin_manager(_config(hermes_home), load_entrypoints=False)
    assert "irc" not in manager.platforms()
    extra = _Platforms("irc")
    manager.register(extra, name="extra")
    assert "irc" in manager.platforms()
    manager.unregister(extra)
    assert "irc" not in manager.platforms()
    manager.register(_Platforms("telegram"), name="again")
    with pytest.raises(PlatformConflictError, match="'again' \\(not from a distribution\\)"):
        manager.platforms()


@pytest.mark.parametrize("module_name", SPEC_MODULES)
def test_every_hook_is_documented(module_name: str) -> None:
    module = importlib.import_module(module_name)
    hooks = [obj for name, obj in vars(module).items() if name.startswith("hermes_")]
    assert hooks, f"{module_name} defines no hook"
    for hook in hooks:
        doc = inspect.getdoc(hook) or ""
        for section in ("**When:**", "**Mode:**", "**Arguments:**", "**Failure policy:**"):
            assert section in doc, f"{hook.__name__} lacks {section}"


def _numeric_ids(source: SessionSource) -> None:
    if not source.chat_id.lstrip("-").isdigit():
        raise InvalidValueError("chat_id", f"chat_id {source.chat_id!r} must be numeric on strict")


class _StrictPlatform:
    @hookimpl
    def hermes_register_platforms(self, config: GatewayConfig) -> list[PlatformSpec]:
        return [PlatformSpec(name="strict", validate_source=_numeric_ids)]


def test_identifier_validator_runs_on_untrusted_input(hermes_home: Path) -> None:
    manager = create_plugin_manager(_config(hermes_home), load_entrypoints=False)
    manager.register(_StrictPlatform(), name="strict")
    assert SessionSource.from_dict({"platform": "strict", "chat_id": -5}, plugins=manager)
    with pytest.raises(InvalidValueError, match="must be numeric") as info:
        SessionSource.from_dict({"platform": "strict", "chat_id": "abc"}, plugins=manager)
    assert info.value.field == "chat_id"
