"""Explaining a configuration value that the schema refuses, or a host's key that looks like ours.

Both walk the section models of :mod:`hermes_core.config.schema` by the keys a file uses. A pydantic
:class:`~pydantic.ValidationError` becomes a :class:`~hermes_core.domain.errors.ConfigError` naming
the dotted key, the file and what is accepted, and showing the rejected value only where it cannot
be a credential.
"""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Iterator, Mapping
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from hermes_core.config.loading import HugeInteger, dotted
from hermes_core.config.values import SECTION_TEXT, SharedSection, is_secret
from hermes_core.domain.errors import ConfigError

__all__ = ["config_error", "near_misses"]

_INTERNAL_FIELDS = ("hermes_home", "source")  # set by the constructors, never by the file
_NEAR_MISS_CUTOFF = 0.8  # how alike a host's key must be to one of ours to warn about it


def near_misses(
    data: Mapping[Any, Any], model: type[BaseModel], prefix: str = ""
) -> Iterator[tuple[str, str]]:
    """(unknown key, our key it resembles) for the shared sections of ``data``.

    Such a key belongs to the host, so validation ignores it, but a misspelling of ours (say
    ``group_session_per_user``) would otherwise change behaviour without a word.
    """
    for name, value in data.items():
        field = _field_named(model, name) if isinstance(name, str) else None
        if field is None:
            match = difflib.get_close_matches(str(name), _settings(model), 1, _NEAR_MISS_CUTOFF)
            if match:
                yield f"{prefix}{name}", f"{prefix}{match[0]}"
            continue
        child, in_mapping = _nested(field)
        if child is None or not issubclass(child, SharedSection) or not isinstance(value, Mapping):
            continue
        if not in_mapping:
            yield from near_misses(value, child, f"{prefix}{name}.")
            continue
        for entry, section in value.items():
            if isinstance(section, Mapping):
                yield from near_misses(section, child, f"{prefix}{name}.{entry}.")


def config_error(
    exc: ValidationError, source: str, root: type[BaseModel], prefix: tuple[str, ...] = ()
) -> ConfigError:
    """The first pydantic error of validating ``root`` as a ConfigError naming the key, the file
    and what is accepted; ``prefix`` is where ``root``'s section sits in the file."""
    error = exc.errors()[0]
    loc = tuple(part for part in error["loc"] if part != "[key]")
    key = dotted((*prefix, *loc))
    model, field = _field_at(root, loc)
    if error["type"] == "extra_forbidden" and model is not None:
        known = _settings(model)
        match = difflib.get_close_matches(str(loc[-1]), known, 1)
        hint = f" (did you mean {dotted((*prefix, *loc[:-1], match[0]))}?)" if match else ""
        accepted = f"accepted keys: {', '.join(known)}" if known else "it takes no keys"
        message = f"unknown key {key}{hint}; {accepted}"
        return ConfigError(key, f"{source}: {message}", source=source)
    if error["loc"][-1:] == ("[key]",):
        accepted = "keys that are strings"
    else:
        accepted = field.description if field and field.description else SECTION_TEXT
    if error["type"] == "missing":
        problem = f"{key} is missing"
    else:
        setting = field if model is None else None
        problem = f"invalid value for {key}{_show(error['input'], setting)}"
    return ConfigError(key, f"{source}: {problem}; expected {accepted}", source=source)


def _show(value: object, setting: FieldInfo | None) -> str:
    """The rejected value as a message shows it: a short repr of a plain value given to a
    setting that holds no credential; otherwise only its type, since a section, a list or a URL
    may carry a password."""
    plain = isinstance(value, bool | int | float | str | HugeInteger | None)
    url = isinstance(value, str) and "://" in value
    if setting is None or is_secret(setting) or not plain or url:
        return f" (a value of type {type(value).__name__})"
    try:
        return f": {reprlib.repr(value)}"
    except ValueError:  # an integer too long to print
        return f": {HugeInteger()!r}"


def _settings(model: type[BaseModel]) -> list[str]:
    """The keys a file may set in ``model``'s section."""
    return [
        field.alias or name
        for name, field in model.model_fields.items()
        if name not in _INTERNAL_FIELDS
    ]


def _nested(field: FieldInfo) -> tuple[type[BaseModel] | None, bool]:
    """The section model ``field`` holds, and whether it holds a mapping of them (platforms)."""
    in_mapping = get_origin(field.annotation) is dict
    return _model_in(get_args(field.annotation)[1] if in_mapping else field.annotation), in_mapping


def _field_at(
    root: type[BaseModel], loc: tuple[int | str, ...]
) -> tuple[type[BaseModel] | None, FieldInfo | None]:
    """The model reached from ``root`` along ``loc`` and the last field on the way (the one that
    failed)."""
    model: type[BaseModel] | None = root
    field: FieldInfo | None = None
    in_mapping = False
    for part in loc:
        if in_mapping:  # ``part`` is a key of a mapping field (a platform name)
            in_mapping, field = False, None
            continue
        found = _field_named(model, str(part)) if model else None
        if found is None:  # an unknown key, or an item of a list
            break
        field = found
        model, in_mapping = _nested(field)
    return model, field


def _field_named(model: type[BaseModel], name: str) -> FieldInfo | None:
    """The field of ``model`` that the file calls ``name`` (its alias, else its own name)."""
    return next((f for n, f in model.model_fields.items() if (f.alias or n) == name), None)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model class in ``annotation`` (``X`` or ``X | None``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, map(_model_in, get_args(annotation))), None)
