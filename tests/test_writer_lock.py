"""One writer per database: the lock covers the database, not the state directory.

Two gateways with their own ``HERMES_HOME`` on one SQLite file or one PostgreSQL database, or a
gateway and a plain store, would otherwise both write (turns of one session at once, lanes split
into two sessions, each undoing the other's ``/new`` from a stale cache). The second writer is
refused naming the holder; read-only stores take no lock; the lock dies with its process. The
multi-process tests run real child processes (``support/lock_children.py``).
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine
from support.lock_children import Holder, configure, race

from hermes_core import GatewayConfig, MessageEvent
from hermes_core.domain.errors import (
    GatewayLockedError,
    ReadOnlyStoreError,
    StoreUnavailableError,
)
from hermes_core.gateway.agents import EchoAgent, InMemoryAdapter
from hermes_core.gateway.runtime import Gateway
from hermes_core.state.instance import LockFile
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager, telegram_dm


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """One database shared by every state directory of the test."""
    if request.param == "postgresql":
        return str(request.getfixturevalue("empty_database"))
    return f"sqlite:///{tmp_path / 'shared' / 'state.db'}"


def _config(home: Path, url: str) -> GatewayConfig:
    settings = {
        "storage": {"url": url},
        "gateway": {"housekeeping": {"initial_delay_secs": 3600}},
    }
    return GatewayConfig.from_dict(settings, environ={"HERMES_HOME": str(home)})


def _open(home: Path, url: str, *, read_only: bool = False) -> SessionStore:
    config = _config(home, url)
    return SessionStore.open(config, plugins=fresh_plugin_manager(home), read_only=read_only)


@pytest.fixture
def stores() -> Iterator[list[SessionStore]]:
    """Stores a test opens; closed at the end even when it fails."""
    opened: list[SessionStore] = []
    yield opened
    for store in opened:
        store.close()


def _open_eventually(home: Path, url: str, timeout: float = 10.0) -> SessionStore:
    """Open for writing, retrying while a just-killed holder's lock is still being released
    (PostgreSQL ends a dead client's session when the server notices the closed socket)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _open(home, url)
        except GatewayLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.slow
async def test_a_second_gateway_on_one_database_is_refused(url: str, tmp_path: Path) -> None:
    configure(tmp_path / "home-a", url)
    first = Holder("gateway", tmp_path / "home-a")
    second = Gateway(
        _config(tmp_path / "home-b", url),
        fresh_plugin_manager(tmp_path / "home-b"),
        lambda entry: EchoAgent(),
        [InMemoryAdapter("telegram")],
    )
    try:
        with pytest.raises(GatewayLockedError, match=rf"another writer .*pid[ =]{first.pid}\b"):
            await second.start()
    finally:
        assert first.stop() == 0
    await second.start()  # the first one stopped: its lock went with it
    await second.handle_message(MessageEvent(source=telegram_dm(), text="hello"))
    await second.idle()
    await second.stop()


async def test_a_plain_store_beside_a_running_gateway_is_refused(
    url: str, tmp_path: Path, stores: list[SessionStore]
) -> None:
    adapter = InMemoryAdapter("telegram")
    config = _config(tmp_path / "gateway-home", url)
    gateway = Gateway(
        config, fresh_plugin_manager(tmp_path / "gateway-home"), lambda e: EchoAgent(), [adapter]
    )
    await gateway.start()
    try:
        await gateway.handle_message(MessageEvent(source=telegram_dm(), text="hello"))
        await gateway.idle()
        key = gateway.store.session_key_for(telegram_dm())
        before = gateway.store.peek_session_id(key)
        with pytest.raises(GatewayLockedError, match=rf"pid[ =]{os.getpid()}\b"):
            _open(tmp_path / "operator-home", url)
        reader = _open(tmp_path / "operator-home", url, read_only=True)
        stores.append(reader)
        entry = reader.lookup_by_session_key(key)
        assert entry is not None
        assert entry.session_id == before
        with pytest.raises(ReadOnlyStoreError, match="read-only"):
            reader.reset_session(key)
        assert gateway.store.peek_session_id(key) == before  # nothing to overwrite any more
    finally:
        await gateway.stop()


def test_a_read_only_store_refuses_every_change_and_takes_no_lock(
    url: str, tmp_path: Path, stores: list[SessionStore]
) -> None:
    writer = _open(tmp_path / "writer", url)
    stores.append(writer)
    entry = writer.get_or_create_session(telegram_dm())
    writer.append_to_transcript(entry.session_id, {"role": "user", "content": "kept"})
    reader = _open(tmp_path / "reader", url, read_only=True)
    stores.append(reader)
    assert reader.health()["read_only"] is True
    assert [m["content"] for m in reader.load_transcript(entry.session_id)] == ["kept"]
    changes: list[Any] = [
        lambda: reader.get_or_create_session(telegram_dm("2")),
        lambda: reader.suspend_session(entry.session_key),
        lambda: reader.append_to_transcript(entry.session_id, {"role": "user", "content": "x"}),
        lambda: reader.mark_turn_active(entry.session_key),
        lambda: reader.run(lambda: None),
    ]
    for change in changes:
        with pytest.raises(ReadOnlyStoreError, match="opened read-only"):
            change()
    writer.suspend_session(entry.session_key)  # the writer was never blocked by the reader
    seen = reader.lookup_by_session_key(entry.session_key)
    assert seen is not None
    assert seen.suspended
    assert [e.session_key for e in reader.list_sessions()] == [entry.session_key]


def test_read_only_needs_a_schema(url: str, tmp_path: Path) -> None:
    with pytest.raises(StoreUnavailableError, match=r"no database at|no hermes-sessions schema"):
        _open(tmp_path / "reader", url, read_only=True)


@pytest.mark.slow
def test_four_gateways_starting_on_an_empty_database(url: str, tmp_path: Path) -> None:
    homes = [tmp_path / f"home-{n}" for n in range(4)]
    for home in homes:
        configure(home, url)
    reports = race("write", homes)
    outcomes = sorted(outcome for _, outcome, _ in reports)
    errors = [detail for _, outcome, detail in reports if outcome == "error"]
    assert not errors, errors[0]
    assert outcomes == ["locked", "locked", "locked", "writer"]
    writer = next(pid for pid, outcome, _ in reports if outcome == "writer")
    for _, outcome, detail in reports:
        if outcome == "locked":
            assert re.search(rf"pid[ =]{writer}\b", detail), detail


@pytest.mark.slow
def test_four_read_only_opens_at_once(url: str, tmp_path: Path) -> None:
    with _open(tmp_path / "writer", url) as writer:  # creates the schema, then keeps writing
        writer.get_or_create_session(telegram_dm())
        homes = [tmp_path / f"reader-{n}" for n in range(4)]
        for home in homes:
            configure(home, url)
        reports = race("read", homes)
    assert sorted((outcome, detail) for _, outcome, detail in reports) == [("reader", "1")] * 4


@pytest.mark.slow
def test_the_lock_dies_with_a_killed_holder(url: str, tmp_path: Path) -> None:
    configure(tmp_path / "holder", url)
    holder = Holder("store", tmp_path / "holder")
    try:
        with pytest.raises(GatewayLockedError):
            _open(tmp_path / "next", url)
    finally:
        assert holder.kill() == -9
    with _open_eventually(tmp_path / "next", url) as store:
        store.get_or_create_session(telegram_dm())


def test_the_sqlite_lock_file_is_private_and_names_its_holder(tmp_path: Path) -> None:
    database = tmp_path / "db" / "state.db"
    with _open(tmp_path / "home", f"sqlite:///{database}"):
        lock = Path(f"{database}.lock")
        assert stat.S_IMODE(lock.stat().st_mode) == 0o600
        record = json.loads(lock.read_text(encoding="utf-8"))
        assert record["pid"] == os.getpid()
        assert record["home"] == str(tmp_path / "home")
        with pytest.raises(GatewayLockedError, match=rf"pid {os.getpid()} on host .*HERMES_HOME"):
            _open(tmp_path / "other", f"sqlite:///{database}")


# -- PostgreSQL connection loss ------------------------------------------------------------------


def test_a_writer_whose_lock_was_taken_while_disconnected_writes_nothing_more(
    empty_database: str, tmp_path: Path, stores: list[SessionStore]
) -> None:
    first = _open(tmp_path / "first", empty_database)
    stores.append(first)
    entry = first.get_or_create_session(telegram_dm())
    engine = create_engine(empty_database, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as admin:  # the lock goes with the writer's session
            admin.exec_driver_sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
    finally:
        engine.dispose()
    second = _open_eventually(tmp_path / "second", empty_database)
    stores.append(second)
    second.reset_session(entry.session_key)
    with pytest.raises(StoreUnavailableError, match="taken by another process"):
        first.suspend_session(entry.session_key)
    health = first.health()
    assert health["available"] is False
    assert "writes nothing more" in health["unavailable_reason"]
    second.close()
    with pytest.raises(StoreUnavailableError, match="taken by another process"):
        first.suspend_session(entry.session_key)  # never again, even once the lock is free
    with _open(tmp_path / "check", empty_database, read_only=True) as reader:
        current = reader.lookup_by_session_key(entry.session_key)
        assert current is not None
        assert not current.suspended
        assert current.session_id != entry.session_id


_SLOW_HOLDER = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(float(sys.argv[2]))  # the moment between taking the lock and naming itself
data = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
os.pwrite(fd, data, 0)
os.ftruncate(fd, len(data))
time.sleep(5)
"""


@pytest.mark.parametrize("before", ["nothing", "a gone holder's record"])
def test_a_refused_writer_names_a_holder_that_has_not_written_its_record_yet(
    tmp_path: Path, before: str
) -> None:
    """A process refused in the instant after the holder took the lock, before the holder
    wrote its record, waits for the record instead of naming nobody or the previous holder."""
    path = tmp_path / "state.db.lock"
    if before != "nothing":
        path.write_text(json.dumps({"pid": 2**22 + 1, "host": socket.gethostname()}))
    holder = subprocess.Popen(
        [sys.executable, "-c", _SLOW_HOLDER, str(path), "0.3"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked"
        named: list[dict[str, Any]] = []

        def refused(record: dict[str, Any]) -> GatewayLockedError:
            named.append(record)
            return GatewayLockedError("held")

        with pytest.raises(GatewayLockedError):
            LockFile.acquire(path, {"pid": os.getpid()}, refused)
        assert named == [{"pid": holder.pid, "host": socket.gethostname()}]
    finally:
        holder.kill()
        holder.wait()
