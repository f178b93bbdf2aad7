"""The store contract on the default SQLite backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from hermes_core import GatewayConfig
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager
from hermes_core.testing.store_contract import StoreContract, StoreFactory


def open_sqlite_store(home: Path) -> SessionStore:
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(home)})
    return SessionStore.open(config, plugins=fresh_plugin_manager(home))


class TestSqliteStore(StoreContract):
    @pytest.fixture
    def store_factory(self) -> StoreFactory:
        return open_sqlite_store
