"""``prune`` and ``rekey`` over more lanes than one batch: the same result as in one batch, and a
run killed (SIGKILL of a real process) midway is finished by running it again, with every lane
and message accounted for and nothing moved twice; on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.database import run_sql
from support.killing import dies_after, run_killed
from support.terminal import Terminal

from hermes_core import GatewayConfig, build_session_key
from hermes_core.cli import common
from hermes_core.domain.errors import KeySchemaError
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager, telegram_dm

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

LANES = 30
IDLE = range(0, LANES, 2)  # the lanes made idle, every other one


def configure(home: Path, settings: dict[str, Any], schema: str) -> GatewayConfig:
    """Write ``config.yaml`` (the child process reads it) and return the same configuration."""
    data = dict(settings, keys={"schema": schema})
    (home / "config.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    return GatewayConfig.load(environ={"HERMES_HOME": str(home)})


def populate(config: GatewayConfig, home: Path) -> dict[str, str]:
    """:data:`LANES` lanes with two messages each; session ids by chat id."""
    ids = {}
    with SessionStore.open(config, plugins=fresh_plugin_manager(home)) as store:
        for n in range(LANES):
            entry = store.get_or_create_session(telegram_dm(str(n)))
            for text in (f"hello {n}", f"bye {n}"):
                store.append_to_transcript(entry.session_id, {"role": "user", "content": text})
            ids[str(n)] = entry.session_id
    return ids


def census(config: GatewayConfig) -> tuple[int, int, int]:
    """(routing rows, session rows, messages) straight from the database."""
    url = config.storage_url
    return tuple(
        run_sql(url, f"SELECT count(*) FROM {table}")[0][0]
        for table in ("gateway_routing", "sessions", "messages")
    )


def transcripts(config: GatewayConfig, home: Path, ids: dict[str, str]) -> dict[str, list[str]]:
    with SessionStore.open(config, plugins=fresh_plugin_manager(home), read_only=True) as store:
        return {
            chat: [message["content"] for message in store.load_transcript(session_id)]
            for chat, session_id in ids.items()
        }


def killed(home: Path, patch: str, command: list[str]) -> int:
    """``hermes-sessions COMMAND`` on ``home`` in a child process that ``patch`` kills midway;
    its exit status."""
    return run_killed(patch, command, {**os.environ, "HERMES_HOME": str(home)})


def make_idle(config: GatewayConfig) -> None:
    keys = ", ".join(f"'agent:main:telegram:dm:c={n}'" for n in IDLE)
    run_sql(
        config.storage_url,
        f"UPDATE gateway_routing SET updated_at = 1000 WHERE session_key IN ({keys})",
    )


# -- prune -----------------------------------------------------------------------------------------


def test_prune_in_pages_removes_every_idle_lane_and_tells_each_page(
    hermes_home: Path, settings: dict[str, Any]
) -> None:
    config = configure(hermes_home, settings, "v2")
    ids = populate(config, hermes_home)
    make_idle(config)
    pages: list[int] = []
    with SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)) as store:
        removed = store.prune_idle_lanes(1, batch_size=4, progress=pages.append)
    assert removed == sorted(f"agent:main:telegram:dm:c={n}" for n in IDLE)  # as one batch does
    assert pages == [4, 4, 4, 3]
    assert census(config) == (LANES - len(IDLE), LANES, 2 * LANES)
    assert transcripts(config, hermes_home, ids)["4"] == ["hello 4", "bye 4"]


PRUNE_KILLED = dies_after(
    "hermes_plugins.sql_store.backend:SqlBackend.delete_idle_routes", 2,
    setup="import hermes_core.store.pruning as pruning\npruning.MAINTENANCE_BATCH = 3",
)  # fmt: skip
"""``prune`` in pages of three lanes, killed once its second page is removed."""


def test_a_prune_killed_midway_is_finished_by_running_it_again(
    hermes_home: Path, settings: dict[str, Any]
) -> None:
    config = configure(hermes_home, settings, "v2")
    ids = populate(config, hermes_home)
    before = transcripts(config, hermes_home, ids)
    make_idle(config)
    status = killed(hermes_home, PRUNE_KILLED, ["prune", "--days", "1", "--json"])
    assert status == -signal.SIGKILL
    assert census(config) == (LANES - 6, LANES, 2 * LANES)  # two pages of three committed
    with SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)) as store:
        removed = store.prune_idle_lanes(1, batch_size=4)
    assert len(removed) == len(IDLE) - 6  # only what the killed run had left
    assert census(config) == (LANES - len(IDLE), LANES, 2 * LANES)
    assert transcripts(config, hermes_home, ids) == before
    mirror = config.sessions_dir / "sessions.json"
    if mirror.exists():  # written again, without the pruned lanes
        assert "agent:main:telegram:dm:c=0" not in mirror.read_text(encoding="utf-8")


# -- rekey -----------------------------------------------------------------------------------------


def v2_key(chat: str) -> str:
    return build_session_key(telegram_dm(chat))


def test_rekey_in_batches_moves_every_lane_once(
    hermes_home: Path, settings: dict[str, Any]
) -> None:
    config = configure(hermes_home, settings, "v1")
    ids = populate(config, hermes_home)
    before = transcripts(config, hermes_home, ids)
    told: list[tuple[str, int, int]] = []
    v2_config = configure(hermes_home, settings, "v2")
    with SessionStore(
        v2_config.sessions_dir, v2_config, plugins=fresh_plugin_manager(hermes_home),
        rekeying=True,
    ) as store:  # fmt: skip
        report = store.rekey(
            batch_size=4, progress=lambda phase, count, total: told.append((phase, count, total))
        )
    assert len(report.moves) == LANES
    assert report.batches == 8  # 30 lanes, 4 a batch
    assert (report.sessions, report.left, report.collisions) == (LANES, (), ())
    assert [t for t in told if t[0] == "moving"] == [("moving", 1, 8)] * 8
    assert sum(count for phase, count, _ in told if phase == "reading") == 2 * LANES
    with SessionStore.open(v2_config, plugins=fresh_plugin_manager(hermes_home)) as store:
        assert {chat: store.peek_session_id(v2_key(chat)) for chat in ids} == ids
    assert census(v2_config) == (LANES, LANES, 2 * LANES)
    assert transcripts(v2_config, hermes_home, ids) == before


REKEY_KILLED = dies_after(
    "hermes_plugins.sql_store.rekey:RekeyRows.move_keys", 3,
    setup="from hermes_core.store.rekey import RekeyPlan\nreal_batches = RekeyPlan.batches\n"
    "RekeyPlan.batches = lambda self, size, schema='v2': real_batches(self, 4, schema)",
)  # fmt: skip
"""``rekey`` in batches of four lanes, killed once its third batch is moved."""


def test_a_rekey_killed_midway_is_finished_by_running_it_again(
    hermes_home: Path, settings: dict[str, Any]
) -> None:
    config = configure(hermes_home, settings, "v1")
    ids = populate(config, hermes_home)
    before = transcripts(config, hermes_home, ids)
    v2_config = configure(hermes_home, settings, "v2")
    status = killed(hermes_home, REKEY_KILLED, ["rekey", "--to", "v2", "--json"])
    assert status == -signal.SIGKILL
    with pytest.raises(KeySchemaError, match="was interrupted"):
        SessionStore.open(v2_config, plugins=fresh_plugin_manager(hermes_home))
    with SessionStore(
        v2_config.sessions_dir, v2_config, plugins=fresh_plugin_manager(hermes_home),
        rekeying=True,
    ) as store:  # fmt: skip
        report = store.rekey(batch_size=4)
    assert report.schema_before == "v1>v2"
    assert (report.unchanged, len(report.moves)) == (12, LANES - 12)  # none moved twice
    with SessionStore.open(v2_config, plugins=fresh_plugin_manager(hermes_home)) as store:
        assert {chat: store.peek_session_id(v2_key(chat)) for chat in ids} == ids
    assert census(v2_config) == (LANES, LANES, 2 * LANES)
    assert transcripts(v2_config, hermes_home, ids) == before


# -- progress on a terminal ------------------------------------------------------------------------


def test_progress_redraws_at_most_once_an_interval_and_never_when_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("time.monotonic", lambda: 100.0)  # the clock stands still
    terminal = Terminal()
    bar = common.Progress("rekey", 0, terminal)
    for _ in range(1000):
        bar.told("reading", 1, total=0)
    bar.told("moving", 1, total=2)
    bar.close()
    assert terminal.getvalue() == "\rrekey: reading 1\rrekey: reading 1,000\n" + (
        "\rrekey: moving [###############---------------] 1/2" * 2 + "\n"
    )
    quiet = Terminal()
    silent = common.Progress("prune", 0, quiet, quiet=True)
    silent.advance(5)
    silent.close()
    assert quiet.getvalue() == ""
