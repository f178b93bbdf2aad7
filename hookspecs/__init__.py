"""Hook specifications of hermes-sessions (installed as ``hermes_hookspecs``).

The pluggy project name is ``hermes``; every hook name starts with ``hermes_``. Each module holds
one concern and documents, for every hook, when it is called, its call mode, its arguments, what it
returns and its failure policy. Implementations use ``hermes_core.hookimpl``.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "hermes"
"""The pluggy project name shared by the spec and implementation markers."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
"""Marker for hook specifications (used only inside this package)."""

SPEC_MODULES: tuple[str, ...] = (
    "hermes_hookspecs.platforms",
    "hermes_hookspecs.storage",
    "hermes_hookspecs.recovery",
    "hermes_hookspecs.eviction",
    "hermes_hookspecs.lifecycle",
)
"""Import paths of every hook specification module, in registration order."""
