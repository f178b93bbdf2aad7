"""The store contract on PostgreSQL, for one gateway and shared by several (turn leases, lane
wake-ups); needs ``HERMES_TEST_POSTGRES_URL`` (``.ci/run`` sets it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import POSTGRES_SKIP_REASON, POSTGRES_URL
from hermes_core import GatewayConfig
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager
from hermes_core.testing.deployment_contract import DeploymentContract
from hermes_core.testing.store_contract import StoreContract, StoreFactory

pytestmark = pytest.mark.skipif(not POSTGRES_URL, reason=POSTGRES_SKIP_REASON)


def postgres_factory(url: str, instances: str = "single") -> StoreFactory:
    def open_store(home: Path) -> SessionStore:
        environ = {"HERMES_HOME": str(home)}
        settings = {"storage": {"url": url, "instances": instances}}
        config = GatewayConfig.from_dict(settings, environ=environ)
        return SessionStore.open(config, plugins=fresh_plugin_manager(home, **settings))

    return open_store


class TestPostgresStore(StoreContract):
    @pytest.fixture
    def store_factory(self, empty_database: str) -> StoreFactory:
        return postgres_factory(empty_database)


class TestSharedPostgresStore(DeploymentContract):
    """Shared by several gateways: the capabilities (turn leases, lane wake-ups) alone, since the
    required tests write turns without the lease a shared store asks for."""

    @pytest.fixture
    def store_factory(self, empty_database: str) -> StoreFactory:
        return postgres_factory(empty_database, instances="shared")
