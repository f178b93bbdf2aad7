"""AgentCache bookkeeping: LRU order and capacity, the never-evicted classes, fingerprints, idle
TTL, soft release vs full cleanup, observers and lock discipline. Memory pressure and eviction
policies are in test_cache_eviction.py."""

from __future__ import annotations

import logging
import threading

import pytest
from support.cache import Agent, Clock, Host, add, make_cache, never_build

from hermes_core import LifecycleEvent
from hermes_core.config.schema import AgentCacheConfig
from hermes_core.gateway.cache import AgentBusyError, AgentCache

# -- LRU and capacity -----------------------------------------------------------------------------


def test_hit_reuses_the_agent_and_moves_it_to_the_most_recent_end() -> None:
    host = Host()
    cache = make_cache(host)
    a, _b, _c = add(cache, "a", "b", "c")
    assert cache.get_or_create("a", "fp", never_build) is a
    assert cache.keys() == ["b", "c", "a"]
    assert "a" in cache
    assert len(cache) == 3


def test_capacity_soft_releases_the_least_recently_used_beyond_the_cap() -> None:
    host = Host()
    cache = make_cache(host, max_size=3)
    add(cache, "a", "b", "c")
    cache.get_or_create("a", "fp", never_build)
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
    with caplog.at_level(logging.WARNING, logger="hermes_core.gateway.cache"):
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
    assert cache.get_or_create("a", "fp", never_build, begin_turn=True) is a
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
    assert cache.get_or_create("a", "fp", never_build) is a
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
    assert cache.get_or_create("a", "fp", never_build) is second


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
    cache.get_or_create("fresh", "fp", never_build)
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
    with caplog.at_level(logging.ERROR, logger="hermes_core.gateway.cache"):
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
