"""The connections a PostgreSQL store holds: counted against the server's limit at start, and
named after the process (and, shared, its instance)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from conftest import POSTGRES_SKIP_REASON, POSTGRES_URL
from hermes_core import GatewayConfig
from hermes_core.domain.errors import ConfigError
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager
from hermes_plugins.sql_store.exclusive import check_connections


def test_a_process_that_can_never_fit_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError) as caught:
        check_connections("db", 2, 15, (20, 4, 2), ours=2)
    message = str(caught.value)
    assert "needs 17 connections (2 writers" in message
    assert "allows 16" in message
    assert "storage.read_connections" in message


def test_a_process_that_fits_only_once_others_close_gets_a_warning() -> None:
    warning = check_connections("db", 1, 8, (20, 3, 12), ours=2)
    assert warning is not None
    assert "only 7 of the server's 17 are free now (10 open elsewhere)" in warning


def test_a_process_that_fits_gets_nothing() -> None:
    assert check_connections("db", 1, 8, (100, 3, 5), ours=2) is None
    assert check_connections("db", 2, 15, (20, 3, 2), ours=2) is None  # exactly the usable slots


def test_a_shared_store_counts_its_listening_connection() -> None:
    with pytest.raises(ConfigError) as caught:
        check_connections("db", 2, 15, (20, 3, 2), ours=2, listening=True)
    assert "needs 18 connections (2 writers" in str(caught.value)
    assert "1 listening for lane wake-ups" in str(caught.value)


def _open(url: str, home: Path, storage: dict[str, object]) -> SessionStore:
    config = GatewayConfig.from_dict(
        {"storage": {"url": url, **storage}}, environ={"HERMES_HOME": str(home)}
    )
    return SessionStore.open(config, plugins=fresh_plugin_manager(home))


def _names(url: str) -> list[str]:
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT application_name FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name LIKE 'hermes%'"
            )
        ).all()
    engine.dispose()
    return [row[0] for row in rows]


@pytest.mark.postgres
@pytest.mark.skipif(not POSTGRES_URL, reason=POSTGRES_SKIP_REASON)
def test_a_store_checks_its_connections_and_names_them(
    empty_database: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    store = _open(empty_database, tmp_path / "single", {"read_connections": 2})
    try:
        names = _names(empty_database)
    finally:
        store.close()
    assert names
    assert all(name.startswith("hermes-sessions pid=") for name in names)
    assert not [r for r in caplog.records if "connections" in r.getMessage()]

    shared = _open(empty_database, tmp_path / "shared", {"instances": "shared"})
    try:
        shared_names = _names(empty_database)
    finally:
        shared.close()
    instance = (tmp_path / "shared" / ".instance_id").read_text().strip()
    assert any(name.startswith(f"hermes {instance[:20]}") for name in shared_names)


@pytest.mark.postgres
@pytest.mark.skipif(not POSTGRES_URL, reason=POSTGRES_SKIP_REASON)
def test_the_readers_get_their_connections_beside_the_writers_and_the_listener(
    empty_database: str, tmp_path: Path
) -> None:
    """The writer connections and a shared store's listener come from the same pool as the
    readers; ``read_connections: 1`` still leaves one for reads while all of them are open."""
    store = _open(
        empty_database, tmp_path / "p1",
        {"read_connections": 1, "writer_connections": 2, "instances": "shared"},
    )  # fmt: skip
    stop = store._leases.listen_lanes(lambda key: None)
    try:
        keys = [f"agent:main:telegram:dm:{n}" for n in range(8)]  # on both writer threads
        for key in keys:
            store.run(store.peek_session_id, key, lane=key)
        started = time.monotonic()
        assert store.peek_session_id(keys[0]) is None  # a read on the pool
        assert time.monotonic() - started < 5  # not after waiting for a connection
    finally:
        if stop is not None:
            stop()
        store.close()


@pytest.mark.postgres
@pytest.mark.skipif(not POSTGRES_URL, reason=POSTGRES_SKIP_REASON)
def test_a_shared_store_writes_over_one_connection_unless_told_otherwise(
    empty_database: str, tmp_path: Path
) -> None:
    """Shared, the other gateways commit in parallel already: one writer connection (and
    thread) per process by default; a single gateway keeps two; the setting overrides both."""
    cases: list[tuple[str, dict[str, object], int]] = [
        ("single", {}, 2),
        ("shared", {"instances": "shared"}, 1),
        ("shared-3", {"instances": "shared", "writer_connections": 3}, 3),
    ]
    for home, storage, writers in cases:
        before = set(threading.enumerate())
        store = _open(empty_database, tmp_path / home, storage)
        try:
            started = set(threading.enumerate()) - before
            names = sorted(t.name for t in started if t.name.startswith("hermes-store-writer"))
            assert len(names) == writers, (home, names)
        finally:
            store.close()
