"""The import path ``hermes_core.text`` of earlier releases, kept so that code written against
it goes on working; the names live in :mod:`hermes_core.domain.text`."""

from __future__ import annotations

from hermes_core.domain.text import (
    clean_text,
)

__all__ = [
    "clean_text",
]
