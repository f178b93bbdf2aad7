"""Lane leases of a store shared by several gateway processes (the capability
``turn_leases``).

A process runs a lane's turn only while it holds the lane's lease: :meth:`Leases.take_lease`
grants it with a new token (and keeps the lane's cached entry only while the routing row still has
the revision it was read or written at, so what another process wrote is read afresh under the
lease) and says whether it took over a lease its holder never released (then the lane needs
the takeover's recovery before anything runs on it); the runtime renews its leases every
quarter of ``storage.turn_lease_secs`` (:meth:`Leases.renew_leases`: on a thread and a
connection of its own, never behind the writer's queued steps) and releases a lane when
nothing waits in its durable queue. Every write of a turn (its start, reply
and ledger row, marker clear, dequeue) is *fenced*: it checks, in its own transaction, that the
token still holds the lease, else raises :class:`~hermes_core.domain.errors.LeaseLostError` and
writes nothing. On a single-instance store every call here is a no-op that grants.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import LeaseLostError
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.state.instance import instance_id
from hermes_core.store.backend import LOCKED, LeaseGrant, Locked
from hermes_core.store.backing import Backing
from hermes_core.store.base import serialised
from hermes_core.store.queue_rows import QueuedEvent, read_queued
from hermes_core.store.routing import RoutingTable
from hermes_core.store.writer import StoreWriter

logger = logging.getLogger(__name__)

UNFENCED: AbstractContextManager[dict[str, str]] = nullcontext({})
"""What :meth:`Leases.fenced` is on a single-instance store: no keyword arguments (the
one dict is only ever read)."""


CLOCK_SLACK_SECS = 60.0
"""Clock difference allowed between an operator's host and the database server when a command
reads lease expiries."""


def lease_state(expires_at: float, now: float, ttl: float, slack: float = 0.0) -> str:
    """What a lease row's expiry means, as the gateways read it: ``live``, ``expired``, or
    ``invalid`` (NaN, infinite or further than ``ttl`` from ``now``, which no grant or renewal
    writes: the gateways treat it as lapsed). ``slack``: seconds of clock difference allowed
    (a reader whose clock is not the database server's)."""
    if not expires_at <= now + ttl + slack:  # NaN compares false
        return "invalid"
    return "live" if expires_at >= now else "expired"


class Leases:
    """Which lanes this process holds, under which token, and the lease rows behind them
    (``backing.bound.leases``; none on a single-instance store)."""

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
        self._owner: tuple[str, str] | None = None
        self._lock = threading.Lock()
        """Held by a change of the dicts below that reads first: writer threads and the
        renewal (on a thread of its own) both change them."""
        self._held: dict[str, str] = {}
        """Lane → token of the leases held."""
        self._granting: set[str] = set()
        """Tokens granted in a batch not committed yet: a renewal, on a connection of its own,
        cannot see their rows and would take them for lost, so it leaves them for next time."""
        self._unleased: dict[str, int] = {}
        """The lanes the last scan left for their enqueuer (see :meth:`claim_orphaned_lanes`)."""
        self._found_free: frozenset[str] = frozenset()
        """The lanes start-up claimed without a lease row (see :meth:`found_unleased`)."""

    @property
    def shared(self) -> bool:
        """Whether other gateway processes may use this store at the same time (leases)."""
        return self._backing.bound.leases is not None

    @property
    def owner(self) -> tuple[str, str]:
        """This process as a lease owner: (instance id, boot token of this open store), found
        once (every grant names it)."""
        if self._owner is None:
            configured = self._config.gateway.instance_id
            self._owner = instance_id(self._config.hermes_home, configured), secrets.token_hex(16)
        return self._owner

    def _granted(self, token: str) -> None:
        with self._lock:
            self._granting.discard(token)

    def holds(self, session_key: str) -> bool:
        """Whether this process holds the lane's lease (always, on a single-instance store)."""
        return not self.shared or session_key in self._held

    def held_lanes(self) -> list[str]:
        """The lanes whose lease this process holds."""
        return list(self._held)

    @serialised
    def wake_lane(self, session_key: str) -> None:
        """Tell the other processes that something waits for the lane's lease holder (once
        this write commits; nothing when the backend has no wake-ups)."""
        wakeups = self._backing.bound.wakeups
        if wakeups is not None:
            with self._backing.canonical:
                wakeups.wake_lane(session_key)

    def listen_lanes(self, woken: Callable[[str], None]) -> Callable[[], None] | None:
        """Call ``woken(session_key)`` (on another thread) for each lane another process wakes;
        the function that stops listening, or None when the backend has no wake-ups."""
        wakeups = self._backing.bound.wakeups
        return None if wakeups is None else wakeups.listen_lanes(woken)

    @serialised
    def take_lease(self, session_key: str, *, reclaim: bool = False) -> LeaseGrant | Locked | None:
        """Take the lane's lease (a new token), unless another live process holds it (None) or
        another transaction has its row locked at this moment (:data:`LOCKED`: nothing done,
        try again shortly); ``unreleased`` when it replaced a lease never given back (see
        :data:`LeaseGrant`). ``reclaim``: a lease of an earlier boot of this instance is taken
        back at once (start-up: that boot is gone, the state directory's lock says so). The
        lane's cached entry is kept while its routing row is still at the revision it was read
        or written at, and replaced by the entry read in the grant's own statement when the row
        moved on; when the grant waited for another process's transaction on the lease, it is
        dropped and read afresh (the statement's snapshot may miss what that one wrote)."""
        taken = self.take_idle_lease(session_key, reclaim=reclaim)
        return taken if taken is None or taken == LOCKED else taken[0]

    @serialised
    def take_idle_lease(
        self, session_key: str, *, reclaim: bool = False
    ) -> tuple[LeaseGrant, bool] | Locked | None:
        """:meth:`take_lease`, and whether events wait in the lane's durable queue (read in
        the same statement). Held elsewhere (None), the lease cannot change hands before this
        step's commit, so its holder's release sees an event queued in the same step; locked
        (:data:`LOCKED`), nothing is marked, and the caller must try again."""
        rows = self._backing.bound.leases
        if rows is None:
            return "free", False
        token = secrets.token_hex(16)
        owner, boot = self.owner
        ttl = self._config.storage.turn_lease_secs
        routes = self._routes
        cached = routes.cached_revision(session_key)
        with self._backing.canonical:
            taken = rows.take_lease(session_key, owner, boot, token, ttl, cached, reclaim=reclaim)
        if taken is None or taken == LOCKED:
            return taken
        with self._lock:
            previous = self._held.get(session_key)
            self._held[session_key] = token
            self._granting.add(token)
        self._writer.after_commit(lambda: self._granted(token))
        self._writer.on_rollback(lambda: self._granted(token))
        self._writer.on_rollback(lambda: self._restore(session_key, previous))
        if taken.entry is not None:  # the row moved on: its entry came with the grant
            entry = None if taken.ended else routes.parse(taken.entry)
            routes.cache(session_key, entry, taken.revision)
        elif taken.revision is None or taken.revision != cached:
            routes.forget(session_key)
        return taken.grant, taken.waiting

    def _restore(self, session_key: str, token: str | None) -> None:
        with self._lock:
            if token is None:
                self._held.pop(session_key, None)
            else:
                self._held[session_key] = token

    @serialised
    def release_lease(
        self, session_key: str, *, delivered: str | None = None
    ) -> list[QueuedEvent] | Locked | None:
        """Give up the lane's lease: None when it is released, else it is kept because events
        wait in the lane's durable queue, and those events (read in the same statement, oldest
        first), which this process then runs, or :data:`LOCKED` (kept: another transaction has
        its row locked at this moment; try again shortly). A lease lost meanwhile counts as
        released.
        ``delivered``: the ledger row of a reply delivered, deleted in the same statement (call
        this only while :meth:`holds` the lane, or the row stays)."""
        rows = self._backing.bound.leases
        token = self._held.get(session_key)
        if rows is None or token is None:
            return None
        with self._backing.canonical:
            kept = rows.release_lease(session_key, token, delivered)
        if kept == LOCKED:
            return kept
        if kept is not None:
            return read_queued(kept, self._backing, self._plugins, set_aside=True)
        self._held.pop(session_key, None)
        self._writer.on_rollback(lambda: self._restore(session_key, token))
        return None

    @serialised
    def give_up_leases(self, keep: Collection[str] = ()) -> list[str]:
        """Give up every lease this process holds but those of ``keep``, whatever waits in
        their lanes (a clean stop, once drained: the other processes need not wait for the
        leases to expire), and wake the other processes for the lanes with events queued;
        those lanes."""
        rows = self._backing.bound.leases
        held = self._held
        with self._lock:
            tokens = {key: token for key, token in held.items() if key not in keep}
        if rows is None or not tokens:
            return []
        with self._backing.canonical:
            waiting = rows.give_up_leases(list(tokens.values()))
        with self._lock:
            for key, token in tokens.items():
                if held.get(key) == token:
                    del held[key]
        self._writer.on_rollback(lambda: self._restore_all(tokens))
        for key in waiting:
            self.wake_lane(key)
        return waiting

    def _restore_all(self, tokens: dict[str, str]) -> None:
        with self._lock:
            self._held.update(tokens)

    @serialised
    def abandon_lease(self, session_key: str) -> None:
        """Stop renewing the lane's lease without releasing it (its takeover failed): it expires
        and the lane is taken over again, recovery included."""
        self._held.pop(session_key, None)

    def renew_leases(self) -> list[str]:
        """Extend every lease this process holds; the lanes whose lease was lost (they are
        dropped: their turns' next writes raise :class:`LeaseLostError`). Not a writer step:
        it commits on a connection of its own, so it never waits behind the lanes' steps (call
        it from a thread other than the writer's and the event loop's)."""
        rows = self._backing.bound.leases
        leases, granting = self._held, self._granting
        with self._lock:
            held = {key: token for key, token in leases.items() if token not in granting}
        if rows is None or not held:
            return []
        kept = rows.renew_leases(list(held.values()), self._config.storage.turn_lease_secs)
        with self._lock:  # released or granted again meanwhile: not lost
            lost = [k for k, token in held.items() if token not in kept and leases.get(k) == token]
            for key in lost:
                del leases[key]
        return lost

    @serialised
    def claim_orphaned_lanes(self, *, expired: bool = False) -> list[str]:
        """Take the lease of every lane with a marker, queued events or unsettled replies that
        has no lease or was held by an earlier boot of this instance (start-up recovery works
        on these) or, with ``expired``, whose holder let its lease expire (the takeover of a
        dead process's lanes), and of every lane armed to resume whose holder so left it
        unreleased (it died between arming and starting the resumed turn); the lanes taken
        ([] on a single-instance store).

        With ``expired`` (the periodic scan), a lane that only queued events make orphaned and
        that has no lease is left to the process that queued them, which takes the lease
        right after its enqueue commit: it is claimed only when the previous scan found the
        same oldest event waiting without a lease (nobody took the lane in between). A scan
        whose batch is rolled back does not count as the previous one."""
        rows = self._backing.bound.leases
        if rows is None:
            return []
        ttl = self._config.storage.turn_lease_secs
        with self._backing.canonical:
            orphaned = rows.orphaned_lanes(*self.owner, expired, ttl)
        if expired:
            previous = self._unleased
            self._unleased = {key: head for key, head in orphaned if head is not None}
            self._writer.on_rollback(lambda: setattr(self, "_unleased", previous))
            orphaned = [
                (key, head) for key, head in orphaned if head is None or previous.get(key) == head
            ]
        reclaim = not expired
        taken = [(key, self.take_lease(key, reclaim=reclaim)) for key, _ in orphaned]
        if reclaim:
            self._found_free = frozenset(key for key, grant in taken if grant == "free")
        return [key for key, grant in taken if grant is not None and grant != LOCKED]

    def found_unleased(self) -> frozenset[str]:
        """The lanes start-up claimed (:meth:`claim_orphaned_lanes` without ``expired``) that
        had no lease at all: what they hold (a turn marker, above all) was left by a process
        that may not be this instance, so a clean previous stop of this instance says nothing
        about them (empty on a single-instance store)."""
        return self._found_free

    def fence(self, session_key: str) -> None:
        """Within a write's transaction: raise :class:`LeaseLostError` unless this process's
        token still holds the lane's lease (no-op on a single-instance store)."""
        rows = self._backing.bound.leases
        if rows is not None:
            with self.fenced(session_key) as fence:
                if not rows.check_lease(session_key, fence["lease"]):
                    raise LeaseLostError("the lane's lease is held under another token")

    def fenced(self, session_key: str) -> AbstractContextManager[dict[str, str]]:
        """Around a write that fences itself (the backend checks the lease in the write's own
        statement): the keyword arguments to pass it, ``lease`` (the token) on a shared store
        and none otherwise, so a backend without leases never gets one. Raises
        :class:`LeaseLostError` when this process holds no lease on the lane, or when the
        backend found it lost; the lease is forgotten here then."""
        return UNFENCED if self._backing.bound.leases is None else self._leased(session_key)

    @contextmanager
    def _leased(self, session_key: str) -> Iterator[dict[str, str]]:
        """:meth:`fenced` on a shared store."""
        try:
            token = self._held.get(session_key)
            if token is None:
                raise LeaseLostError("this process holds no lease on the lane")
            yield {"lease": token}
        except LeaseLostError:
            self._held.pop(session_key, None)
            raise LeaseLostError(
                "this process no longer holds the lane's turn lease (it expired and another "
                "gateway took the lane over); nothing more of the turn is written. Raise "
                "storage.turn_lease_secs if the process pauses for longer than a quarter of it."
            ) from None
