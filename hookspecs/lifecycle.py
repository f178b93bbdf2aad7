"""Lifecycle observers: notified after a change has been committed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hermes_hookspecs import hookspec

if TYPE_CHECKING:
    from hermes_core.domain.specs import LifecycleEvent


@hookspec
def hermes_on_lifecycle_event(event: LifecycleEvent) -> None:
    """Observe one lifecycle event (:class:`hermes_core.LifecycleEvent`) after it was committed.

    **When:** after the commit of: a session created, reset, suspended, replaced or reopened;
    resume marked or cleared; a turn started or ended; an agent soft-released or fully cleaned up;
    a queue item accepted, refused, merged or discarded; a delivery-ledger transition (its
    ``detail`` names the ``state``, the ``platform`` and, for a failed send, the
    ``failure_kind``); a recovery step's result; a store commit (``store_committed``, on the
    store's writer thread, with the ``seconds`` it took and the writer ``steps`` it held); a
    lane taken over from a gateway process whose lease expired (``lane_taken_over``).
    ``event.kind`` names which.

    **Mode:** every implementation is called on its own, in pluggy's call order: the last
    registered plugin first, ``tryfirst=True`` implementations before the others and
    ``trylast=True`` ones after them. Return values are ignored. Hook wrappers are refused at
    registration.

    **Arguments:** ``event``, a frozen record with the kind, the session key and id (when the event
    concerns a session), the time, and a small ``detail`` mapping.

    **Failure policy:** observers cannot veto or modify anything and must not block (hand slow work
    to a thread or task). An exception is logged with the plugin's name and ignored: it never breaks
    a turn, and the other observers still run.
    """
