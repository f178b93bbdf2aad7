"""``hermes-sessions serve`` with the Telegram connector in a child process, against the fake Bot
API: killed between storing an update and moving the offset past it (or answering the webhook),
the restarted process gets the update again and it is answered once; while the store is
unavailable the offset does not move, and the update is answered once the store is back."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from support.fake_telegram import TOKEN, FakeTelegram, message_update
from support.loopback import LoopbackServer
from support.serve_child import WAIT_SECS, ServeChild
from support.tcp_proxy import proxied

from hermes_core.turns.crashpoints import CONNECTOR_CRASH_POINTS

pytestmark = pytest.mark.slow

CRASH_POINT = "connector_before_ack"
SECRET = "process-test-secret"
ENVIRON = {"TELEGRAM_BOT_TOKEN": TOKEN, "TELEGRAM_WEBHOOK_SECRET": SECRET}
TERMINATE_OTHERS = (
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


@pytest.fixture
def fake() -> Iterator[tuple[FakeTelegram, str]]:
    state = FakeTelegram()
    with LoopbackServer(state.app()) as server:
        yield state, server.url


def _write_config(home: Path, api: str, storage: str | None = None, mode: str = "polling") -> Path:
    telegram = {"enabled": True, "api_base": api, "poll_timeout_secs": 1, "retry_max_secs": 0.5,
                "mode": mode}  # fmt: skip
    settings: dict[str, object] = {"platforms": {"telegram": telegram}, "server": {"port": 0}}
    if storage:
        settings["storage"] = {"url": storage}
    path = home / "serve.yaml"
    path.write_text(yaml.safe_dump(settings), encoding="utf-8")
    return path


def test_the_crash_point_is_a_connector_point() -> None:
    assert CRASH_POINT in CONNECTOR_CRASH_POINTS


def test_killed_before_the_offset_moved_the_update_is_answered_once_after_a_restart(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    config = _write_config(hermes_home, url)
    update = state.queue(message_update(42, "hello", message_id=5))
    crashed = ServeChild(hermes_home, config, ENVIRON, crash_at=CRASH_POINT)
    assert crashed.wait() == -signal.SIGKILL, crashed.output()
    assert [u["update_id"] for u in state.pending] == [update]  # never confirmed
    assert all(offset is None or offset <= update for offset in state.offsets)
    served = ServeChild(hermes_home, config, ENVIRON)
    served.wait_serving()
    served.until(lambda: len(state.sent) >= 1 and not state.pending)
    time.sleep(1.5)  # a second answer would come now
    assert served.stop() == 0, served.output()
    assert len(state.sent) == 1, state.texts()
    assert state.sent[0].text.endswith("hello")
    assert state.sent[0].chat_id == "42"
    assert state.pending == []


def test_killed_before_the_webhook_answered_the_update_is_answered_once_after_a_redelivery(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    config = _write_config(hermes_home, url, mode="webhook")
    update = {"update_id": 7, **message_update(42, "hooked", message_id=5)}
    headers = {"X-Telegram-Bot-Api-Secret-Token": SECRET}
    crashed = ServeChild(hermes_home, config, ENVIRON, crash_at=CRASH_POINT)
    app = crashed.wait_serving()
    with pytest.raises(httpx.TransportError):  # killed before answering: Telegram tries again
        httpx.post(f"{app}/telegram", json=update, headers=headers, timeout=WAIT_SECS)
    assert crashed.wait() == -signal.SIGKILL, crashed.output()
    served = ServeChild(hermes_home, config, ENVIRON)
    app = served.wait_serving()
    answer = httpx.post(f"{app}/telegram", json=update, headers=headers, timeout=WAIT_SECS)
    assert answer.status_code == 200
    served.until(lambda: len(state.sent) >= 1)
    time.sleep(1.5)  # a second answer would come now
    assert served.stop() == 0, served.output()
    assert len(state.sent) == 1, state.texts()
    assert state.sent[0].text.endswith("hooked")


@pytest.mark.postgres
def test_while_the_store_is_unavailable_the_offset_stays_and_the_update_is_answered_after(
    fake: tuple[FakeTelegram, str], hermes_home: Path, empty_database: str
) -> None:
    state, url = fake
    with proxied(empty_database) as database:
        config = _write_config(hermes_home, url, storage=database.url)
        served = ServeChild(hermes_home, config, ENVIRON)
        served.wait_serving()
        state.queue(message_update(42, "before", message_id=1))
        served.until(lambda: "echo: before" in state.texts())
        database.down = True
        _admin_sql(empty_database, TERMINATE_OTHERS)
        polls = len(state.offsets)
        during = state.queue(message_update(42, "during", message_id=2))
        served.until(lambda: len(state.offsets) >= polls + 4)  # refused, fetched again
        assert all(offset is None or offset <= during for offset in state.offsets)
        assert "echo: during" not in state.texts()
        database.down = False
        served.until(lambda: "echo: during" in state.texts())
        served.until(lambda: (state.offsets[-1] or 0) > during)
        assert served.stop() == 0, served.output()
    assert state.texts().count("echo: during") == 1
    assert served.output().count(f"update {during} not stored") == 1  # logged once
    assert state.texts().count("echo: before") == 1


def _admin_sql(url: str, statement: str) -> None:
    from sqlalchemy import create_engine

    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(statement)
    finally:
        engine.dispose()
