"""The built-in platforms' connectors (imported when ``hermes-sessions serve`` or a host builds
one; they need the ``serve`` extra)."""

from __future__ import annotations

import importlib
from typing import Any

from hermes_core import ConnectorContext, ConnectorSpec


def lazy_connector(platform: str, builder: str, summary: str) -> ConnectorSpec:
    """The ``ConnectorSpec`` of a built-in connector whose module is imported only when the
    connector is built, so registering it needs none of the ``serve`` extra's packages.

    ``builder`` names the callable that takes the ``ConnectorContext`` as
    ``"<module>:<name>"``, the module inside this package (``"telegram:build_telegram"``)."""
    module, _, name = builder.partition(":")

    def build(context: ConnectorContext) -> Any:
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)(context)

    return ConnectorSpec(platform=platform, build=build, summary=summary)
