"""A populated state directory for the operator-command tests: lanes with transcripts, a
suspended lane, a queued event, a dead letter and an owed reply."""

from __future__ import annotations

from pathlib import Path

import pytest

from hermes_core.cli.main import main
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.models import MessageEvent, SessionSource
from hermes_core.store import SessionStore

ALICE = SessionSource(platform="telegram", chat_id="1001", user_id="1001", user_name="Alice")
BOB = SessionSource(platform="telegram", chat_id="1002", user_id="1002", user_name="Bob")
TOPIC = SessionSource(
    platform="discord", chat_id="55", chat_type="group", thread_id="7", user_id="9"
)


def config_for(home: Path, url: str | None = None) -> GatewayConfig:
    """The configuration of a state directory (and optionally another store URL)."""
    data = {"storage": {"url": url}} if url else {}
    return GatewayConfig.from_dict(data, environ={"HERMES_HOME": str(home)})


def populate(home: Path, url: str | None = None) -> dict[str, str]:
    """Fill the store of ``home`` (or ``url``); returns the lanes' keys by name."""
    with SessionStore.open(config_for(home, url)) as store:
        keys = {}
        for name, source in (("alice", ALICE), ("bob", BOB), ("topic", TOPIC)):
            entry = store.get_or_create_session(source)
            keys[name] = entry.session_key
            for text in (f"hello from {name}", f"the zebra of {name}"):
                store.append_to_transcript(entry.session_id, {"role": "user", "content": text})
                store.append_to_transcript(
                    entry.session_id, {"role": "assistant", "content": f"echo: {text}"}
                )
        store.suspend_session(keys["bob"])
        store._queue.add(keys["topic"], MessageEvent(source=TOPIC, text="queued later"))
        dead = store._queue.add(keys["alice"], MessageEvent(source=ALICE, text="poison"))
        for _ in range(store.config.gateway.max_dispatch_attempts):
            store._queue.fail(dead, "agent exploded")
        alice = store.lookup_by_session_key(keys["alice"])
        assert alice is not None
        store._turns.record_delivery_obligation(
            keys["alice"], alice.session_id, "telegram", "1001", None, "a reply owed", "ref-1"
        )
    return keys


State = tuple[Path, dict[str, str]]
"""A populated state directory and its lanes' keys by name (the ``state`` fixture)."""


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``hermes-sessions *argv`` in process: its exit code, standard output and error."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def where(home: Path, url: str | None) -> list[str]:
    """The command-line options naming the store: the state directory, and ``url`` if given."""
    return ["--state-dir", str(home), *(["--url", url] if url else [])]
