"""Queued events survive a real SIGKILL and run once, in order, after the restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CRASH_TABLE
from hermes_core import GatewayConfig, MessageEvent
from hermes_core.testing import telegram_dm

DRIVER = Path(__file__).parent / "support" / "runtime_driver.py"


def _inbox(workdir: Path, texts: list[str]) -> None:
    with (workdir / "inbox.jsonl").open("w", encoding="utf-8") as inbox:
        for number, text in enumerate(texts):
            source = telegram_dm("7", user_id=f"user{number}")  # distinct senders: no merging
            event = MessageEvent(source=source, text=text, message_id=f"m{number}")
            inbox.write(json.dumps(event.to_dict()) + "\n")


def _run(workdir: Path, home: Path, mode: str, crash_at: str | None = None) -> int:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    environ["HERMES_HOME"] = str(home)
    if crash_at:
        environ["HERMES_CRASH_AT"] = crash_at
    settings = {"display": {"busy_input_mode": "queue"}, "gateway": {"busy_ack_enabled": False}}
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    (home / "config.yaml").write_text(json.dumps(settings), encoding="utf-8")
    done = subprocess.run([sys.executable, str(DRIVER), str(workdir), mode], env=environ,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    if done.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"driver failed ({done.returncode}):\n{done.stderr}")
    return done.returncode


def _replies(workdir: Path) -> list[str]:
    path = workdir / "outbox.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return [json.loads(line)["text"] for line in lines]


@pytest.mark.slow
@pytest.mark.parametrize("crash_at", [None, "enqueued"])
def test_queued_events_survive_sigkill_and_run_once_in_order(
    tmp_path: Path, crash_at: str | None
) -> None:
    home, workdir = tmp_path / "home", tmp_path / "work"
    workdir.mkdir()
    texts = ["first (running)", "second", "third", "fourth"]
    _inbox(workdir, texts)
    assert _run(workdir, home, "fill", crash_at) == -signal.SIGKILL
    acked_before = len((workdir / "acks.jsonl").read_text().splitlines())
    assert _run(workdir, home, "run") == 0
    replies = _replies(workdir)
    assert replies == [f"echo: {text}" for text in texts]  # once each, in order
    assert _run(workdir, home, "run") == 0  # a second restart repeats nothing
    assert _replies(workdir) == replies
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(home)})
    assert not (config.hermes_home / "restart_counts.json").exists()
    CRASH_TABLE.append((f"{crash_at or 'sigkill'} (runtime queue)", 2, acked_before, 0, 0))
