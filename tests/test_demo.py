"""``hermes-sessions demo``: the real gateway, a real SIGKILL and the recovery, end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from hermes_core.cli import main
from hermes_core.gateway_texts import NEW_SESSION
from hermes_core.ledger import RESTART_PREFIX


def test_demo_crashes_and_recovers_the_reply_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--state-dir", str(tmp_path / "demo")]) == 0
    out = capfd.readouterr().out
    assert out.count(RESTART_PREFIX) == 1  # Bob's stored reply, recovered after the kill
    assert out.count("echo: What did we decide yesterday?") == 1
    assert "✝ killed after storing Bob's reply" in out
    assert NEW_SESSION in out
    assert "echo: [Bob] Also: remember the changelog." in out  # queued behind a running turn
    assert (tmp_path / "demo" / "state.db").exists()
    for key in ("agent:main:telegram:dm:c=1001", "agent:main:telegram:dm:c=1002",
                "agent:main:telegram:group:c=-100200:t=17"):  # fmt: skip
        assert key in out
