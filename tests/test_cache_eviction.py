"""AgentCache under memory pressure and with eviction policies: what a pressure pass releases
and protects, what it warns about, and how a policy's plan is checked, cut or replaced."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import pytest
from support.cache import MIB, Agent, Clock, Host, add, make_cache, never_build

from hermes_core import EvictionCandidate, EvictionPolicy
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.specs import EvictionReason
from hermes_core.gateway.cache import AgentCache
from hermes_core.gateway.eviction import plan_evictions

# -- memory pressure ------------------------------------------------------------------------------


class Signal:
    """A fake memory signal: bytes in use, or None when unreadable."""

    def __init__(self, used: int | None) -> None:
        self.used = used
        self.reads = 0

    def __call__(self) -> int | None:
        self.reads += 1
        return self.used


def test_pressure_is_a_no_op_at_or_below_budget_disabled_empty_or_unreadable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = Host()
    signal = Signal(100 * MIB)
    cache = make_cache(host, signal=signal, budget=100 * MIB, protect_recent=0)
    assert cache.sweep_pressure() == 0
    assert signal.reads == 0  # empty: the signal is not even read
    add(cache, "a", "b")
    assert cache.sweep_pressure() == 0  # signal == budget
    signal.used = None
    with caplog.at_level(logging.WARNING, logger="hermes_core.gateway.cache"):
        assert cache.sweep_pressure() == 0
    assert "memory signal unreadable" in caplog.text
    disabled = make_cache(host, signal=Signal(10**12), budget=None, protect_recent=0)
    add(disabled, "c")
    assert disabled.sweep_pressure() == 0
    assert host.soft == []


def test_pressure_releases_lru_first_and_trims(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[int] = []

    def fake_trim() -> bool:
        trims.append(1)
        return True

    monkeypatch.setattr("hermes_core.gateway.cache.malloc_trim", fake_trim)
    host = Host()
    cache = make_cache(host, signal=Signal(101 * MIB), budget=100 * MIB, protect_recent=0)
    add(cache, "a", "b", "c")
    assert cache.sweep_pressure() == 3
    assert host.soft == ["a", "b", "c"]
    assert {event.detail["reason"] for event in host.events} == {"pressure"}
    assert trims == [1]


@pytest.mark.parametrize(
    ("protect_recent", "size", "protected"),
    [(8, 10, 5), (2, 10, 2), (0, 10, 0), (8, 1, 0), (8, 3, 1)],
)
def test_pressure_protects_the_most_recent_min_of_setting_and_half(
    protect_recent: int, size: int, protected: int
) -> None:
    host = Host()
    cache = make_cache(
        host, signal=Signal(2 * MIB), budget=MIB, protect_recent=protect_recent,
        max_evictions_per_pass=100,
    )  # fmt: skip
    keys = [f"k{index}" for index in range(size)]
    add(cache, *keys)
    assert cache.sweep_pressure() == size - protected
    assert cache.keys() == keys[size - protected :]


def test_pressure_batch_skips_protected_entries_without_using_the_batch() -> None:
    host = Host()
    cache = make_cache(
        host, signal=Signal(2 * MIB), budget=MIB, protect_recent=2, max_evictions_per_pass=2
    )
    busy, _, _, _, _, _ = add(cache, "busy", "a", "b", "c", "d", "e")
    cache.begin_turn("busy", busy)
    add(cache, "unpersisted", persisted=False)
    cache.get_or_create("a", "fp", never_build)  # a becomes protected as most recent
    # order: busy b c d e unpersisted a; protected: unpersisted, a
    assert cache.sweep_pressure() == 2
    assert host.soft == ["b", "c"]
    assert cache.sweep_pressure() == 2
    assert host.soft == ["b", "c", "d", "e"]


@pytest.mark.parametrize(
    ("blocker", "message"),
    [("in_flight", "1 with a turn in flight, 0 with an unpersisted transcript"),
     ("unpersisted", "0 with a turn in flight, 1 with an unpersisted transcript"),
     ("unknown", "0 with a turn in flight, 1 with an unpersisted transcript")],
)  # fmt: skip
def test_pressure_warns_what_blocked_it_when_nothing_is_evictable(
    blocker: str, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    host = Host()
    cache = make_cache(host, signal=Signal(2 * MIB), budget=MIB, protect_recent=1)
    [a] = add(cache, "a", persisted=blocker == "in_flight")
    if blocker == "in_flight":
        cache.begin_turn("a", a)
    if blocker == "unpersisted":
        cache.report_persistence("a", a, persisted=4, in_memory=5)
    if blocker == "unknown":
        cache.report_persistence("a", a, persisted=None, in_memory=5)
    add(cache, "b")  # protected: the most recent of two
    with caplog.at_level(logging.WARNING, logger="hermes_core.gateway.cache"):
        assert cache.sweep_pressure() == 0
    assert "over its memory budget and released 0" in caplog.text
    assert message in caplog.text
    assert host.soft == []


def test_persistence_caught_up_makes_an_agent_evictable_again() -> None:
    host = Host()
    cache = make_cache(host, signal=Signal(2 * MIB), budget=MIB, protect_recent=0)
    [a] = add(cache, "a", persisted=False)
    cache.report_persistence("a", a, persisted=2, in_memory=3)
    assert cache.sweep_pressure() == 0
    cache.report_persistence("a", a, persisted=3, in_memory=3)
    assert cache.sweep_pressure() == 1


def test_budget_comes_from_the_configuration() -> None:
    host = Host()
    config = GatewayConfig.from_dict({"agent": {"agent_cache": {"memory_high_mb": 2048}}})
    cache: AgentCache[Agent] = AgentCache(
        config, soft_release=host.soft_release, full_cleanup=host.full_cleanup
    )
    assert cache.memory_budget_bytes == 2048 * MIB
    assert cache.policy.name == "lru"
    off = GatewayConfig.from_dict({"agent": {"agent_cache": {"memory_high_mb": "off"}}})
    assert AgentCache(off, soft_release=print, full_cleanup=print).memory_budget_bytes is None


# -- eviction policies ----------------------------------------------------------------------------


def policy(
    name: str, plan: Callable[[Sequence[EvictionCandidate], EvictionReason, int], Sequence[str]]
) -> EvictionPolicy:
    return EvictionPolicy(name=name, plan=plan)


def test_policy_may_reorder_and_shrink_the_plan() -> None:
    seen: list[tuple[list[str], str, int]] = []

    def newest_first(
        candidates: Sequence[EvictionCandidate], reason: EvictionReason, limit: int
    ) -> list[str]:
        seen.append(([c.session_key for c in candidates], reason, limit))
        assert all(c.persisted and not c.in_flight for c in candidates)
        return [c.session_key for c in reversed(candidates)][:2]

    host = Host()
    cache = make_cache(
        host, policy=policy("newest", newest_first), signal=Signal(2 * MIB), budget=MIB,
        protect_recent=1, max_evictions_per_pass=3,
    )  # fmt: skip
    add(cache, "a", "b", "c", "d", "e")
    assert cache.sweep_pressure() == 2
    assert seen == [(["a", "b", "c"], "pressure", 3)]
    assert host.soft == ["c", "b"]


def test_policy_protected_and_unknown_keys_are_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def greedy(
        candidates: Sequence[EvictionCandidate], reason: EvictionReason, limit: int
    ) -> list[str]:
        return ["e", "d", "nope", "b", "b", "a"]  # e is protected, d beyond the batch, b repeated

    host = Host()
    cache = make_cache(
        host, policy=policy("greedy", greedy), signal=Signal(2 * MIB), budget=MIB,
        protect_recent=1, max_evictions_per_pass=3,
    )  # fmt: skip
    add(cache, "a", "b", "c", "d", "e")
    with caplog.at_level(logging.WARNING, logger="hermes_core.gateway.eviction"):
        assert cache.sweep_pressure() == 2
    assert host.soft == ["b", "a"]
    assert (
        "eviction policy 'greedy' planned 4 protected, unknown or repeated entries" in caplog.text
    )
    assert cache.keys() == ["c", "d", "e"]


def test_plan_longer_than_the_limit_is_cut(caplog: pytest.LogCaptureFixture) -> None:
    candidates = [
        EvictionCandidate(session_key=key, last_activity=None, in_flight=False, persisted=True)
        for key in "abc"
    ]
    everything = policy("everything", lambda found, reason, limit: [c.session_key for c in found])
    with caplog.at_level(logging.WARNING, logger="hermes_core.gateway.eviction"):
        assert plan_evictions(everything, candidates, "idle", 2) == ["a", "b"]
    assert "'everything' planned 3 entries for a limit of 2; the plan was cut" in caplog.text


def test_a_policy_that_raises_falls_back_to_the_builtin_planner(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(
        candidates: Sequence[EvictionCandidate], reason: EvictionReason, limit: int
    ) -> list[str]:
        raise RuntimeError("boom")

    host = Host()
    cache = make_cache(host, policy=policy("broken", broken), max_size=2)
    with caplog.at_level(logging.ERROR, logger="hermes_core.gateway.eviction"):
        add(cache, "a", "b", "c")
    assert host.soft == ["a"]
    assert "eviction policy 'broken' failed on a capacity pass" in caplog.text


def test_policy_sees_idle_candidates_with_their_activity() -> None:
    seen: list[EvictionCandidate] = []

    def spy(
        candidates: Sequence[EvictionCandidate], reason: EvictionReason, limit: int
    ) -> list[str]:
        seen.extend(candidates)
        assert reason == "idle"
        return []

    host = Host()
    clock = Clock()
    cache = make_cache(host, policy=policy("spy", spy), clock=clock, idle_ttl_secs=10)
    add(cache, "a")
    clock.now += 11
    assert cache.sweep_idle() == 0
    assert seen == [
        EvictionCandidate(session_key="a", last_activity=1000.0, in_flight=False, persisted=True)
    ]
