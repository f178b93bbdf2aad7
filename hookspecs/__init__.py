"""Hook specifications of hermes-sessions (installed as ``hermes_hookspecs``).

The pluggy project name is ``hermes``; every hook name starts with ``hermes_``. Each module holds
one concern and documents, for every hook, when it is called, its call mode, its arguments, what it
returns and its failure policy. Implementations use ``hermes_core.hookimpl``.

Call semantics shared by every hook: the plugin manager calls each implementation on its own, so a
failure is isolated and attributed to its plugin, in pluggy's call order: the last registered
plugin first, with ``hookimpl(tryfirst=True)`` moved to the front and ``hookimpl(trylast=True)`` to
the back. Hook wrappers (``hookimpl(wrapper=True)`` or ``hookwrapper=True``) are refused when the
plugin is registered (a ``PluginError`` naming it), as is an implementation of a hook that does
not exist unless marked ``optionalhook=True``.
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
    "hermes_hookspecs.connectors",
)
"""Import paths of every hook specification module, in registration order."""
