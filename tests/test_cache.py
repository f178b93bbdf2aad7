"""AgentCache: LRU, capacity, idle TTL, memory pressure, the never-evicted classes,
eviction policies, soft release vs full cleanup, observers and lock discipline."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from hermes_core import EvictionCandidate, EvictionPolicy, LifecycleEvent
from hermes_core.cache import AgentBusyError, AgentCache
from hermes_core.config import AgentCacheConfig, GatewayConfig
from hermes_core.eviction import plan_evictions
from hermes_core.specs import EvictionReason

MIB = 1024 * 1024


@dataclass(eq=False)
class Agent:
    key: str
    generation: int = 0


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Host:
    """The host side: release callbacks and an observer that record what happened."""

    soft: list[str] = field(default_factory=list)
    full: list[str] = field(default_factory=list)
    events: list[LifecycleEvent] = field(default_factory=list)

    def soft_release(self, agent: Agent) -> None:
        self.soft.append(agent.key)

    def full_cleanup(self, agent: Agent) -> None:
        self.full.append(agent.key)


def make_cache(
    host: Host,
    *,
    clock: Callable[[], float] | None = None,
    policy: EvictionPolicy | None = None,
    signal: Callable[[], int | None] = lambda: 0,
    budget: int | None = 1024 * MIB,
    **settings: Any,
) -> AgentCache[Agent]:
    return AgentCache(
        AgentCacheConfig(**settings),
        soft_release=host.soft_release,
        full_cleanup=host.full_cleanup,
        policy=policy,
        memory_signal=signal,
        memory_budget_bytes=budget,
        clock=clock or Clock(),
        notify=host.events.append,
    )


def add(
    cache: AgentCache[Agent], *keys: str, persisted: bool = True, fingerprint: str = "fp"
) -> list[Agent]:
    """Insert agents (persisted transcripts unless told otherwise), in order."""
    agents = []
    for key in keys:
        agent = cache.get_or_create(key, fingerprint, functools.partial(Agent, key))
        if persisted:
            cache.report_persistence(key, agent, persisted=3, in_memory=3)
        agents.append(agent)
    return agents


def _never() -> Agent:
    raise AssertionError("a hit must not build an agent")


# -- LRU and capacity -----------------------------------------------------------------------------


def test_hit_reuses_the_agent_and_moves_it_to_the_most_recent_end() -> None:
    host = Host()
    cache = make_cache(host)
    a, _b, _c = add(cache, "a", "b", "c")
    assert cache.get_or_create("a", "fp", _never) is a
    assert cache.keys() == ["b", "c", "a"]
    assert "a" in cache
    assert len(cache) == 3


def test_capacity_soft_releases_the_least_recently_used_beyond_the_cap() -> None:
    host = Host()
    cache = make_cache(host, max_size=3)
    add(cache, "a", "b", "c")
    cache.get_or_create("a", "fp", _never)
    add(cache, "d", "e")
    assert host.soft == ["b", "c"]
    assert host.full == []
    assert cache.keys() == ["a", "d", "e"]
    assert [(event.kind, event.session_key, event.detail["reason"]) for event in host.events] == [
        ("agent_soft_released", "b", "capacity"),
        ("agent_soft_released", "c", "capacity"),
    ]


def test_capacity_skips_agents_with_a_turn_in_flight() -> None:
    host = Host()
    cache = make_cache(host, max_size=2)
    [a] = add(cache, "a")
    assert cache.begin_turn("a", a)
    add(cache, "b", "c")
    assert host.soft == ["b"]
    assert cache.keys() == ["a", "c"]
    cache.end_turn("a", a)
    add(cache, "d")
    assert host.soft == ["b", "a"]


def test_capacity_stays_over_the_cap_with_a_warning_when_all_are_in_flight(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = Host()
    cache = make_cache(host, max_size=1)
    [a] = add(cache, "a")
    cache.begin_turn("a", a)
    with caplog.at_level(logging.WARNING, logger="hermes_core.cache"):
        add(cache, "b")
    assert host.soft == []
    assert cache.keys() == ["a", "b"]
    assert "over its cap" in caplog.text
    assert "1 with a turn in flight" in caplog.text


def test_capacity_keeps_unpersisted_transcripts_and_never_the_new_agent() -> None:
    host = Host()
    cache = make_cache(host, max_size=1)
    add(cache, "a", persisted=False)
    add(cache, "b")
    assert host.soft == []
    assert cache.keys() == ["a", "b"]


def test_begin_turn_atomically_with_the_lookup() -> None:
    host = Host()
    cache = make_cache(host, max_size=1)
    a = cache.get_or_create("a", "fp", lambda: Agent("a"), begin_turn=True)
    cache.report_persistence("a", a, persisted=1, in_memory=1)
    add(cache, "b")
    assert host.soft == []
    cache.end_turn("a", a)
    assert cache.get_or_create("a", "fp", _never, begin_turn=True) is a
    add(cache, "c")
    assert host.soft == ["b"]


# -- fingerprint, put, discard, close -------------------------------------------------------------


def test_fingerprint_change_soft_releases_and_rebuilds() -> None:
    host = Host()
    cache = make_cache(host)
    [old] = add(cache, "a")
    new = cache.get_or_create("a", "fp2", lambda: Agent("a", generation=1))
    assert new is not old
    assert new.generation == 1
    assert host.soft == ["a"]
    assert host.events[-1].detail == {"reason": "fingerprint"}
    assert not cache.begin_turn("a", old)  # the old agent is no longer cached


def test_fingerprint_change_of_a_busy_agent_is_refused() -> None:
    host = Host()
    cache = make_cache(host)
    a = cache.get_or_create("a", "fp", lambda: Agent("a"), begin_turn=True)
    with pytest.raises(AgentBusyError, match="turn in flight"):
        cache.get_or_create("a", "fp2", lambda: Agent("a", generation=1))
    assert cache.get_or_create("a", "fp", _never) is a
    assert host.soft == []


def test_discard_and_close_fully_clean_up() -> None:
    host = Host()
    cache = make_cache(host)
    [a, _b, _c] = add(cache, "a", "b", "c")
    cache.begin_turn("a", a)  # the host interrupted the turn: a boundary still cleans up
    assert cache.discard("a")
    assert not cache.discard("a")
    assert cache.close() == 2
    assert host.full == ["a", "b", "c"]
    assert host.soft == []
    assert len(cache) == 0
    assert [(event.kind, event.detail["reason"]) for event in host.events] == [
        ("agent_cleaned_up", "boundary"),
        ("agent_cleaned_up", "shutdown"),
        ("agent_cleaned_up", "shutdown"),
    ]


def test_turn_bookkeeping_ignores_an_agent_that_was_replaced() -> None:
    host = Host()
    cache = make_cache(host, max_size=1)
    old = cache.get_or_create("a", "fp", lambda: Agent("a"), begin_turn=True)
    cache.discard("a")
    new = cache.get_or_create("a", "fp", lambda: Agent("a", generation=1), begin_turn=True)
    cache.report_persistence("a", new, persisted=1, in_memory=1)
    cache.end_turn("a", old)  # the interrupted turn unwinds late: the new agent stays busy
    cache.report_persistence("a", old, persisted=0, in_memory=5)
    add(cache, "b")
    assert host.soft == []
    assert cache.keys() == ["a", "b"]


def test_put_caches_a_host_built_agent_and_replaces_like_a_fingerprint_change() -> None:
    host = Host()
    cache = make_cache(host)
    first = Agent("a")
    cache.put("a", first, "fp", last_activity=None)
    second = Agent("a", generation=1)
    cache.put("a", second, "fp", last_activity=5.0)
    assert host.soft == ["a"]
    assert cache.get_or_create("a", "fp", _never) is second


# -- idle ----------------------------------------------------------------------------------------


def test_idle_sweep_releases_only_idle_evictable_entries() -> None:
    host = Host()
    clock = Clock()
    cache = make_cache(host, clock=clock, idle_ttl_secs=60)
    [_old, busy, _unpersisted, _fresh] = [
        *add(cache, "old", "busy"),
        *add(cache, "unpersisted", persisted=False),
        *add(cache, "fresh"),
    ]
    unknown = Agent("unknown")
    cache.put("unknown", unknown, "fp", last_activity=None)
    cache.report_persistence("unknown", unknown, persisted=1, in_memory=1)
    cache.begin_turn("busy", busy)
    clock.now += 61
    cache.get_or_create("fresh", "fp", _never)
    assert cache.sweep_idle() == 1
    assert host.soft == ["old"]
    assert host.events[-1].detail == {"reason": "idle"}
    assert cache.keys() == ["busy", "unpersisted", "unknown", "fresh"]
    clock.now += 60  # exactly the TTL since "fresh" was used: not yet idle
    assert cache.sweep_idle() == 0
    cache.end_turn("busy", busy)
    clock.now += 61
    assert cache.sweep_idle() == 2
    assert host.soft == ["old", "busy", "fresh"]


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
    with caplog.at_level(logging.WARNING, logger="hermes_core.cache"):
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

    monkeypatch.setattr("hermes_core.cache.malloc_trim", fake_trim)
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
    cache.get_or_create("a", "fp", _never)  # a becomes protected as most recent
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
    with caplog.at_level(logging.WARNING, logger="hermes_core.cache"):
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
    with caplog.at_level(logging.WARNING, logger="hermes_core.eviction"):
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
    with caplog.at_level(logging.WARNING, logger="hermes_core.eviction"):
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
    with caplog.at_level(logging.ERROR, logger="hermes_core.eviction"):
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


# -- observers and lock discipline ----------------------------------------------------------------


def test_failing_releases_and_observers_are_logged_and_do_not_stop_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    released: list[str] = []

    def flaky(agent: Agent) -> None:
        released.append(agent.key)
        if agent.key == "a":
            raise OSError("provider down")

    def observer(event: LifecycleEvent) -> None:
        raise RuntimeError("observer bug")

    cache: AgentCache[Agent] = AgentCache(
        AgentCacheConfig(), soft_release=flaky, full_cleanup=flaky, memory_budget_bytes=None,
        notify=observer,
    )  # fmt: skip
    add(cache, "a", "b")
    with caplog.at_level(logging.ERROR, logger="hermes_core.cache"):
        assert cache.close() == 2
    assert released == ["a", "b"]
    assert "agent_cleaned_up of a cached agent (shutdown) failed" in caplog.text
    assert "observer of agent_cleaned_up failed" in caplog.text


def test_failed_release_is_reported_to_observers() -> None:
    events: list[LifecycleEvent] = []

    def failing(agent: Agent) -> None:
        raise OSError("provider down")

    cache: AgentCache[Agent] = AgentCache(
        AgentCacheConfig(), soft_release=failing, full_cleanup=failing, memory_budget_bytes=None,
        notify=events.append,
    )  # fmt: skip
    add(cache, "a")
    cache.discard("a")
    assert events[0].detail == {"reason": "boundary", "error": "OSError"}


def test_releases_run_without_the_lock_and_may_call_back_into_the_cache() -> None:
    seen: list[tuple[list[str], bool]] = []
    cache: AgentCache[Agent]

    def reentrant(agent: Agent) -> None:
        seen.append((cache.keys(), agent.key in cache))
        if agent.key == "a":
            add(cache, "from-release")

    cache = AgentCache(
        AgentCacheConfig(max_size=2), soft_release=reentrant, full_cleanup=reentrant,
        memory_budget_bytes=None,
    )  # fmt: skip
    done = threading.Event()

    def run() -> None:
        add(cache, "a", "b", "c")
        cache.close()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(5), "a release callback deadlocked on the cache lock"
    assert seen[0] == (["b", "c"], False)  # "a" was popped before its release ran


def test_concurrent_misses_build_one_agent_per_key() -> None:
    host = Host()
    cache = make_cache(host)
    started = threading.Event()
    release = threading.Event()
    built: list[Agent] = []

    def slow_factory() -> Agent:
        started.set()
        release.wait(5)
        agent = Agent("a", generation=len(built))
        built.append(agent)
        return agent

    results: list[Agent] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(cache.get_or_create("a", "fp", slow_factory))
        )
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    assert started.wait(5)
    assert cache.get_or_create("other", "fp", lambda: Agent("other")).key == "other"
    release.set()
    for thread in threads:
        thread.join(5)
    assert len(built) == 1
    assert results == [built[0]] * 3


def test_a_failing_factory_caches_nothing_and_the_next_call_builds() -> None:
    host = Host()
    cache = make_cache(host)

    def broken() -> Agent:
        raise RuntimeError("no model configured")

    with pytest.raises(RuntimeError, match="no model configured"):
        cache.get_or_create("a", "fp", broken)
    assert cache.keys() == []
    assert cache.get_or_create("a", "fp", lambda: Agent("a")).key == "a"
