"""Reading sample platform payloads the way a host does, for the reader tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hermes_core import MessageEvent, ReadContext, read_event, resolve_session_key
from hermes_core.testing import fresh_plugin_manager


def read(
    platform: str, payload: object, hermes_home: Path, context: ReadContext | None = None
) -> MessageEvent | None:
    """The event the platform's built-in reader finds in ``payload``."""
    return read_event(platform, payload, context=context, plugins=fresh_plugin_manager(hermes_home))


def keyed(
    platform: str, payload: Any, hermes_home: Path, context: ReadContext | None = None
) -> tuple[str, bool]:
    """(session key, shared multi-user flag) of the event in ``payload``, default settings."""
    event = read(platform, payload, hermes_home, context)
    assert event is not None, "the payload should read to an event"
    resolution = resolve_session_key(event.source, plugins=fresh_plugin_manager(hermes_home))
    return resolution.key, resolution.shared
