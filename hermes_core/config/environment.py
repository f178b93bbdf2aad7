"""The environment variables that override configuration settings (SPEC A.1).

Each variable's text is parsed, then validated exactly like the file's value for its key (type and
range). A blank variable counts as unset; an invalid one is left out and reported to the caller,
which warns about it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from pydantic import BaseModel, ValidationError

__all__ = ["apply_environment"]

_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})
_BOOL_WORDS = "1/true/yes/on or 0/false/no/off"

Config = TypeVar("Config", bound=BaseModel)


def _env_bool(raw: str) -> bool:
    word = raw.strip().lower()
    if word not in _TRUE_WORDS | _FALSE_WORDS:
        raise ValueError(raw)
    return word in _TRUE_WORDS


def _env_names(raw: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in raw.split(",") if name.strip())


# (variable, (section, key), parser of the text, what text the parser accepts); the parsed value
# is then validated exactly like the file's value for the key.
_ENVIRONMENT: tuple[tuple[str, tuple[str, str], Callable[[str], object], str], ...] = (
    ("HERMES_AGENT_TIMEOUT", ("agent", "gateway_timeout"), float, "a number of seconds"),
    ("HERMES_AUTO_CONTINUE_FRESHNESS", ("agent", "gateway_auto_continue_freshness"),
     float, "a number of seconds"),
    ("GATEWAY_MULTIPLEX_PROFILES", ("gateway", "multiplex_profiles"), _env_bool, _BOOL_WORDS),
    ("HERMES_GATEWAY_BUSY_ACK_ENABLED", ("gateway", "busy_ack_enabled"), _env_bool, _BOOL_WORDS),
    ("HERMES_DISABLE_PLUGINS", ("plugins", "disable"), _env_names, "comma-separated names"),
    ("HERMES_PLUGINS_AUTOLOAD", ("plugins", "autoload"), _env_bool, _BOOL_WORDS),
)  # fmt: skip


def apply_environment(
    config: Config, environ: Mapping[str, str]
) -> tuple[Config, list[tuple[str, str, ValueError]]]:
    """``config`` with the A.1 overrides applied, and the (variable, text, what is accepted)
    of each variable that was set but invalid, in the order of the table."""
    rejected: list[tuple[str, str, ValueError]] = []
    for variable, (section, key), parse, syntax in _ENVIRONMENT:
        raw = environ.get(variable, "")
        if not raw.strip():
            continue
        current = getattr(config, section)
        try:
            value = _checked(type(current), key, parse, syntax, raw)
        except ValueError as exc:
            rejected.append((variable, raw, exc))
            continue
        updated = current.model_copy(update={key: value})
        config = config.model_copy(update={section: updated})
    return config, rejected


def _checked(
    model: type[BaseModel], key: str, parse: Callable[[str], object], syntax: str, raw: str
) -> object:
    """``raw`` parsed, then validated as the file's ``key`` is (type and range); a ValueError
    says what is accepted."""
    try:
        value = parse(raw)
    except ValueError:
        raise ValueError(syntax) from None
    try:
        return getattr(model.model_validate({key: value}), key)
    except ValidationError:
        raise ValueError(model.model_fields[key].description) from None
