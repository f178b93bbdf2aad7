"""Turn leases on a shared PostgreSQL store (``storage.instances: shared``).

A lane's lease is one row of ``session_turn_leases``: its owner (instance and boot), a token that
is new with every grant, and an expiry on the server's clock (so the hosts' clocks never matter).
A grant succeeds when the lane has no lease, its lease expired, or this boot holds it, and
says whether it replaced a row (a lease never released: the takeover of a dead or hung holder's
lane); the conflicting row is locked by the grant either way (and marked ``waiting`` when the
grant is refused), so a grant and a release of one lane serialise on that row. A turn's writes
are fenced: the lease row is locked (``FOR KEY SHARE``) in the write's own transaction, by
:meth:`LeaseRows.check_lease` or by the turn's start and finish statements themselves (see
``dialects/postgresql_turns.py``), and the write goes ahead only if the token still holds it;
that lock conflicts with a grant that would change the owner, never with the mark of a refused
one. Renewals commit on a pooled connection and skip the rows locked at that moment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hermes_core.store.backend import LOCKED, LeaseTaken, Locked
from hermes_plugins.sql_store.connection import SqlConnection
from hermes_plugins.sql_store.rows import route_entry

_NOW = "extract(epoch from clock_timestamp())"

_LAPSED = f"(l.expires_at < {_NOW} OR l.expires_at > {_NOW} + %(ttl)s)"
"""A lease that binds nobody: expired, or with an expiry no grant or renewal could have written
(further than a lease from now: NaN and infinity included, which PostgreSQL sorts above every
number), a junk row that would otherwise keep its lane from running for ever."""

_GRANTABLE = (
    f"({_LAPSED} OR l.owner_boot = %(boot)s OR (%(reclaim)s AND l.owner_instance = %(owner)s))"
)
_GRANTED = ", ".join(
    f"{column} = CASE WHEN EXISTS (SELECT 1 FROM exclusive) THEN {value} ELSE l.{column} END"
    for column, value in (
        ("owner_instance", "EXCLUDED.owner_instance"),
        ("owner_boot", "EXCLUDED.owner_boot"),
        ("token", "EXCLUDED.token"),
        ("acquired_at", _NOW),
        ("expires_at", f"{_NOW} + %(ttl)s"),
    )
)

_TAKE = f"""
WITH present AS (
    SELECT 1 FROM session_turn_leases WHERE session_key = %(key)s
), free AS (
    SELECT expires_at, owner_instance, owner_boot FROM session_turn_leases
    WHERE session_key = %(key)s FOR NO KEY UPDATE SKIP LOCKED
), grantable AS (
    SELECT 1 FROM free AS l WHERE {_GRANTABLE}
), exclusive AS (
    SELECT 1 FROM session_turn_leases
    WHERE session_key = %(key)s AND EXISTS (SELECT 1 FROM grantable) FOR UPDATE SKIP LOCKED
), open AS (
    SELECT NOT EXISTS (SELECT 1 FROM present) OR (EXISTS (SELECT 1 FROM free)
        AND (NOT EXISTS (SELECT 1 FROM grantable) OR EXISTS (SELECT 1 FROM exclusive))) AS open
), taken AS (
    INSERT INTO session_turn_leases AS l
        (session_key, owner_instance, owner_boot, token, acquired_at, expires_at)
    SELECT %(key)s, %(owner)s, %(boot)s, %(token)s, {_NOW}, {_NOW} + %(ttl)s
    FROM open WHERE open.open
    ON CONFLICT (session_key) DO UPDATE SET
        {_GRANTED}, waiting = CASE WHEN EXISTS (SELECT 1 FROM exclusive) THEN 0 ELSE 1 END
        WHERE EXISTS (SELECT 1 FROM present)
    RETURNING l.token = %(token)s AS granted, l.xmax <> 0 AS replaced
), route AS (
    SELECT r.revision, r.entry_json, r.updated_at, r.active_turn_token,
        r.active_turn_started_at, s.end_reason IS NOT NULL AS ended
    FROM gateway_routing AS r LEFT JOIN sessions AS s ON s.id = r.session_id
    WHERE r.session_key = %(key)s
        AND NOT EXISTS (SELECT 1 FROM session_turn_leases WHERE session_key = %(key)s)
)
SELECT open.open, taken.granted, taken.replaced,
    EXISTS (SELECT 1 FROM queued_events WHERE session_key = %(key)s AND dead_at IS NULL),
    route.revision,
    CASE WHEN route.revision IS DISTINCT FROM %(cached)s THEN route.entry_json END,
    route.updated_at, route.active_turn_token, route.active_turn_started_at, route.ended
FROM open LEFT JOIN taken ON true LEFT JOIN route ON taken.granted
"""
# Lock modes: a holder's fence of its writes locks the row ``FOR KEY SHARE``; a grant locks it
# ``FOR NO KEY UPDATE`` (``free``), and only a grant that would change its owner (``grantable``,
# as the locked row is now) locks it ``FOR UPDATE`` as well (``exclusive``), the one mode that
# conflicts with a fence. So a refused grant, which only marks the row ``waiting`` (an enqueuer
# elsewhere, possibly one that froze with its transaction open), never holds up the holder's
# fenced writes, only its release (see ``_RELEASE``), while no lease changes hands during a
# fenced write. A lock the statement needs and another transaction holds (a grant or release
# in progress elsewhere, a fence of the holder's write against a change of owner, or any of
# these in a process frozen with its transaction open) is not waited for: nothing is inserted,
# granted or marked (``open`` false) and the caller tries again shortly, so one lane's locked
# row never holds up the writer's other lanes. Only a row that appeared after the statement's
# snapshot (another grant's insert) still makes it wait, bounded by the writer session's
# ``lock_timeout``; such a row is left as it is (``open`` true, nothing ``taken``: the
# statement's reads cannot see it) and the statement runs once more, with a snapshot that
# does. A grant's times are taken when the row is written (after any such wait), so a grant
# always runs its full ``ttl``. ``reclaim``: an earlier boot of this instance counts as gone
# (start-up, under the state directory's lock).
# An inserted row has no xmax; a row the conflict clause updated carries the updater's. The
# conflict clause updates the row as the locks found it (whatever the statement's snapshot): a
# grant replaces the owner and clears the mark; a refused one (the lease is another boot's,
# unexpired) only marks the row ``waiting``, since the caller queues an event in this
# transaction, and the holder's release, which deletes the row only while it is not marked,
# cannot lock it until this transaction ends and then sees the mark (see ``_RELEASE``). Every
# part of the statement reads with one snapshot, taken when it began. The queue: an event
# committed after it was queued by a process whose own grant then fails on this row (or that
# holds the row locked), so the release of this lease sees it. The lane's routing row (none:
# no row), with its session's end, is returned only when that snapshot has no lease row for the
# lane: a statement that waited for a transaction holding the row (another grant's insert)
# began before that transaction committed, and its snapshot misses the routing writes
# committed with it (then nothing: the entry is read afresh; so always for a lease replaced). A
# write committed after the snapshot without the lease row counts as one made after the entry
# was read (the next checked write of the entry sees it). The entry itself comes only when its
# revision is not the one the caller has cached.

_FENCE = """
SELECT 1 FROM session_turn_leases WHERE session_key = %(key)s AND token = %(token)s FOR KEY SHARE
"""

_RENEW = f"""
WITH free AS (
    SELECT session_key FROM session_turn_leases WHERE token = ANY(%(tokens)s)
    FOR UPDATE SKIP LOCKED
), renewed AS (
    UPDATE session_turn_leases SET expires_at = {_NOW} + %(ttl)s
    WHERE session_key IN (SELECT session_key FROM free) AND token = ANY(%(tokens)s)
)
SELECT token FROM session_turn_leases WHERE token = ANY(%(tokens)s)
"""
# A row a transaction has locked (a fence of this process's writer, a grant elsewhere) is
# skipped, not waited for: the renewal never waits for a lock, so it can never deadlock with a
# writer's batch that locks several lease rows; such a lease is renewed next time. The tokens
# returned are those present when the statement began (a skipped lease counts as kept).

_RELEASE = """
WITH mine AS (
    SELECT 1 FROM session_turn_leases WHERE session_key = %(key)s AND token = %(token)s
), free AS (
    SELECT 1 FROM session_turn_leases WHERE session_key = %(key)s AND token = %(token)s
    FOR NO KEY UPDATE SKIP LOCKED
), queued AS (
    SELECT id, event_json FROM queued_events WHERE session_key = %(key)s AND dead_at IS NULL
), delivered AS (
    DELETE FROM delivery_obligations
    WHERE obligation_id = %(delivered)s::text AND EXISTS (SELECT 1 FROM mine)
), released AS (
    DELETE FROM session_turn_leases
    WHERE session_key = %(key)s AND token = %(token)s AND waiting = 0
        AND NOT EXISTS (SELECT 1 FROM queued) AND EXISTS (SELECT 1 FROM free)
    RETURNING 1
), kept AS (
    UPDATE session_turn_leases SET waiting = 0
    WHERE session_key = %(key)s AND token = %(token)s AND NOT EXISTS (SELECT 1 FROM released)
        AND EXISTS (SELECT 1 FROM free)
    RETURNING 1
)
SELECT true, NULL::int4, NULL::text FROM released
UNION ALL SELECT false, queued.id, queued.event_json FROM kept LEFT JOIN queued ON true
UNION ALL SELECT NULL, NULL, NULL FROM mine WHERE NOT EXISTS (SELECT 1 FROM free)
ORDER BY 2
"""
# One statement, whatever it decides: the lease row is deleted while it is not marked
# ``waiting`` and nothing waits in the lane's queue (one row, true); otherwise it is kept, the
# mark cleared, and the lane's queued events come back (false, then one row per event, oldest
# first); one row of NULLs: another transaction has the row locked at this moment (a grant
# elsewhere marking it, in a live or a frozen process), nothing was decided and the caller
# tries again shortly, rather than wait with the writer's other lanes behind it; no row: the
# token no longer holds it. ``delivered``: a ledger row deleted whatever the release decides
# (the settle of a delivered reply), while the token still holds the lease. An event committed
# before the statement's snapshot is seen by its queue read. One being queued meanwhile comes
# with a refused grant that marks the row in the same transaction: the row is locked until that
# transaction ends, and a release that locks it afterwards checks the row as that transaction
# left it, marked, and keeps it. The queue read keeps the statement's snapshot, which may miss
# that event; so a release that kept the row with nothing queued in view runs once more, with a
# snapshot taken after (the keep cleared the mark, and while its transaction holds the row
# nobody can mark it again): that run is final. A kept lease whose snapshot saw some events but
# missed a later one is released only by a later release, which sees it.

_GIVE_UP = """
WITH gone AS (
    DELETE FROM session_turn_leases WHERE token = ANY(%(tokens)s) RETURNING session_key
)
SELECT gone.session_key FROM gone
WHERE EXISTS (SELECT 1 FROM queued_events AS q WHERE q.session_key = gone.session_key
    AND q.dead_at IS NULL)
"""
# A clean stop gives up every lease it holds, queued events or not; the lanes with events
# queued (by other processes: this one has drained) come back, so the others can be woken.

_ORPHANS = f"""
WITH owing AS (
    SELECT session_key FROM gateway_routing WHERE active_turn_token IS NOT NULL
    UNION SELECT session_key FROM delivery_obligations
        WHERE state IN ('pending', 'attempting')
), waiting AS (
    SELECT session_key, min(id) AS head FROM queued_events WHERE dead_at IS NULL
    GROUP BY session_key
), lanes AS (
    SELECT session_key FROM owing UNION SELECT session_key FROM waiting
)
SELECT lanes.session_key,
    CASE WHEN l.session_key IS NULL AND owing.session_key IS NULL THEN waiting.head END
FROM lanes
LEFT JOIN owing ON owing.session_key = lanes.session_key
LEFT JOIN waiting ON waiting.session_key = lanes.session_key
LEFT JOIN session_turn_leases AS l ON l.session_key = lanes.session_key
WHERE l.session_key IS NULL OR (l.owner_instance = %(owner)s AND l.owner_boot <> %(boot)s)
   OR (%(expired)s AND {_LAPSED})
UNION
SELECT r.session_key, NULL FROM gateway_routing AS r
JOIN session_turn_leases AS l ON l.session_key = r.session_key
WHERE r.resume_pending <> 0 AND ((l.owner_instance = %(owner)s AND l.owner_boot <> %(boot)s)
   OR (%(expired)s AND {_LAPSED}))
UNION
SELECT l.session_key, NULL FROM session_turn_leases AS l
WHERE NOT %(expired)s AND l.owner_instance = %(owner)s AND l.owner_boot <> %(boot)s
ORDER BY 1
"""
# The second column: a lane's oldest queued event when queued events are all that make it
# orphaned and it has no lease row (its enqueuer may be about to take the lease). The second
# part: a lane armed to resume whose holder died before the resumed turn began (no marker is
# left then); one whose holder released it had its resume seen to. The third (start-up only):
# every other lane an earlier boot of this instance still holds, taken back so that nothing
# queued elsewhere for it waits for that lease to expire.


class LeaseRows:
    """The lease table's statements (PostgreSQL); each method is one transaction unless it runs
    inside the store's batch."""

    def __init__(self, conn: SqlConnection) -> None:
        self._conn = conn

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
        """Grant the lane's lease to ``(owner, boot)`` with ``token`` for ``ttl`` seconds
        (see :class:`~hermes_core.store.backend.LeaseTaken`; the entry comes with it when the
        routing row's revision is not ``cached``); None while another boot holds it unexpired
        (the row stays locked until the transaction ends either way); ``"locked"`` when
        another transaction has the lease row locked (nothing done). ``reclaim``: an earlier
        boot of ``owner`` counts as gone."""
        params = {
            "key": session_key, "owner": owner, "boot": boot, "token": token, "ttl": ttl,
            "cached": cached, "reclaim": reclaim,
        }  # fmt: skip
        with self._conn.write("taking a turn lease") as cursor:
            row = cursor.execute(_TAKE, params).fetchone()
            if row[0] and row[1] is None:  # a row inserted after its snapshot: now in view
                row = cursor.execute(_TAKE, params).fetchone()
        opened, granted, replaced, waiting, revision, entry_json, *route = row
        if not opened or granted is None:
            return LOCKED
        if not granted:
            return None
        entry = None
        if entry_json is not None:
            columns = ("entry_json", "updated_at", "active_turn_token", "active_turn_started_at")
            entry = route_entry(dict(zip(columns, (entry_json, *route[:3]), strict=True)))
        return LeaseTaken(
            "unreleased" if replaced else "free", bool(waiting), revision, entry, bool(route[3])
        )

    def check_lease(self, session_key: str, token: str) -> bool:
        """Whether ``token`` still holds the lane's lease; the row stays locked (``FOR KEY
        SHARE``) until the transaction ends, so no grant can overtake the write it fences (a
        refused grant's mark, which changes no owner, does not wait for it)."""
        with self._conn.write("checking a turn lease") as cursor:
            row = cursor.execute(_FENCE, {"key": session_key, "token": token}).fetchone()
            return row is not None

    def renew_leases(self, tokens: Sequence[str], ttl: float) -> set[str]:
        """Extend the leases of ``tokens`` by ``ttl`` from now; the tokens that still held.
        Its own short transaction on a pooled connection, never a writer connection's: it
        waits for no writer step (in shared mode no connection holds a writer lock)."""
        if not tokens:
            return set()
        with self._conn.read("renewing turn leases") as conn:
            rows = conn.exec_driver_sql(_RENEW, {"tokens": list(tokens), "ttl": ttl}).fetchall()
            conn.commit()
        return {row[0] for row in rows}

    def release_lease(
        self, session_key: str, token: str, delivered: str | None = None
    ) -> list[tuple[int, str, str]] | Locked | None:
        """Give the lane's lease up unless events wait in its queue: None when it was released
        (or is no longer ``token``'s), else kept and the lane's queued events (id, key,
        payload), oldest first; ``"locked"`` when another transaction has the lease row locked
        (nothing decided). An event queued concurrently is either seen here or finds the lane
        free afterwards. ``delivered``: a ledger row deleted in the same statement (the settle
        of a reply) while ``token`` holds the lease."""
        params = {"key": session_key, "token": token, "delivered": delivered}
        with self._conn.write("releasing a turn lease") as cursor:
            rows = cursor.execute(_RELEASE, params).fetchall()
            if rows and rows[0][0] is False and rows[0][1] is None:  # kept, no event in view
                rows = cursor.execute(_RELEASE, {**params, "delivered": None}).fetchall()
        if rows and rows[0][0] is None:
            return LOCKED
        if not rows or rows[0][0]:
            return None
        return [(event, session_key, payload) for _, event, payload in rows if event is not None]

    def give_up_leases(self, tokens: Sequence[str]) -> list[str]:
        """Delete the leases of ``tokens`` whatever waits (a clean stop); the lanes among them
        with events queued."""
        if not tokens:
            return []
        with self._conn.write("giving up turn leases") as cursor:
            return [row[0] for row in cursor.execute(_GIVE_UP, {"tokens": list(tokens)})]

    def orphaned_lanes(
        self, owner: str, boot: str, expired: bool, ttl: float
    ) -> list[tuple[str, int | None]]:
        """Lanes with a turn marker, queued events or unsettled replies whose lease is absent
        or held by an earlier boot of ``owner`` (or, with ``expired``, expired), and lanes
        armed to resume whose lease was never released and is so held or expired; each with
        its oldest queued event's id when only queued events and no lease row make it so. An
        expiry further than ``ttl`` from now counts as expired (a junk row)."""
        params: dict[str, Any] = {"owner": owner, "boot": boot, "expired": expired, "ttl": ttl}
        with self._conn.write("looking for lanes without a live lease") as cursor:
            return [(row[0], row[1]) for row in cursor.execute(_ORPHANS, params).fetchall()]
