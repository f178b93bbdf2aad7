"""A bounded map kept in order of use, for the caches on a turn's path (entries, prompts, seen
messages). An ``OrderedDict`` underneath: a hit or an insert is a few C calls, where
``cachetools``' caches run several Python frames on every access."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

_K = TypeVar("_K")
_V = TypeVar("_V")


class Recent(OrderedDict[_K, _V]):
    """At most ``size`` keys, least recently used first (not locked: callers that share one
    across threads hold their own lock)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def use(self, key: _K) -> _V | None:
        """The key's value, now the most recently used; None when absent."""
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def put(self, key: _K, value: _V) -> list[_K]:
        """Set the key as the most recently used; the keys dropped to stay within ``size``."""
        self[key] = value
        self.move_to_end(key)
        dropped = []
        while len(self) > self.size:
            dropped.append(self.popitem(last=False)[0])
        return dropped
