"""SessionStore: the public facade over the store's services.

A store is a handful of services composed at open, each owning its own state and receiving
what it needs in its constructor: the backend in use and degraded mode (``backing``), the entry
cache (``entries``), the writer (``writer``), the routing index (``routing``), the lane state
machine (``sessions``), a turn's writes and marker recovery (``turns``), transcripts and search
(``transcripts``), the durable queue's rows (``queue_rows``), the delivery ledger
(``obligations``), lane leases of a shared store (``leases``), stuck-loop counts (``counts``),
the sessions.json mirror and the way out of degraded mode (``fallback``), pruning (``pruning``)
and re-keying (``rekey``).

The facade's public methods are what a host embedding the library calls, each delegating to a
service. What only the gateway, start-up recovery and the command line use is not on it: they
reach the services through the facade's private attributes (``store._leases``,
``store._queue``, ...), which are internal to this package. The facade stays in one class on
purpose: it is the whole API a host reads, in one place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import StoreError
from hermes_core.domain.keys import KeySchema
from hermes_core.domain.models import SessionEntry, SessionSource
from hermes_core.plugins.manager import HermesPluginManager, default_plugin_manager
from hermes_core.state.files import ensure_private_dir
from hermes_core.store.backend import DeadLetter, Message, SearchHit, SessionRow
from hermes_core.store.backing import Backing
from hermes_core.store.base import PhaseProgress
from hermes_core.store.counts import RestartCountStore
from hermes_core.store.entries import EntryCache
from hermes_core.store.fallback import Fallback
from hermes_core.store.leases import Leases
from hermes_core.store.mirror import MIRROR_FILENAME, MirrorWriter
from hermes_core.store.obligations import Obligations
from hermes_core.store.pruning import Pruner
from hermes_core.store.queue_rows import QueueRows
from hermes_core.store.rekey import Rekeying
from hermes_core.store.rekey_report import Forum, RekeyReport
from hermes_core.store.routing import RoutingTable
from hermes_core.store.sessions import Sessions
from hermes_core.store.transcripts import Transcripts
from hermes_core.store.turns import Turns

_T = TypeVar("_T")


class SessionStore:
    """Session keys → sessions, lane flags, turn markers and transcripts (thread-safe: every
    change runs on the store's writer and returns once committed)."""

    def __init__(
        self,
        sessions_dir: str | Path,
        config: GatewayConfig,
        has_active_processes_fn: Callable[[str], bool] | None = None,
        *,
        plugins: HermesPluginManager | None = None,
        read_only: bool = False,
        rekeying: bool = False,
    ) -> None:
        """``rekeying``: open a store whose recorded key schema differs from ``keys.schema``
        (or whose re-key was interrupted), for :meth:`rekey`."""
        self.config = config
        self.read_only = read_only
        """Opened to read only: no writer lock is taken and every change is refused
        (``ReadOnlyStoreError``), so it may be opened beside a running gateway."""
        # Read-only creates nothing: an operator's `ls` must not leave directories behind.
        directory = Path(sessions_dir)
        if directory.is_symlink():  # refused like a symlinked database file
            raise StoreError(
                f"{directory}: the sessions directory is a symlink, which the store never "
                "follows (nor a symlinked state.db); set gateway.sessions_dir to the directory "
                "it points at, or put that directory in its place."
            )
        self.sessions_dir = directory if read_only else ensure_private_dir(directory)
        self.plugins = plugins = plugins if plugins is not None else default_plugin_manager(config)
        self._closed = False
        cache = EntryCache(config.storage.entry_cache_size)
        mirror = MirrorWriter(self.sessions_dir / MIRROR_FILENAME)
        backing = Backing(
            config, plugins, self.sessions_dir, cache, mirror, read_only=read_only,
            rekeying=rekeying,
        )  # fmt: skip
        # Each batch of the writer first reads its uncached lanes' routes through the routing
        # table, which needs the writer and so comes next (the lambda binds it late).
        writer = backing.open_writer(cache.clear, lambda lanes: routes.prefetched(lanes))  # noqa: PLW0108
        routes = RoutingTable(backing, cache, writer, plugins)
        self._backing, self._writer, self._routes = backing, writer, routes
        self._leases = Leases(backing, routes, writer, config, plugins)
        self._queue = QueueRows(
            backing, writer, config, plugins, self._leases.holds, read_only=read_only
        )
        self._counts = RestartCountStore(backing, config)
        self._obligations = Obligations(backing, writer, config, plugins)
        self._fallback = Fallback(
            backing, cache, writer, mirror, self.sessions_dir, config, plugins,
            read_only=read_only,
        )  # fmt: skip
        self._sessions = Sessions(backing, routes, writer, config, plugins)
        self._turns = Turns(
            backing, routes, writer, self._sessions, self._leases, self._obligations, self._counts
        )
        self._transcripts = Transcripts(backing, routes, writer)
        self._pruner = Pruner(backing, routes, writer, self._fallback, has_active_processes_fn)
        self._rekeying = Rekeying(
            backing, cache, writer, self._fallback, self._counts, config, plugins
        )
        meta = backing.bound.maintenance
        if meta is not None and not read_only:
            self._fallback.import_once(meta)

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

    @property
    def key_schema(self) -> KeySchema:
        """The schema of this store's session keys (``keys.schema``, checked against the
        store's record where the backend keeps one: the ``maintenance`` capability)."""
        return self._backing.key_schema

    @property
    def degraded(self) -> bool:
        """True while the store runs on the JSONL fallback."""
        return self._backing.degraded

    @property
    def shared(self) -> bool:
        """Whether other gateway processes may use this store at the same time (leases)."""
        return self._leases.shared

    # -- sessions and lanes ------------------------------------------------------------------------

    def session_key_for(self, source: SessionSource) -> str:
        """The key the store files ``source`` under (effective flags and profile of the config)."""
        return self._sessions.session_key_for(source)

    def get_or_create_session(
        self, source: SessionSource, force_new: bool = False, touch_activity: bool = True
    ) -> SessionEntry:
        """The lane's current session, creating one at a boundary."""
        return self._sessions.get_or_create_session(source, force_new, touch_activity)

    def reset_session(
        self, session_key: str, display_name: str | None = None
    ) -> SessionEntry | None:
        """Start a new session on the lane (``/new``, ``/reset``); None if the key is unknown."""
        return self._sessions.reset_session(session_key, display_name)

    def suspend_session(self, session_key: str) -> bool:
        """Hard stop: the next message starts a new session. True iff the entry existed."""
        return self._sessions.suspend_session(session_key)

    def unsuspend_session(self, session_key: str) -> bool:
        """Clear a suspension (an operator's decision): the next message continues the lane's
        session. True iff the lane was suspended."""
        return self._sessions.unsuspend_session(session_key)

    def mark_resume_pending(
        self, session_key: str, reason: str = "restart_timeout", *, only_if_running: bool = False
    ) -> bool:
        """Flag the lane for resume (its interrupted turn is resumed at the next start, with
        ``reason``); False if the key is unknown or suspended or, with ``only_if_running``, no
        turn runs on it any more."""
        return self._sessions.mark_resume_pending(
            session_key, reason, only_if_running=only_if_running
        )

    def clear_resume_pending(self, session_key: str) -> bool:
        """Clear the lane's resume flag; False if the key is unknown or not pending."""
        return self._sessions.clear_resume_pending(session_key)

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
        """Add token and cost deltas to the lane's session and its row (unknown key: no-op).
        Counters stay 64-bit integers and the cost a finite number, else
        :class:`~hermes_core.domain.errors.InvalidValueError` and nothing is written."""
        self._sessions.update_session(
            session_key, input_tokens=input_tokens, output_tokens=output_tokens,
            cache_read_tokens=cache_read_tokens, cache_write_tokens=cache_write_tokens,
            total_tokens=total_tokens, estimated_cost_usd=estimated_cost_usd,
            cost_status=cost_status, last_prompt_tokens=last_prompt_tokens,
            touch_activity=touch_activity,
        )  # fmt: skip

    def get_session_metadata(self, session_key: str, name: str, default: Any = None) -> Any:
        """A deep copy of one per-lane metadata value, or ``default``."""
        return self._routes.get_session_metadata(session_key, name, default)

    def set_session_metadata(self, session_key: str, name: str, value: Any) -> bool:
        """Store one JSON value in the lane's metadata (≤ 64 KiB in all); False if unknown."""
        return self._sessions.set_session_metadata(session_key, name, value)

    def lookup_by_session_key(self, session_key: str) -> SessionEntry | None:
        """The lane's entry (read-only: never creates or touches); falsy key → None."""
        return self._routes.lookup_by_session_key(session_key)

    def peek_session_id(self, session_key: str) -> str | None:
        """The lane's current session id, or None."""
        return self._routes.peek_session_id(session_key)

    def lookup_by_session_id(self, session_id: str) -> SessionEntry | None:
        """The entry whose *current* session id is ``session_id``, or None."""
        return self._routes.lookup_by_session_id(session_id)

    def list_sessions(
        self, active_minutes: float | None = None, *, resume_pending: bool = False
    ) -> list[SessionEntry]:
        """All loadable entries (or those updated within ``active_minutes``; only those marked
        ``resume_pending``, read without the other lanes, if so asked), newest first."""
        return self._routes.list_sessions(active_minutes, resume_pending=resume_pending)

    def session_row(self, session_id: str) -> SessionRow | None:
        """The stored row of a session (start, end, counters, last activity), or None."""
        return self._routes.session_row(session_id)

    def has_any_sessions(self) -> bool:
        """True iff at least two session rows exist (the caller's own counts as one)."""
        return self._routes.has_any_sessions()

    def prune_old_entries(self, max_age_days: float | None) -> int:
        """Remove routing entries idle for ``max_age_days`` (sessions and messages stay); the
        number removed."""
        return self._pruner.prune_old_entries(max_age_days)

    def prune_idle_lanes(
        self, max_age_days: float | None, *, batch_size: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[str]:  # fmt: skip
        """:meth:`prune_old_entries`, returning the session keys of the entries removed; a walk
        in pages of ``batch_size`` lanes, each told to ``progress``, safe to run again."""
        return self._pruner.prune_idle_lanes(max_age_days, batch_size=batch_size, progress=progress)

    # -- turns -------------------------------------------------------------------------------------

    def mark_turn_active(
        self,
        session_key: str,
        consumed_event_id: int | None = None,
        user_message: Message | None = None,
        *,
        seen: str | None = None,
        touch: bool = False,
    ) -> str | None:
        """Start a turn on the lane: a new turn marker (what a restart finds of a turn it
        interrupted) and, in the same commit, ``user_message`` in the transcript, the dequeue
        of the durably queued ``consumed_event_id``, ``seen`` (the message's platform id) as
        seen on the lane and, with ``touch``, the lane's activity. The marker's token, or None
        for an unknown key; :class:`~hermes_core.domain.errors.MessageRedeliveredError` when
        ``seen`` was seen on the lane before (nothing written)."""
        return self._turns.mark_turn_active(
            session_key, consumed_event_id, user_message, seen=seen, touch=touch
        )

    def clear_turn_active(self, session_key: str, token: str) -> bool:
        """End a turn: clear the lane's marker iff ``token`` (from :meth:`mark_turn_active`)
        still owns it; True when it did."""
        return self._turns.clear_turn_active(session_key, token)

    def dead_letters(self) -> list[DeadLetter]:
        """Queued messages set aside after failing to start ``gateway.max_dispatch_attempts``
        times, oldest first (``[]`` without the backend's ``queue`` capability)."""
        return self._queue.dead_letters()

    # -- transcripts -------------------------------------------------------------------------------

    def append_to_transcript(
        self, session_id: str, message: Message, skip_db: bool = False
    ) -> None:
        """Store one message durably before returning (``skip_db``: already stored by the agent)."""
        self._transcripts.append_to_transcript(session_id, message, skip_db)

    def load_transcript(self, session_id: str) -> list[dict[str, Any]]:
        """Active messages in insertion order; ``[]`` for an unknown session."""
        return self._transcripts.load_transcript(session_id)

    def rewrite_transcript(
        self, session_id: str, messages: list[Message], *, force: bool = False
    ) -> int:
        """Replace the active messages (old ones are deactivated, never deleted)."""
        return self._transcripts.rewrite_transcript(session_id, messages, force=force)

    def soft_delete_messages(self, session_id: str, message_ids: list[int]) -> int:
        """Deactivate messages (``active=0``); never deletes rows."""
        return self._transcripts.soft_delete_messages(session_id, message_ids)

    def search(
        self,
        query: str,
        *,
        session_id: str | None = None,
        session_key: str | None = None,
        limit: int = 20,
    ) -> list[SearchHit]:
        """Full-text search over active messages, best rank first (``[]`` while degraded),
        ranked among the newest 1,000 matches in scope (a bound on its cost; see
        docs/storage.md). ``query`` is data, never query syntax: every whitespace-separated
        word must occur."""
        return self._transcripts.search(
            query, session_id=session_id, session_key=session_key, limit=limit
        )

    def rebuild_search_index(self) -> bool:
        """Rebuild the derived full-text index in bounded steps (search stays exact
        meanwhile); False when the backend has no index to rebuild."""
        return self._transcripts.rebuild_search_index()

    # -- maintenance -------------------------------------------------------------------------------

    def rekey(
        self, *, dry_run: bool = False, batch_size: int = 500, forums: Sequence[Forum] = (),
        progress: PhaseProgress | None = None,
    ) -> RekeyReport:  # fmt: skip
        """Move every lane of a v1 store to its v2 key, or the thread-less lanes of the forum
        chats ``forums`` to their general topic (``hermes-sessions rekey``), ``batch_size`` keys
        per transaction, telling ``progress``; an interrupted run is finished by running again."""
        return self._rekeying.rekey(
            dry_run=dry_run, batch_size=batch_size, forums=forums, progress=progress
        )

    def import_sessions_json(
        self, path: str | Path, *, strict: bool = False, progress: PhaseProgress | None = None
    ) -> int:
        """Import the entries of a sessions.json whose keys the routing table lacks; the
        number imported. ``strict``: a file that is missing or not a JSON object raises
        :class:`~hermes_core.domain.errors.InvalidValueError` instead of importing nothing.
        ``progress`` is told of each entry read and of the entries written."""
        return self._fallback.import_sessions_json(path, strict=strict, progress=progress)

    # -- the writer, health, close -----------------------------------------------------------------

    def run(self, function: Callable[..., _T], *args: Any, lane: str | None = None) -> _T:
        """Run ``function(*args)`` as one step of the store's writer (its writes commit
        together, possibly with other callers' steps) and return once committed. ``lane``:
        the session key whose state it changes, so other lanes' steps may commit beside it on
        another writer connection; None: it runs alone, ordered against every step."""
        return self._writer.run(function, *args, lane=lane)

    async def arun(self, function: Callable[..., _T], *args: Any, lane: str | None = None) -> _T:
        """:meth:`run` for asyncio: the event loop stays free until the commit is done."""
        return await self._writer.arun(function, *args, lane=lane)

    def submit(
        self, function: Callable[..., _T], *args: Any, lane: str | None = None
    ) -> asyncio.Future[_T]:
        """Hand ``function(*args)`` to the writer now, in order with the lane's other steps
        (and every step without a lane), without waiting (asyncio): the returned future
        settles after its commit."""
        return self._writer.submit(function, *args, lane=lane)

    def health(self) -> dict[str, Any]:
        """Backend, whether writes can be stored now (``available``, false while the database
        connection is lost, with ``unavailable_reason``), read-only mode, degraded state, search
        index, ledger and queue persistence, and which capabilities the backend offers."""
        return self._backing.health()

    def stats(self) -> dict[str, int]:
        """What the store has done so far, for benchmarks: the backend's counters (commits,
        round trips) and the writer's (``batches`` committed, ``steps`` run)."""
        return {**self._backing.backend.stats(), **self._writer.stats()}

    def close(self) -> None:
        """Finish the writes handed over, write the mirror if routing changed, then release the
        backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.close()
            self._fallback.flush_mirror(force=True)
        finally:
            self._backing.backend.close()
