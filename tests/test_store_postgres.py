"""The store contract on PostgreSQL (needs ``HERMES_TEST_POSTGRES_URL``; ``.ci/run`` sets it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import POSTGRES_SKIP_REASON, POSTGRES_URL
from hermes_core import GatewayConfig
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager
from hermes_core.testing.store_contract import StoreContract, StoreFactory

pytestmark = pytest.mark.skipif(not POSTGRES_URL, reason=POSTGRES_SKIP_REASON)


def postgres_factory(url: str) -> StoreFactory:
    def open_store(home: Path) -> SessionStore:
        environ = {"HERMES_HOME": str(home)}
        config = GatewayConfig.from_dict({"storage": {"url": url}}, environ=environ)
        return SessionStore.open(config, plugins=fresh_plugin_manager(home))

    return open_store


class TestPostgresStore(StoreContract):
    @pytest.fixture
    def store_factory(self, empty_database: str) -> StoreFactory:
        return postgres_factory(empty_database)
