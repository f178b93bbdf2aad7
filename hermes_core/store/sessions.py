"""The lane state machine: each session key's current session (created, reopened, reset or
replaced at a boundary), its flags (suspension, resume), counters and metadata.

Every change is a function of the lane's entry as it is now, persisted first and then cached,
and redone on the fresh row when another gateway process sharing the store changed it meanwhile
(``routing``). A turn's own writes (marker, reply, settling) are the ``turns`` service's.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import DuplicateSessionIdError, InvalidValueError, StoreError, shown
from hermes_core.domain.keys import config_profile, resolve_key
from hermes_core.domain.models import SessionEntry, SessionSource
from hermes_core.domain.specs import LifecycleKind
from hermes_core.domain.text import clean_text, clean_value
from hermes_core.domain.timeutil import utc_now
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.store.backend import INT64_MAX, CounterDelta, SessionRow
from hermes_core.store.backing import Backing
from hermes_core.store.base import changed, new_session_id, serialised
from hermes_core.store.routing import RoutingTable
from hermes_core.store.writer import StoreWriter

logger = logging.getLogger(__name__)

METADATA_MAX_BYTES = 65_536
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


class Sessions:
    """Session keys → sessions and the lanes' state, over ``routes`` (thread-safe: every
    change runs on ``writer``)."""

    def __init__(
        self,
        backing: Backing,
        routes: RoutingTable,
        writer: StoreWriter,
        config: GatewayConfig,
        plugins: HermesPluginManager,
    ) -> None:
        self._backing = backing
        self._routes = routes
        self._writer = writer
        self._config = config
        self._plugins = plugins

    # -- get or create -----------------------------------------------------------------

    def session_key_for(self, source: SessionSource) -> str:
        """The key the store files ``source`` under (effective flags and profile of the config)."""
        return resolve_key(source, self._config, self._plugins, schema=self._backing.key_schema).key

    @serialised
    def get_or_create_session(
        self, source: SessionSource, force_new: bool = False, touch_activity: bool = True
    ) -> SessionEntry:
        """The lane's current session, creating one at a boundary."""
        key = self.session_key_for(source)
        entry = self._routes.redo(
            lambda: self._get_or_create(
                key, source, self._routes.load(key), force_new, touch_activity
            )
        )
        return self._routes.snapshot(entry)

    def _touch(self, entry: SessionEntry) -> SessionEntry:
        touched = changed(entry, {"updated_at": utc_now()})
        self._routes.persist(touched, touch=True)
        return touched

    @serialised
    def open_lane(self, session_key: str, source: SessionSource) -> tuple[SessionEntry, bool]:
        """The lane's current session for a turn (like :meth:`get_or_create_session` without
        touching its activity), and whether it replaced a suspended one just now (the sender is
        told). ``session_key`` is the key of ``source``."""

        def attempt() -> tuple[SessionEntry, bool]:
            entry = self._routes.load(session_key)
            opened = self._get_or_create(session_key, source, entry, False, False)
            return opened, entry is not None and entry.suspended

        opened, suspended = self._routes.redo(attempt)
        return self._routes.snapshot(opened), suspended

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
            with self._backing.canonical:
                row = self._backing.backend.newest_session(key)
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
        self._routes.write_entry(
            entry, lambda: self._backing.backend.reopen_session(row.id, entry.to_dict())
        )
        self._routes.notify("session_reopened", entry)
        return entry

    def _rebuilt(self, key: str, source: SessionSource, row: SessionRow) -> SessionEntry:
        """The lane's entry for the session ``row``, rebuilt from it (nothing written)."""
        origin = source
        if row.origin_json:
            try:
                origin = SessionSource.from_dict(json.loads(row.origin_json), plugins=self._plugins)
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
        now, backend = utc_now(), self._backing.backend
        parent = None
        if previous is not None:
            with self._backing.canonical:
                parent = previous.session_id if backend.get_session(previous.session_id) else None
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
                profile_name=config_profile(source, self._config), parent_session_id=parent,
                started_at=now.timestamp(), last_activity_at=now.timestamp(),
            )  # fmt: skip
            write = functools.partial(backend.create_session, row, entry.to_dict(), end_previous)
            try:
                self._routes.write_entry(entry, write)
            except DuplicateSessionIdError:
                continue
            if previous is not None:
                lifecycle: LifecycleKind = (
                    "session_reset" if kind != "suspended" else "session_replaced"
                )
                self._routes.notify(lifecycle, entry, previous_session_id=previous.session_id)
            self._routes.notify("session_created", entry)
            return entry
        raise StoreError(f"could not draw an unused session id for {key} after 3 tries")

    # -- lane state --------------------------------------------------------------------

    @serialised
    def reset_session(
        self, session_key: str, display_name: str | None = None
    ) -> SessionEntry | None:
        """Start a new session on the lane (``/new``, ``/reset``); None if the key is unknown."""

        def attempt() -> SessionEntry | None:
            entry = self._routes.load(session_key)
            if entry is None:
                return None
            source = entry.origin or self._bare_source(entry)
            name = display_name if display_name is not None else entry.display_name
            return self._create(
                session_key, source, entry, "session_reset", kind="reset", display_name=name
            )

        created = self._routes.redo(attempt)
        return self._routes.snapshot(created) if created is not None else None

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
            entry = self._routes.load(session_key)
            updates = change(entry) if entry is not None else None
            if entry is None or updates is None:
                return None
            updated = changed(entry, updates)
            self._routes.persist(updated)
            return updated

        return self._routes.redo(attempt)

    @serialised
    def suspend_session(self, session_key: str) -> bool:
        """Hard stop: the next message starts a new session. True iff the entry existed."""
        entry = self._update(session_key, lambda e: {"suspended": True})
        if entry is not None:
            self._routes.notify("session_suspended", entry)
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
            self._routes.notify("resume_marked", entry, reason=reason)
        return entry is not None

    @serialised
    def clear_resume_pending(self, session_key: str) -> bool:
        """Clear the recovery flag; False if the key is unknown or not pending."""
        cleared = {"resume_pending": False, "resume_reason": None, "last_resume_marked_at": None}
        entry = self._update(session_key, lambda e: cleared if e.resume_pending else None)
        if entry is not None:
            self._routes.notify("resume_cleared", entry)
        return entry is not None

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
            entry = self._routes.load(session_key)
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
                self._backing.backend.update_counters, updated.to_dict(), entry.session_id, delta
            )
            self._routes.write_entry(updated, write)

        self._routes.redo(attempt)

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
