"""The gateway's configuration: the schema and its values (:mod:`.schema`, :mod:`.values`), the
YAML file and the environment that feed it (:mod:`.loading`, :mod:`.environment`), and the
messages a refused value gets (:mod:`.messages`)."""

from __future__ import annotations

from hermes_core.config.schema import GatewayConfig

__all__ = ["GatewayConfig"]
