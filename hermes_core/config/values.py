"""What each configuration setting accepts: the value types of the schema in
:mod:`hermes_core.config.schema` and the two kinds of section it is built from.

Each value type carries the "what is accepted" text that error messages quote, and every number
has an upper bound so that no later arithmetic (dates, timeouts, sizes) can overflow. Paths and
URLs expand ``$HERMES_HOME`` (from the validation context) and ``~``. A field marked
:class:`Secret` may hold a credential and is never echoed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePath
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, model_validator
from pydantic.fields import FieldInfo

__all__ = [
    "SECTION_TEXT", "AnySecs", "ChatId", "Count", "CountOrZero", "Days", "DaysOrZero", "Flag",
    "OptFlag", "PathValue", "Secret", "Secs", "SecsOrZero", "Section", "SharedSection", "Url",
    "WholeDaysOrZero", "Words", "hermes_home", "is_secret", "unencodable_setting",
]  # fmt: skip

_SURROGATE = re.compile("[\ud800-\udfff]")


def unencodable_setting(data: object, path: str = "", depth: int = 0) -> str | None:
    """The dotted key of the first string (or key) in a configuration's ``data`` holding a UTF-16
    surrogate, which no file or database can store, or None. Checked before validation, so such
    a value is refused by name at load rather than failing later when the settings are
    serialised (values nested deeper than any setting are left to validation)."""
    if isinstance(data, str):
        return (path or "(top level)") if _SURROGATE.search(data) else None
    items: Iterator[tuple[str, object]]
    if isinstance(data, Mapping):
        for key in data:
            if isinstance(key, str) and _SURROGATE.search(key):
                return path or "(top level)"
        items = ((f"{path}.{key}" if path else str(key), value) for key, value in data.items())
    elif isinstance(data, list | tuple):
        items = ((f"{path}[{index}]", item) for index, item in enumerate(data))
    else:
        return None
    if depth >= _SETTING_DEPTH:
        return None
    for name, value in items:
        found = unencodable_setting(value, name, depth + 1)
        if found is not None:
            return found
    return None


_SETTING_DEPTH = 32
"""How deep :func:`unencodable_setting` looks (settings nest a few levels)."""


SECTION_TEXT = "a mapping of settings (null means defaults)"
"""What a section accepts, as error messages say it."""
_HOME_VAR = re.compile(r"\$(?:\{HERMES_HOME\}|HERMES_HOME\b)")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\x00-\x1f\x7f]*")
_MAX_COUNT = 1_000_000
_MAX_SECS = 31_536_000  # one year
_MAX_DAYS = 36_500  # about a century


def hermes_home(environ: Mapping[str, str]) -> Path:
    """``$HERMES_HOME`` (default ``~/.hermes``), user-expanded and absolute, symlinks kept."""
    raw = environ.get("HERMES_HOME", "")
    return Path(os.path.abspath(os.path.expanduser(raw if raw.strip() else "~/.hermes")))


def _expand(value: str, info: ValidationInfo) -> str:
    """Replace ``$HERMES_HOME`` with the home the constructor put in the validation context."""
    home = (info.context or {}).get("hermes_home") or hermes_home(os.environ)
    return _HOME_VAR.sub(lambda _: str(home), value)


def _path(value: Any, info: ValidationInfo) -> Any:
    """A non-empty path (string or path object), with ``$HERMES_HOME`` and ``~`` expanded."""
    if isinstance(value, str | PurePath):
        if not str(value).strip():
            raise ValueError("empty path")
        return Path(os.path.expanduser(_expand(str(value), info)))
    return value  # None, or a value that strict validation rejects


def _url(value: Any, info: ValidationInfo) -> Any:
    """A ``scheme://`` URL, with ``$HERMES_HOME`` expanded and ``~`` right after ``:///``."""
    if not isinstance(value, str):
        return value
    if not _URL.fullmatch(value):
        raise ValueError("not a URL")
    head, sep, rest = _expand(value, info).partition(":///")
    return head + sep + (os.path.expanduser(rest) if sep and rest.startswith("~") else rest)


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _int_to_str(value: Any) -> Any:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class Secret:
    """Marks a field whose value may hold a credential: never echoed in messages or ``repr``."""


def is_secret(field: FieldInfo) -> bool:
    """Whether ``field`` is marked :class:`Secret`."""
    return any(isinstance(item, Secret) for item in field.metadata)


# Value types. Each description is the "what is accepted" text of error messages.
Flag = Annotated[bool, Field(description="true or false (a YAML boolean)")]
OptFlag = Annotated[bool | None, Field(description="true, false or null (null inherits)")]
Count = Annotated[
    int, Field(gt=0, le=_MAX_COUNT, description=f"a positive integer up to {_MAX_COUNT}")
]
CountOrZero = Annotated[
    int, Field(ge=0, le=_MAX_COUNT, description=f"an integer >= 0 and up to {_MAX_COUNT}")
]
Secs = Annotated[
    float,
    Field(
        gt=0,
        le=_MAX_SECS,
        allow_inf_nan=False,
        description=f"a positive number of seconds up to {_MAX_SECS} (one year)",
    ),
]
SecsOrZero = Annotated[
    float,
    Field(
        ge=0,
        le=_MAX_SECS,
        allow_inf_nan=False,
        description=f"a number of seconds >= 0 and up to {_MAX_SECS} (one year)",
    ),
]
AnySecs = Annotated[
    float,
    Field(
        ge=-_MAX_SECS,
        le=_MAX_SECS,
        allow_inf_nan=False,
        description=f"a number of seconds from -{_MAX_SECS} to {_MAX_SECS} (one year)",
    ),
]
Days = Annotated[
    float,
    Field(
        gt=0,
        le=_MAX_DAYS,
        allow_inf_nan=False,
        description=f"a positive number of days up to {_MAX_DAYS}",
    ),
]
DaysOrZero = Annotated[
    float,
    Field(
        ge=0,
        le=_MAX_DAYS,
        allow_inf_nan=False,
        description=f"a number of days >= 0 and up to {_MAX_DAYS}",
    ),
]
WholeDaysOrZero = Annotated[
    int,
    Field(ge=0, le=_MAX_DAYS, description=f"a whole number of days >= 0 and up to {_MAX_DAYS}"),
]
PathValue = Annotated[
    Path | None,
    BeforeValidator(_path),
    Field(description="a non-empty path string ($HERMES_HOME and ~ expand)"),
]
Words = Annotated[tuple[Annotated[str, Field(pattern=r"^\S+$")], ...], BeforeValidator(_as_tuple)]
ChatId = Annotated[str, BeforeValidator(_int_to_str)]
"""A chat id; YAML may write it as an integer."""
Url = Annotated[str | None, BeforeValidator(_url), Secret()]
"""A ``scheme://`` URL; it may carry a password."""


class Section(BaseModel):
    """A section this library owns outright: strict values, unknown keys rejected."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_defaults(cls, data: Any) -> Any:
        if data is None:
            return {}
        return dict(data) if isinstance(data, Mapping) else data

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        """Fields as pydantic shows them, with a set secret shown as ``'***'``."""
        fields = type(self).model_fields
        for name, value in super().__repr_args__():
            secret = name in fields and is_secret(fields[name]) and value is not None
            yield name, "***" if secret else value


class SharedSection(Section):
    """A section shared with the host: unknown keys belong to the host and are ignored, with a
    warning when one looks like a misspelling of ours."""

    model_config = ConfigDict(extra="ignore")
