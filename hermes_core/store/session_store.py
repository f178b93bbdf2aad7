"""SessionStore: maps session keys to sessions and carries the lane state machine (SPEC §2, §3).

The routing index is canonical in the backend (one row per key); the entry map here is a bounded
cache of it, loaded per key on first use, so opening and memory do not grow with the number of
stored sessions. Every mutation is persisted first and only then applied to the cache.
"""

from __future__ import annotations

import copy
import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

from hermes_core.config import GatewayConfig
from hermes_core.errors import (
    CorruptDatabaseError,
    DuplicateSessionIdError,
    InvalidValueError,
    SchemaVersionError,
    StoreError,
    StoreUnavailableError,
    TranscriptReadError,
    TranscriptWriteError,
    TurnInProgressError,
)
from hermes_core.keys import config_profile, resolve_for_config
from hermes_core.models import SessionEntry, SessionSource, session_id_problem
from hermes_core.plugins import HermesPluginManager, create_plugin_manager
from hermes_core.specs import LifecycleEvent, LifecycleKind
from hermes_core.store.backend import (
    CounterDelta,
    Message,
    SearchHit,
    SessionRow,
    SqlMaintenance,
    StoreBackend,
)
from hermes_core.store.files import ensure_private_dir
from hermes_core.store.mirror import MirrorWriter, load_mirror, read_mirror
from hermes_core.store.replay import ReplayReport, replay_backlog
from hermes_core.timeutil import utc_now

logger = logging.getLogger(__name__)

DEGRADED_WARNING = "SQL session store unavailable, falling back to JSONL: "
METADATA_MAX_BYTES = 65_536
MIRROR_IMPORTED = "sessions_json_imported"
_STRIPES = 64
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def new_session_id(now: datetime) -> str:
    """``YYYYMMDD_HHMMSS_<8 hex>`` from the creation time (UTC) and 32 random bits."""
    return f"{now:%Y%m%d_%H%M%S}_{secrets.token_hex(4)}"


class SessionStore:
    """Session keys → sessions, lane flags, turn markers and transcripts (thread-safe)."""

    def __init__(
        self,
        sessions_dir: str | Path,
        config: GatewayConfig,
        has_active_processes_fn: Callable[[str], bool] | None = None,
        *,
        plugins: HermesPluginManager | None = None,
        entry_cache_size: int = 10_000,
    ) -> None:
        self.config = config
        self.sessions_dir = ensure_private_dir(Path(sessions_dir))
        self.plugins = plugins if plugins is not None else create_plugin_manager(config)
        self._has_active_processes = has_active_processes_fn
        self._cache_size = entry_cache_size
        self._map_lock = threading.Lock()
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()
        self._stripes = tuple(threading.RLock() for _ in range(_STRIPES))
        self._inflight: dict[str, Future[SessionEntry]] = {}
        self._mirror = MirrorWriter(self.sessions_dir / "sessions.json")
        self._routing_revision = 0
        self._mirror_revision = 0
        self._mirror_written_at = 0.0
        self._unloadable_warned: set[str] = set()
        self._degraded_reason: str | None = None
        self._closed = False
        self._sql: SqlMaintenance | None = None
        self._backend: StoreBackend = self._open_backend()
        if self._sql is not None:
            self._import_mirror_once(self._sql)

    @classmethod
    def open(
        cls,
        config: GatewayConfig | None = None,
        *,
        has_active_processes_fn: Callable[[str], bool] | None = None,
        plugins: HermesPluginManager | None = None,
    ) -> SessionStore:
        """Open the store of ``config`` (None: ``$HERMES_HOME/config.yaml`` and environment)."""
        config = config if config is not None else GatewayConfig.load()
        return cls(config.sessions_dir, config, has_active_processes_fn, plugins=plugins)

    def __enter__(self) -> SessionStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- backend selection and degraded mode -------------------------------------------------------

    def _open_backend(self) -> StoreBackend:
        """The backend for ``storage.url``; SQLite that cannot be used falls back to JSONL."""
        url = self.config.storage_url
        scheme = url.split("://", 1)[0]
        stores = self.plugins.stores()
        spec = stores.get(scheme)
        if spec is None:
            known = ", ".join(sorted(stores)) or "none"
            raise StoreUnavailableError(
                f"storage.url uses the scheme {scheme!r}, which no loaded plugin provides "
                f"(known: {known}); fix storage.url or install the plugin for it."
            )
        try:
            backend: StoreBackend = spec.open(url, self.config)
        except SchemaVersionError:
            raise
        except StoreError as exc:
            if not scheme.startswith("sqlite"):
                raise  # a PostgreSQL store never falls back to local files
            return self._degrade(str(exc))
        self._sql = backend  # type: ignore[assignment]  # SQL backends provide maintenance too
        return backend

    def _degrade(self, reason: str) -> StoreBackend:
        from hermes_plugins.jsonl_store import JsonlBackend

        logger.warning("%s%s", DEGRADED_WARNING, reason)
        self._degraded_reason = reason
        self._sql = None
        return JsonlBackend(self.sessions_dir, self.plugins)

    def _enter_degraded(self, error: CorruptDatabaseError) -> None:
        """Canonical corruption: keep working on JSONL; the database file is left for doctor."""
        logger.error("%s", error)
        with self._map_lock:
            cached = {key: entry.to_dict() for key, entry in self._entries.items()}
        mirror = load_mirror(self._mirror.path, self.plugins)
        merged: dict[str, Any] = dict(mirror.unregistered)
        merged.update({key: entry.to_dict() for key, entry in mirror.entries.items()})
        merged.update(cached)  # the cache holds the newest state of the lanes it knows
        self._mirror.write(merged, self._routing_revision + 1)
        try:
            self._backend.close()
        except StoreError:
            logger.debug("closing the corrupt store failed", exc_info=True)
        self._backend = self._degrade(str(error))

    @contextmanager
    def _canonical(self) -> Iterator[None]:
        """Switch to degraded mode when the canonical database turns out to be corrupt."""
        try:
            yield
        except CorruptDatabaseError as exc:
            if self._sql is not None:
                self._enter_degraded(exc)
            raise

    def replay_backlog(self) -> ReplayReport | None:
        """Import the JSONL backlog into SQL exactly once (step ``jsonl_backlog_replay``);
        None while degraded (nothing to import into)."""
        if self._sql is None:
            return None
        with self._canonical():
            report = replay_backlog(self.sessions_dir, self._sql, self.plugins)
        if report.routes_inserted or report.routes_updated:
            with self._map_lock:
                self._entries.clear()  # replayed routes replace what the cache knew
            self._routing_changed()
        self.flush_mirror(force=True)
        return report

    def try_leave_degraded(self) -> bool:
        """While degraded, try the SQL store again; on success replay the backlog into it and
        leave degraded mode (housekeeping calls this). True when SQL is in use afterwards."""
        if self._sql is not None:
            return True
        spec = self.plugins.stores().get(self.config.storage_url.split("://", 1)[0])
        if spec is None:
            return False
        try:
            backend: StoreBackend = spec.open(self.config.storage_url, self.config)
        except StoreError as exc:
            logger.debug("the SQL store is still unavailable: %s", exc)
            return False
        for stripe in self._stripes:  # no lane operation runs during the switch
            stripe.acquire()
        try:
            self._backend.close()
            self._backend, self._sql = backend, backend  # type: ignore[assignment]
            self._degraded_reason = None
            with self._map_lock:
                self._entries.clear()
        finally:
            for stripe in self._stripes:
                stripe.release()
        logger.warning("the SQL session store is available again; replaying the JSONL backlog")
        self.replay_backlog()
        return True

    @property
    def degraded(self) -> bool:
        """True while the store runs on the JSONL fallback."""
        return self._sql is None

    # -- entry cache -------------------------------------------------------------------------------

    def _stripe(self, session_key: str) -> threading.RLock:
        return self._stripes[hash(session_key) % _STRIPES]

    def _remember(self, entry: SessionEntry) -> None:
        with self._map_lock:
            self._entries[entry.session_key] = entry
            self._entries.move_to_end(entry.session_key)
            while len(self._entries) > self._cache_size:
                self._entries.popitem(last=False)

    def _forget(self, session_key: str) -> None:
        with self._map_lock:
            self._entries.pop(session_key, None)

    def _parse(self, data: dict[str, Any] | Any) -> SessionEntry | None:
        """A stored entry, or None (warned once per platform) when it cannot be loaded."""
        try:
            return SessionEntry.from_dict(data, plugins=self.plugins)
        except InvalidValueError as exc:
            tag = str(getattr(exc, "field", "entry"))
            origin = data.get("origin") if isinstance(data, dict) else None
            platform = origin.get("platform") if isinstance(origin, dict) else None
            marker = f"{platform}" if platform else tag
            if marker not in self._unloadable_warned:
                self._unloadable_warned.add(marker)
                logger.warning(
                    "skipping stored session entries that cannot be loaded (%s); they stay in "
                    "the store and return once fixed (e.g. the platform plugin loads)",
                    exc,
                )
            return None

    def _load(self, session_key: str) -> SessionEntry | None:
        """The entry of a key from the cache or the backend (a stale route counts as none)."""
        with self._map_lock:
            entry = self._entries.get(session_key)
            if entry is not None:
                self._entries.move_to_end(session_key)
                return entry
        with self._canonical():
            data = self._backend.get_route(session_key)
            if data is None:
                return None
            entry = self._parse(data)
            if entry is None:
                return None
            row = self._backend.get_session(entry.session_id)
        if row is not None and row.end_reason is not None:
            return None  # stale route: its session ended at a boundary elsewhere
        self._remember(entry)
        return entry

    def _persist(self, entry: SessionEntry, *, touch: bool = False) -> None:
        """Write one routing entry, then make it the cached one."""
        with self._canonical():
            self._backend.put_route(entry.to_dict(), touch=touch)
        self._routing_changed()
        self._remember(entry)

    def _routing_changed(self) -> None:
        with self._map_lock:
            self._routing_revision += 1

    def _notify(self, kind: LifecycleKind, entry: SessionEntry, **detail: Any) -> None:
        if self.plugins.observing:
            event = LifecycleEvent(
                kind=kind, session_key=entry.session_key, session_id=entry.session_id, detail=detail
            )
            self.plugins.notify(event)

    @staticmethod
    def _snapshot(entry: SessionEntry) -> SessionEntry:
        """A copy for callers, so the cached entry never changes under them (or by them)."""
        metadata = copy.deepcopy(entry.metadata) if entry.metadata else {}
        return entry.model_copy(update={"metadata": metadata})

    # -- get or create (SPEC §3.3) -----------------------------------------------------------------

    def session_key_for(self, source: SessionSource) -> str:
        """The key the store files ``source`` under (effective flags and profile of the config)."""
        return resolve_for_config(source, self.config, self.plugins).key

    def get_or_create_session(
        self, source: SessionSource, force_new: bool = False, touch_activity: bool = True
    ) -> SessionEntry:
        """The lane's current session, creating one at a boundary; single-flight per key."""
        key = self.session_key_for(source)
        with self._map_lock:
            flight = self._inflight.get(key)
            leader = flight is None
            if flight is None:
                flight = self._inflight[key] = Future()
        if not leader:
            entry = flight.result()  # the leader's entry, or its exception
            if touch_activity:
                with self._stripe(key):
                    current = self._load(key)
                    if current is not None and current.session_id == entry.session_id:
                        entry = self._touch(current)
            return self._snapshot(entry)
        try:
            with self._stripe(key):
                entry = self._get_or_create(key, source, force_new, touch_activity)
        except BaseException as exc:
            flight.set_exception(exc)
            raise
        else:
            flight.set_result(entry)
            return self._snapshot(entry)
        finally:
            with self._map_lock:
                self._inflight.pop(key, None)

    def _touch(self, entry: SessionEntry) -> SessionEntry:
        touched = entry.model_copy(update={"updated_at": utc_now()})
        self._persist(touched, touch=True)
        return touched

    def _get_or_create(
        self, key: str, source: SessionSource, force_new: bool, touch: bool
    ) -> SessionEntry:
        entry = self._load(key)
        if force_new:
            return self._create(key, source, entry, "session_reset", kind="force_new")
        if entry is not None:
            if entry.suspended:
                return self._create(key, source, entry, "suspended", kind="suspended")
            return self._touch(entry) if touch else entry
        with self._canonical():
            row = self._backend.newest_session(key)
        if row is not None and row.reopenable:
            return self._reopen(key, source, row)
        return self._create(key, source, None, None, kind="new")

    def _reopen(self, key: str, source: SessionSource, row: SessionRow) -> SessionEntry:
        """Rebuild the lane's entry from its newest resumable row (SPEC §3.3 step 4)."""
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
        entry = SessionEntry(
            session_key=key, session_id=row.id, created_at=started, updated_at=activity,
            origin=origin, display_name=row.display_name or origin.chat_name,
            platform=origin.platform, chat_type=row.chat_type or origin.chat_type,
            input_tokens=row.input_tokens, output_tokens=row.output_tokens,
            cache_read_tokens=row.cache_read_tokens, cache_write_tokens=row.cache_write_tokens,
            total_tokens=row.total_tokens, estimated_cost_usd=row.estimated_cost_usd,
            cost_status=row.cost_status or "unknown",
        )  # fmt: skip
        with self._canonical():
            self._backend.reopen_session(row.id, entry.to_dict())
        self._routing_changed()
        self._remember(entry)
        self._notify("session_reopened", entry)
        return entry

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
            try:
                with self._canonical():
                    self._backend.create_session(row, entry.to_dict(), end_previous)
            except DuplicateSessionIdError:
                continue
            self._routing_changed()
            self._remember(entry)
            if previous is not None:
                lifecycle: LifecycleKind = (
                    "session_reset" if kind != "suspended" else "session_replaced"
                )
                self._notify(lifecycle, entry, previous_session_id=previous.session_id)
            self._notify("session_created", entry)
            return entry
        raise StoreError(f"could not draw an unused session id for {key} after 3 tries")

    # -- lane state (SPEC §3.2) --------------------------------------------------------------------

    def reset_session(
        self, session_key: str, display_name: str | None = None
    ) -> SessionEntry | None:
        """Start a new session on the lane (``/new``, ``/reset``); None if the key is unknown."""
        with self._stripe(session_key):
            entry = self._load(session_key)
            if entry is None:
                return None
            source = entry.origin or self._bare_source(entry)
            name = display_name if display_name is not None else entry.display_name
            created = self._create(
                session_key, source, entry, "session_reset", kind="reset", display_name=name
            )
            return self._snapshot(created)

    @staticmethod
    def _bare_source(entry: SessionEntry) -> SessionSource:
        """A minimal source for an entry stored without origin (older writers)."""
        platform = entry.platform or entry.session_key.split(":")[2]
        return SessionSource(platform=platform, chat_id="", chat_type=entry.chat_type)

    def _update(
        self, session_key: str, change: Callable[[SessionEntry], dict[str, Any] | None]
    ) -> SessionEntry | None:
        """Apply ``change`` (field updates, or None for no change) to a lane and persist it."""
        with self._stripe(session_key):
            entry = self._load(session_key)
            if entry is None:
                return None
            updates = change(entry)
            if updates is None:
                return None
            updated = entry.model_copy(update=updates)
            self._persist(updated)
            return updated

    def suspend_session(self, session_key: str) -> bool:
        """Hard stop: the next message starts a new session. True iff the entry existed."""
        entry = self._update(session_key, lambda e: {"suspended": True})
        if entry is not None:
            self._notify("session_suspended", entry)
        return entry is not None

    def mark_resume_pending(self, session_key: str, reason: str = "restart_timeout") -> bool:
        """Soft recovery flag; False if the key is unknown or suspended."""
        entry = self._update(
            session_key,
            lambda e: None if e.suspended else {
                "resume_pending": True, "resume_reason": reason, "last_resume_marked_at": utc_now()
            },
        )  # fmt: skip
        if entry is not None:
            self._notify("resume_marked", entry, reason=reason)
        return entry is not None

    def clear_resume_pending(self, session_key: str) -> bool:
        """Clear the recovery flag; False if the key is unknown or not pending."""
        cleared = {"resume_pending": False, "resume_reason": None, "last_resume_marked_at": None}
        entry = self._update(session_key, lambda e: cleared if e.resume_pending else None)
        if entry is not None:
            self._notify("resume_cleared", entry)
        return entry is not None

    def mark_turn_active(
        self,
        session_key: str,
        consumed_event_id: int | None = None,
        user_message: Message | None = None,
    ) -> str | None:
        """Persist a new turn marker (and, atomically, the dequeue and the user message)."""
        with self._stripe(session_key):
            entry = self._load(session_key)
            if entry is None:
                return None
            token = secrets.token_hex(16)
            updated = entry.model_copy(
                update={"active_turn_token": token, "active_turn_started_at": utc_now()}
            )
            message = (entry.session_id, user_message) if user_message is not None else None
            with self._canonical():
                self._backend.begin_turn(updated.to_dict(), consumed_event_id, message)
            self._routing_changed()
            self._remember(updated)
        self._notify("turn_started", updated, token=token)
        return token

    def clear_turn_active(self, session_key: str, token: str) -> bool:
        """Compare-and-swap: clear the marker iff ``token`` still owns it."""
        with self._stripe(session_key):
            entry = self._load(session_key)
            if entry is None or entry.active_turn_token != token:
                return False
            updated = entry.model_copy(
                update={"active_turn_token": None, "active_turn_started_at": None}
            )
            with self._canonical():
                cleared = self._backend.clear_turn_marker(updated.to_dict(), token)
            if not cleared:
                self._forget(session_key)  # someone else owns the row now: reload next time
                return False
            self._routing_changed()
            self._remember(updated)
        self._notify("turn_ended", updated, token=token)
        return True

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
        """Add token and cost deltas; mirror them to the session row (unknown key: no-op)."""
        total = total_tokens if total_tokens is not None else input_tokens + output_tokens
        with self._stripe(session_key):
            entry = self._load(session_key)
            if entry is None:
                return
            updates: dict[str, Any] = {
                "input_tokens": entry.input_tokens + input_tokens,
                "output_tokens": entry.output_tokens + output_tokens,
                "cache_read_tokens": entry.cache_read_tokens + cache_read_tokens,
                "cache_write_tokens": entry.cache_write_tokens + cache_write_tokens,
                "total_tokens": entry.total_tokens + total,
                "estimated_cost_usd": entry.estimated_cost_usd + estimated_cost_usd,
            }
            if cost_status is not None:
                updates["cost_status"] = cost_status
            if last_prompt_tokens is not None:
                updates["last_prompt_tokens"] = last_prompt_tokens
            if touch_activity:
                updates["updated_at"] = utc_now()
            updated = entry.model_copy(update=updates)
            delta = CounterDelta(
                input_tokens=input_tokens, output_tokens=output_tokens,
                cache_read_tokens=cache_read_tokens, cache_write_tokens=cache_write_tokens,
                total_tokens=total, estimated_cost_usd=estimated_cost_usd, cost_status=cost_status,
                last_activity_at=updated.updated_at.timestamp() if touch_activity else None,
            )  # fmt: skip
            with self._canonical():
                self._backend.update_counters(updated.to_dict(), entry.session_id, delta)
            self._routing_changed()
            self._remember(updated)

    def get_session_metadata(self, session_key: str, name: str, default: Any = None) -> Any:
        """A deep copy of one per-lane metadata value, or ``default``."""
        entry = self._load(session_key) if session_key else None
        if entry is None or name not in entry.metadata:
            return default
        return copy.deepcopy(entry.metadata[name])

    def set_session_metadata(self, session_key: str, name: str, value: Any) -> bool:
        """Store one JSON value in the lane's metadata (≤ 64 KiB in all); False if unknown."""

        def change(entry: SessionEntry) -> dict[str, Any]:
            metadata = {**copy.deepcopy(entry.metadata), name: copy.deepcopy(value)}
            try:
                size = len(json.dumps(metadata, ensure_ascii=False).encode("utf-8"))
            except (TypeError, ValueError) as exc:
                raise InvalidValueError(
                    "metadata", f"metadata value {name!r} is not JSON-serialisable: {exc}."
                ) from None
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
        if not session_id:
            return None
        with self._canonical():
            data = self._backend.get_route_by_session_id(session_id)
        entry = self._parse(data) if data is not None else None
        if entry is None:
            return None
        cached = self._load(entry.session_key)  # the cache holds the newest state
        return self._snapshot(cached if cached is not None else entry)

    def list_sessions(self, active_minutes: float | None = None) -> list[SessionEntry]:
        """All loadable entries (or those updated within ``active_minutes``), newest first."""
        with self._canonical():
            stored = list(self._backend.iter_routes())
        entries = [entry for entry in map(self._parse, stored) if entry is not None]
        if active_minutes is not None:
            cutoff = utc_now() - timedelta(minutes=active_minutes)
            entries = [entry for entry in entries if entry.updated_at >= cutoff]
        return sorted(entries, key=lambda entry: entry.updated_at, reverse=True)

    def has_any_sessions(self) -> bool:
        """True iff at least two session rows exist (the caller's own counts as one)."""
        with self._canonical():
            return self._backend.count_sessions() >= 2

    # -- pruning (SPEC §3.4) -----------------------------------------------------------------------

    def _has_active_process(self, session_key: str) -> bool:
        if self._has_active_processes is None:
            return False
        try:
            return bool(self._has_active_processes(session_key))
        except Exception:
            logger.warning("has_active_processes_fn failed; keeping the lane", exc_info=True)
            return True

    def prune_old_entries(self, max_age_days: float | None) -> int:
        """Remove routing entries idle for ``max_age_days`` (sessions and messages stay)."""
        if max_age_days is None or max_age_days <= 0 or self._sql is None:
            return 0
        cutoff = time.time() - max_age_days * 86_400
        with self._canonical():
            candidates = self._sql.prune_candidates(cutoff)
        keys = [key for key in candidates if not self._has_active_process(key)]
        with self._canonical():
            removed = self._backend.delete_routes(keys)
        for key in keys:
            self._forget(key)
        if removed:
            self._routing_changed()
            self.flush_mirror(force=True)
        return removed

    # -- transcripts (SPEC §3.4) -------------------------------------------------------------------

    @staticmethod
    def _check_session_id(session_id: str) -> None:
        problem = session_id_problem(session_id) if isinstance(session_id, str) else "not a string"
        if problem is not None:
            raise InvalidValueError(
                "session_id", f"session_id {session_id!r} is invalid: {problem}."
            )

    def append_to_transcript(
        self, session_id: str, message: Message, skip_db: bool = False
    ) -> None:
        """Store one message durably before returning (``skip_db``: already stored by the agent)."""
        if skip_db:
            return
        self._check_session_id(session_id)
        try:
            with self._canonical():
                self._backend.append_message(session_id, message)
        except TranscriptWriteError:
            raise
        except StoreError as exc:
            raise TranscriptWriteError(f"the message was not stored: {exc}") from exc

    def load_transcript(self, session_id: str) -> list[dict[str, Any]]:
        """Active messages in insertion order; ``[]`` for an unknown session."""
        self._check_session_id(session_id)
        try:
            with self._canonical():
                return self._backend.load_messages(session_id)
        except TranscriptReadError:
            raise
        except StoreError as exc:
            raise TranscriptReadError(f"the transcript could not be read: {exc}") from exc

    def rewrite_transcript(
        self, session_id: str, messages: list[Message], *, force: bool = False
    ) -> int:
        """Replace the active messages (old ones are deactivated, never deleted)."""
        self._check_session_id(session_id)
        with self._canonical():
            if self._backend.get_session(session_id) is None:
                raise InvalidValueError("session_id", f"session {session_id} does not exist.")
        owner = self.lookup_by_session_id(session_id)
        if owner is not None and owner.active_turn_token and not force:
            raise TurnInProgressError(
                f"a turn is running on {owner.session_key}; rewrite the transcript after it "
                "ends, or pass force=True"
            )
        try:
            with self._canonical():
                return self._backend.rewrite_messages(session_id, messages)
        except TranscriptWriteError:
            raise
        except StoreError as exc:
            raise TranscriptWriteError(f"the transcript was not rewritten: {exc}") from exc

    def soft_delete_messages(self, session_id: str, message_ids: list[int]) -> int:
        """Deactivate messages (``active=0``); never deletes rows."""
        self._check_session_id(session_id)
        with self._canonical():
            return self._backend.soft_delete_messages(session_id, message_ids)

    def search(
        self,
        query: str,
        *,
        session_id: str | None = None,
        session_key: str | None = None,
        limit: int = 20,
    ) -> list[SearchHit]:
        """Full-text search over active messages, best rank first (``[]`` while degraded)."""
        limit = max(1, min(int(limit), 100))
        with self._canonical():
            return self._backend.search(
                query, session_id=session_id, session_key=session_key, limit=limit
            )

    def rebuild_search_index(self) -> bool:
        """Rebuild the derived full-text index (step ``fts_rebuild_if_stale``)."""
        if self._sql is None:
            return False
        with self._canonical():
            return self._sql.rebuild_fts()

    # -- sessions.json mirror (SPEC §3.5.3) --------------------------------------------------------

    def _import_mirror_once(self, sql: SqlMaintenance) -> None:
        """Import an existing gateway's sessions.json into an empty routing table, once."""
        with self._canonical():
            if sql.get_meta(MIRROR_IMPORTED) is not None or sql.has_routes():
                return
        if self.import_sessions_json(self._mirror.path):
            logger.warning("imported the routing index from %s", self._mirror.path)

    def import_sessions_json(self, path: str | Path) -> int:
        """Import the entries of a sessions.json whose keys the routing table lacks."""
        if self._sql is None:
            raise StoreUnavailableError(
                "sessions.json can only be imported into the SQL store; it is unavailable now."
            )
        entries = [entry.to_dict() for entry in read_mirror(Path(path), self.plugins).values()]
        with self._canonical():
            imported = self._sql.import_routes(entries, (MIRROR_IMPORTED, str(time.time())))
        if imported:
            self._routing_changed()
            self.flush_mirror(force=True)
        return imported

    def flush_mirror(self, *, force: bool = False) -> bool:
        """Rewrite sessions.json if routing changed (at most once per interval unless ``force``).

        Never on the per-message path: housekeeping, ``close`` and bulk changes call it.
        """
        if self._sql is None or not self.config.write_sessions_json:
            return False
        with self._map_lock:
            revision = self._routing_revision
        interval = self.config.gateway.sessions_json_interval_secs
        if revision == self._mirror_revision and self._mirror.path.exists():
            return False
        if not force and time.monotonic() - self._mirror_written_at < interval:
            return False
        with self._canonical():
            snapshot = {entry["session_key"]: entry for entry in self._backend.iter_routes()}
        try:
            written = self._mirror.write(snapshot, revision)
        except StoreError as exc:
            logger.warning("sessions.json mirror not written (the SQL store is intact): %s", exc)
            return False
        self._mirror_revision = revision
        self._mirror_written_at = time.monotonic()
        return written

    # -- health, close -----------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """Backend, degraded state, search index, ledger and queue persistence."""
        backend = self._backend.health()
        ledger_on = self.config.gateway.delivery_ledger.enabled
        return {
            "backend": backend["backend"],
            "degraded": self.degraded,
            "degraded_reason": self._degraded_reason,
            "fts": backend["fts"],
            "ledger": "unavailable" if self.degraded else ("enabled" if ledger_on else "disabled"),
            "queue_persistent": self._backend.durable_queue,
        }

    def close(self) -> None:
        """Write the mirror if routing changed, then release the backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._sql is not None:
                self.flush_mirror(force=True)
        finally:
            self._backend.close()
