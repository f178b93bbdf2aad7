"""The fakes the agent-cache tests share: an agent, a hand-moved clock, a host that records
releases and lifecycle events, and a cache built from them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hermes_core import EvictionPolicy, LifecycleEvent
from hermes_core.config.schema import AgentCacheConfig
from hermes_core.gateway.cache import AgentCache

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


def never_build() -> Agent:
    """A factory for lookups that must hit: building fails the test."""
    raise AssertionError("a hit must not build an agent")
