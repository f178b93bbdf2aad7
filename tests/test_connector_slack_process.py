"""``hermes-sessions serve`` with the Slack connector, as a process: killed (SIGKILL) between
storing an event and answering Slack, restarted, Slack's redelivery answered exactly once; and
a store that cannot take an event, a 503, the event answered once Slack delivers it again."""

from __future__ import annotations

import json
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.fake_slack import SECRET, TOKEN, FakeSlack, encode, message_event, signed_headers
from support.gateway_driver import open_store
from support.loopback import LoopbackServer
from support.serve_child import WAIT_SECS, ServeChild

from hermes_core.gateway.texts import REFUSED_NOT_SAVED

pytestmark = pytest.mark.slow

ENVIRON = {"SLACK_BOT_TOKEN": TOKEN, "SLACK_SIGNING_SECRET": SECRET}


@pytest.fixture
def fake() -> Iterator[tuple[FakeSlack, str]]:
    slack = FakeSlack()
    with LoopbackServer(slack.app) as server:
        yield slack, f"{server.url}/api"


def _post(url: str, body: dict[str, Any], **signing: Any) -> int:
    """Slack's signed POST of ``body`` to the connector's route; the status code."""
    raw = encode(body)
    headers = signed_headers(raw, **signing)
    return httpx.post(f"{url}/slack", content=raw, headers=headers, timeout=WAIT_SECS).status_code


def _config(home: Path, api: str, **extra: Any) -> Path:
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    settings = {
        "platforms": {"slack": {"enabled": True, "api_base": api}},
        "server": {"host": "127.0.0.1", "port": 0},
        **extra,
    }
    path = home / "config.yaml"
    path.write_text(json.dumps(settings), encoding="utf-8")
    return path


def test_a_kill_before_the_answer_is_redelivered_and_answered_once(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    config = _config(hermes_home, api)
    event = message_event("hello after a crash", "1700000000.002000")
    killed = ServeChild(hermes_home, config, ENVIRON, crash_at="connector_before_ack")
    url = killed.wait_serving()
    with pytest.raises(httpx.HTTPError):  # the connection drops: Slack got no answer
        _post(url, event)
    assert killed.wait() == -signal.SIGKILL, killed.output()
    with open_store(hermes_home) as store:
        assert len(store.list_sessions()) == 1  # stored before the kill, then not answered
    restarted = ServeChild(hermes_home, config, ENVIRON)
    try:
        assert _post(restarted.wait_serving(), event, retry=1) == 200  # Slack's redelivery
        restarted.until(lambda: len(slack.posted) >= 1)
        time.sleep(1.0)  # room for a second answer, which must not come
    finally:
        assert restarted.stop() == 0, restarted.output()
    assert len(slack.posted) == 1
    assert slack.posted[0].text.endswith("echo: hello after a crash")
    assert slack.posted[0].channel == "C0GENERAL"
    with open_store(hermes_home) as store:
        (entry,) = store.list_sessions()
        contents = [message.get("content") for message in store.load_transcript(entry.session_id)]
    assert contents.count("hello after a crash") == 1


def test_an_event_the_store_cannot_take_is_a_5xx_and_answered_when_redelivered(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    config = _config(hermes_home, api, storage={"sqlite_busy_timeout_secs": 0.3})
    event = message_event("is the disk back", "1700000000.003000")
    serving = ServeChild(hermes_home, config, ENVIRON)
    try:
        url = serving.wait_serving()
        holder = sqlite3.connect(hermes_home / "state.db", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # the store cannot write: another process holds it
        try:
            assert _post(url, event) == 503
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert _post(url, event, retry=1) == 200
        serving.until(lambda: "echo: is the disk back" in slack.texts)
        time.sleep(0.5)
    finally:
        assert serving.stop() == 0, serving.output()
    assert slack.texts == [REFUSED_NOT_SAVED, "echo: is the disk back"]
