"""AgentCache: host-built agents cached per session key to keep prompt caches warm.

Entries live in an ``OrderedDict`` in recency order (least recently used first) under one
``threading.Lock``. ``cachetools.LRUCache`` is deliberately not used: it evicts by itself inside
``__setitem__`` (it must pop *something* or loop), so it can neither skip the never-evicted
classes (in flight, recently used under pressure, not fully persisted) nor stay over its cap when
only in-flight agents are left, and its recency order is private, so the protected-aware LRU walk
every pass needs is impossible through its API. The ``OrderedDict`` is what ``LRUCache`` keeps
inside; here the cache picks its victims itself.

Every pass (capacity on insert, idle, pressure) selects candidates under the lock, lets the eviction
policy plan outside it, pops the planned entries under the lock (checking each again), then runs
the host's releases in plan order with the lock released, so a release may call back into the
cache. Releases are host callbacks; the cache never ends a session or touches the store.

``get_or_create`` (factory, releases), ``sweep_*``, ``discard`` and ``close`` block: an asyncio
host runs them in a worker thread. Logs never name session keys (they carry chat and user ids).

One module on purpose: every pass follows the lock discipline above, which is only checkable
with all of them in view.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from typing import Generic, Literal, TypeVar

from hermes_core.config.schema import AgentCacheConfig, GatewayConfig
from hermes_core.domain.errors import HermesError
from hermes_core.domain.specs import (
    EvictionCandidate,
    EvictionPolicy,
    EvictionReason,
    LifecycleEvent,
)
from hermes_core.gateway.eviction import LRU_POLICY, plan_evictions
from hermes_core.gateway.memory import malloc_trim, resolve_memory_budget
from hermes_core.gateway.memory import memory_signal as process_memory_signal

__all__ = ["AgentBusyError", "AgentCache", "ReleaseReason"]

logger = logging.getLogger(__name__)

A = TypeVar("A")

ReleaseReason = Literal["capacity", "idle", "pressure", "fingerprint", "boundary", "shutdown"]
"""Why an agent left the cache; the ``reason`` in the detail of the observers' event."""


class AgentBusyError(HermesError):
    """The cached agent has a turn in flight, so it cannot be replaced now."""


@dataclass(eq=False)
class _Entry(Generic[A]):
    agent: A
    fingerprint: str
    last_activity: float | None
    turns: int = 0
    """Turns in flight (class 1 while above zero)."""
    persisted: bool = False
    """Whether the live transcript is known to be fully persisted (unknown = False, class 3)."""


def _candidate(key: str, entry: _Entry[A]) -> EvictionCandidate:
    return EvictionCandidate(
        session_key=key,
        last_activity=entry.last_activity,
        in_flight=entry.turns > 0,
        persisted=entry.persisted,
    )


@dataclass
class _Selection(Generic[A]):
    """What a pass selected under the lock, and what blocked the rest."""

    entries: dict[str, _Entry[A]] = field(default_factory=dict)
    limit: int = 0
    in_flight: int = 0
    unpersisted: int = 0


class AgentCache(Generic[A]):
    """LRU cache of agents with idle expiry and memory-pressure release.

    ``soft_release(agent)`` commits and drops what the agent holds in memory (capacity, idle,
    pressure, fingerprint change); ``full_cleanup(agent)`` shuts it down (boundaries, shutdown);
    both are the host's, run outside the lock and must be bounded. ``policy`` defaults to the
    built-in LRU planner. ``memory_budget_bytes`` overrides the budget resolved from
    ``memory_high_mb`` (None disables pressure release); ``memory_signal`` returns the bytes to
    compare with it (None: unreadable, the pass is skipped). ``notify`` receives the
    ``agent_soft_released`` / ``agent_cleaned_up`` events (e.g. a plugin manager's ``notify``).
    """

    def __init__(
        self,
        config: GatewayConfig | AgentCacheConfig | None = None,
        *,
        soft_release: Callable[[A], None],
        full_cleanup: Callable[[A], None],
        policy: EvictionPolicy | None = None,
        memory_signal: Callable[[], int | None] = process_memory_signal,
        memory_budget_bytes: int | Literal["config"] | None = "config",
        clock: Callable[[], float] = time.monotonic,
        notify: Callable[[LifecycleEvent], None] | None = None,
    ) -> None:
        settings = config.agent.agent_cache if isinstance(config, GatewayConfig) else config
        settings = settings or AgentCacheConfig()
        self.max_size = settings.max_size
        self.idle_ttl_secs = settings.idle_ttl_secs
        self.max_evictions_per_pass = settings.max_evictions_per_pass
        self.protect_recent = settings.protect_recent
        self.memory_budget_bytes = (
            resolve_memory_budget(settings.memory_budget_setting)
            if memory_budget_bytes == "config"
            else memory_budget_bytes
        )
        self._soft_release = soft_release
        self._full_cleanup = full_cleanup
        self.policy = policy or LRU_POLICY
        self._memory_signal = memory_signal
        self._clock = clock
        self._notify = notify
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry[A]] = OrderedDict()
        self._building: dict[str, threading.Lock] = {}
        """Keys whose agent is being built: the builder holds the lock, a caller waiting for the
        build takes it once it is released (a bare lock: an ``Event`` costs a ``Condition``)."""

    # -- lookups and turn bookkeeping --------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def keys(self) -> list[str]:
        """The cached session keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def get_or_create(
        self, key: str, fingerprint: str, factory: Callable[[], A], *, begin_turn: bool = False
    ) -> A:
        """The agent cached for ``key``, built by ``factory`` on a miss or a fingerprint change.

        A hit moves the entry to the most recently used end. A new ``fingerprint`` soft-releases
        the old agent (:class:`AgentBusyError` during its turn) and builds anew, outside the lock,
        one build per key at a time (the factory must not ask for its own key); an insert above
        ``max_size`` releases LRU entries. ``begin_turn`` marks a turn in flight in the
        same step, so no sweep can release the agent in between.
        """
        while True:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry.fingerprint == fingerprint:
                    self._entries.move_to_end(key)
                    entry.last_activity = self._clock()
                    entry.turns += int(begin_turn)
                    return entry.agent
                pending, mine, stale = self._claim(key)
            if mine:
                return self._install(
                    key, pending, stale, factory, fingerprint, self._clock, begin_turn
                )
            with pending:  # released when the build ends
                pass

    def put(self, key: str, agent: A, fingerprint: str, *, last_activity: float | None) -> None:
        """Cache an agent the host built itself, with its last activity on the cache's clock.

        ``last_activity`` None means unknown: the idle sweep keeps the entry. An agent cached
        for ``key`` is replaced as on a fingerprint change (soft release; busy → error).
        """
        while True:
            with self._lock:
                pending, mine, stale = self._claim(key)
            if mine:
                self._install(
                    key, pending, stale, lambda: agent, fingerprint, lambda: last_activity
                )
                return
            with pending:  # released when the build ends
                pass

    def _claim(self, key: str) -> tuple[threading.Lock, bool, _Entry[A] | None]:
        """Under the lock: the build lock of ``key``, whether this caller builds (else it waits
        for it) and, when it does, the entry it replaces."""
        pending = self._building.get(key)
        if pending is not None:
            return pending, False, None
        entry = self._entries.get(key)
        if entry is not None and entry.turns:
            raise AgentBusyError(
                "the cached agent of this session has a turn in flight; replace it once the turn "
                "has ended"
            )
        self._building[key] = pending = threading.Lock()
        pending.acquire()
        return pending, True, self._entries.pop(key, None)

    def _install(
        self, key: str, pending: threading.Lock, stale: _Entry[A] | None,
        factory: Callable[[], A], fingerprint: str, stamp: Callable[[], float | None],
        begin_turn: bool = False,
    ) -> A:  # fmt: skip
        """Release the replaced entry, build and insert the new one, then enforce the cap."""
        try:
            if stale is not None:
                self._release([(key, stale)], "fingerprint", full=False)
            agent = factory()
            with self._lock:
                entry = _Entry(agent, fingerprint, stamp(), turns=int(begin_turn))
                self._entries[key] = entry
        finally:
            with self._lock:
                del self._building[key]
            pending.release()
        self._evict("capacity", lambda: self._select_lru(len(self._entries) - self.max_size, {key}))
        return agent

    def begin_turn(self, key: str, agent: A) -> bool:
        """Mark a turn of ``agent`` in flight; False if ``key`` no longer caches that agent."""
        return self._count_turn(key, agent, +1)

    def end_turn(self, key: str, agent: A) -> None:
        """The turn of ``agent`` has ended (no-op if it was discarded or replaced meanwhile)."""
        self._count_turn(key, agent, -1)

    def _count_turn(self, key: str, agent: A, delta: int) -> bool:
        with self._lock:
            entry = self._find(key, agent)
            if entry is not None:
                entry.turns = max(entry.turns + delta, 0)
                entry.last_activity = self._clock()
            return entry is not None

    def report_persistence(
        self, key: str, agent: A, *, persisted: int | None, in_memory: int | None
    ) -> None:
        """Record how much of ``agent``'s live transcript is durable: an agent
        holding more than is stored is never evicted.

        ``persisted`` messages stored, ``in_memory`` messages held; None means unknown, and an
        unknown or lagging count protects the agent from every eviction pass.
        """
        with self._lock:
            entry = self._find(key, agent)
            if entry is not None:
                entry.persisted = (
                    persisted is not None and in_memory is not None and persisted >= in_memory
                )

    def _find(self, key: str, agent: A) -> _Entry[A] | None:
        entry = self._entries.get(key)
        return entry if entry is not None and entry.agent is agent else None

    # -- full cleanup ------------------------------------------------------------------------------

    def discard(self, key: str) -> bool:
        """Fully clean up the agent of ``key`` at a boundary; False if none was cached.

        The host interrupts a running turn first: a turn in flight does not protect it here.
        """
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._release([(key, entry)], "boundary", full=True)
        return True

    def close(self) -> int:
        """Fully clean up every cached agent (shutdown), least recently used first; the count."""
        with self._lock:
            victims = list(self._entries.items())
            self._entries.clear()
        count = len(victims)
        self._release(victims, "shutdown", full=True)
        return count

    # -- eviction passes ---------------------------------------------------------------------------

    def sweep_idle(self) -> int:
        """Soft-release entries idle longer than ``idle_ttl_secs``; the count.

        Unknown activity is kept, as are turns in flight and unpersisted transcripts.
        """
        return self._evict("idle", self._select_idle)

    def sweep_pressure(self) -> int:
        """Soft-release up to ``max_evictions_per_pass`` agents while over budget; the count.

        A no-op when the budget is disabled, the cache is empty, the signal is unreadable or at
        most the budget. Afterwards freed heap is returned to the OS (``malloc_trim``).
        """
        budget = self.memory_budget_bytes
        if budget is None or not len(self):
            return 0
        used = self._memory_signal()
        if used is None:
            logger.warning("memory signal unreadable; pressure pass skipped")
            return 0
        if used <= budget:
            return 0
        released = self._evict(
            "pressure", lambda: self._select_lru(self.max_evictions_per_pass, self._protected())
        )
        malloc_trim()
        return released

    def _evictable(self, entry: _Entry[A], selection: _Selection[A]) -> bool:
        """Whether ``entry`` is outside classes 1 and 3; counts what blocks it."""
        if entry.turns:
            selection.in_flight += 1
        elif not entry.persisted:
            selection.unpersisted += 1
        return not entry.turns and entry.persisted

    def _protected(self) -> set[str]:
        """Class 2: the ``min(protect_recent, len // 2)`` most recently used keys."""
        return set(
            islice(reversed(self._entries), min(self.protect_recent, len(self._entries) // 2))
        )

    def _select_lru(self, limit: int, skip: set[str]) -> _Selection[A]:
        """Up to ``limit`` evictable entries from the least recently used end, outside ``skip``."""
        selection: _Selection[A] = _Selection(limit=limit)
        for key, entry in self._entries.items():
            if len(selection.entries) >= limit:
                break
            if key not in skip and self._evictable(entry, selection):
                selection.entries[key] = entry
        return selection

    def _select_idle(self) -> _Selection[A]:
        selection: _Selection[A] = _Selection()
        now = self._clock()
        for key, entry in self._entries.items():
            if self._idle(entry, now) and self._evictable(entry, selection):
                selection.entries[key] = entry
        selection.limit = len(selection.entries)
        return selection

    def _idle(self, entry: _Entry[A], now: float) -> bool:
        return entry.last_activity is not None and now - entry.last_activity > self.idle_ttl_secs

    def _still_evictable(
        self, reason: EvictionReason, key: str, entry: _Entry[A], protected: set[str]
    ) -> bool:
        """Re-check a planned entry under the lock: the policy ran while the lock was free."""
        if self._entries.get(key) is not entry or entry.turns or not entry.persisted:
            return False
        if reason == "capacity":
            return len(self._entries) > self.max_size
        if reason == "idle":
            return self._idle(entry, self._clock())
        return key not in protected

    def _evict(self, reason: EvictionReason, select: Callable[[], _Selection[A]]) -> int:
        """One pass: select under the lock, plan, pop under the lock, release outside it."""
        with self._lock:
            selection = select()
        victims: list[tuple[str, _Entry[A]]] = []
        if selection.entries:
            candidates = [_candidate(key, entry) for key, entry in selection.entries.items()]
            victims = self._pop_planned(
                reason, plan_evictions(self.policy, candidates, reason, selection.limit), selection
            )
        entries_left = len(self)
        if (reason == "pressure" and not victims) or (
            reason == "capacity" and entries_left > self.max_size
        ):
            logger.warning(
                "agent cache is over its %s and released %d: %d with a turn in flight, %d with "
                "an unpersisted transcript; %d cached",
                "cap" if reason == "capacity" else "memory budget", len(victims),
                selection.in_flight, selection.unpersisted, entries_left,
            )  # fmt: skip
        count = len(victims)
        self._release(victims, reason, full=False)
        return count

    def _pop_planned(
        self, reason: EvictionReason, plan: list[str], selection: _Selection[A]
    ) -> list[tuple[str, _Entry[A]]]:
        """Pop the planned entries that are still evictable; the selection lets go of all."""
        victims = []
        with self._lock:
            protected = self._protected() if reason == "pressure" else set()
            for key in plan:
                entry = selection.entries[key]
                if self._still_evictable(reason, key, entry, protected):
                    del self._entries[key]
                    victims.append((key, entry))
        selection.entries.clear()
        return victims

    # -- releases ----------------------------------------------------------------------------------

    def _release(
        self, victims: list[tuple[str, _Entry[A]]], reason: ReleaseReason, *, full: bool
    ) -> None:
        """Run the host's release for each victim in order (never under the lock), then notify.

        ``victims`` is emptied as it goes, so each agent's last cache reference is gone once its
        release returned.
        """
        callback = self._full_cleanup if full else self._soft_release
        kind: Literal["agent_cleaned_up", "agent_soft_released"] = (
            "agent_cleaned_up" if full else "agent_soft_released"
        )
        queue = deque(victims)
        victims.clear()
        while queue:
            key, entry = queue.popleft()
            detail: dict[str, str] = {"reason": reason}
            try:
                callback(entry.agent)
            except Exception as exc:
                logger.exception("%s of a cached agent (%s) failed", kind, reason)
                detail["error"] = type(exc).__name__
            del entry
            if self._notify is not None:
                try:
                    self._notify(LifecycleEvent(kind=kind, session_key=key, detail=detail))
                except Exception:
                    logger.exception("observer of %s failed", kind)
