"""Built-in plugins of hermes-sessions, registered exactly like third-party ones.

``BUILTIN_PLUGINS`` lists (plugin name, module) pairs; ``create_plugin_manager`` registers them
first, in this order. The same names are declared in the ``hermes.plugins`` entry-point group.
"""

from __future__ import annotations

BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("platforms", "hermes_plugins.platforms"),
    ("telegram", "hermes_plugins.telegram"),
    ("discord", "hermes_plugins.discord"),
    ("slack", "hermes_plugins.slack"),
    ("whatsapp", "hermes_plugins.whatsapp"),
    ("sql_store", "hermes_plugins.sql_store"),
    ("recovery_steps", "hermes_plugins.recovery_steps"),
    ("eviction", "hermes_plugins.eviction"),
)

GENERIC_PLATFORMS_PLUGIN = "platforms"
"""The built-in whose platforms follow the generic key rule with nothing specific to add: each of
them yields to another plugin that registers the same platform (listed as replaced)."""

ESSENTIAL_PLUGINS: frozenset[str] = frozenset({"sql_store", "recovery_steps", "eviction"})
"""Built-ins whose loss breaks the gateway: disabling one is a configuration error unless other
plugins provide what it did (the ``storage.url`` scheme, the recovery steps by name, a policy)."""
