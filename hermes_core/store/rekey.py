"""Re-keying a store from key schema v1 to v2 (``hermes-sessions rekey --to v2``).

Every lane moves to the v2 key of its source, rebuilt from what the store recorded: a routing
entry's ``origin``, a session row's ``origin_json``, a queued event's ``source``. Session ids,
transcripts, flags, markers, queued events, ledger rows and restart counts move with their keys;
nothing is merged. A v1 key under which sources with different v2 keys were stored (the leak
schema v2 ends) is reported as a collision: each row follows its own source. Lanes whose source
is unknown stay where they are and are reported.

The plan is computed afresh from the store on every run and the store records ``v1>v2`` until
the last batch commits, so an interrupted run is finished by running it again.

The same machinery moves the thread-less lanes of named Telegram forum chats to their General
topic (``rekey --forum telegram CHAT_ID``; the thread is the platform's
``PlatformSpec.forum_general_thread``, ``"1"``) within the store's schema: the reader keys a
forum's messages outside any topic there since the key rule changed, and the stored origins do
not say which chats are forums. Several per-user lanes may have one General-topic key; the most
recently active takes it and the others are left (their sessions stay readable by id).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import InvalidValueError, KeySchemaError, StoreUnavailableError
from hermes_core.domain.models import SessionSource
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.store.backend import EntryDict, KeyMoves, StoredKeys
from hermes_core.store.backing import Backing
from hermes_core.store.base import KEY_SCHEMA_META, REKEYING, PhaseProgress, exclusive, untold
from hermes_core.store.counts import RestartCountStore
from hermes_core.store.entries import EntryCache
from hermes_core.store.fallback import Fallback
from hermes_core.store.keyschema import check_forums, general_topic_keys, keys_in_both
from hermes_core.store.rekey_report import Collision, Forum, RekeyReport
from hermes_core.store.writer import StoreWriter

logger = logging.getLogger(__name__)

KeysOf = Callable[[SessionSource], tuple[str, str]]
"""A source's (v1 key, v2 key) under the store's settings."""


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
    """Old key → new key of the sources seen whose old key has a restart count (the counts
    follow these)."""
    report: RekeyReport

    def batches(self, size: int, schema: str = "v2") -> Iterator[KeyMoves]:
        """The moves in batches of ``size`` keys; the last one records ``schema``, the others
        ``v1>v2`` unless the store stays in ``schema`` throughout."""
        interim = schema if self.report.schema_before == schema else REKEYING
        items = list(self.units.items())
        starts = range(0, len(items), size) if items else range(1)
        for start in starts:
            chunk = items[start : start + size]
            last = start + size >= len(items)
            yield KeyMoves(
                lanes={old: unit.lane for old, unit in chunk if unit.lane is not None},
                sessions=[move for _old, unit in chunk for move in unit.sessions],
                queued=[move for _old, unit in chunk for move in unit.queued],
                key_schema=schema if last else interim,
            )


def plan_rekey(
    stored: StoredKeys,
    keys_of: KeysOf,
    plugins: HermesPluginManager | None,
    schema_before: str,
    *,
    twins: bool = True,
    counted: Collection[str] = (),
    seen: Callable[[int], None] | None = None,
) -> RekeyPlan:
    """Where everything in ``stored`` moves (nothing is written); ``twins``: report the v1
    collisions of sources not recorded (the move to v2); ``counted``: the keys with a restart
    count, whose renames the plan keeps; ``seen`` is called with each row read.

    The rows are walked once as they stream in; only what moves or is left is kept (the
    memory grows with the lanes that move, not with the store)."""
    planner = _Planner(keys_of, plugins, twins, frozenset(counted), seen or (lambda count: None))
    return planner.plan(stored, schema_before)


class _Planner:
    def __init__(
        self,
        keys_of: KeysOf,
        plugins: HermesPluginManager | None,
        twins: bool,
        counted: frozenset[str],
        seen: Callable[[int], None],
    ) -> None:
        self.keys_of = keys_of
        self.plugins = plugins
        self.find_twins = twins
        self.counted = counted
        self.seen = seen
        self.updated: dict[str, str] = {}
        """Moving routing key → its entry's ``updated_at``, to pick one of several lanes moving
        to one key."""
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
            if keys[0] in self.counted:
                self.renames[keys[0]] = keys[1]
            if self.find_twins:
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
        unchanged = self._routes(stored.routes)
        units: defaultdict[str, _Unit] = defaultdict(_Unit)
        for session_id, key, origin, started in stored.sessions:
            self.seen(1)
            new = self._target(key, _json(origin))
            if new is not None:
                unit = units[key]
                unit.sessions.append((session_id, new))
                if started >= unit.newest:
                    unit.newest, unit.lane = started, new
        for event_id, key, event in stored.queued:
            self.seen(1)
            data = _json(event)
            new = self._target(key, data.get("source") if isinstance(data, dict) else None)
            if new is not None:
                units[key].queued.append((event_id, new))
                units[key].lane = units[key].lane or new
        order = self._order(stored.routed(set(self.lanes.values())))
        for key in self.left:
            units.pop(key, None)
        ordered: dict[str, _Unit] = {}
        for key in order:
            ordered[key] = units.pop(key, _Unit())
            ordered[key].lane = self.lanes[key]
        rest = sorted(units)  # rows of other sources, or of a pruned lane's history
        routed, others = stored.routed(rest), stored.others(rest)
        for key in rest:
            unit = ordered[key] = units[key]
            if key in routed or key not in others:
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

    def _routes(self, routes: Iterable[EntryDict]) -> int:
        """Plan the routing rows; returns how many are already under their v2 key."""
        unchanged = 0
        for entry in routes:
            self.seen(1)
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
                self.updated[key] = str(entry.get("updated_at") or "")
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
        """Lane moves in an order where no move lands on a key still in use (``routed``: the
        new keys that have a routing row); moves that cannot (their v2 key belongs to a lane
        that stays, or a cycle) are left."""
        pending = dict(self.lanes)
        claimed: dict[str, str] = {}
        for old in sorted(pending, key=lambda key: (self.updated.get(key, ""), key), reverse=True):
            new = pending[old]
            if new in claimed:  # per-user lanes of a forum, all moving to its General topic
                self.left[old] = (
                    f"its new key {new} goes to {claimed[new]}, the most recently active lane "
                    "with that key (this lane's sessions stay readable by id)"
                )
                del pending[old], self.lanes[old]
            else:
                claimed[new] = old
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
            self.left[old] = f"its new key {new} is held by another lane"
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

    def rekey(
        self,
        *,
        dry_run: bool = False,
        batch_size: int = 500,
        forums: Sequence[Forum] = (),
        progress: PhaseProgress | None = None,
    ) -> RekeyReport:
        """Move every lane of a v1 store to its v2 key, or with ``forums`` ((platform, chat id)
        pairs) the thread-less lanes of those forums to their General topic, ``batch_size`` keys per
        transaction (see the module). A dry run only reads, so it may run on a read-only store
        beside a running gateway; the real run needs a store opened for writing, which no
        gateway can hold meanwhile (the database's writer lock). ``progress`` is told of each
        row read (phase ``reading``, total 0: unknown) and each batch committed (``moving``)."""
        chats = tuple(sorted(set(forums)))
        check_forums(frozenset(chats), self._plugins)
        told = progress or untold
        if dry_run:
            return self._rekey(True, batch_size, chats, told)
        return self._rekey_exclusively(batch_size, chats, told)

    @exclusive
    def _rekey_exclusively(
        self, batch_size: int, forums: tuple[Forum, ...], progress: PhaseProgress
    ) -> RekeyReport:
        return self._rekey(False, batch_size, forums, progress)

    def _keys_of(self, forums: tuple[Forum, ...], schema: str) -> KeysOf:
        """(old key, new key) of a source: v1 and v2, or its keys outside and in the General
        topic of one of ``forums`` under ``schema``."""
        if not forums:
            return functools.partial(keys_in_both, config=self._config, plugins=self._plugins)
        return functools.partial(
            general_topic_keys, config=self._config, plugins=self._plugins,
            schema="v2" if schema == "v2" else "v1", forums=frozenset(forums),
        )  # fmt: skip

    def _rekey(
        self, dry_run: bool, batch_size: int, forums: tuple[Forum, ...], progress: PhaseProgress
    ) -> RekeyReport:
        backing = self._backing
        sql = backing.bound.maintenance
        if sql is None:
            raise StoreUnavailableError(backing.without("maintenance", "Re-keying"))
        before = sql.get_meta(KEY_SCHEMA_META) or backing.key_schema
        if forums and before == REKEYING:
            raise KeySchemaError(
                "a re-key of this store to key schema v2 was interrupted; run `hermes-sessions "
                "rekey --to v2` again to finish it, then move the forums' lanes."
            )
        if before == "v2" and not forums:
            return RekeyReport(dry_run=dry_run, schema_before=before)
        if not dry_run:
            self._fallback.replay_backlog()  # lanes the degraded mode wrote are re-keyed too
        counts = self._counts.current
        stored = counts.load()
        plan = plan_rekey(
            sql.stored_keys(), self._keys_of(forums, before), self._plugins, before,
            twins=not forums, counted=stored.keys(),
            seen=functools.partial(progress, "reading", total=0),
        )  # fmt: skip
        plan = dataclasses.replace(plan, report=dataclasses.replace(plan.report, forums=forums))
        moved_counts = {plan.renames.get(key, key): value for key, value in stored.items()}
        changed = sum(1 for key in stored if key in plan.renames)
        if dry_run:
            return dataclasses.replace(plan.report, counts=changed)
        batches = 0
        schema = before if forums else "v2"
        total = max(1, -(-len(plan.units) // batch_size))
        for moves in plan.batches(batch_size, schema):
            sql.move_keys(moves)
            batches += 1
            progress("moving", 1, total=total)
        if changed:
            counts.save(moved_counts)
        backing.key_schema = "v2" if schema == "v2" else "v1"
        self._cache.clear()
        self._cache.routing_changed()
        self._fallback.flush_mirror(force=True)
        logger.warning(
            "re-keyed %d lanes %s in %d batches", len(plan.report.moves),
            "to their forum's General topic" if forums else "to key schema v2", batches,
        )  # fmt: skip
        return dataclasses.replace(plan.report, dry_run=False, counts=changed, batches=batches)
