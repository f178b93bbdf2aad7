"""The built-in platforms' connectors (imported when ``hermes-sessions serve`` or a host builds
one; they need the ``serve`` extra)."""
