"""What the store may ask of its backend: the backend checked against its ``StoreSpec``.

:func:`bind_backend` runs once per opened backend. A method missing from the required
:class:`~hermes_core.store.backend.StoreBackend` protocol, or from the protocol of a capability
the spec declares, is a :class:`~hermes_core.domain.errors.StoreContractError` naming the plugin;
each capability with a protocol is then bound (None when not declared), so callers ask the
:class:`BoundBackend` instead of probing the backend. A feature the spec does not declare
(:data:`WITHOUT`) is turned off, with one warning each (none for the core's own JSONL fallback,
whose one degraded-mode warning says it all).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, cast

from hermes_core.domain.errors import StoreContractError
from hermes_core.domain.specs import STORE_CAPABILITIES, StoreCapability, StoreSpec
from hermes_core.store.backend import (
    DurableQueue,
    LaneWakeups,
    LedgerRows,
    Maintenance,
    ParallelWriters,
    Pruning,
    RestartCountRows,
    RouteBatches,
    SearchCapable,
    StoreBackend,
    TranscriptEditing,
    TurnLeases,
)
from hermes_core.store.operator import OperatorBackend

logger = logging.getLogger(__name__)

PROTOCOLS: dict[StoreCapability, type] = {
    "search": SearchCapable,
    "transcript_edits": TranscriptEditing,
    "pruning": Pruning,
    "ledger": LedgerRows,
    "queue": DurableQueue,
    "restart_counts": RestartCountRows,
    "maintenance": Maintenance,
    "turn_leases": TurnLeases,
    "parallel_writers": ParallelWriters,
    "lane_wakeups": LaneWakeups,
    "operator": OperatorBackend,
    "route_batches": RouteBatches,
}
"""The protocol a backend implements for each capability it declares (``atomic_batches`` and
``local_state`` change how the store uses the required protocol, and have none)."""

WITHOUT: dict[StoreCapability, str] = {
    "search": "search() returns no hits",
    "transcript_edits": "rewrite_transcript() and soft_delete_messages() raise "
    "TranscriptWriteError",
    "pruning": "prune_old_entries() removes nothing",
    "ledger": "replies are sent without the delivery ledger",
    "queue": "queued events are kept in memory only",
    "restart_counts": "restart counts are kept in this instance's restart_counts.json",
    "maintenance": "the key schema is not recorded; sessions.json imports, the JSONL backlog "
    "replay and re-keying are unavailable",
}
"""The features the store turns off without a capability (the warning's text); the other
capabilities' absence is a choice (one gateway at a time, one writer, state elsewhere)."""


def protocol_methods(protocol: type) -> list[str]:
    """The methods ``protocol`` (with the protocols it extends) declares, sorted."""
    names = {
        name
        for klass in protocol.__mro__
        if getattr(klass, "_is_protocol", False) and klass.__module__ != "typing"
        for name, value in vars(klass).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }
    return sorted(names)


@dataclass(frozen=True)
class BoundBackend:
    """An opened backend and the capabilities it was checked to offer (None: not offered)."""

    spec: StoreSpec
    backend: StoreBackend
    search: SearchCapable | None = None
    edits: TranscriptEditing | None = None
    pruning: Pruning | None = None
    ledger: LedgerRows | None = None
    queue: DurableQueue | None = None
    counts: RestartCountRows | None = None
    maintenance: Maintenance | None = None
    leases: TurnLeases | None = None
    """Set with ``turn_leases``: several gateways share the store."""
    writers: ParallelWriters | None = None
    wakeups: LaneWakeups | None = None
    """Set with ``lane_wakeups`` on a shared store (``turn_leases``)."""
    operator: OperatorBackend | None = None
    batches: RouteBatches | None = None
    """Set with ``route_batches``: a writer batch reads its uncached lanes' routes at once."""

    def offers(self) -> dict[str, bool]:
        """Each capability, and whether this backend offers it."""
        return {name: name in self.spec.capabilities for name in STORE_CAPABILITIES}


def bind_backend(spec: StoreSpec, backend: Any, plugin: str, *, warn: bool = True) -> BoundBackend:
    """Check ``backend`` (opened by ``spec`` of ``plugin``) against what the spec declares."""
    required = protocol_methods(StoreBackend)
    missing = [name for name in required if not _has(backend, name)]
    for capability in sorted(spec.capabilities):
        if capability in PROTOCOLS:
            missing += [
                f"{name} ({capability})"
                for name in protocol_methods(PROTOCOLS[capability])
                if not _has(backend, name) and name not in required
            ]
    if missing:
        raise StoreContractError(
            f"storage plugin {plugin!r} opened a {spec.name!r} backend that lacks "
            f"{', '.join(missing)}: implement them in the backend (or remove the capability from "
            "its StoreSpec.capabilities), or disable the plugin and choose another storage.url."
        )
    if warn:
        for capability, without in WITHOUT.items():
            quiet = capability == "restart_counts" and "turn_leases" not in spec.capabilities
            if capability not in spec.capabilities and not quiet:
                logger.warning(
                    "storage backend %r (plugin %r) does not offer %s: %s",
                    spec.name, plugin, capability, without,
                )  # fmt: skip
    offered = spec.capabilities

    def bound(capability: StoreCapability) -> Any:
        return backend if capability in offered else None

    shared = "turn_leases" in offered
    return BoundBackend(
        spec=spec,
        backend=cast(StoreBackend, backend),
        search=bound("search"),
        edits=bound("transcript_edits"),
        pruning=bound("pruning"),
        ledger=bound("ledger"),
        queue=bound("queue"),
        counts=bound("restart_counts"),
        maintenance=bound("maintenance"),
        leases=bound("turn_leases"),
        writers=bound("parallel_writers"),
        wakeups=bound("lane_wakeups") if shared else None,
        operator=bound("operator"),
        batches=bound("route_batches"),
    )


def _has(backend: object, name: str) -> bool:
    return callable(getattr(backend, name, None))
