"""What every part of the store contract kit shares (needs pytest, the ``test`` extra): the
``store`` fixture, the skip by capability, and the reach to the store's bound backend."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hermes_core.domain.specs import StoreCapability
from hermes_core.store import SessionStore
from hermes_core.store.capabilities import BoundBackend

StoreFactory = Callable[[Path], SessionStore]
"""Opens the store under test for a state directory."""

DM_KEY = "agent:main:telegram:dm:c=99"
"""The lane of :func:`~hermes_core.testing.telegram_dm` ``()``."""


class ContractBase:
    """The fixture and helpers of the kit's test classes."""

    @pytest.fixture
    def store(self, store_factory: StoreFactory, tmp_path: Path) -> Iterator[SessionStore]:
        opened = store_factory(tmp_path / "state")
        yield opened
        opened.close()

    @staticmethod
    def offers(store: SessionStore, capability: StoreCapability, *, wanted: bool = True) -> None:
        """Skip the calling test unless the backend's offer of ``capability`` is ``wanted``."""
        if store.health()["capabilities"][capability] is not wanted:
            verb = "does not offer" if wanted else "offers"
            pytest.skip(f"the backend {verb} {capability!r}")

    @staticmethod
    def bound(store: SessionStore) -> BoundBackend:
        """The store's backend, bound to the capabilities it was checked to offer: a
        capability's promise is tested on the protocol the backend implements for it."""
        return store._backing.bound
