"""What the store's services share: the writer-step decorators, the entry copy, new session
ids and the constants of the store's own ``state_meta`` records."""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from hermes_core.domain.models import SessionEntry
from hermes_core.store.writer import StoreWriter

MIRROR_IMPORTED = "sessions_json_imported"
"""``state_meta`` name recording that sessions.json was imported once (its time)."""
KEY_SCHEMA_META = "key_schema"
"""``state_meta`` name of the store's session-key schema: ``v1``, ``v2`` or :data:`REKEYING`."""
REKEYING = "v1>v2"
"""The recorded schema while ``rekey`` moves lanes from v1 to v2 (until its last batch)."""
MAINTENANCE_BATCH = 1_000
"""Rows one housekeeping step of the writer changes at most: a long pass goes in many short
steps, and the turns' steps run between them instead of waiting for the whole pass."""


class PhaseProgress(Protocol):
    """Told of a long operation's progress: ``count`` more items of phase ``phase`` done, of
    ``total`` (0: unknown). A re-key tells ``reading`` rows and ``moving`` batches; an import
    of sessions.json, ``reading`` entries and ``writing`` them."""

    def __call__(self, phase: str, count: int, *, total: int) -> None: ...


def untold(phase: str, count: int, *, total: int) -> None:
    """A :class:`PhaseProgress` for no progress to show."""


class OnWriter(Protocol):
    """A service whose mutating methods run on the store's writer."""

    _writer: StoreWriter


_S = TypeVar("_S", bound=OnWriter)
_P = ParamSpec("_P")
_T = TypeVar("_T")


def new_session_id(now: datetime) -> str:
    """``YYYYMMDD_HHMMSS_<8 hex>`` from the creation time (UTC) and 32 random bits."""
    return f"{now:%Y%m%d_%H%M%S}_{secrets.token_hex(4)}"


def changed(entry: SessionEntry, updates: Mapping[str, Any]) -> SessionEntry:
    """A copy of ``entry`` with ``updates`` set, unvalidated (``model_copy``): the store's
    updates are values it made itself, and the entry in its cache must not change."""
    return entry.model_copy(update=updates)


def _on_writer(
    method: Callable[Concatenate[_S, _P], _T], *, alone: bool
) -> Callable[Concatenate[_S, _P], _T]:
    def run(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        writer = self._writer
        if writer.on_writer_thread:
            return method(self, *args, **kwargs)
        return writer.run(functools.partial(method, self, *args, **kwargs), alone=alone)

    functools.update_wrapper(run, method)
    return run


def serialised(method: Callable[Concatenate[_S, _P], _T]) -> Callable[Concatenate[_S, _P], _T]:
    """Run a mutating store method on the store's writer thread (see ``writer``): it returns
    once its writes are committed, and never interleaves with another mutation."""
    return _on_writer(method, alone=False)


def exclusive(method: Callable[Concatenate[_S, _P], _T]) -> Callable[Concatenate[_S, _P], _T]:
    """Like :func:`serialised`, but outside any group commit: for maintenance whose own reads
    (through other connections) must see what it has just written."""
    return _on_writer(method, alone=True)
