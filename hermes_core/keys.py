"""The import path ``hermes_core.keys`` of earlier releases, kept so that code written against
it goes on working; the names live in :mod:`hermes_core.domain.keys`."""

from __future__ import annotations

from hermes_core.domain.keys import (
    KeyResolution,
    SessionKeyParts,
    build_session_key,
    is_shared_multi_user_session,
    parse_session_key,
    resolve_for_config,
    resolve_session_key,
)

__all__ = [
    "KeyResolution",
    "SessionKeyParts",
    "build_session_key",
    "is_shared_multi_user_session",
    "parse_session_key",
    "resolve_for_config",
    "resolve_session_key",
]
