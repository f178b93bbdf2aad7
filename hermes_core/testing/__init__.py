"""Helpers for testing hermes-sessions and its plugins (importable without pytest).

The store contract kit, :class:`hermes_core.testing.store_contract.StoreContract`, is a pytest
suite and needs the ``test`` extra (``pip install 'hermes-sessions[test]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.models import SessionSource
from hermes_core.domain.specs import LifecycleEvent, RecoveryStep
from hermes_core.plugins.manager import HermesPluginManager, create_plugin_manager, hookimpl


def fresh_plugin_manager(hermes_home: Path, **config: Any) -> HermesPluginManager:
    """A strict manager of the built-in plugins for a state directory (no entry points)."""
    settings = GatewayConfig.from_dict(config, environ={"HERMES_HOME": str(hermes_home)})
    return create_plugin_manager(settings, load_entrypoints=False, strict=True)


class LifecycleRecorder:
    """A lifecycle observer plugin that records the kinds of the events it sees, in order."""

    def __init__(self) -> None:
        self.kinds: list[str] = []

    @hookimpl
    def hermes_on_lifecycle_event(self, event: LifecycleEvent) -> None:
        self.kinds.append(event.kind)


class RecoveryStepsPlugin:
    """A plugin registering the given recovery steps (to test step ordering and isolation)."""

    def __init__(self, *steps: RecoveryStep) -> None:
        self.steps = list(steps)

    @hookimpl
    def hermes_register_recovery_steps(self, config: GatewayConfig) -> list[RecoveryStep]:
        return self.steps


def telegram_dm(chat_id: str = "99", **fields: Any) -> SessionSource:
    """A Telegram DM source (the lane ``agent:main:telegram:dm:c=<chat_id>``)."""
    return SessionSource(platform="telegram", chat_id=chat_id, **fields)
