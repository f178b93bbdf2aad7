"""Data model: where a message came from, the routing entry of a lane, events and context.

Untrusted input (``from_dict``, constructor arguments) only ever raises
:class:`~hermes_core.domain.errors.InvalidValueError` (or its subclass for unknown platforms), with
a sentence naming the field; every string in it is normalised first
(:mod:`hermes_core.domain.text`).

One module on purpose: the models refer to each other and share the validation helpers at the
top.
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Callable, Mapping
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hermes_core.domain.errors import InvalidValueError, shown
from hermes_core.domain.text import clean_text, clean_value, exact_text_problem
from hermes_core.domain.timeutil import format_utc, parse_utc, utc_now

if TYPE_CHECKING:
    from hermes_core.domain.specs import PlatformSpec
    from hermes_core.plugins.manager import HermesPluginManager

PLATFORM_NAME_RE = re.compile(r"[a-z0-9_]+")
_SESSION_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_CONTROL_RE = re.compile(r"[\x00-\x1f]")
_DRIVE_RE = re.compile(r"^[A-Za-z]:")
_SCALARS = frozenset({str, type(None), bool, int, float})
"""Types of plain untrusted values (exactly these: subclasses go the long way)."""
_is_str = str.__instancecheck__


def session_id_problem(value: str) -> str | None:
    """Why ``value`` is not a safe session id (it becomes a file name), or None when it is."""
    if not _SESSION_ID_RE.fullmatch(value) or ".." in value:
        return (
            "use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit, no '..'"
        )
    return None


def session_key_problem(value: str) -> str | None:
    """Why ``value`` is not a safe session key, or None when it is."""
    if not 1 <= len(value) <= 1024:
        return "it must be 1-1024 characters long"
    if ".." in value:
        return "it must not contain '..'"
    if _CONTROL_RE.search(value):
        return "it must not contain NUL or other control characters"
    if value[0] in "/\\":
        return "it must not start with '/' or '\\'"
    if _DRIVE_RE.match(value):
        return "it must not start with a drive prefix such as 'C:'"
    return None


def _invalid_from_validation(model: str, exc: ValidationError) -> InvalidValueError:
    """Turn pydantic's error into our named error, naming the first offending field."""
    first = exc.errors()[0]
    field = ".".join(str(part) for part in first["loc"])
    message = str(first["msg"]).removeprefix("Value error, ")
    if not field:  # the model's own check
        return InvalidValueError(model, f"{model} is invalid: {message}")
    return InvalidValueError(field, f"{model}.{field} is invalid: {message}")


class _Model(BaseModel):
    """Base of the library's models: construction errors are :class:`InvalidValueError`."""

    if not TYPE_CHECKING:  # keep the typed constructor the pydantic mypy plugin generates

        def __init__(self, /, **data: Any) -> None:
            try:
                super().__init__(**data)
            except ValidationError as exc:
                raise _invalid_from_validation(type(self).__name__, exc) from None


class _Untrusted(_Model):
    """A model of data from a platform: every string given is normalised first
    (:func:`~hermes_core.domain.text.clean_text`), nested ones too, so it can always be stored; the
    ids named by ``_exact`` are refused instead when they would change."""

    _exact: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _clean_texts(cls, data: Any) -> Any:
        if isinstance(data, dict):
            values = data.values()
            if _SCALARS.issuperset(map(type, values)):  # no container, model or subclass
                texts = "".join(filter(_is_str, values))
                if texts.isascii() and "\x00" not in texts:
                    return data  # clean_text keeps every one of these strings as it is
            for name in cls._exact:
                value = data.get(name)
                problem = exact_text_problem(value) if isinstance(value, str) else None
                if problem is not None:
                    raise ValueError(
                        f"{name} {shown(value)} is not a usable id: {problem}; pass the id as "
                        "the platform sent it"
                    )
            return {
                name: clean_text(value) if value.__class__ is str
                else value if value.__class__ in _SCALARS  # nothing to clean
                else clean_value(value, field=name)
                for name, value in data.items()
            }  # fmt: skip
        return data


def _id_string(field: str, value: object) -> str | None:
    """Untrusted id value → string: numbers become decimal strings (numeric Telegram ids)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise InvalidValueError(field, f"{field} must be a string or a number, not a boolean.")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    raise InvalidValueError(field, f"{field} must be a string or an integer, got {shown(value)}.")


def _text(field: str, value: object) -> str | None:
    """Untrusted text value → string or None."""
    if value is None or isinstance(value, str):
        return value
    raise InvalidValueError(field, f"{field} must be a string or null, got {type(value).__name__}.")


def _flag(value: object) -> bool:
    """Untrusted truthy value → bool (strings read as words, so "false" stays False)."""
    if isinstance(value, str):
        return value.strip().lower() in {"1", "true", "yes", "on"}
    return bool(value)


def _platform_spec(name: object, plugins: HermesPluginManager | None, field: str) -> PlatformSpec:
    """The spec of a registered platform, else :class:`UnknownPlatformError`."""
    from hermes_core.plugins.manager import platform_registry

    if not isinstance(name, str) or not name:
        raise InvalidValueError(field, f"{field} is required and must be a platform name.")
    return platform_registry(plugins).require(name, field=field)


_SOURCE_ID_FIELDS = (
    "chat_id", "user_id", "thread_id", "user_id_alt", "chat_id_alt", "scope_id", "guild_id",
    "parent_chat_id", "message_id", "prospective_thread_id",
)  # fmt: skip
_SOURCE_TEXT_FIELDS = ("chat_name", "user_name", "chat_topic", "auto_thread_initial_name")
_SOURCE_FIELDS: dict[str, Callable[[str, object], str | None]] = {
    **dict.fromkeys(_SOURCE_ID_FIELDS, _id_string),
    **dict.fromkeys((*_SOURCE_TEXT_FIELDS, "chat_type", "profile"), _text),
}
"""The fields :meth:`SessionSource.from_dict` reads, with the conversion of a value that is
not already a string."""


def generic_description(source: SessionSource) -> str:
    """The generic summary of a source: ``DM with <user>``, ``group: <chat>``, ``channel:
    <chat>`` or the chat, then ``, thread: <thread_id>`` when set."""
    if source.chat_type == "dm":
        text = f"DM with {source.user_name or source.user_id or 'user'}"
    elif source.chat_type in ("group", "channel"):
        text = f"{source.chat_type}: {source.chat_name or source.chat_id}"
    else:
        text = source.chat_name or source.chat_id
    if source.thread_id:
        text += f", thread: {source.thread_id}"
    return text


class SessionSource(_Untrusted):
    """Immutable record of where a message came from; changes produce a copy (:meth:`replace`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    _exact = _SOURCE_ID_FIELDS

    platform: str
    chat_id: str
    chat_name: str | None = None
    chat_type: str = "dm"
    user_id: str | None = None
    user_name: str | None = None
    thread_id: str | None = None
    chat_topic: str | None = None
    user_id_alt: str | None = None
    chat_id_alt: str | None = None
    is_bot: bool = False
    scope_id: str | None = None
    guild_id: str | None = None
    parent_chat_id: str | None = None
    message_id: str | None = None
    role_authorized: bool = False
    profile: str | None = None
    auto_thread_created: bool = False
    auto_thread_initial_name: str | None = None
    prospective_thread_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _scope_alias(cls, data: Any) -> Any:
        """``guild_id`` is a deprecated alias of ``scope_id``; a set ``scope_id`` wins."""
        if isinstance(data, dict):
            if data.get("scope_id") is None and data.get("guild_id") is not None:
                data = {**data, "scope_id": data["guild_id"]}
            elif data.get("scope_id") is not None:
                data = {**data, "guild_id": data["scope_id"]}
        return data

    @field_validator("platform")
    @classmethod
    def _platform_name(cls, value: str) -> str:
        if not PLATFORM_NAME_RE.fullmatch(value):
            raise ValueError(f"platform {shown(value)} must match ^[a-z0-9_]+$")
        return value

    @field_validator("chat_type")
    @classmethod
    def _chat_type(cls, value: str) -> str:
        if not value:
            raise ValueError("chat_type must be a non-empty string such as 'dm' or 'group'")
        return value

    def replace(self, **changes: Any) -> SessionSource:
        """A validated copy with ``changes`` applied."""
        return SessionSource(**{**self.model_dump(), **changes})

    @property
    def description(self) -> str:
        """Human-readable summary, e.g. ``group: My Group, thread: 12345``: the platform's
        ``PlatformSpec.describe`` (from the default plugin manager) if it has one, else
        :func:`generic_description`."""
        from hermes_core.plugins.manager import platform_registry

        spec = platform_registry().get(self.platform)
        if spec is not None and spec.describe is not None:
            return spec.describe(self)
        return generic_description(self)

    def to_dict(self) -> dict[str, Any]:
        """Byte-stable serialisation in the fixed key order below; trust flags are never written."""
        data: dict[str, Any] = {
            "platform": self.platform,
            "chat_id": self.chat_id,
            "chat_name": self.chat_name,
            "chat_type": self.chat_type,
            "user_id": self.user_id,
            "user_name": self.user_name,
            "thread_id": self.thread_id,
            "chat_topic": self.chat_topic,
        }
        for name in ("user_id_alt", "chat_id_alt"):
            if getattr(self, name):
                data[name] = getattr(self, name)
        scope = self.scope_id or self.guild_id
        if scope:
            data["scope_id"] = scope
            data["guild_id"] = scope
        for name in ("parent_chat_id", "message_id", "profile"):
            if getattr(self, name):
                data[name] = getattr(self, name)
        if self.auto_thread_created:
            data["auto_thread_created"] = True
        for name in ("auto_thread_initial_name", "prospective_thread_id"):
            if getattr(self, name):
                data[name] = getattr(self, name)
        return data

    @classmethod
    def from_dict(
        cls, data: object, *, plugins: HermesPluginManager | None = None
    ) -> SessionSource:
        """Parse untrusted data; the platform must be registered in ``plugins`` (None: built-in)."""
        if not isinstance(data, Mapping):
            raise InvalidValueError("source", "source must be a JSON object (mapping).")
        spec = _platform_spec(data.get("platform"), plugins, "platform")
        if "chat_id" not in data:
            raise InvalidValueError("chat_id", 'chat_id is required (use "" when there is none).')
        # Only the fields given and not null are passed on: the rest take their defaults
        # without being validated again. Keys not listed (the trust flags among them) are
        # never read.
        values: dict[str, Any] = {"platform": spec.name, "chat_id": ""}
        for name, value in data.items():
            convert = _SOURCE_FIELDS.get(name)
            if convert is not None and value is not None:
                values[name] = value if value.__class__ is str else convert(name, value)
        values["chat_id"] = values["chat_id"] or ""
        if _flag(data.get("auto_thread_created", False)):
            values["auto_thread_created"] = True
        source = cls(**values)
        if spec.validate_source is not None:
            spec.validate_source(source)
        return source


class HomeChannel(_Untrusted):
    """A platform's default destination for scheduled deliveries."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    platform: str
    chat_id: str
    name: str


# Order of SessionEntry.to_dict(); ``origin`` follows only when set.
_ENTRY_FIELD_ORDER = (
    "session_key", "session_id", "created_at", "updated_at", "display_name", "platform",
    "chat_type", "metadata", "input_tokens", "output_tokens", "cache_read_tokens",
    "cache_write_tokens", "total_tokens", "last_prompt_tokens", "estimated_cost_usd",
    "cost_status", "expiry_finalized", "suspended", "resume_pending", "resume_reason",
    "last_resume_marked_at", "active_turn_token", "active_turn_started_at", "is_fresh_reset",
    "was_auto_reset", "auto_reset_reason", "reset_had_activity", "prev_session_id",
)  # fmt: skip
_ENTRY_INT_FIELDS = (
    "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens", "total_tokens",
    "last_prompt_tokens",
)  # fmt: skip
_ENTRY_BOOL_FIELDS = (
    "expiry_finalized", "suspended", "resume_pending", "is_fresh_reset", "was_auto_reset",
    "reset_had_activity",
)  # fmt: skip
_ENTRY_TEXT_FIELDS = (
    "display_name", "resume_reason", "auto_reset_reason", "prev_session_id",
)  # fmt: skip


class SessionEntry(_Model):
    """The routing entry of one lane: its current session id and per-lane state."""

    model_config = ConfigDict(extra="forbid")

    session_key: str
    session_id: str
    created_at: datetime
    updated_at: datetime
    origin: SessionSource | None = None
    display_name: str | None = None
    platform: str | None = None
    chat_type: str = "dm"
    metadata: dict[str, Any] = Field(default_factory=dict)
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    total_tokens: int = 0
    last_prompt_tokens: int = 0
    estimated_cost_usd: float = 0.0
    cost_status: str = "unknown"
    was_auto_reset: bool = False
    auto_reset_reason: str | None = None
    reset_had_activity: bool = False
    prev_session_id: str | None = None
    is_fresh_reset: bool = False
    expiry_finalized: bool = False
    suspended: bool = False
    resume_pending: bool = False
    resume_reason: str | None = None
    last_resume_marked_at: datetime | None = None
    active_turn_token: str | None = None
    active_turn_started_at: datetime | None = None

    @field_validator("session_key")
    @classmethod
    def _key_guard(cls, value: str) -> str:
        problem = session_key_problem(value)
        if problem is not None:
            raise ValueError(f"session_key {shown(value)} is not valid: {problem}")
        return value

    @field_validator("session_id")
    @classmethod
    def _id_guard(cls, value: str) -> str:
        problem = session_id_problem(value)
        if problem is not None:
            raise ValueError(f"session_id {shown(value)} is not valid: {problem}")
        return value

    @field_validator("created_at", "updated_at", "last_resume_marked_at", "active_turn_started_at")
    @classmethod
    def _aware_utc(cls, value: datetime | None) -> datetime | None:
        return None if value is None else parse_utc(value)

    def to_dict(self) -> dict[str, Any]:
        """Serialise in a stable key order; datetimes as ISO UTC with microseconds."""
        data: dict[str, Any] = {}
        for name in _ENTRY_FIELD_ORDER:
            value = getattr(self, name)
            data[name] = format_utc(value) if isinstance(value, datetime) else value
        data["metadata"] = dict(self.metadata)
        if self.origin is not None:
            data["origin"] = self.origin.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: object, *, plugins: HermesPluginManager | None = None) -> SessionEntry:
        """Parse stored data leniently (older writers load) but with every guard applied: texts
        in their normal form (:func:`~hermes_core.domain.text.clean_text`), counts below 2**63."""
        from hermes_core.plugins.manager import platform_registry

        if not isinstance(data, Mapping):
            raise InvalidValueError("entry", "a session entry must be a JSON object (mapping).")
        values: dict[str, Any] = {}
        for name in ("session_key", "session_id"):
            if not isinstance(data.get(name), str):
                raise InvalidValueError(name, f"{name} is required and must be a string.")
            values[name] = data[name]
        for name in ("created_at", "updated_at"):
            stamp = parse_utc(data.get(name))
            if stamp is None:
                raise InvalidValueError(name, f"{name} is required and must be an ISO 8601 time.")
            values[name] = stamp
        # A value equal to its field's default is left out: it is not validated again.
        for name in _ENTRY_INT_FIELDS:
            number = data.get(name)
            if number and isinstance(number, int) and not isinstance(number, bool):
                if not 0 <= number < 2**63:
                    raise InvalidValueError(
                        name, f"{name} {shown(number)} is not a count from 0 to 2**63 - 1."
                    )
                values[name] = number
        cost = data.get("estimated_cost_usd")
        if isinstance(cost, (int, float)) and not isinstance(cost, bool) and math.isfinite(cost):
            values["estimated_cost_usd"] = float(cost)
        for name in _ENTRY_BOOL_FIELDS:
            if _flag(data.get(name, False)):
                values[name] = True
        if "expiry_finalized" not in data and "memory_flushed" in data:
            values["expiry_finalized"] = _flag(data["memory_flushed"])
        for name in (*_ENTRY_TEXT_FIELDS, "cost_status"):
            if isinstance(data.get(name), str):
                values[name] = clean_text(data[name])
        if isinstance(data.get("chat_type"), str) and data["chat_type"]:
            values["chat_type"] = clean_text(data["chat_type"]) or "dm"
        metadata = data.get("metadata")
        if metadata and isinstance(metadata, Mapping):
            values["metadata"] = clean_value(dict(metadata), field="metadata", plain=True)
        platform = data.get("platform")
        if isinstance(platform, str) and platform in platform_registry(plugins):
            values["platform"] = platform
        if isinstance(data.get("origin"), Mapping):
            values["origin"] = SessionSource.from_dict(data["origin"], plugins=plugins)
        marked = data.get("last_resume_marked_at")
        if marked is not None:
            values["last_resume_marked_at"] = parse_utc(marked)
        token = data.get("active_turn_token")
        if isinstance(token, str) and token:
            values["active_turn_token"] = token
            values["active_turn_started_at"] = parse_utc(data.get("active_turn_started_at"))
        return cls(**values)


class MessageType(str, Enum):
    """Kind of an inbound message."""

    TEXT = "text"
    PHOTO = "photo"
    VIDEO = "video"
    AUDIO = "audio"
    VOICE = "voice"
    DOCUMENT = "document"
    STICKER = "sticker"
    LOCATION = "location"


def new_event_id() -> str:
    """A random 32-hex event id."""
    return secrets.token_hex(16)


class MessageEvent(_Untrusted):
    """One inbound message (or internal wake) with its source."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: SessionSource
    text: str = ""
    message_type: MessageType = MessageType.TEXT
    event_id: str = Field(default_factory=new_event_id)
    message_id: str | None = None
    reply_to_message_id: str | None = None
    media_urls: tuple[str, ...] = ()
    internal: bool = False
    queued_via_command: bool = False
    bound_session_id: str | None = None
    received_at: datetime = Field(default_factory=utc_now)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("received_at")
    @classmethod
    def _aware_utc(cls, value: datetime) -> datetime:
        stamp = parse_utc(value)
        if stamp is None:
            raise ValueError("received_at must be a valid time")
        return stamp

    def replace(self, **changes: Any) -> MessageEvent:
        """A validated copy with ``changes`` applied."""
        return MessageEvent(**{**dict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; :meth:`from_dict` restores every field."""
        return {
            "event_id": self.event_id,
            "text": self.text,
            "message_type": self.message_type.value,
            "source": self.source.to_dict(),
            "message_id": self.message_id,
            "reply_to_message_id": self.reply_to_message_id,
            "media_urls": list(self.media_urls),
            "internal": self.internal,
            "queued_via_command": self.queued_via_command,
            "bound_session_id": self.bound_session_id,
            "received_at": format_utc(self.received_at),
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: object, *, plugins: HermesPluginManager | None = None) -> MessageEvent:
        """Parse an untrusted event; missing optional fields take their defaults."""
        if not isinstance(data, Mapping):
            raise InvalidValueError("event", "an event must be a JSON object (mapping).")
        if "source" not in data:
            raise InvalidValueError("source", "source is required.")
        values: dict[str, Any] = {
            "source": SessionSource.from_dict(data["source"], plugins=plugins)
        }
        for name in ("event_id", "text"):
            if data.get(name) is not None:
                values[name] = _text(name, data[name])
        for name in ("message_id", "reply_to_message_id", "bound_session_id"):
            values[name] = _id_string(name, data.get(name))
        kind = data.get("message_type", "text")
        try:
            values["message_type"] = MessageType(str(kind).lower())
        except ValueError:
            allowed = ", ".join(member.value for member in MessageType)
            raise InvalidValueError(
                "message_type", f"message_type {shown(kind)} is not one of: {allowed}."
            ) from None
        media = data.get("media_urls") or []
        if not isinstance(media, list) or not all(isinstance(url, str) for url in media):
            raise InvalidValueError("media_urls", "media_urls must be a list of strings.")
        values["media_urls"] = tuple(media)
        for name in ("internal", "queued_via_command"):
            values[name] = _flag(data.get(name, False))
        if "received_at" in data:
            stamp = parse_utc(data["received_at"])
            if stamp is None:
                raise InvalidValueError("received_at", "received_at must be an ISO 8601 time.")
            values["received_at"] = stamp
        metadata = data.get("metadata") or {}
        if not isinstance(metadata, Mapping):
            raise InvalidValueError("metadata", "metadata must be a JSON object (mapping).")
        values["metadata"] = dict(metadata)
        return cls(**values)


class SessionContext(_Model):
    """What the system prompt says about the current session.

    Built by :func:`hermes_core.build_session_context`; ``session_entry`` is the routing entry it
    was built from (platform notes read it), ``hermes_home`` None means ``$HERMES_HOME`` and
    ``pii_hmac_key_file`` None means ``<hermes_home>/pii_hmac.key``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: SessionSource
    connected_platforms: tuple[str, ...] = ()
    home_channels: tuple[HomeChannel, ...] = ()
    shared_multi_user_session: bool = False
    session_key: str = ""
    session_id: str = ""
    created_at: datetime | None = None
    updated_at: datetime | None = None
    session_entry: SessionEntry | None = None
    hermes_home: Path | None = None
    redact_pii: bool = False
    redact_pii_mode: Literal["hmac", "sha256"] = "hmac"
    pii_hmac_key_file: Path | None = None
