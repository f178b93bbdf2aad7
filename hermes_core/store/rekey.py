"""Re-keying a store from key schema v1 to v2 (``hermes-sessions rekey --to v2``).

Every lane moves to the v2 key of its source, rebuilt from what the store recorded: a routing
entry's ``origin``, a session row's ``origin_json``, a queued event's ``source``. Session ids,
transcripts, flags, markers, queued events, ledger rows and restart counts move with their keys;
nothing is merged. A v1 key under which sources with different v2 keys were stored (the leak
schema v2 ends) is reported as a collision: each row follows its own source. Lanes whose source
is unknown stay where they are and are reported.

The plan is computed afresh from the store on every run and the store records ``v1>v2`` until
the last batch commits, so an interrupted run is finished by running it again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import InvalidValueError, StoreUnavailableError
from hermes_core.domain.models import SessionSource
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.store.backend import KeyMoves, StoredKeys
from hermes_core.store.backing import Backing
from hermes_core.store.base import KEY_SCHEMA_META, REKEYING, exclusive
from hermes_core.store.counts import RestartCountStore
from hermes_core.store.entries import EntryCache
from hermes_core.store.fallback import Fallback
from hermes_core.store.keyschema import keys_in_both
from hermes_core.store.writer import StoreWriter

logger = logging.getLogger(__name__)

KeysOf = Callable[[SessionSource], tuple[str, str]]
"""A source's (v1 key, v2 key) under the store's settings."""


@dataclass(frozen=True)
class Collision:
    """A v1 key that sources with different v2 keys share today."""

    key: str
    targets: tuple[str, ...]
    """Their v2 keys, sorted."""
    recorded: bool = True
    """Rows of both sources are stored. False: one source is recorded, and another source
    (a forum topic read as a group member, or the other way round) has the same v1 key, so
    their messages may share one session: the common case, as the key records no more."""

    def describe(self) -> str:
        """The collision as ``rekey`` prints it."""
        targets = ", ".join(self.targets)
        if self.recorded:
            return (
                f"collision: {self.key} is shared today by sources with different v2 keys "
                f"({targets}); each row follows its own source, nothing is merged"
            )
        return (
            f"collision: {self.key} is the v1 key of sources with different v2 keys ({targets}); "
            "one of them is recorded, so if both wrote, their messages share one session, which "
            "moves with the recorded source (check the transcript)"
        )


@dataclass(frozen=True)
class RekeyReport:
    """What ``rekey`` moved (or, in a dry run, would move) and what it found."""

    dry_run: bool
    schema_before: str
    """``v1``, ``v2`` (nothing to do) or ``v1>v2`` (an interrupted run)."""
    moves: tuple[tuple[str, str], ...] = ()
    """Lanes (routing rows), old key → v2 key, in the order they move."""
    sessions: int = 0
    """Session rows whose key changes."""
    queued: int = 0
    """Queued events (dead letters included) whose key changes."""
    unchanged: int = 0
    """Lanes already under their v2 key (moved by an earlier run, or the same in both)."""
    collisions: tuple[Collision, ...] = ()
    left: tuple[tuple[str, str], ...] = ()
    """Lanes left as they are: (key, why)."""
    counts: int = 0
    """Stuck-loop counts whose key changes."""
    batches: int = 0
    """Transactions committed (0 in a dry run)."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping."""
        return {
            "dry_run": self.dry_run, "schema_before": self.schema_before,
            "moves": [{"from": old, "to": new} for old, new in self.moves],
            "sessions": self.sessions, "queued": self.queued, "unchanged": self.unchanged,
            "collisions": [
                {"key": c.key, "targets": list(c.targets), "recorded": c.recorded}
                for c in self.collisions
            ],
            "left": [{"key": key, "reason": why} for key, why in self.left],
            "counts": self.counts, "batches": self.batches,
        }  # fmt: skip


@dataclass
class _Unit:
    """Everything stored under one old key that moves in the same batch."""

    lane: str | None = None
    """The new key of the routing row and of the key's other records, if they move."""
    sessions: list[tuple[str, str]] = field(default_factory=list)
    queued: list[tuple[int, str]] = field(default_factory=list)
    newest: float = float("-inf")


@dataclass
class RekeyPlan:
    """The moves of a re-key, in order, and what was found on the way."""

    units: dict[str, _Unit]
    renames: dict[str, str]
    """v1 key → v2 key of every source seen (restart counts follow these)."""
    report: RekeyReport

    def batches(self, size: int) -> Iterator[KeyMoves]:
        """The moves in batches of ``size`` keys; the last one records schema v2."""
        items = list(self.units.items())
        starts = range(0, len(items), size) if items else range(1)
        for start in starts:
            chunk = items[start : start + size]
            last = start + size >= len(items)
            yield KeyMoves(
                lanes={old: unit.lane for old, unit in chunk if unit.lane is not None},
                sessions=[move for _old, unit in chunk for move in unit.sessions],
                queued=[move for _old, unit in chunk for move in unit.queued],
                key_schema="v2" if last else REKEYING,
            )


def plan_rekey(
    stored: StoredKeys, keys_of: KeysOf, plugins: HermesPluginManager | None, schema_before: str
) -> RekeyPlan:
    """Where everything in ``stored`` moves (nothing is written)."""
    planner = _Planner(keys_of, plugins)
    return planner.plan(stored, schema_before)


class _Planner:
    def __init__(self, keys_of: KeysOf, plugins: HermesPluginManager | None) -> None:
        self.keys_of = keys_of
        self.plugins = plugins
        self.renames: dict[str, str] = {}
        self.targets: defaultdict[str, set[str]] = defaultdict(set)
        self.twins: defaultdict[str, set[str]] = defaultdict(set)
        """v1 key → v2 keys of sources not recorded that have the same v1 key."""
        self.lanes: dict[str, str] = {}
        self.left: dict[str, str] = {}

    def _keys(self, data: object) -> tuple[str, str] | None:
        """(v1, v2) of a stored source, or None when it cannot be read or keyed."""
        if not isinstance(data, Mapping):
            return None
        try:
            source = SessionSource.from_dict(data, plugins=self.plugins)
            keys = self.keys_of(source)
        except InvalidValueError:
            return None
        if keys[0] != keys[1]:
            self.renames[keys[0]] = keys[1]
            self.twins[keys[0]].update(self._twin_keys(source, keys))
        return keys

    def _twin_keys(self, source: SessionSource, keys: tuple[str, str]) -> Iterator[str]:
        """v2 keys of the source's twin (its thread id read as a sender id, or the other way
        round) when the twin has the same v1 key and another v2 key."""
        thread, user = source.thread_id, source.user_id
        twin = (
            source.replace(thread_id=None, user_id=thread, user_id_alt=None)
            if thread
            else source.replace(thread_id=user)
            if user
            else None
        )
        try:
            found = self.keys_of(twin) if twin is not None else None
        except InvalidValueError:
            return
        if found is not None and found[0] == keys[0] and found[1] != keys[1]:
            yield found[1]

    def plan(self, stored: StoredKeys, schema_before: str) -> RekeyPlan:
        unchanged = self._routes(stored)
        units: defaultdict[str, _Unit] = defaultdict(_Unit)
        for session_id, key, origin, started in stored.sessions:
            new = self._target(key, _json(origin))
            if new is not None:
                unit = units[key]
                unit.sessions.append((session_id, new))
                if started >= unit.newest:
                    unit.newest, unit.lane = started, new
        for event_id, key, event in stored.queued:
            data = _json(event)
            new = self._target(key, data.get("source") if isinstance(data, dict) else None)
            if new is not None:
                units[key].queued.append((event_id, new))
                units[key].lane = units[key].lane or new
        routed = {entry["session_key"] for entry in stored.routes}
        order = self._order(routed)
        for key in self.left:
            units.pop(key, None)
        ordered: dict[str, _Unit] = {}
        for key in order:
            ordered[key] = units.pop(key, _Unit())
            ordered[key].lane = self.lanes[key]
        for key in sorted(units):  # rows of other sources, or of a pruned lane's history
            unit = ordered[key] = units[key]
            if key in routed or key not in stored.others:
                unit.lane = None  # only the rows move: the key's lane stays, or there is none
        collisions = tuple(
            Collision(key, tuple(sorted(targets | self.twins[key])), len(targets) > 1)
            for key, targets in sorted(self.targets.items())
            if len(targets | self.twins[key]) > 1
        )
        report = RekeyReport(
            dry_run=True, schema_before=schema_before,
            moves=tuple((key, self.lanes[key]) for key in order),
            sessions=sum(len(unit.sessions) for unit in ordered.values()),
            queued=sum(len(unit.queued) for unit in ordered.values()),
            unchanged=unchanged, collisions=collisions, left=tuple(sorted(self.left.items())),
        )  # fmt: skip
        return RekeyPlan(ordered, self.renames, report)

    def _routes(self, stored: StoredKeys) -> int:
        """Plan the routing rows; returns how many are already under their v2 key."""
        unchanged = 0
        for entry in stored.routes:
            key, origin = entry["session_key"], entry.get("origin")
            keys = self._keys(origin)
            if keys is None:
                self.left[key] = (
                    "its stored entry cannot be read (`hermes-sessions doctor` says why)"
                    if "session_id" not in entry
                    else "no origin is recorded, so its source is unknown"
                    if origin is None
                    else "its origin cannot be read or keyed (is its platform's plugin loaded?)"
                )
            elif key == keys[1]:
                unchanged += 1
            elif key == keys[0]:
                self.lanes[key] = keys[1]
                self.targets[key].add(keys[1])
            else:
                self.left[key] = "its key is not its origin's v1 key under the current settings"
        return unchanged

    def _target(self, key: str, source: object) -> str | None:
        """The new key of a row stored under ``key`` with ``source``, or None (it stays)."""
        if key in self.left:
            return None
        keys = self._keys(source)
        if keys is not None and key == keys[1]:
            return None
        if keys is not None and key == keys[0]:
            self.targets[key].add(keys[1])
            return keys[1]
        return self.lanes.get(key)

    def _order(self, routed: set[str]) -> list[str]:
        """Lane moves in an order where no move lands on a key still in use; moves that
        cannot (their v2 key belongs to a lane that stays, or a cycle) are left."""
        pending = dict(self.lanes)
        vacated: set[str] = set()
        order: list[str] = []
        while pending:
            ready = [old for old, new in pending.items() if new not in routed or new in vacated]
            if not ready:
                break
            for old in ready:
                order.append(old)
                vacated.add(old)
                del pending[old]
        for old, new in pending.items():
            self.left[old] = f"its v2 key {new} is held by another lane"
            del self.lanes[old]
        return order


def _json(text: str | None) -> Any:
    """Parsed JSON text, or None when there is none or it is malformed."""
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


class Rekeying:
    """The re-key operation of a store: its plan over what ``backing`` stores, moved in
    batches; the mirror (``fallback``) and the entry cache follow, and so do the restart
    ``counts``."""

    def __init__(
        self,
        backing: Backing,
        cache: EntryCache,
        writer: StoreWriter,
        fallback: Fallback,
        counts: RestartCountStore,
        config: GatewayConfig,
        plugins: HermesPluginManager,
    ) -> None:
        self._backing = backing
        self._cache = cache
        self._writer = writer
        self._fallback = fallback
        self._counts = counts
        self._config = config
        self._plugins = plugins

    def rekey(self, *, dry_run: bool = False, batch_size: int = 500) -> RekeyReport:
        """Move every lane of a v1 store to its v2 key, ``batch_size`` keys per transaction
        (see the module). A dry run only reads, so it may run on a read-only store beside a
        running gateway; the real run needs a store opened for writing, which no gateway can
        hold meanwhile (the database's writer lock)."""
        if dry_run:
            return self._rekey(True, batch_size)
        return self._rekey_exclusively(batch_size)

    @exclusive
    def _rekey_exclusively(self, batch_size: int) -> RekeyReport:
        return self._rekey(False, batch_size)

    def _keys_in_both(self, source: SessionSource) -> tuple[str, str]:
        return keys_in_both(source, self._config, self._plugins)

    def _rekey(self, dry_run: bool, batch_size: int) -> RekeyReport:
        backing = self._backing
        sql = backing.bound.maintenance
        if sql is None:
            raise StoreUnavailableError(backing.without("maintenance", "Re-keying"))
        before = sql.get_meta(KEY_SCHEMA_META) or backing.key_schema
        if before == "v2":
            return RekeyReport(dry_run=dry_run, schema_before=before)
        if not dry_run:
            self._fallback.replay_backlog()  # lanes the degraded mode wrote are re-keyed too
        plan = plan_rekey(sql.stored_keys(), self._keys_in_both, self._plugins, before)
        counts = self._counts.current
        stored = counts.load()
        moved_counts = {plan.renames.get(key, key): value for key, value in stored.items()}
        changed = sum(1 for key in stored if key in plan.renames)
        if dry_run:
            return dataclasses.replace(plan.report, counts=changed)
        batches = 0
        for moves in plan.batches(batch_size):
            sql.move_keys(moves)
            batches += 1
        if changed:
            counts.save(moved_counts)
        backing.key_schema = "v2"
        self._cache.clear()
        self._cache.routing_changed()
        self._fallback.flush_mirror(force=True)
        logger.warning(
            "re-keyed %d lanes to key schema v2 in %d batches", len(plan.report.moves), batches
        )
        return dataclasses.replace(plan.report, dry_run=False, counts=changed, batches=batches)
