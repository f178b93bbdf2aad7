"""The in-memory example backend passes the store contract kit (run by the project's test suite)."""

from __future__ import annotations

from pathlib import Path

import pytest

import hermes_memory_store
from hermes_core import GatewayConfig, SessionStore
from hermes_core.testing import fresh_plugin_manager
from hermes_core.testing.store_contract import StoreContract, StoreFactory


def open_memory_store(home: Path) -> SessionStore:
    """A store over the database ``memory://<home>`` (the same one again for the same home)."""
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    plugins = fresh_plugin_manager(home)
    plugins.register(hermes_memory_store, name="memory_store")
    settings = {"storage": {"url": f"memory://{home}"}}
    config = GatewayConfig.from_dict(settings, environ={"HERMES_HOME": str(home)})
    return SessionStore.open(config, plugins=plugins)


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def store_factory(self) -> StoreFactory:
        return open_memory_store
