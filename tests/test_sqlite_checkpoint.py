"""SQLite checkpoints run on a thread of the store, off the writer's path: committed pages reach
the database file without the writer copying them, and a process killed while they are copied
loses nothing it committed."""

from __future__ import annotations

import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

from hermes_core import GatewayConfig
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager, telegram_dm
from hermes_plugins.sql_store.dialects.sqlite_checkpoint import (
    WRITER_CHECKPOINT_PAGES,
    Checkpointer,
)

LANES = 200


def _routes_in_file_alone(database: Path, copy: Path) -> int:
    """The routing rows of the database file read without its WAL (a copy of the file alone);
    -1 while a checkpoint is writing it (a torn copy)."""
    shutil.copyfile(database, copy)
    try:
        with closing(sqlite3.connect(copy)) as conn:
            return int(conn.execute("SELECT count(*) FROM gateway_routing").fetchone()[0])
    except sqlite3.DatabaseError:
        return -1
    finally:
        copy.unlink()


def _checkpoint_threads() -> int:
    return sum(thread.name == "hermes-sqlite-checkpoint" for thread in threading.enumerate())


def test_commits_reach_the_database_file_without_the_writer_checkpointing(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(home)})
    store = SessionStore.open(config, plugins=fresh_plugin_manager(home))
    database = home / "state.db"
    try:
        for index in range(LANES):
            source = telegram_dm(str(index))
            store._sessions.open_lane(store.session_key_for(source), source)
        with closing(sqlite3.connect(database)) as conn:
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
        assert pages < WRITER_CHECKPOINT_PAGES  # the writer's own checkpoint was never due
        assert _checkpoint_threads() == 1
        deadline = time.monotonic() + 10
        while (found := _routes_in_file_alone(database, tmp_path / "copy.db")) != LANES:
            assert time.monotonic() < deadline, f"{found} of {LANES} routes in the file alone"
            time.sleep(0.05)
    finally:
        store.close()
    assert _checkpoint_threads() == 0
    assert not Path(f"{database}-wal").exists()  # the last connection checkpointed the rest


_WRITER = """
import os, signal, sys
from hermes_core import GatewayConfig
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager, telegram_dm
from hermes_plugins.sql_store.dialects.sqlite_checkpoint import Checkpointer
done = []
checkpoint = Checkpointer._checkpoint
def counted(self, conn):
    checkpoint(self, conn)
    done.append(1)
Checkpointer._checkpoint = counted
home = sys.argv[1]
store = SessionStore.open(
    GatewayConfig.from_dict({}, environ={"HERMES_HOME": home}), plugins=fresh_plugin_manager(home)
)
for index in range(10**9):
    source = telegram_dm(str(index))
    store._sessions.open_lane(store.session_key_for(source), source)
    print(index, flush=True)
    if len(done) >= 5:  # checkpoints copied pages while lanes were written, and go on
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_process_killed_while_it_checkpoints_keeps_every_commit(tmp_path: Path) -> None:
    """A writer killed (SIGKILL) amid commits once its checkpoint thread has copied pages five
    times: every lane it reported committed is in the store it leaves, which is intact."""
    home = tmp_path / "home"
    child = subprocess.run(
        [sys.executable, "-c", _WRITER, str(home)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    committed = [int(line) for line in child.stdout.split()]
    assert len(committed) > 5
    with closing(sqlite3.connect(home / "state.db")) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        keys = {row[0] for row in conn.execute("SELECT session_key FROM gateway_routing")}
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(home)})
    store = SessionStore.open(config, plugins=fresh_plugin_manager(home))
    try:
        expected = {store.session_key_for(telegram_dm(str(index))) for index in committed}
        assert all(store.lookup_by_session_key(key) is not None for key in expected)
    finally:
        store.close()
    assert expected <= keys


class _StopDuringTheWait(threading.Event):
    """The checkpoint thread's ``_stopping``: its wait between a commit and the checkpoint lets
    ``stop`` run to its join, then ends as if its time had run out just before the stop."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        super().__init__()
        self.checkpointer = checkpointer
        self.stopper: threading.Thread | None = None

    def wait(self, timeout: float | None = None) -> bool:
        if self.stopper is not None:
            return super().wait(timeout)
        self.stopper = threading.Thread(target=self.checkpointer.stop, name="stopper")
        self.stopper.start()
        deadline = time.monotonic() + 10
        while not (self.is_set() and self.checkpointer._due.is_set()):  # stop set both
            assert time.monotonic() < deadline, "stop() did not run"
            time.sleep(0.001)
        return False


def test_a_stop_during_the_wait_before_a_checkpoint_ends_the_thread(tmp_path: Path) -> None:
    """A stop that comes while the thread waits to gather commits is not lost: the thread
    checkpoints once more and ends, and ``stop`` returns."""
    checkpointer = Checkpointer(tmp_path / "state.db", "NORMAL", 5.0, "state.db")
    stopping = checkpointer._stopping = _StopDuringTheWait(checkpointer)
    checkpointer.committed()
    deadline = time.monotonic() + 10
    while stopping.stopper is None:
        assert time.monotonic() < deadline, "the checkpoint thread never waited"
        time.sleep(0.001)
    stopping.stopper.join(timeout=10)
    assert not stopping.stopper.is_alive(), "stop() never returned: the thread missed the stop"
    assert _checkpoint_threads() == 0
