"""``hermes-sessions serve`` with the Slack connector, as a process: killed (SIGKILL) between
storing an event and answering Slack, restarted, Slack's redelivery answered exactly once; and
a store that cannot take an event, a 503, the event answered once Slack delivers it again."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.fake_slack import SECRET, TOKEN, FakeSlack, encode, message_event, signed_headers
from support.gateway_driver import open_store
from support.loopback import LoopbackServer

from hermes_core.gateway.texts import REFUSED_NOT_SAVED

pytestmark = pytest.mark.slow

START_SECS = 30.0


@pytest.fixture
def fake() -> Iterator[tuple[FakeSlack, str]]:
    slack = FakeSlack()
    with LoopbackServer(slack.app) as server:
        yield slack, f"{server.url}/api"


class Serving:
    """One ``hermes-sessions serve`` process; ``url`` once it printed ``serving on``."""

    def __init__(self, home: Path, config: Path, crash_at: str | None = None) -> None:
        environ = {**os.environ, "HERMES_HOME": str(home), "SLACK_BOT_TOKEN": TOKEN,
                   "SLACK_SIGNING_SECRET": SECRET}  # fmt: skip
        environ.pop("HERMES_CRASH_AT", None)
        if crash_at:
            environ["HERMES_CRASH_AT"] = crash_at
        self.out = home / f"serve-{time.monotonic_ns()}.out"
        with self.out.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "hermes_core", "serve", "--config", str(config)],
                env=environ, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.url = self._serving_url()

    def _serving_url(self) -> str:
        deadline = time.monotonic() + START_SECS
        while time.monotonic() < deadline:
            for line in self.out.read_text(encoding="utf-8").splitlines():
                if line.startswith("serving on "):
                    return line.removeprefix("serving on ")
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.process.kill()
        raise AssertionError(f"serve did not start: {self.out.read_text(encoding='utf-8')}")

    def post(self, body: dict[str, Any], **signing: Any) -> int:
        raw = encode(body)
        answer = httpx.post(
            f"{self.url}/slack", content=raw, headers=signed_headers(raw, **signing)
        )
        return answer.status_code

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(START_SECS)


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


def _until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_kill_before_the_answer_is_redelivered_and_answered_once(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    config = _config(hermes_home, api)
    event = message_event("hello after a crash", "1700000000.002000")
    killed = Serving(hermes_home, config, crash_at="connector_before_ack")
    with pytest.raises(httpx.HTTPError):  # the connection drops: Slack got no answer
        killed.post(event)
    assert killed.process.wait(START_SECS) == -signal.SIGKILL
    with open_store(hermes_home) as store:
        assert len(store.list_sessions()) == 1  # stored before the kill, then not answered
    restarted = Serving(hermes_home, config)
    try:
        assert restarted.post(event, retry=1) == 200  # Slack's redelivery
        _until(lambda: len(slack.posted) >= 1)
        time.sleep(1.0)  # room for a second answer, which must not come
    finally:
        assert restarted.stop() == 0
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
    serving = Serving(hermes_home, config)
    try:
        holder = sqlite3.connect(hermes_home / "state.db", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # the store cannot write: another process holds it
        try:
            assert serving.post(event) == 503
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert serving.post(event, retry=1) == 200
        _until(lambda: "echo: is the disk back" in slack.texts)
        time.sleep(0.5)
    finally:
        assert serving.stop() == 0
    assert slack.texts == [REFUSED_NOT_SAVED, "echo: is the disk back"]
