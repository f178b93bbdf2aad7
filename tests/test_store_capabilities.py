"""The store checks a backend against its StoreSpec at open: required methods, declared
capabilities, and features turned off (one warning each) for what is not declared."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from hermes_core import GatewayConfig, SessionStore, StoreSpec, hookimpl
from hermes_core.domain.errors import StoreContractError, StoreUnavailableError
from hermes_core.domain.specs import STORE_CAPABILITIES
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.store.jsonl import JsonlBackend
from hermes_core.testing import fresh_plugin_manager, telegram_dm


class _WithoutGetRoute:
    """A backend that forgot ``get_route`` (everything else delegates to a JSONL backend)."""

    def __init__(self, inner: JsonlBackend) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "get_route":
            raise AttributeError(name)
        return getattr(self._inner, name)


class _Backends:
    """A storage plugin serving ``bare://`` with the core's JSONL backend (exactly the required
    protocol) under the declaration it is given."""

    def __init__(self, home: Path, wrap: type[_WithoutGetRoute] | None = None, **declared: Any):
        self.home, self.wrap, self.declared = home, wrap, declared

    def open(self, url: str, config: GatewayConfig) -> object:
        backend = JsonlBackend(self.home / "bare")
        return backend if self.wrap is None else self.wrap(backend)

    @hookimpl
    def hermes_register_stores(self, config: GatewayConfig) -> list[StoreSpec]:
        return [StoreSpec(name="bare", schemes=("bare",), open=self.open, **self.declared)]


def _open(home: Path, plugin: _Backends) -> SessionStore:
    (home / "bare").mkdir(parents=True, mode=0o700)
    plugins: HermesPluginManager = fresh_plugin_manager(home)
    plugins.register(plugin, name="bare_store")
    config = GatewayConfig.from_dict(
        {"storage": {"url": "bare://x"}}, environ={"HERMES_HOME": str(home)}
    )
    return SessionStore.open(config, plugins=plugins)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_required_protocol_only_turns_features_off_with_one_warning_each(
    hermes_home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING), _open(hermes_home, _Backends(hermes_home)) as store:
        entry = store.get_or_create_session(telegram_dm())
        store.append_to_transcript(entry.session_id, {"role": "user", "content": "needle"})
        assert store.search("needle") == []
        assert store._obligations.ledger is None
        health = store.health()
        assert health["capabilities"] == dict.fromkeys(STORE_CAPABILITIES, False)
        assert (health["backend"], health["degraded"]) == ("bare", False)
        assert (health["fts"], health["ledger"], health["queue_persistent"]) == (
            "unavailable", "unavailable", False,
        )  # fmt: skip
    warned = _warnings(caplog)
    off = ("search", "transcript_edits", "pruning", "ledger", "queue", "maintenance")
    for capability in off:
        prefix = f"storage backend 'bare' (plugin 'bare_store') does not offer {capability}: "
        assert sum(message.startswith(prefix) for message in warned) == 1, capability
    assert len(warned) == len(off)  # restart counts stay in a file for one instance: no warning


@pytest.mark.parametrize(
    ("capability", "methods"),
    [
        ("turn_leases",
         ("check_lease", "orphaned_lanes", "release_lease", "renew_leases", "take_lease")),
        ("parallel_writers", ("bind_writer", "writer_connections")),
        ("lane_wakeups", ("listen_lanes", "wake_lane")),
        ("operator", ("integrity_problems", "record_kinds", "table_digest", "table_rows")),
        ("route_batches", ("get_routes",)),
    ],
)  # fmt: skip
def test_a_backend_declaring_a_capability_must_implement_its_protocol(
    hermes_home: Path, capability: str, methods: tuple[str, ...]
) -> None:
    with pytest.raises(StoreContractError) as info:
        _open(hermes_home, _Backends(hermes_home, capabilities=frozenset({capability})))
    message = str(info.value)
    for name in methods:
        assert f"{name} ({capability})" in message
    assert "remove the capability from its StoreSpec.capabilities" in message


def test_the_older_boolean_spelling_declares_capabilities() -> None:
    def spec(**older: Any) -> StoreSpec:
        return StoreSpec(name="x", schemes=("x",), open=lambda url, config: None, **older)

    default = spec()
    assert default.capabilities == frozenset()
    assert (default.single_instance, default.atomic_batches, default.local) == (True, False, False)
    older = spec(atomic_batches=True, single_instance=False, parallel_writers=True,
                 lane_wakeups=True, local=True, capabilities={"search"})  # fmt: skip
    assert older.capabilities == {
        "search", "atomic_batches", "turn_leases", "parallel_writers", "lane_wakeups",
        "local_state",
    }  # fmt: skip
    assert (older.single_instance, older.parallel_writers, older.lane_wakeups) == (
        False, True, True,
    )  # fmt: skip
    assert spec(single_instance=True, local=False).capabilities == frozenset()
    with pytest.raises(ValueError, match="single_instance=True contradicts the capability"):
        spec(single_instance=True, capabilities={"turn_leases"})


def test_a_missing_required_method_is_an_error_naming_the_plugin(hermes_home: Path) -> None:
    with pytest.raises(StoreContractError) as info:
        _open(hermes_home, _Backends(hermes_home, wrap=_WithoutGetRoute))
    message = str(info.value)
    assert "storage plugin 'bare_store' opened a 'bare' backend that lacks get_route" in message
    assert "implement them in the backend" in message


def test_a_declared_capability_must_be_implemented(hermes_home: Path) -> None:
    plugin = _Backends(hermes_home, capabilities=frozenset({"search", "ledger"}))
    with pytest.raises(StoreContractError) as info:
        _open(hermes_home, plugin)
    message = str(info.value)
    assert "lacks add_obligation (ledger)" in message
    assert "rebuild_fts (search)" in message
    assert "search (search)" in message
    assert "remove the capability from its StoreSpec.capabilities" in message


def test_without_maintenance_imports_and_rekeying_say_what_to_change(hermes_home: Path) -> None:
    with _open(hermes_home, _Backends(hermes_home)) as store:
        with pytest.raises(StoreUnavailableError, match=r"^Importing sessions\.json needs a"):
            store.import_sessions_json(hermes_home / "sessions.json")
        with pytest.raises(StoreUnavailableError, match=r"Choose a storage\.url whose"):
            store.rekey(dry_run=True)
