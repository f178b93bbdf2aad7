"""Text normalisation at the model boundary: what is stored is what is read back.

Chat metadata and message text come from platforms and bridges that may hand over strings no
encoder accepts: an emoji cut in half (a lone UTF-16 surrogate) or a NUL byte (PostgreSQL text
refuses it). Every text field of a ``SessionSource``, a ``MessageEvent`` and a stored message goes
through :func:`clean_text` once, identically for every backend, so such input is stored in a
normal form instead of failing deep inside a driver.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from hermes_core.domain.errors import InvalidValueError, shown

MAX_NESTING = 64
"""How deep lists and mappings inside metadata and messages may nest."""

_SURROGATE_RE = re.compile("[\ud800-\udfff]")
_SCALARS = frozenset({type(None), bool, int, float})
"""Exact types :func:`clean_value` returns as they are (a float only when finite)."""


def clean_text(value: str) -> str:
    """``value`` with NUL removed, surrogate pairs joined into their character and lone
    surrogates replaced by U+FFFD; every other string comes back unchanged (the same object)."""
    if "\x00" in value:
        value = value.replace("\x00", "")
    if value.isascii() or _SURROGATE_RE.search(value) is None:
        return value
    return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def exact_text_problem(value: str) -> str | None:
    """Why ``value`` cannot be kept exactly as given, or None: a NUL or a UTF-16 surrogate,
    which :func:`clean_text` would remove or replace. Ids are refused rather than cleaned, so two
    ids differing only by such characters never become one."""
    if "\x00" in value:
        return "it holds a NUL character"
    if not value.isascii() and _SURROGATE_RE.search(value) is not None:
        return "it holds a UTF-16 surrogate (half of a character), which cannot be stored"
    return None


def clean_value(value: Any, *, field: str, plain: bool = False, depth: int = 0) -> Any:
    """``value`` with :func:`clean_text` applied to every string in it (mapping keys included),
    through lists, tuples and mappings; deeper nesting than :data:`MAX_NESTING` is refused.
    ``plain``: only JSON values are allowed (strings, finite numbers, booleans, None, lists and
    mappings with string keys), as a transcript message must hold."""
    if isinstance(value, str):
        return clean_text(value)
    kind = type(value)
    if kind in _SCALARS and (kind is not float or math.isfinite(value)):
        return value  # told by exact type, before any abstract-class check
    is_mapping = kind is dict or (kind is not list and isinstance(value, Mapping))
    if is_mapping or isinstance(value, (list, tuple)):
        if depth >= MAX_NESTING:
            raise InvalidValueError(
                field, f"{field} nests lists or mappings more than {MAX_NESTING} levels deep."
            )
        if is_mapping:
            cleaned_map: dict[Any, Any] = {}
            for key, item in value.items():
                if plain and not isinstance(key, str):
                    raise InvalidValueError(field, f"{field} has a non-string key {shown(key)}.")
                name = clean_text(key) if isinstance(key, str) else key
                cleaned_map[name] = (
                    clean_text(item)  # the common item, without a call of this function
                    if type(item) is str
                    else clean_value(item, field=field, plain=plain, depth=depth + 1)
                )
            return cleaned_map
        cleaned = [clean_value(item, field=field, plain=plain, depth=depth + 1) for item in value]
        return cleaned if isinstance(value, list) or plain else tuple(cleaned)
    if plain and not (
        value is None
        or isinstance(value, (bool, int))
        or (isinstance(value, float) and math.isfinite(value))
    ):
        raise InvalidValueError(
            field,
            f"{field} holds {shown(value)}, which is not a JSON value; pass strings, finite "
            "numbers, booleans, None, lists and mappings only.",
        )
    return value
