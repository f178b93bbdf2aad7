"""The persistence contract a storage backend implements.

:class:`~hermes_core.store.SessionStore` owns the lifecycle rules (keys, flags, the writer, the
entry cache); a backend only persists. Every write method is one transaction committed before
it returns (tier D), unless it runs inside ``transaction()``, which commits them together.
Routing entries travel as ``SessionEntry.to_dict()`` mappings; the backend stores them verbatim
(``entry_json``) beside the column copies it needs for queries.

One module on purpose: the whole contract, the required protocol, each capability's protocol
and the values they exchange, in the one place a backend author reads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from hermes_core.domain.errors import InvalidValueError, shown
from hermes_core.domain.text import clean_value

if TYPE_CHECKING:
    from hermes_core.domain.models import SessionEntry

EntryDict = Mapping[str, Any]
"""A ``SessionEntry.to_dict()`` mapping."""

SESSION_ENDED = "session_ended"
"""The key a backend may add to an entry it reads (:meth:`StoreBackend.get_route`), with
whether the entry's session has ended, found in the same read: the store then does not read
the session row to tell whether the route is stale."""

Message = Mapping[str, Any]
"""A transcript message: ``role`` plus optional fields; other keys go to extra_json."""

MESSAGE_COLUMNS = (
    "role", "content", "tool_calls", "tool_call_id", "tool_name", "timestamp", "token_count",
    "finish_reason", "platform_message_id", "display_kind",
)  # fmt: skip
"""Message fields with a column of their own; ``tool_calls`` is stored as JSON text."""

MESSAGE_ROLES = frozenset({"user", "assistant", "tool", "system", "session_meta"})
INT64_MAX = 2**63 - 1
"""The largest integer every backend stores (SQLite and PostgreSQL ``BIGINT``)."""


def clean_message(message: Message) -> dict[str, Any]:
    """``message`` as every backend stores it: a known ``role``, ``timestamp`` as finite epoch
    seconds (now when missing), ``token_count`` a 64-bit integer, every string normalised
    (:func:`~hermes_core.domain.text.clean_text`) and nothing but JSON values inside. Raises
    :class:`InvalidValueError` saying what to change."""
    if not isinstance(message, Mapping):
        raise InvalidValueError("message", "a transcript message must be a mapping with a role.")
    role = message.get("role")
    if not isinstance(role, str) or role not in MESSAGE_ROLES:
        allowed = ", ".join(sorted(MESSAGE_ROLES))
        raise InvalidValueError("role", f"message role {shown(role)} is not one of: {allowed}.")
    stamp = message.get("timestamp")
    if stamp is None:
        stamp = time.time()
    elif isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not math.isfinite(stamp):
        raise InvalidValueError(
            "timestamp",
            f"message timestamp {shown(stamp)} must be finite epoch seconds (a number).",
        )
    count = message.get("token_count")
    if count is not None and (
        isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= INT64_MAX
    ):
        raise InvalidValueError(
            "token_count", f"token_count {shown(count)} must be an integer from 0 to 2**63-1."
        )
    cleaned: dict[str, Any] = clean_value(message, field="message", plain=True)
    cleaned["timestamp"] = float(stamp)
    return cleaned


RECOVERABLE_END_REASONS = frozenset({
    "agent_close", "ws_orphan_reap", "startup_orphan_reap", "superseded_by_resume", "lru_evict",
    "idle_timeout", "ws_disconnect", "tui_shutdown",
})  # fmt: skip
"""Resource-only end reasons: such rows are reopened with their id."""


@dataclass(frozen=True, slots=True)
class SessionRow:
    """One row of ``sessions``: a conversation and its routing identity. Times are epoch seconds."""

    id: str
    session_key: str
    source: str
    started_at: float
    chat_id: str | None = None
    chat_type: str | None = None
    thread_id: str | None = None
    user_id: str | None = None
    display_name: str | None = None
    origin_json: str | None = None
    profile_name: str | None = None
    parent_session_id: str | None = None
    ended_at: float | None = None
    end_reason: str | None = None
    last_activity_at: float | None = None
    message_count: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    total_tokens: int = 0
    estimated_cost_usd: float = 0.0
    cost_status: str | None = None
    expiry_finalized: bool = False

    @property
    def reopenable(self) -> bool:
        """Open, or ended for a resource-only reason, and not fenced."""
        if self.expiry_finalized:
            return False
        return self.end_reason is None or self.end_reason in RECOVERABLE_END_REASONS


@dataclass(frozen=True, slots=True)
class CounterDelta:
    """What ``update_session`` adds to (or sets on) the counters of a session row."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    total_tokens: int = 0
    estimated_cost_usd: float = 0.0
    cost_status: str | None = None
    last_activity_at: float | None = None


@dataclass(frozen=True, slots=True)
class Obligation:
    """One row of the delivery ledger: a reply owed to a chat. Epoch-second times."""

    obligation_id: str
    session_key: str
    session_id: str | None
    platform: str
    chat_id: str | None
    thread_id: str | None
    reply_to_message_id: str | None
    content: str
    origin_kind: str
    state: str
    attempts: int
    failure_kind: str | None
    last_error: str | None
    created_at: float
    updated_at: float
    owner_instance: str | None = None
    owner_boot: str | None = None
    lease_expires_at: float | None = None
    marked_sends: int = 0
    """Sends attempted with a "may be a duplicate" prefix (at most one may ever arrive)."""
    stream_messages: str | None = None
    """A streamed reply's platform messages, as the JSON of its :data:`STREAM_METADATA`
    record: delivering the row edits them rather than posting anew."""


STREAM_METADATA = "streamed_reply"
"""The lane metadata that names the platform messages of a streamed reply while its turn runs
(``{"messages": [[message id, offset], ...]}``, empty until the first is posted). Every end of
the turn that clears its marker drops it: a finished reply's messages move to its ledger row
(:attr:`Obligation.stream_messages`); after a crash the recovery keeps it, so the lane's next
turn finds the stream its predecessor left cut."""


def new_obligation(
    session_key: str,
    session_id: str | None,
    platform: str,
    chat_id: str | None,
    thread_id: str | None,
    reply_to_message_id: str | None,
    content: str,
    *,
    obligation_id: str = "",
    origin_kind: str = "turn",
    stream_messages: str | None = None,
    **claim: Any,
) -> Obligation:
    """A new ledger row (``obligation_id`` empty for a reply sent without the ledger): unsent,
    or recorded already claimed with the fields of ``claim`` (``DeliveryLedger.claim_state``;
    the row is built once, and a frozen row costs a few microseconds to build)."""
    now = time.time()
    state: dict[str, Any] = {"state": "pending", "attempts": 0, "updated_at": now} | claim
    return Obligation(
        obligation_id=obligation_id, session_key=session_key, session_id=session_id,
        platform=platform, chat_id=chat_id, thread_id=thread_id,
        reply_to_message_id=reply_to_message_id, content=content, origin_kind=origin_kind,
        failure_kind=None, last_error=None, created_at=now, stream_messages=stream_messages,
        **state,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A queued event set aside after failing to start ``gateway.max_dispatch_attempts`` times."""

    event_id: int
    session_key: str
    event_json: str
    attempts: int
    last_error: str | None
    dead_at: float


@dataclass(frozen=True, slots=True)
class StoredKeys:
    """Where session keys are stored, as re-keying reads them: each kind of row streamed (read
    in that order, once, each from a read of its own; the real run holds the writer lock, so
    nothing changes in between), and lookups of keys among the ones a plan needs."""

    routes: Iterable[EntryDict]
    """Every routing entry (its ``session_key`` and ``origin``)."""
    sessions: Iterable[tuple[str, str, str | None, float]]
    """Session rows: (id, session key, origin JSON, started at)."""
    queued: Iterable[tuple[int, str, str]]
    """Queued events, dead letters included: (id, session key, event JSON)."""
    routed: Callable[[Collection[str]], set[str]]
    """Those of the keys given that have a routing row."""
    others: Callable[[Collection[str]], set[str]]
    """Those of the keys given that redelivery records, ledger rows, restart counts or turn
    leases name."""


@dataclass(frozen=True, slots=True)
class KeyMoves:
    """One batch of a re-key, written in one transaction."""

    lanes: Mapping[str, str]
    """Old key → new key: the routing row (``entry_json`` follows), redelivery records, ledger
    rows, restart counts and turn leases. A record already present under the new key wins."""
    sessions: Sequence[tuple[str, str]]
    """(session id, new key) of session rows."""
    queued: Sequence[tuple[int, str]]
    """(event id, new key) of queued events."""
    key_schema: str
    """The ``state_meta`` key schema once the batch is committed."""


@dataclass(frozen=True, slots=True)
class SearchHit:
    """One full-text search result."""

    session_id: str
    message_id: int
    role: str
    timestamp: float
    snippet: str


class StoreBackend(Protocol):
    """The required part of the storage contract: every backend implements all of it. Errors are
    ``StoreError`` subclasses. What a backend offers beyond it is declared on its
    ``StoreSpec.capabilities`` and implemented by the capability protocols below."""

    def close(self) -> None:
        """Flush and release connections and files."""

    def stats(self) -> dict[str, int]:
        """Counters for benchmarks (for SQL: ``commits``, ``statements``, ``reads``,
        ``round_trips``); empty where there is nothing to count."""

    def transaction(self) -> AbstractContextManager[object]:
        """One transaction around several write methods (the store's group commit): their
        writes join it and commit together when it exits, or none of them if it raises (with
        the capability ``atomic_batches``; otherwise a null context)."""

    def health(self) -> dict[str, Any]:
        """Backend-specific details for ``SessionStore.health()``: ``fts`` (``ok``/``stale``/
        ``unavailable``) with the search capability; ``available`` and ``unavailable_reason``
        when the backend can lose its connection."""

    # -- routing index ------------------------------------------------------------------------

    def get_route(self, session_key: str) -> EntryDict | None:
        """The stored entry of a key, or None; it may carry :data:`SESSION_ENDED`."""

    def get_route_by_session_id(self, session_id: str) -> EntryDict | None:
        """The entry whose *current* session id is ``session_id``, or None."""

    def iter_routes(self) -> Iterator[EntryDict]:
        """Every stored entry, read in one transaction (a consistent snapshot)."""

    def put_route(self, entry: EntryDict, *, touch: bool = False) -> None:
        """Insert or replace one routing row (a single-row write). ``touch`` marks a write that
        only moves ``updated_at``; the degraded JSONL backend may coalesce those."""

    def clear_turn_marker(self, entry: SessionEntry, token: str, *, rewrite: bool = False) -> bool:
        """Store ``entry``'s cleared marker iff the stored marker token is ``token``. Only the
        marker changed since the entry was last written (a backend may write just that), and
        with ``rewrite`` its metadata (:data:`STREAM_METADATA`)."""

    def begin_turn(
        self,
        entry: SessionEntry,
        consumed_event_id: int | None,
        user_message: tuple[str, Message] | None,
        seen: str | None = None,
        lease: str | None = None,
        *,
        rewrite: bool = False,
    ) -> bool:
        """One transaction: record ``seen`` (a platform message id) as seen on the lane, write
        ``entry``'s new marker and activity time (nothing else changed since it was last
        written but, with ``rewrite``, its metadata: :data:`STREAM_METADATA`), delete the
        queued event, append ``(session_id, message)``. False, with nothing written, when
        ``seen`` was recorded before (a redelivery); backends without a durable redelivery
        record always write. ``lease`` (passed only to a backend with :class:`TurnLeases`,
        which must accept it): the turn's lease token; unless it still holds the lane's lease
        (checked, and kept so, in the same transaction) nothing is written and
        :class:`~hermes_core.domain.errors.LeaseLostError` is raised."""

    def routes_with_markers(self) -> list[EntryDict]:
        """Every entry whose turn marker is set."""

    def routes_to_resume(self) -> list[EntryDict]:
        """Every entry marked ``resume_pending`` (read without reading the other lanes)."""

    def put_routes(self, entries: Sequence[EntryDict]) -> None:
        """Write several routing entries in one transaction."""

    # -- sessions -------------------------------------------------------------------------------

    def get_session(self, session_id: str) -> SessionRow | None:
        """One session row, or None."""

    def newest_session(self, session_key: str) -> SessionRow | None:
        """The most recently started session row of a key, or None."""

    def count_sessions(self) -> int:
        """Number of session rows (stops counting at 2 where that is cheaper)."""

    def create_session(
        self, row: SessionRow, entry: EntryDict, end_previous: tuple[str, str] | None
    ) -> None:
        """One transaction: end ``end_previous`` = (session id, reason) if it is still open,
        insert ``row``, write ``entry``. Raises ``DuplicateSessionIdError`` on an id collision."""

    def reopen_session(self, session_id: str, entry: EntryDict) -> None:
        """One transaction: clear the row's end, write ``entry``."""

    def update_counters(self, entry: EntryDict, session_id: str, delta: CounterDelta) -> None:
        """One transaction: write ``entry``; add ``delta`` to the session row's counters."""

    # -- transcripts -----------------------------------------------------------------------------

    def append_message(self, session_id: str, message: Message) -> int:
        """Insert one message; returns its id. The row's count and last activity follow."""

    def load_messages(self, session_id: str) -> list[dict[str, Any]]:
        """Active messages in insertion order (``[]`` for an unknown session)."""


class SearchCapable(Protocol):
    """Capability ``search``: full-text search over active messages."""

    def search(
        self, query: str, *, session_id: str | None, session_key: str | None, limit: int
    ) -> list[SearchHit]:
        """Full-text search over active messages, best rank first."""

    def rebuild_fts(self) -> bool:
        """Rebuild the derived full-text index; False when full-text search is unavailable."""

    def reindex_fts(self) -> None:
        """Rebuild what of the index is rebuilt in one piece, without holding the writer's
        connection or blocking writes (before :meth:`start_fts_rebuild`; may be a no-op)."""

    def start_fts_rebuild(self) -> bool:
        """Start rebuilding the index (short); what it leaves unindexed, search still finds
        and :meth:`index_backlog` indexes. False when full-text search is unavailable."""

    def index_backlog(self) -> bool:
        """Index one bounded batch of what waits to be indexed, in a transaction of its own;
        True while another batch waits."""


class TranscriptEditing(Protocol):
    """Capability ``transcript_edits``: transcript rewrites and soft deletes (never deletes)."""

    def rewrite_messages(self, session_id: str, messages: Sequence[Message]) -> int:
        """One transaction: deactivate the active messages, append ``messages``."""

    def soft_delete_messages(self, session_id: str, message_ids: Sequence[int]) -> int:
        """Set ``active=0`` on the given messages of the session; returns the count."""


class Pruning(Protocol):
    """Capability ``pruning``: removing idle routing entries."""

    def prune_candidates(
        self, cutoff: float, after: str | None = None, limit: int | None = None
    ) -> list[str]:
        """Keys idle since before ``cutoff`` (epoch seconds), not suspended, without a marker.
        In key order; a page of a walk: only keys after ``after``, at most ``limit``."""

    def delete_idle_routes(self, session_keys: Sequence[str], cutoff: float) -> list[str]:
        """Remove the routing rows of those keys still idle since before ``cutoff``, not
        suspended, without a marker (re-checked in the delete: a lane that became active since
        :meth:`prune_candidates` stays); sessions and messages stay. Returns the keys removed."""


class LedgerRows(Protocol):
    """Capability ``ledger``: the delivery ledger's rows."""

    def add_obligation(
        self,
        obligation: Obligation,
        marker: tuple[SessionEntry, str] | None,
        reply: tuple[str, Message] | None = None,
        lease: str | None = None,
        *,
        rewrite: bool = False,
    ) -> tuple[bool, bool]:
        """One transaction: append ``reply`` = (session id, message), insert ``obligation``
        unless its id exists and, with ``marker`` = (entry without marker, token), clear the
        lane's turn marker if that token still owns it (with ``rewrite``, its metadata too).
        Returns (obligation was new, marker was cleared). ``lease``: fenced like
        :meth:`StoreBackend.begin_turn`."""

    def obligations(
        self, states: Sequence[str], platforms: Sequence[str] | None = None
    ) -> list[Obligation]:
        """Ledger rows in the given states (and platforms), oldest first."""

    def obligation_since(self, session_key: str, since: float) -> bool:
        """Whether a ledger row of the lane was created at or after ``since``."""

    def update_obligation(self, obligation_id: str, changes: Mapping[str, Any]) -> None:
        """Change columns of one ledger row."""

    def delete_obligation(self, obligation_id: str) -> None:
        """Remove one ledger row (a delivered reply)."""

    def obligations_to_prune(self, terminal_before: float, max_rows: int) -> list[str]:
        """Ids of the terminal (failed or abandoned) rows retention drops: those last updated
        before ``terminal_before`` and the oldest beyond ``max_rows``; oldest first."""

    def delete_terminal_obligations(self, obligation_ids: Sequence[str]) -> int:
        """Delete those of the rows that are still terminal, in one transaction; how many."""


class DurableQueue(Protocol):
    """Capability ``queue``: durable per-lane queues of events, dead letters and redelivery
    records."""

    def add_queued(
        self, session_key: str, internal: bool, bound: str | None, event: str,
        seen: str | None = None,
    ) -> int | None:  # fmt: skip
        """Append one queued event (JSON text) to a lane's durable queue and record ``seen`` as
        seen on the lane, in one transaction; its id, or None (nothing written) when ``seen``
        was recorded before."""

    def fail_queued(self, event_id: int, error: str, max_attempts: int) -> bool:
        """Count a failed dispatch; at ``max_attempts`` the event becomes a dead letter (kept,
        no longer queued). True when it did."""

    def dead_letters(self) -> list[DeadLetter]:
        """The dead-lettered events, oldest first."""

    def prune_seen(self, before: float, limit: int) -> int:
        """Forget at most ``limit`` redelivery records older than ``before`` (epoch seconds);
        the count."""

    def remove_queued(self, event_ids: Sequence[int]) -> int:
        """Delete queued events (discarded by a command); returns how many."""

    def queued(self, session_key: str | None = None) -> list[tuple[int, str, str]]:
        """Every queued event (dead letters excluded), or those of one lane, as (id, session
        key, event JSON), in queue order."""


class RestartCountRows(Protocol):
    """Capability ``restart_counts``: stuck-loop counts kept in the store, tagged with the
    instance that struck the lane, so instances sharing the store keep their own."""

    def restart_counts(self, owner: str) -> dict[str, int]:
        """The stuck-loop counts of the lanes instance ``owner`` struck last."""

    def save_restart_counts(self, owner: str, counts: Mapping[str, int]) -> None:
        """One transaction: replace ``owner``'s counts (other instances' rows stay)."""

    def remove_restart_count(self, session_key: str) -> None:
        """Forget a lane's count (a successful turn, a reset, a suspension replacement)."""


class ParallelWriters(Protocol):
    """What a backend with the capability ``parallel_writers`` implements: a writer connection per
    writer thread, each carrying its own transactions."""

    def writer_connections(self) -> int:
        """How many writer connections the store's writer may use in parallel (at least 1)."""

    def bind_writer(self, index: int) -> None:
        """Give the calling thread writer connection ``index`` (``0 <= index <
        writer_connections()``); its writes and ``transaction()`` use that connection from now
        on. Threads never bound share connection 0."""


class RouteBatches(Protocol):
    """What a backend with the capability ``route_batches`` implements: the routing entries of
    many keys in one read, so the store's writer reads the lanes a batch begins, that it has not
    cached, at once instead of one statement each on its serial path."""

    def get_routes(self, session_keys: Collection[str]) -> dict[str, EntryDict]:
        """The stored entries of ``session_keys`` by key (a key without a row is left out), each
        as :meth:`StoreBackend.get_route` returns it; read in the open transaction when called
        inside ``transaction()``."""


LeaseGrant = Literal["free", "unreleased"]
"""How a lane's lease was granted: ``free``, the lane had none (its last holder released it);
``unreleased``, it replaced a lease its holder never gave back (expired: the holder died or hung;
or already this boot's), so the holder may have left a turn cut short or a reply unsent."""


Locked = Literal["locked"]
"""What a grant or release says when another transaction has the lane's lease row locked at
that moment (a grant or release elsewhere, or one in a process frozen with its transaction
open): nothing was done, not even a mark, and nothing waited; the caller tries again shortly."""
LOCKED: Locked = "locked"


@dataclass(frozen=True)
class LeaseTaken:
    """A lease granted by :meth:`TurnLeases.take_lease`, and the lane as the grant's own
    statement read it."""

    grant: LeaseGrant
    waiting: bool
    """Events wait in the lane's durable queue."""
    revision: int | None
    """The lane's routing row revision; None: no row, or not known to be current when the grant
    commits (the grant waited for another transaction holding the lease row)."""
    entry: EntryDict | None = None
    """The lane's stored entry, when ``revision`` is known and not the caller's cached one."""
    ended: bool = False
    """That entry's session has ended (a stale route: the lane has no current session)."""


class TurnLeases(Protocol):
    """What a backend with the capability ``turn_leases`` implements: lane leases shared by
    every process using the store (times on the backend's clock), and routing rows read with
    their revision and written only at the revision read (the store's cache may be stale)."""

    def take_lease(
        self,
        session_key: str,
        owner: str,
        boot: str,
        token: str,
        ttl: float,
        cached: int | None = None,
        *,
        reclaim: bool = False,
    ) -> LeaseTaken | Locked | None:
        """Grant the lane's lease to ``(owner, boot)`` under ``token`` for ``ttl`` seconds
        (absent, expired, with an expiry further than ``ttl`` from now, already this boot's,
        or with ``reclaim`` an earlier boot's of ``owner``) and say how, with what the same
        statement read (:class:`LeaseTaken`; the lane's entry only when its routing row's
        revision is not ``cached``, the one the caller holds); None while another boot holds
        it. Either way the lease is kept from changing hands until the transaction ends (so a
        release waits for an event the caller queues in it). :data:`LOCKED` when another
        transaction has the lease locked: a grant never waits for one (its ``ttl`` counts from
        the moment the lease is written)."""

    def check_lease(self, session_key: str, token: str) -> bool:
        """Whether ``token`` still holds the lane's lease, keeping it so until the enclosing
        transaction ends (the fence of a turn's write)."""

    def renew_leases(self, tokens: Sequence[str], ttl: float) -> set[str]:
        """Extend the leases of ``tokens`` to ``ttl`` seconds from now; the tokens that held.
        Called from a thread of its own, beside the writer threads: it must not wait for the
        writer's transactions (nor, for long, for rows they lock)."""

    def release_lease(
        self, session_key: str, token: str, delivered: str | None = None
    ) -> list[tuple[int, str, str]] | Locked | None:
        """Give up the lane's lease unless events wait in its durable queue: None when it was
        released (or ``token`` no longer holds it), else the lane's queued events as
        :meth:`DurableQueue.queued` returns them (kept: the caller runs them); :data:`LOCKED`
        when another transaction has the lease locked (nothing decided, nothing waited for);
        with ``delivered``, delete that ledger row (a reply delivered) in the same transaction
        whatever the release decides, while ``token`` still holds the lease."""

    def give_up_leases(self, tokens: Sequence[str]) -> list[str]:
        """Delete the leases of ``tokens`` whatever waits in their lanes (a clean stop); the
        lanes among them with events queued."""

    def read_route(self, session_key: str) -> tuple[EntryDict, int] | None:
        """The stored entry of a key (which may carry :data:`SESSION_ENDED`) and its row's
        revision (the count of the row's writes, which every routing write increments), or
        None."""

    def checked_routes(
        self, expected: Mapping[str, int | None]
    ) -> AbstractContextManager[dict[str, int]]:
        """Within it, a routing write of the calling thread (``put_route``, ``create_session``,
        ``reopen_session``, ``update_counters``) to a key of ``expected`` applies only while
        the key's row has the revision given (None: only while the key has no row); when it
        does not, that method writes nothing at all. The mapping yielded receives each key
        written, with its row's new revision."""

    def orphaned_lanes(
        self, owner: str, boot: str, expired: bool, ttl: float
    ) -> list[tuple[str, int | None]]:
        """Lanes with a turn marker, queued events or unsettled replies whose lease is absent
        or held by an earlier boot of ``owner`` (or, with ``expired``, expired or with an
        expiry further than ``ttl`` from now); also lanes
        armed to resume whose lease, never released, is so held or expired. Each comes with
        the id of its oldest queued event when queued events alone, with no lease at all,
        make it orphaned (else None): its enqueuer may be about to take the lease."""


class LaneWakeups(Protocol):
    """What a backend with the capability ``lane_wakeups`` implements: a signal from one process to
    every other process sharing the store that a lane has something for its lease holder.
    Signals may be lost (a connection cut); the holder then sees the lane's queued events when
    its turn ends."""

    def wake_lane(self, session_key: str) -> None:
        """Signal ``session_key`` to the other processes once the enclosing write commits."""

    def listen_lanes(self, woken: Callable[[str], None]) -> Callable[[], None]:
        """Call ``woken(session_key)`` (on a thread of the backend's) for every lane signalled
        by another process from now on; returns the function that stops listening."""


class BacklogTarget(Protocol):
    """What the JSONL backlog replay needs from the canonical store."""

    def get_meta(self, name: str) -> str | None:
        """A ``state_meta`` value, or None."""

    def get_route(self, session_key: str) -> EntryDict | None:
        """The stored entry of a key, or None."""

    def put_route(self, entry: EntryDict, *, touch: bool = False) -> None:
        """Insert or replace one routing row."""

    def get_session(self, session_id: str) -> SessionRow | None:
        """One session row, or None."""

    def import_backlog(
        self,
        session_id: str,
        messages: Sequence[Message],
        offset: tuple[str, str],
        create_row: SessionRow | None,
    ) -> None:
        """One transaction: insert ``create_row`` if given, append ``messages`` in order and set
        ``state_meta[offset[0]] = offset[1]`` (the byte offset imported so far)."""


class Maintenance(BacklogTarget, Protocol):
    """Capability ``maintenance``: ``state_meta`` values, the sessions.json and JSONL backlog
    imports and re-keying (the key schema is recorded only in a store that offers it)."""

    def set_meta(self, name: str, value: str) -> None:
        """Set one ``state_meta`` value (one transaction)."""

    def stored_keys(self) -> StoredKeys:
        """Every stored session key and what it belongs to, from one read (for re-keying)."""

    def move_keys(self, moves: KeyMoves) -> None:
        """One transaction: apply one batch of a re-key (see :class:`KeyMoves`)."""

    def has_routes(self) -> bool:
        """Whether the routing table has any row (cheap: reads at most one)."""

    def route_page(self, after: str | None, limit: int) -> list[EntryDict]:
        """Up to ``limit`` stored entries in key order after the key ``after`` (None: from the
        first): the routing index read a page at a time, in memory bounded by ``limit``."""

    def count_routes(self) -> int:
        """The number of routing rows (one count, no row read into memory)."""

    def import_routes(
        self, entries: Sequence[tuple[EntryDict, SessionRow]], marker: tuple[str, str]
    ) -> int:
        """One transaction: insert the entries whose key is missing, each with its session row
        unless a row of that id exists (a parent that does not exist is left out), and set
        ``state_meta[marker]``. Returns the number of entries inserted."""
