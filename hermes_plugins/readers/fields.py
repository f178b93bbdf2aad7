"""Typed access to a JSON object from a platform payload; every failure names the field's path."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hermes_core.domain.errors import MalformedEventError, shown
from hermes_core.domain.models import MessageType

_ID_LIMIT = 2**64
"""Integer ids are 64-bit at most on every platform."""


def malformed(
    path: str, problem: str, fix: str = "pass the payload exactly as the platform delivered it"
) -> MalformedEventError:
    """The error for the field at ``path``: ``<path> <problem>; <fix>.``"""
    return MalformedEventError(path, f"{path} {problem}; {fix}.")


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


class Fields:
    """A JSON object found at ``path`` in a payload, read field by field."""

    def __init__(self, data: object, path: str) -> None:
        if not isinstance(data, Mapping):
            raise malformed(path, f"must be a JSON object, got {_kind(data)}")
        self.data: Mapping[str, Any] = data
        self.path = path

    def _at(self, name: str) -> str:
        return f"{self.path}.{name}"

    def has(self, name: str) -> bool:
        """Whether ``name`` is present and not null."""
        return self.data.get(name) is not None

    def obj(self, name: str) -> Fields:
        """The required object ``name``."""
        return Fields(self.data.get(name), self._at(name))

    def opt_obj(self, name: str) -> Fields | None:
        """The object ``name``, or None when absent or null."""
        return self.obj(name) if self.has(name) else None

    def objs(self, name: str) -> list[Fields]:
        """The list of objects ``name`` (empty when absent or null)."""
        value = self.data.get(name)
        if value is None:
            return []
        if not isinstance(value, list):
            raise malformed(self._at(name), f"must be a list, got {_kind(value)}")
        return [Fields(item, f"{self._at(name)}[{index}]") for index, item in enumerate(value)]

    def id(self, name: str) -> str:
        """The required id ``name``: a non-empty string, or an integer as its decimal string."""
        value = self.opt_id(name)
        if value is None:
            raise malformed(self._at(name), "is required")
        return value

    def opt_id(self, name: str) -> str | None:
        """The id ``name``, or None when absent or null."""
        value = self.data.get(name)
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) >= _ID_LIMIT:
                raise malformed(self._at(name), "is an integer too large to be an id")
            return str(value)
        if isinstance(value, str) and value:
            return value
        got = shown(value) if isinstance(value, str | float | bool) else _kind(value)
        raise malformed(self._at(name), f"must be a non-empty string or an integer, got {got}")

    def text(self, name: str) -> str | None:
        """The string ``name``, or None when absent or null."""
        value = self.data.get(name)
        if value is None or isinstance(value, str):
            return value
        raise malformed(self._at(name), f"must be a string, got {_kind(value)}")

    def flag(self, name: str) -> bool:
        """The boolean ``name``; absent or null is False."""
        value = self.data.get(name)
        if value is None or isinstance(value, bool):
            return bool(value)
        raise malformed(self._at(name), f"must be true or false, got {_kind(value)}")

    def integer(self, name: str) -> int | None:
        """The integer ``name``, or None when absent or null."""
        value = self.data.get(name)
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise malformed(self._at(name), f"must be an integer, got {_kind(value)}")


def media_type(mime: str | None) -> MessageType:
    """The message type of an attachment with MIME type ``mime`` (unknown: a document)."""
    major = (mime or "").split("/", 1)[0].lower()
    return {
        "image": MessageType.PHOTO,
        "video": MessageType.VIDEO,
        "audio": MessageType.AUDIO,
    }.get(major, MessageType.DOCUMENT)
