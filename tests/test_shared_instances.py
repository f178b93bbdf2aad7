"""Several gateway processes on one PostgreSQL database (``storage.instances: shared``)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from support.gateway_driver import read_lines
from support.shared_driver import SPAWN, configure, event, replies, shared_child

pytestmark = [pytest.mark.postgres, pytest.mark.multi_process]

URL = os.environ.get("HERMES_TEST_POSTGRES_URL")


@pytest.fixture
def empty_database() -> str:
    if not URL:
        pytest.skip("set HERMES_TEST_POSTGRES_URL to run the multi-process tests")
    engine = create_engine(URL)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()
    return URL


def _overlaps(workdir: Path) -> int:
    """Pairs of turns of one lane that ran at the same time (by the harness's spans)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for path in workdir.glob("spans-*.jsonl"):
        for line in read_lines(path):
            spans.setdefault(line["key"], []).append((line["start"], line["end"]))
    overlaps = 0
    for runs in spans.values():
        runs.sort()
        overlaps += sum(1 for a, b in itertools.pairwise(runs) if b[0] < a[1])
    return overlaps


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_fed_the_same_lanes_never_overlap_a_lane(
    tmp_path: Path, empty_database: str, processes: int
) -> None:
    lanes, rounds = 6, 3
    feeds: dict[int, list[dict[str, object]]] = {n: [] for n in range(processes)}
    count = 0
    for turn in range(rounds):
        for lane in range(lanes):
            for n in range(processes):  # every lane gets a message through every process
                feeds[n].append(event(f"c{lane}", f"m{turn}-{n}", f"{lane}-{turn}-{n}"))
                count += 1
    workdir = tmp_path / "work"
    workdir.mkdir()
    children = []
    for n in range(processes):
        home = tmp_path / f"home{n}"
        configure(home, empty_database)
        child = SPAWN.Process(
            target=shared_child, args=(str(home), str(workdir), f"p{n}", feeds[n], count)
        )
        child.start()
        children.append(child)
    for child in children:
        child.join(120)
        assert child.exitcode == 0
    assert len(read_lines(workdir / "started.jsonl")) == processes  # all came up together
    sent = replies(workdir)
    answered = {line["reply_to"] for line in sent}
    assert answered == {f"{lane}-{turn}-{n}" for lane in range(lanes) for turn in range(rounds)
                        for n in range(processes)}  # fmt: skip
    assert len(sent) == count  # each reply once
    assert _overlaps(workdir) == 0
    engine = create_engine(empty_database)
    with engine.connect() as conn:
        open_per_key = conn.execute(text(
            "SELECT max(n) FROM (SELECT count(*) AS n FROM sessions WHERE end_reason IS NULL "
            "GROUP BY session_key) AS c"
        )).scalar()  # fmt: skip
        leases_left = conn.execute(text("SELECT count(*) FROM session_turn_leases")).scalar()
    engine.dispose()
    assert open_per_key == 1
    assert leases_left == 0  # every lane handed back when it ran dry
