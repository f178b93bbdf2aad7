"""What the store may ask of its backend: the backend checked against its ``StoreSpec``.

:func:`bind_backend` runs once per opened backend. A method missing from the required
:class:`~hermes_core.store.backend.StoreBackend` protocol, or from a capability the spec declares,
is a :class:`~hermes_core.domain.errors.StoreContractError` naming the plugin; a capability the spec
does not declare turns its feature off, with one warning each (none for the core's own JSONL
fallback, whose one degraded-mode warning says it all).
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
    SearchCapable,
    StoreBackend,
    TranscriptEditing,
    TurnLeases,
)

logger = logging.getLogger(__name__)

PROTOCOLS: dict[StoreCapability, type] = {
    "search": SearchCapable,
    "transcript_edits": TranscriptEditing,
    "pruning": Pruning,
    "ledger": LedgerRows,
    "queue": DurableQueue,
    "restart_counts": RestartCountRows,
    "maintenance": Maintenance,
}
"""The protocol a backend implements for each capability it declares."""

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
"""What the store does without each capability (the warning's text)."""


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
    """Set when the spec is not ``single_instance``: several gateways share the store."""
    wakeups: LaneWakeups | None = None
    """Set when the spec declares ``lane_wakeups`` on a shared store."""

    def offers(self) -> dict[str, bool]:
        """Each capability, and whether this backend offers it."""
        return {name: name in self.spec.capabilities for name in STORE_CAPABILITIES}


def bind_backend(spec: StoreSpec, backend: Any, plugin: str, *, warn: bool = True) -> BoundBackend:
    """Check ``backend`` (opened by ``spec`` of ``plugin``) against what the spec declares."""
    missing = [name for name in protocol_methods(StoreBackend) if not _has(backend, name)]
    for capability in sorted(spec.capabilities):
        missing += [
            f"{name} ({capability})"
            for name in protocol_methods(PROTOCOLS[capability])
            if not _has(backend, name) and name not in protocol_methods(StoreBackend)
        ]
    if not spec.single_instance:
        missing += [
            f"{name} (turn leases)"
            for name in protocol_methods(TurnLeases)
            if not _has(backend, name)
        ]
    if spec.parallel_writers:
        missing += [
            f"{name} (parallel writers)"
            for name in protocol_methods(ParallelWriters)
            if not _has(backend, name)
        ]
    if spec.lane_wakeups:
        missing += [
            f"{name} (lane wake-ups)"
            for name in protocol_methods(LaneWakeups)
            if not _has(backend, name)
        ]
    if missing:
        raise StoreContractError(
            f"storage plugin {plugin!r} opened a {spec.name!r} backend that lacks "
            f"{', '.join(missing)}: implement them in the backend (or remove the capability from "
            "its StoreSpec.capabilities; turn leases are needed unless "
            "StoreSpec.single_instance, ParallelWriters with StoreSpec.parallel_writers, "
            "LaneWakeups with StoreSpec.lane_wakeups), or disable the plugin and choose another "
            "storage.url."
        )
    if warn:
        for capability in STORE_CAPABILITIES:
            quiet = capability == "restart_counts" and spec.single_instance
            if capability not in spec.capabilities and not quiet:
                logger.warning(
                    "storage backend %r (plugin %r) does not offer %s: %s",
                    spec.name, plugin, capability, WITHOUT[capability],
                )  # fmt: skip
    offered = spec.capabilities
    return BoundBackend(
        spec=spec,
        backend=cast(StoreBackend, backend),
        search=cast(SearchCapable, backend) if "search" in offered else None,
        edits=cast(TranscriptEditing, backend) if "transcript_edits" in offered else None,
        pruning=cast(Pruning, backend) if "pruning" in offered else None,
        ledger=cast(LedgerRows, backend) if "ledger" in offered else None,
        queue=cast(DurableQueue, backend) if "queue" in offered else None,
        counts=cast(RestartCountRows, backend) if "restart_counts" in offered else None,
        maintenance=cast(Maintenance, backend) if "maintenance" in offered else None,
        leases=None if spec.single_instance else cast(TurnLeases, backend),
        wakeups=cast(LaneWakeups, backend)
        if spec.lane_wakeups and not spec.single_instance
        else None,
    )


def _has(backend: object, name: str) -> bool:
    return callable(getattr(backend, name, None))
