"""The store contract on the default SQLite backend."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from hermes_core import GatewayConfig
from hermes_core.domain.models import SessionEntry
from hermes_core.store import SessionStore
from hermes_core.store.base import changed
from hermes_core.testing import fresh_plugin_manager, telegram_dm
from hermes_core.testing.store_contract import StoreContract, StoreFactory


def open_sqlite_store(home: Path) -> SessionStore:
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(home)})
    return SessionStore.open(config, plugins=fresh_plugin_manager(home))


class TestSqliteStore(StoreContract):
    @pytest.fixture
    def store_factory(self) -> StoreFactory:
        return open_sqlite_store


@pytest.mark.parametrize(
    "updates",
    [
        {"updated_at": datetime(2026, 12, 1, 7, 0, tzinfo=timezone.utc)},
        {"active_turn_token": "b" * 32, "active_turn_started_at": None, "suspended": True},
        {"metadata": {"a": [1]}},
        {},
    ],
)
def test_changed_entry_is_the_model_copy(updates: dict[str, Any]) -> None:
    """The store's copy of an entry is ``model_copy(update=...)`` in every part: field values,
    fields set, extra and private data."""
    entry = SessionEntry(
        session_key="agent:main:telegram:dm:99", session_id="20261130_075200_0a1b2c3d",
        created_at=datetime(2026, 11, 30, tzinfo=timezone.utc),
        updated_at=datetime(2026, 11, 30, tzinfo=timezone.utc),
        origin=telegram_dm("99"), active_turn_token="a" * 32, input_tokens=3,
    )  # fmt: skip
    copied, expected = changed(entry, updates), entry.model_copy(update=updates)
    assert type(copied) is type(expected)
    assert copied.__dict__ == expected.__dict__
    assert copied.model_fields_set == expected.model_fields_set
    assert copied.__pydantic_extra__ == expected.__pydantic_extra__
    assert copied.__pydantic_private__ == expected.__pydantic_private__
    assert copied == expected
    assert copied.to_dict() == expected.to_dict()
    assert copied.__dict__ is not entry.__dict__
    assert copied.model_fields_set is not entry.model_fields_set
