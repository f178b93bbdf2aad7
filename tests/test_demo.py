"""``hermes-sessions demo``: the real gateway, a real SIGKILL and the recovery, end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from hermes_core.cli.main import main
from hermes_core.gateway.texts import NEW_SESSION
from hermes_core.turns.ledger import RESTART_PREFIX


@pytest.mark.slow
def test_demo_crashes_and_recovers_the_reply_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--state-dir", str(tmp_path / "demo")]) == 0
    out, err = capfd.readouterr()
    assert "for tests only" not in out + err  # the demo announces its crash point itself
    assert "health" not in out
    assert out.splitlines()[-2:] == [
        f"next, see what was stored: hermes-sessions ls --state-dir {tmp_path / 'demo'}",
        f"then one lane, by a key listed: hermes-sessions show KEY --state-dir {tmp_path / 'demo'}",
    ]
    assert out.count(RESTART_PREFIX) == 1  # Bob's stored reply, recovered after the kill
    assert out.count("echo: What did we decide yesterday?") == 1
    assert "✝ killed after storing Bob's reply" in out
    assert NEW_SESSION in out
    assert "echo: [Bob] Also: remember the changelog." in out  # queued behind a running turn
    assert (tmp_path / "demo" / "state.db").exists()
    for key in ("agent:main:telegram:dm:c=1001", "agent:main:telegram:dm:c=1002",
                "agent:main:telegram:group:c=-100200:t=17"):  # fmt: skip
        assert key in out

    assert main(["demo", "--state-dir", str(tmp_path / "demo")]) == 2  # a second run: refused
    out, err = capfd.readouterr()
    assert out == ""
    assert err == (
        f"hermes-sessions: error: {tmp_path / 'demo'} is not empty; the demo runs on a new or "
        "empty directory: name another, or leave --state-dir out for a temporary one.\n"
    )
