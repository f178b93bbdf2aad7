"""SessionStore: maps session keys to sessions and carries the lane state machine.

The routing index is canonical in the backend (one row per key); the entry map here is a bounded
cache of it, loaded per key on first use, so opening and memory do not grow with the number of
stored sessions. Every mutation is persisted first and only then applied to the cache; on a
store shared by several gateway processes a write from a cached entry is checked against the
row's revision and redone on the fresh row if another process changed it (see ``routing``).

The lane state machine stays in one class (its transitions are read together); transcripts,
turn recovery and re-keying are its base classes in sibling modules.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import secrets
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from types import TracebackType
from typing import Any

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import (
    DuplicateSessionIdError,
    InvalidValueError,
    MessageRedeliveredError,
    StoreError,
    shown,
)
from hermes_core.domain.keys import config_profile, resolve_key
from hermes_core.domain.models import SessionEntry, SessionSource, session_id_problem
from hermes_core.domain.specs import LifecycleKind
from hermes_core.domain.text import clean_text, clean_value
from hermes_core.domain.timeutil import checked_span, utc_now
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.store.backend import (
    INT64_MAX,
    LOCKED,
    CounterDelta,
    Message,
    Obligation,
    SessionRow,
)
from hermes_core.store.base import (
    MAINTENANCE_BATCH,
    changed,
    exclusive,
    new_session_id,
    serialised,
)
from hermes_core.store.leases import QueuedEvent
from hermes_core.store.rekey import RekeyStore
from hermes_core.store.transcripts import TranscriptStore
from hermes_core.turns.ledger import SendResult

logger = logging.getLogger(__name__)

METADATA_MAX_BYTES = 65_536
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


class SessionStore(RekeyStore, TranscriptStore):
    """Session keys → sessions, lane flags, turn markers and transcripts (thread-safe)."""

    @classmethod
    def open(
        cls,
        config: GatewayConfig | None = None,
        *,
        has_active_processes_fn: Callable[[str], bool] | None = None,
        plugins: HermesPluginManager | None = None,
        read_only: bool = False,
    ) -> SessionStore:
        """Open the store of ``config`` (None: ``$HERMES_HOME/config.yaml`` and environment).

        For writing, the store takes its database's one-writer lock (``GatewayLockedError``
        names the holder when another process writes to it); ``read_only`` takes no lock and
        refuses every change."""
        config = config if config is not None else GatewayConfig.load()
        return cls(
            config.sessions_dir, config, has_active_processes_fn, plugins=plugins,
            read_only=read_only,
        )  # fmt: skip

    def __enter__(self) -> SessionStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- get or create -----------------------------------------------------------------

    def session_key_for(self, source: SessionSource) -> str:
        """The key the store files ``source`` under (effective flags and profile of the config)."""
        return resolve_key(source, self.config, self.plugins, schema=self.key_schema).key

    @serialised
    def get_or_create_session(
        self, source: SessionSource, force_new: bool = False, touch_activity: bool = True
    ) -> SessionEntry:
        """The lane's current session, creating one at a boundary."""
        key = self.session_key_for(source)
        entry = self._redo(
            lambda: self._get_or_create(key, source, self._load(key), force_new, touch_activity)
        )
        return self._snapshot(entry)

    def _touch(self, entry: SessionEntry) -> SessionEntry:
        touched = changed(entry, {"updated_at": utc_now()})
        self._persist(touched, touch=True)
        return touched

    @serialised
    def open_lane(self, session_key: str, source: SessionSource) -> tuple[SessionEntry, bool]:
        """The lane's current session for a turn (like :meth:`get_or_create_session` without
        touching its activity), and whether it replaced a suspended one just now (the sender is
        told). ``session_key`` is the key of ``source``."""

        def attempt() -> tuple[SessionEntry, bool]:
            entry = self._load(session_key)
            opened = self._get_or_create(session_key, source, entry, False, False)
            return opened, entry is not None and entry.suspended

        opened, suspended = self._redo(attempt)
        return self._snapshot(opened), suspended

    def _get_or_create(
        self,
        key: str,
        source: SessionSource,
        entry: SessionEntry | None,
        force_new: bool,
        touch: bool,
    ) -> SessionEntry:
        """The lane's session given its ``entry`` as just loaded (None: no routing entry, so it
        is not read a second time), created or reopened where needed."""
        if entry is not None and not force_new:
            if entry.suspended:
                return self._create(key, source, entry, "suspended", kind="suspended")
            return self._touch(entry) if touch else entry
        row = None
        if entry is None:  # a new lane, or one whose routing entry was pruned
            with self._canonical():
                row = self._backend.newest_session(key)
        if force_new:
            if entry is None and row is not None and row.end_reason is None:
                entry = self._rebuilt(key, source, row)  # still open: it ends here
            return self._create(key, source, entry, "session_reset", kind="force_new")
        if row is not None and row.reopenable:
            return self._reopen(key, source, row)
        return self._create(key, source, None, None, kind="new")

    def _reopen(self, key: str, source: SessionSource, row: SessionRow) -> SessionEntry:
        """Rebuild the lane's entry from its newest resumable row, and store it."""
        entry = self._rebuilt(key, source, row)
        self._write_entry(entry, lambda: self._backend.reopen_session(row.id, entry.to_dict()))
        self._notify("session_reopened", entry)
        return entry

    def _rebuilt(self, key: str, source: SessionSource, row: SessionRow) -> SessionEntry:
        """The lane's entry for the session ``row``, rebuilt from it (nothing written)."""
        origin = source
        if row.origin_json:
            try:
                origin = SessionSource.from_dict(json.loads(row.origin_json), plugins=self.plugins)
            except (InvalidValueError, ValueError):
                logger.warning("session %s has an unreadable origin; using the message's", row.id)
        started = datetime.fromtimestamp(row.started_at, timezone.utc)
        try:
            activity = datetime.fromtimestamp(row.last_activity_at or row.started_at, timezone.utc)
        except (OverflowError, OSError, ValueError):
            activity = _EPOCH  # invalid activity reads as old, never fresh
        return SessionEntry(
            session_key=key, session_id=row.id, created_at=started, updated_at=activity,
            origin=origin, display_name=row.display_name or origin.chat_name,
            platform=origin.platform, chat_type=row.chat_type or origin.chat_type,
            input_tokens=row.input_tokens, output_tokens=row.output_tokens,
            cache_read_tokens=row.cache_read_tokens, cache_write_tokens=row.cache_write_tokens,
            total_tokens=row.total_tokens, estimated_cost_usd=row.estimated_cost_usd,
            cost_status=row.cost_status or "unknown",
        )  # fmt: skip

    def _create(
        self,
        key: str,
        source: SessionSource,
        previous: SessionEntry | None,
        end_reason: str | None,
        *,
        kind: str,
        display_name: str | None = None,
    ) -> SessionEntry:
        """A new session for the lane, ending ``previous`` with ``end_reason`` (one transaction)."""
        now = utc_now()
        parent = None
        if previous is not None:
            with self._canonical():
                parent = (
                    previous.session_id if self._backend.get_session(previous.session_id) else None
                )
        fields: dict[str, Any] = {
            "session_key": key, "created_at": now, "updated_at": now, "origin": source,
            "display_name": display_name if display_name is not None else source.chat_name,
            "platform": source.platform, "chat_type": source.chat_type,
        }  # fmt: skip
        if previous is not None:
            fields["prev_session_id"] = previous.session_id
            fields["reset_had_activity"] = previous.last_prompt_tokens > 0
            fields["is_fresh_reset"] = kind == "reset"
            if kind == "suspended":
                fields["was_auto_reset"] = True
                fields["auto_reset_reason"] = "suspended"
        end_previous = (previous.session_id, end_reason) if previous and end_reason else None
        for _attempt in range(3):
            session_id = new_session_id(now)
            entry = SessionEntry(session_id=session_id, **fields)
            row = SessionRow(
                id=session_id, session_key=key, source=source.platform, chat_id=source.chat_id,
                chat_type=source.chat_type, thread_id=source.thread_id, user_id=source.user_id,
                display_name=entry.display_name,
                origin_json=json.dumps(source.to_dict(), ensure_ascii=False),
                profile_name=config_profile(source, self.config), parent_session_id=parent,
                started_at=now.timestamp(), last_activity_at=now.timestamp(),
            )  # fmt: skip
            write = functools.partial(
                self._backend.create_session, row, entry.to_dict(), end_previous
            )
            try:
                self._write_entry(entry, write)
            except DuplicateSessionIdError:
                continue
            if previous is not None:
                lifecycle: LifecycleKind = (
                    "session_reset" if kind != "suspended" else "session_replaced"
                )
                self._notify(lifecycle, entry, previous_session_id=previous.session_id)
            self._notify("session_created", entry)
            return entry
        raise StoreError(f"could not draw an unused session id for {key} after 3 tries")

    # -- lane state --------------------------------------------------------------------

    @serialised
    def reset_session(
        self, session_key: str, display_name: str | None = None
    ) -> SessionEntry | None:
        """Start a new session on the lane (``/new``, ``/reset``); None if the key is unknown."""

        def attempt() -> SessionEntry | None:
            entry = self._load(session_key)
            if entry is None:
                return None
            source = entry.origin or self._bare_source(entry)
            name = display_name if display_name is not None else entry.display_name
            return self._create(
                session_key, source, entry, "session_reset", kind="reset", display_name=name
            )

        created = self._redo(attempt)
        return self._snapshot(created) if created is not None else None

    @staticmethod
    def _bare_source(entry: SessionEntry) -> SessionSource:
        """A minimal source for an entry stored without origin (older writers)."""
        platform = entry.platform or entry.session_key.split(":")[2]
        return SessionSource(platform=platform, chat_id="", chat_type=entry.chat_type)

    def _update(
        self, session_key: str, change: Callable[[SessionEntry], dict[str, Any] | None]
    ) -> SessionEntry | None:
        """Apply ``change`` (field updates, or None for no change) to a lane and persist it
        (redone on the fresh entry if another process changed it meanwhile)."""

        def attempt() -> SessionEntry | None:
            entry = self._load(session_key)
            updates = change(entry) if entry is not None else None
            if entry is None or updates is None:
                return None
            updated = changed(entry, updates)
            self._persist(updated)
            return updated

        return self._redo(attempt)

    @serialised
    def suspend_session(self, session_key: str) -> bool:
        """Hard stop: the next message starts a new session. True iff the entry existed."""
        entry = self._update(session_key, lambda e: {"suspended": True})
        if entry is not None:
            self._notify("session_suspended", entry)
        return entry is not None

    @serialised
    def unsuspend_session(self, session_key: str) -> bool:
        """Clear a suspension (an operator's decision): the next message continues the lane's
        session. True iff the lane was suspended."""
        entry = self._update(session_key, lambda e: {"suspended": False} if e.suspended else None)
        return entry is not None

    @serialised
    def mark_resume_pending(
        self, session_key: str, reason: str = "restart_timeout", *, only_if_running: bool = False
    ) -> bool:
        """Soft recovery flag; False if the key is unknown or suspended, or (``only_if_running``,
        a draining gateway's mark) no turn marker is set any more: that turn has finished."""

        def change(entry: SessionEntry) -> dict[str, Any] | None:
            if entry.suspended or (only_if_running and entry.active_turn_token is None):
                return None
            return {"resume_pending": True, "resume_reason": reason,
                    "last_resume_marked_at": utc_now()}  # fmt: skip

        entry = self._update(session_key, change)
        if entry is not None:
            self._notify("resume_marked", entry, reason=reason)
        return entry is not None

    @serialised
    def clear_resume_pending(self, session_key: str) -> bool:
        """Clear the recovery flag; False if the key is unknown or not pending."""
        cleared = {"resume_pending": False, "resume_reason": None, "last_resume_marked_at": None}
        entry = self._update(session_key, lambda e: cleared if e.resume_pending else None)
        if entry is not None:
            self._notify("resume_cleared", entry)
        return entry is not None

    @serialised
    def mark_turn_active(
        self,
        session_key: str,
        consumed_event_id: int | None = None,
        user_message: Message | None = None,
        *,
        seen: str | None = None,
        touch: bool = False,
    ) -> str | None:
        """Persist a new turn marker and, in the same commit, the dequeue of
        ``consumed_event_id``, the user message, ``seen`` (its platform message id) as seen on
        the lane and, with ``touch``, the lane's activity. Returns the marker token, or None for
        an unknown key; raises :class:`MessageRedeliveredError` (nothing written) when ``seen``
        was seen on the lane before."""
        entry = self._load(session_key)
        if entry is None:
            return None
        token = secrets.token_hex(16)
        now = utc_now()
        changes: dict[str, Any] = {"active_turn_token": token, "active_turn_started_at": now}
        if touch:
            changes["updated_at"] = now
        updated = changed(entry, changes)
        message = (entry.session_id, user_message) if user_message is not None else None
        # one backend write: its own transaction, fenced in its own statement
        with self._canonical(), self._fenced(session_key) as fence:
            begun = self._backend.begin_turn(updated, consumed_event_id, message, seen, **fence)
        if not begun:
            raise MessageRedeliveredError("the platform delivered this message again")
        self._routing_changed()
        self._remember(updated, self._bumped(session_key))
        self._notify("turn_started", updated, token=token)
        return token

    @serialised
    def clear_turn_active(self, session_key: str, token: str) -> bool:
        """Compare-and-swap: clear the marker iff ``token`` still owns it."""
        entry = self._load(session_key)
        if entry is None or entry.active_turn_token != token:
            return False
        updated = changed(entry, {"active_turn_token": None, "active_turn_started_at": None})
        with self._canonical(), self._backend.transaction():
            self._fence(session_key)
            cleared = self._backend.clear_turn_marker(updated, token)
        if not cleared:
            self._forget(session_key)  # someone else owns the row now: reload next time
            return False
        self._routing_changed()
        self._remember(updated, self._bumped(session_key))
        self._notify("turn_ended", updated, token=token)
        return True

    @serialised
    def settle_delivery(
        self,
        row: Obligation,
        result: SendResult,
        close: tuple[str, str | None] | None = None,
        *,
        success: bool = True,
        kept: Callable[[list[QueuedEvent]], object] | None = None,
    ) -> bool:
        """After a send attempt, in one commit: end the lane's turn with ``close`` = (session
        key, turn token) (its marker if still set and, after a ``success``, the resume flag and
        stuck-loop count where set), settle the ledger row (none without the ledger) and, given
        ``kept``, give up the lane's lease as :meth:`release_lease` does (a delivered reply's
        row goes in the same statement); events waiting in the lane's durable queue keep it
        and go to ``kept``. True when the platform accepted the reply."""
        ledger = self.ledger
        delivered = result.ok
        lane = row.session_key
        if close is not None:
            self.close_turn(*close, success=success)
        release = None
        if kept is not None and self.shared and self.holds(lane):
            release = functools.partial(self._release, lane, kept)
        if ledger is not None and row.obligation_id:
            delete = None
            if release is not None and delivered:
                delete, release = release, None
            delivered = ledger.settle(row, result, delete)
        if release is not None:
            release()
        return delivered

    def _release(
        self,
        session_key: str,
        kept: Callable[[list[QueuedEvent]], object],
        delivered: str | None = None,
    ) -> None:
        waiting = self.release_lease(session_key, delivered=delivered)
        if waiting is not None and waiting != LOCKED:  # locked: kept, released later
            kept(waiting)

    @serialised
    def close_turn(self, session_key: str, token: str | None, *, success: bool = True) -> None:
        """End a turn: clear its marker if ``token`` still owns it; after a success also the
        resume flag and the stuck-loop count, each only where set (failed turns keep the flag).
        Writes nothing that would not change."""
        entry = self._load(session_key) if token is not None or success else None
        if token is not None and entry is not None and entry.active_turn_token == token:
            self.clear_turn_active(session_key, token)  # a turn's reply usually cleared it
            entry = self._load(session_key)
        if success:
            if entry is not None and entry.resume_pending:
                self.clear_resume_pending(session_key)
            self.counts.remove(session_key)

    @serialised
    def update_session(
        self,
        session_key: str,
        *,
        input_tokens: int = 0,
        output_tokens: int = 0,
        cache_read_tokens: int = 0,
        cache_write_tokens: int = 0,
        total_tokens: int | None = None,
        estimated_cost_usd: float = 0.0,
        cost_status: str | None = None,
        last_prompt_tokens: int | None = None,
        touch_activity: bool = True,
    ) -> None:
        """Add token and cost deltas; mirror them to the session row (unknown key: no-op).
        Counters stay 64-bit integers and the cost a finite number, else
        :class:`InvalidValueError` and nothing is written."""
        total = total_tokens if total_tokens is not None else input_tokens + output_tokens

        def attempt() -> None:  # redone on the fresh entry if another process changed it
            entry = self._load(session_key)
            if entry is None:
                return
            deltas = {
                "input_tokens": input_tokens, "output_tokens": output_tokens,
                "cache_read_tokens": cache_read_tokens, "cache_write_tokens": cache_write_tokens,
                "total_tokens": total,
            }  # fmt: skip
            updates: dict[str, Any] = {
                name: _counter(name, getattr(entry, name), delta) for name, delta in deltas.items()
            }
            if last_prompt_tokens is not None:
                updates["last_prompt_tokens"] = _counter(
                    "last_prompt_tokens", 0, last_prompt_tokens
                )
            cost = entry.estimated_cost_usd + _finite("estimated_cost_usd", estimated_cost_usd)
            updates["estimated_cost_usd"] = _finite("estimated_cost_usd", cost)
            if cost_status is not None:
                if not isinstance(cost_status, str):
                    raise InvalidValueError("cost_status", "cost_status must be a string.")
                updates["cost_status"] = clean_text(cost_status)
            if touch_activity:
                updates["updated_at"] = utc_now()
            updated = changed(entry, updates)
            delta = CounterDelta(
                input_tokens=input_tokens, output_tokens=output_tokens,
                cache_read_tokens=cache_read_tokens, cache_write_tokens=cache_write_tokens,
                total_tokens=total, estimated_cost_usd=estimated_cost_usd, cost_status=cost_status,
                last_activity_at=updated.updated_at.timestamp() if touch_activity else None,
            )  # fmt: skip
            write = functools.partial(
                self._backend.update_counters, updated.to_dict(), entry.session_id, delta
            )
            self._write_entry(updated, write)

        self._redo(attempt)

    def get_session_metadata(self, session_key: str, name: str, default: Any = None) -> Any:
        """A deep copy of one per-lane metadata value, or ``default``."""
        entry = self._load(session_key) if session_key else None
        if entry is None or name not in entry.metadata:
            return default
        return copy.deepcopy(entry.metadata[name])

    @serialised
    def set_session_metadata(self, session_key: str, name: str, value: Any) -> bool:
        """Store one JSON value in the lane's metadata (≤ 64 KiB in all); False if unknown."""

        def change(entry: SessionEntry) -> dict[str, Any]:
            if not isinstance(name, str):
                raise InvalidValueError("metadata", "a metadata name must be a string.")
            cleaned = clean_value(value, field="metadata", plain=True)  # a fresh copy
            metadata = {**copy.deepcopy(entry.metadata), clean_text(name): cleaned}
            size = len(json.dumps(metadata, ensure_ascii=False).encode("utf-8"))
            if size > METADATA_MAX_BYTES:
                raise InvalidValueError(
                    "metadata",
                    f"metadata of {session_key} would be {size} bytes, over the "
                    f"{METADATA_MAX_BYTES}-byte limit; store large data elsewhere.",
                )
            return {"metadata": metadata}

        return self._update(session_key, change) is not None

    # -- lookups -----------------------------------------------------------------------------------

    def lookup_by_session_key(self, session_key: str) -> SessionEntry | None:
        """The lane's entry (read-only: never creates or touches); falsy key → None."""
        entry = self._load(session_key) if session_key else None
        return self._snapshot(entry) if entry is not None else None

    def peek_session_id(self, session_key: str) -> str | None:
        """The lane's current session id, or None."""
        entry = self._load(session_key) if session_key else None
        return entry.session_id if entry is not None else None

    def lookup_by_session_id(self, session_id: str) -> SessionEntry | None:
        """The entry whose *current* session id is ``session_id``, or None."""
        if not isinstance(session_id, str) or session_id_problem(session_id) is not None:
            return None  # no session has such an id
        entry = self._current_entry_of(session_id)
        return self._snapshot(entry) if entry is not None else None

    def list_sessions(self, active_minutes: float | None = None) -> list[SessionEntry]:
        """All loadable entries (or those updated within ``active_minutes``), newest first."""
        with self._canonical():
            stored = list(self._backend.iter_routes())
        entries = [entry for entry in map(self._parse, stored) if entry is not None]
        if active_minutes is not None:
            minutes = checked_span(active_minutes, "active_minutes", "minutes")
            cutoff = utc_now() - timedelta(minutes=minutes)
            entries = [entry for entry in entries if entry.updated_at >= cutoff]
        return sorted(entries, key=lambda entry: entry.updated_at, reverse=True)

    def session_row(self, session_id: str) -> SessionRow | None:
        """The stored row of a session (start, end, counters, last activity), or None."""
        with self._canonical():
            return self._backend.get_session(session_id)

    def has_any_sessions(self) -> bool:
        """True iff at least two session rows exist (the caller's own counts as one)."""
        with self._canonical():
            return self._backend.count_sessions() >= 2

    # -- pruning -----------------------------------------------------------------------

    def _has_active_process(self, session_key: str) -> bool:
        if self._has_active_processes is None:
            return False
        try:
            return bool(self._has_active_processes(session_key))
        except Exception:
            logger.warning("has_active_processes_fn failed; keeping the lane", exc_info=True)
            return True

    def prune_old_entries(self, max_age_days: float | None) -> int:
        """Remove routing entries idle for ``max_age_days`` (sessions and messages stay); None
        or 0 removes nothing, a value that is no finite number of days is refused. The number
        removed (:meth:`prune_idle_lanes` names them)."""
        return len(self.prune_idle_lanes(max_age_days))

    def prune_idle_lanes(self, max_age_days: float | None) -> list[str]:
        """:meth:`prune_old_entries`, returning the session keys of the entries removed. The
        candidates are read first, then removed in batches of :data:`MAINTENANCE_BATCH` keys,
        each a writer step of its own (turns' steps run between them) whose delete re-checks
        that the lane is still idle."""
        if max_age_days is None or max_age_days == 0 or self._bound.pruning is None:
            return []
        cutoff = time.time() - checked_span(max_age_days, "max_age_days") * 86_400
        with self._canonical():
            candidates = self._bound.pruning.prune_candidates(cutoff)
        removed: list[str] = []
        for start in range(0, len(candidates), MAINTENANCE_BATCH):
            batch = candidates[start : start + MAINTENANCE_BATCH]
            removed += self._prune_batch(
                [key for key in batch if not self._has_active_process(key)], cutoff
            )
        if removed:
            self.flush_mirror(force=True)
        return removed

    @exclusive
    def _prune_batch(self, keys: list[str], cutoff: float) -> list[str]:
        """Remove the entries of ``keys`` still idle since before ``cutoff`` (one step)."""
        pruning = self._bound.pruning
        if pruning is None or not keys:
            return []
        with self._canonical():
            removed = pruning.delete_idle_routes(keys, cutoff)
        for key in removed:
            self._forget(key)
        if removed:
            self._routing_changed()
        return removed


def _counter(name: str, current: int, delta: object) -> int:
    """``current + delta`` for a token counter: ``delta`` an integer, the sum a 64-bit one."""
    if isinstance(delta, bool) or not isinstance(delta, int):
        raise InvalidValueError(name, f"{name} must be an integer, got {shown(delta)}.")
    result = current + delta
    if not -INT64_MAX <= result <= INT64_MAX:
        raise InvalidValueError(name, f"{name} would become {result}, outside a 64-bit integer.")
    return result


def _finite(name: str, value: object) -> float:
    """``value`` as a finite float (costs are stored as such)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidValueError(name, f"{name} must be a number, got {shown(value)}.")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise InvalidValueError(name, f"{name} must be a finite number, got {shown(value)}.")
    return number
