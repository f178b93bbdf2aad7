"""``hermes-sessions serve`` with the WhatsApp connector, a real process: killed between storing
a webhook's message and answering Meta, it answers the message exactly once after a restart and
Meta's redelivery; a store that cannot take a message gets Meta a 5xx, and the message is
answered once Meta delivers it again."""

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
from support.fake_whatsapp import (
    ENVIRON,
    PHONE_NUMBER_ID,
    FakeCloudApi,
    signed_headers,
    text_message,
    webhook_body,
)
from support.loopback import LoopbackServer
from support.serve_child import WAIT_SECS, ServeChild

from hermes_core.gateway.texts import REFUSED_NOT_SAVED

pytestmark = pytest.mark.slow

USER = "15551234567"


def _config(home: Path, api_url: str, **sections: Any) -> Path:
    """``serve``'s configuration file: the WhatsApp connector against the fake Cloud API."""
    settings = {"enabled": True, "phone_number_id": PHONE_NUMBER_ID, "api_base": api_url}
    config = {
        "gateway": {"housekeeping": {"initial_delay_secs": 3600}},
        "server": {"host": "127.0.0.1", "port": 0},
        "platforms": {"whatsapp": settings},
        **sections,
    }
    path = home / "serve.yaml"
    path.write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
    return path


def _post(url: str, body: bytes) -> httpx.Response:
    """Meta's signed POST of ``body`` to the connector's route."""
    return httpx.post(
        f"{url}/whatsapp", content=body, headers=signed_headers(body), timeout=WAIT_SECS
    )


@pytest.fixture
def api() -> Iterator[tuple[FakeCloudApi, str]]:
    fake = FakeCloudApi()
    with LoopbackServer(fake.app) as server:
        yield fake, server.url


def test_killed_before_the_ack_it_answers_the_redelivered_message_once(
    hermes_home: Path, api: tuple[FakeCloudApi, str]
) -> None:
    fake, url = api
    body = webhook_body(text_message(USER, "hi", "wamid.k"))
    config = _config(hermes_home, url)
    doomed = ServeChild(hermes_home, config, ENVIRON, crash_at="connector_before_ack")
    app = doomed.wait_serving()
    with pytest.raises(httpx.HTTPError):  # stored, then killed before Meta heard back
        _post(app, body)
    assert doomed.wait() == -signal.SIGKILL, doomed.output()
    again = ServeChild(hermes_home, config, ENVIRON)
    try:
        app = again.wait_serving()
        status = f"whatsapp: webhook /whatsapp, replies from phone number id {PHONE_NUMBER_ID}"
        assert any(line.startswith(status) for line in again.lines), again.output()
        assert _post(app, body).status_code == 200  # Meta delivers it again
        fake.wait_for(1)
        time.sleep(1.0)  # room for a second answer, which must not come
    finally:
        assert again.stop() == 0, again.output()
    # Depending on how far the turn got before the kill, the restart resumes it (an internal
    # event: the reply quotes nothing) or sends its stored reply under the gateway's recovered-reply
    # prefix; the redelivered message is recognised as stored and not answered again.
    (sent,) = fake.attempts
    assert sent.to == USER
    assert sent.text.endswith("echo: hi")


def test_a_store_that_cannot_take_the_message_gets_meta_a_5xx_then_answers_it_once(
    hermes_home: Path, api: tuple[FakeCloudApi, str]
) -> None:
    fake, url = api
    body = webhook_body(text_message(USER, "hi", "wamid.u"))
    config = _config(hermes_home, url, storage={"sqlite_busy_timeout_secs": 0.3})
    served = ServeChild(hermes_home, config, ENVIRON)
    try:
        app = served.wait_serving()
        holder = sqlite3.connect(hermes_home / "state.db", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # the store cannot write: another process holds it
        try:
            assert _post(app, body).status_code >= 500
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert _post(app, body).status_code == 200  # Meta delivers it again
        fake.wait_for(2)
        time.sleep(1.0)
    finally:
        assert served.stop() == 0, served.output()
    assert fake.texts() == [REFUSED_NOT_SAVED, "echo: hi"]
