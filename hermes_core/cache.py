"""The import path ``hermes_core.cache`` of earlier releases, kept so that code written against
it goes on working; the names live in :mod:`hermes_core.gateway.cache`."""

from __future__ import annotations

from hermes_core.gateway.cache import (
    AgentBusyError,
    AgentCache,
)

__all__ = [
    "AgentBusyError",
    "AgentCache",
]
