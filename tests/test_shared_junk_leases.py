"""A junk turn lease (an expiry of NaN, infinity or centuries away, which no gateway writes) on a
shared PostgreSQL store: the gateways take the lane over, and ``doctor`` and ``show`` see it
(issue 30)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from support.database import run_sql
from support.shared_driver import configure
from test_shared_takeover import SOURCE, _gateway, _message, _wait

from hermes_core.cli.main import main
from hermes_core.gateway.agents import EchoAgent
from hermes_core.store import SessionStore

pytestmark = pytest.mark.postgres

JUNK = ("'NaN'", "'Infinity'", "1e12")
"""Expiries no grant or renewal writes (SQL literals): 1e12 is the year 33658."""


def _stalled_lane(root: Path, url: str, expiry: str) -> str:
    """A lane with a queued message and a lease row of another instance expiring at
    ``expiry``; its key."""
    config = configure(root / "enqueuer", url, lease_secs=30, scan_secs=3600)
    with SessionStore.open(config) as store:
        key = store.get_or_create_session(SOURCE).session_key
        assert store._queue.add(key, _message("still waiting", "m1"))
    run_sql(url, "INSERT INTO session_turn_leases (session_key, owner_instance, owner_boot, token, "
            f"acquired_at, expires_at) VALUES (:key, 'ghost', 'ghost', 'ghost', 0, {expiry})",
            key=key)  # fmt: skip
    return key


@pytest.mark.slow
@pytest.mark.parametrize("expiry", JUNK)
def test_a_lane_under_a_junk_lease_is_taken_over_and_its_queue_answered(
    tmp_path: Path, empty_database: str, expiry: str
) -> None:
    _stalled_lane(tmp_path, empty_database, expiry)

    async def scenario() -> list[str]:
        gateway, adapter = _gateway(
            tmp_path, "taker", empty_database, EchoAgent, lease_secs=30, scan_secs=0.2
        )
        await gateway.start()
        await _wait(lambda: bool(adapter.sent), "the queued message's answer")
        await gateway.idle()
        await gateway.stop()
        return adapter.texts()

    assert asyncio.run(scenario()) == ["echo: still waiting"]
    assert run_sql(empty_database, "SELECT count(*) FROM queued_events") == [(0,)]


@pytest.mark.slow
def test_doctor_and_show_see_a_junk_lease_and_the_queue_it_holds(
    tmp_path: Path, empty_database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    key = _stalled_lane(tmp_path, empty_database, "'Infinity'")
    home = tmp_path / "operator"
    configure(home, empty_database, lease_secs=30)
    assert main(["doctor", "--json", "--state-dir", str(home)]) == 1
    findings = {item["check"]: item for item in json.loads(capsys.readouterr().out)["findings"]}
    assert findings["leases"]["status"] == "problem"
    assert "1 event(s) queued on 1 lane(s)" in findings["leases"]["detail"]
    assert main(["show", key, "--state-dir", str(home)]) == 0
    out = capsys.readouterr().out
    assert "lease:    ghost (invalid; expires never)" in out
    assert "queued:   1 event(s)" in out
    assert main(["show", key, "--json", "--state-dir", str(home)]) == 0
    details = json.loads(capsys.readouterr().out)
    assert details["lease"] == {"owner_instance": "ghost", "expires_in_secs": None,
                                "state": "invalid"}  # fmt: skip
    assert [item["text"] for item in details["queued"]] == ["still waiting"]
