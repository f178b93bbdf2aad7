"""GatewayConfig: the validated, frozen configuration of hermes-sessions.

Built only by :meth:`GatewayConfig.from_yaml`, :meth:`GatewayConfig.from_dict` and
:meth:`GatewayConfig.load`; precedence is environment > file > default. An invalid file value is a
:class:`~hermes_core.errors.ConfigError` naming the dotted key, the file and what is accepted (every
number has a range), so a typo never silently falls back to a default; an environment value gets the
same checks, and an invalid one warns once and is ignored. Credentials are never echoed: not in
messages, not in ``repr``.

Section fields hold what the file said (paths already expanded; ``None`` where the default depends
on other settings); the properties of :class:`GatewayConfig` give the effective values.

One module on purpose: the whole configuration schema is one reference, read beside
docs/configuration.md, and the validation helpers walk that schema.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import reprlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path, PurePath
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic.fields import FieldInfo

from hermes_core.errors import ConfigError

__all__ = [
    "LEGACY_RESET_WARNING", "AgentCacheConfig", "AgentConfig", "BusyQueueConfig",
    "DeliveryLedgerConfig", "DisplayConfig", "GatewayConfig", "GatewaySection",
    "HomeChannelConfig", "HousekeepingConfig", "KeysConfig", "MemoryBudgetSetting",
    "PlatformConfig",
    "PluginsConfig", "PrivacyConfig", "StorageConfig",
]  # fmt: skip

logger = logging.getLogger(__name__)

LEGACY_RESET_WARNING = (
    "session_reset settings are ignored: hermes-sessions never ends a conversation because of "
    "idle time or the clock; use /new or /reset."
)
_LEGACY_KEYS = ("session_reset", "reset_by_type", "reset_by_platform")
_FLAGS = ("group_sessions_per_user", "thread_sessions_per_user")
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})
_MEMORY_OFF = frozenset({"0", "false", "off", "none", "disabled", ""})
_HOME_VAR = re.compile(r"\$(?:\{HERMES_HOME\}|HERMES_HOME\b)")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\x00-\x1f\x7f]*")
_SECTION = "a mapping of settings (null means defaults)"
_INTERNAL_FIELDS = ("hermes_home", "source")  # set by the constructors, never by the file
_NEAR_MISS_CUTOFF = 0.8  # how alike a host's key must be to one of ours to warn about it
_MAX_DEPTH = 32  # nesting levels a configuration file may use
_MAX_DIGITS = 100  # longer YAML integers are not converted (Python refuses more than 4300 digits)
_MAX_COUNT = 1_000_000
_MAX_SECS = 31_536_000  # one year
_MAX_DAYS = 36_500  # about a century
_MAX_MEMORY_MB = 16 * 1024 * 1024  # 16 TiB

MemoryBudgetSetting = Literal["auto"] | float | None

_warned: set[str] = set()


def _warn_once(tag: str, message: str, *args: object) -> None:
    """Log ``message`` as a warning the first time ``tag`` is seen in this process."""
    if tag not in _warned:
        _warned.add(tag)
        logger.warning(message, *args)


def _reset_warnings() -> None:
    """Forget which warnings were logged (for tests of the once-per-process behaviour)."""
    _warned.clear()


def _hermes_home(environ: Mapping[str, str]) -> Path:
    """``$HERMES_HOME`` (default ``~/.hermes``), user-expanded and absolute, symlinks kept."""
    raw = environ.get("HERMES_HOME", "")
    return Path(os.path.abspath(os.path.expanduser(raw if raw.strip() else "~/.hermes")))


def _expand(value: str, info: ValidationInfo) -> str:
    """Replace ``$HERMES_HOME`` with the home the constructor put in the validation context."""
    home = (info.context or {}).get("hermes_home") or _hermes_home(os.environ)
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


def _memory_budget(value: object) -> MemoryBudgetSetting:
    """Interpret ``memory_high_mb``: ``"auto"``, ``None`` (off) or a positive MB."""
    word = value.strip().lower() if isinstance(value, str) else None
    if value is True or word in ("auto", "true"):
        return "auto"
    if value is None or value is False or word in _MEMORY_OFF:
        return None
    try:
        number = float(value) if isinstance(value, int | float | str) else math.nan
    except (ValueError, OverflowError):
        number = math.nan
    if not math.isfinite(number) or not 0 <= number <= _MAX_MEMORY_MB:
        raise ValueError("not a memory budget")
    return number or None


def _check_memory_budget(value: Any) -> Any:
    _memory_budget(value)
    return value


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _int_to_str(value: Any) -> Any:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class _Secret:
    """Marks a field whose value may hold a credential: never echoed in messages or ``repr``."""


# Value types. Each description is the "what is accepted" text of error messages; every number
# has an upper bound so that no later arithmetic (dates, timeouts, sizes) can overflow.
_Flag = Annotated[bool, Field(description="true or false (a YAML boolean)")]
_OptFlag = Annotated[bool | None, Field(description="true, false or null (null inherits)")]
_Count = Annotated[
    int, Field(gt=0, le=_MAX_COUNT, description=f"a positive integer up to {_MAX_COUNT}")
]
_CountOrZero = Annotated[
    int, Field(ge=0, le=_MAX_COUNT, description=f"an integer >= 0 and up to {_MAX_COUNT}")
]
_Secs = Annotated[
    float,
    Field(
        gt=0,
        le=_MAX_SECS,
        allow_inf_nan=False,
        description=f"a positive number of seconds up to {_MAX_SECS} (one year)",
    ),
]
_SecsOrZero = Annotated[
    float,
    Field(
        ge=0,
        le=_MAX_SECS,
        allow_inf_nan=False,
        description=f"a number of seconds >= 0 and up to {_MAX_SECS} (one year)",
    ),
]
_AnySecs = Annotated[
    float,
    Field(
        ge=-_MAX_SECS,
        le=_MAX_SECS,
        allow_inf_nan=False,
        description=f"a number of seconds from -{_MAX_SECS} to {_MAX_SECS} (one year)",
    ),
]
_Days = Annotated[
    float,
    Field(
        gt=0,
        le=_MAX_DAYS,
        allow_inf_nan=False,
        description=f"a positive number of days up to {_MAX_DAYS}",
    ),
]
_DaysOrZero = Annotated[
    float,
    Field(
        ge=0,
        le=_MAX_DAYS,
        allow_inf_nan=False,
        description=f"a number of days >= 0 and up to {_MAX_DAYS}",
    ),
]
_WholeDaysOrZero = Annotated[
    int,
    Field(ge=0, le=_MAX_DAYS, description=f"a whole number of days >= 0 and up to {_MAX_DAYS}"),
]
_PathValue = Annotated[
    Path | None,
    BeforeValidator(_path),
    Field(description="a non-empty path string ($HERMES_HOME and ~ expand)"),
]
_Words = Annotated[tuple[Annotated[str, Field(pattern=r"^\S+$")], ...], BeforeValidator(_as_tuple)]


class _HugeInteger:
    """Stands in for a YAML integer too long to convert; validation then rejects it like any
    out-of-range number, naming the key and its range (a host's key stays ignored)."""

    def __repr__(self) -> str:
        return f"<an integer of {_MAX_DIGITS}+ digits>"


class _LoadProblem(yaml.MarkedYAMLError):
    """A file :class:`_ConfigLoader` refuses; ``key`` is the dotted key concerned."""

    def __init__(self, key: str, problem: str, mark: yaml.Mark | None) -> None:
        super().__init__(problem=problem, problem_mark=mark)
        self.key = key


class _ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing duplicate keys (YAML keeps the last one silently) and nesting
    deeper than ``_MAX_DEPTH`` (composing recurses), and not converting integers longer than
    ``_MAX_DIGITS`` (Python refuses them with a bare ``ValueError``)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._path: list[int | str] = []  # where the node being composed sits

    def compose_node(
        self, parent: yaml.Node | None, index: int | yaml.Node | None
    ) -> yaml.Node | None:
        """Compose one node; ``index`` is a value's key node, an item's position or None."""
        if len(self._path) > _MAX_DEPTH:
            problem = f"nested more than {_MAX_DEPTH} levels deep; flatten this value"
            mark = parent.start_mark if parent is not None else None
            raise _LoadProblem(_dotted(self._path), problem, mark)
        if isinstance(index, int):
            self._path.append(index)
        else:
            self._path.append(str(index.value) if isinstance(index, yaml.ScalarNode) else "")
        try:
            return super().compose_node(parent, index)  # type: ignore[arg-type]  # stub: int
        finally:
            self._path.pop()

    def compose_mapping_node(self, anchor: Any) -> yaml.MappingNode:
        """Compose a mapping, refusing a key that appears in it twice."""
        node = super().compose_mapping_node(anchor)
        first: dict[tuple[str, object], yaml.Mark] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            seen = first.setdefault((key.tag, key.value), key.start_mark)
            if seen is not key.start_mark:
                name = _dotted((*self._path, str(key.value)))
                problem = f"duplicate key {name} (first on line {seen.line + 1}); keep only one"
                raise _LoadProblem(name, problem, key.start_mark)
        return node

    def construct_yaml_int(self, node: yaml.ScalarNode) -> Any:
        """An int, or a :class:`_HugeInteger` when the literal is too long to convert."""
        if len(str(node.value)) > _MAX_DIGITS:
            return _HugeInteger()
        return super().construct_yaml_int(node)


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)


class _Section(BaseModel):
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
            secret = name in fields and _is_secret(fields[name]) and value is not None
            yield name, "***" if secret else value


class _SharedSection(_Section):
    """A section shared with the host: unknown keys belong to the host and are ignored, with a
    warning when one looks like a misspelling of ours."""

    model_config = ConfigDict(extra="ignore")


class HomeChannelConfig(_SharedSection):
    """``platforms.<name>.home_channel``: default destination of scheduled deliveries."""

    chat_id: Annotated[str, BeforeValidator(_int_to_str)] = Field(
        min_length=1, description="a non-empty chat id (string or integer)"
    )
    name: str = Field("Home", description="a channel name (string)")


class PlatformConfig(_SharedSection):
    """``platforms.<name>``; a ``None`` flag inherits the top-level value. ``bot_username``
    is this bot's name there: ``/new@<name>`` and the like are obeyed only when addressed to it."""

    enabled: _Flag = False
    home_channel: HomeChannelConfig | None = Field(None, description="{chat_id, name} or null")
    group_sessions_per_user: _OptFlag = None
    thread_sessions_per_user: _OptFlag = None
    bot_username: str | None = Field(
        None, pattern=r"^[^\s@]+$", description="the bot's user name, without @ or spaces"
    )


class StorageConfig(_Section):
    """``storage``; ``url`` is ``None`` unless set (SQLite under ``$HERMES_HOME``)."""

    url: Annotated[str | None, BeforeValidator(_url), _Secret()] = Field(
        None, description="a URL such as sqlite:///path/state.db or postgresql://host/db"
    )
    sqlite_synchronous: Literal["normal", "full"] = Field(
        "normal", description="one of: normal, full"
    )
    sqlite_busy_timeout_secs: _Secs = 5.0
    turn_lease_secs: _Secs = 120.0
    instances: Literal["single", "shared"] = Field("single", description="one of: single, shared")
    """``shared``: several gateway processes use one PostgreSQL database, each lane's turns under
    a lease; ``single`` (the default): one writer per database."""
    lease_scan_secs: _Secs = 2.0
    """Shared mode: how often a gateway looks for lanes whose lease expired (a dead or hung
    holder) or that wait with queued messages and no holder."""
    writer_connections: int = Field(2, ge=1, le=16, description="an integer from 1 to 16")
    """PostgreSQL: connections the store's writer commits on in parallel, one thread each, with
    each lane's steps always on the same one (SQLite has one writer connection)."""
    read_connections: int = Field(8, ge=1, le=64, description="an integer from 1 to 64")
    """PostgreSQL: pooled read connections per process, beside its writer connections (a
    process needs ``writer_connections + read_connections`` of the server's
    ``max_connections``)."""


class BusyQueueConfig(_Section):
    """``gateway.busy_queue``; a zero burst window disables merging.

    A burst stops growing at ``burst_max_parts`` messages or ``burst_max_bytes`` of text and
    media URLs (UTF-8); the next follow-up starts a new item."""

    max_pending: _Count = 32
    burst_window_secs: _SecsOrZero = 2.0
    burst_max_parts: int = Field(32, ge=1, le=1000, description="an integer from 1 to 1000")
    burst_max_bytes: int = Field(
        65536, ge=1024, le=16 * 1024 * 1024, description="an integer from 1024 to 16777216"
    )


class DeliveryLedgerConfig(_Section):
    """``gateway.delivery_ledger``; a bare boolean means ``{enabled: <bool>}``."""

    enabled: _Flag = True
    max_attempts: _Count = 3
    stale_reply_max_age_secs: _Secs = 86400.0
    retention_days: _DaysOrZero = 7.0
    max_rows: _Count = 500
    lease_secs: _Secs = 120.0

    @model_validator(mode="before")
    @classmethod
    def _bare_boolean(cls, data: Any) -> Any:
        return {"enabled": data} if isinstance(data, bool) else data


class HousekeepingConfig(_Section):
    """``gateway.housekeeping``; an initial delay of 0 runs the first pass at once."""

    initial_delay_secs: _SecsOrZero = 60.0
    interval_secs: _Secs = 300.0
    prune_interval_secs: _Secs = 3600.0


class GatewaySection(_SharedSection):
    """``gateway``; ``sessions_dir``, ``write_sessions_json``, ``instance_id``: None unless set."""

    sessions_dir: _PathValue = None
    write_sessions_json: _OptFlag = None
    sessions_json_interval_secs: _Secs = 60.0
    reset_triggers: _Words = Field(
        ("/new", "/reset"), description="a list of non-empty strings without spaces"
    )
    session_store_max_age_days: _WholeDaysOrZero = 90
    multiplex_profiles: _Flag = False
    instance_id: str | None = Field(None, pattern=r"\S", description="a non-empty string")
    startup_restore_timeout_secs: _Secs = 120.0
    busy_ack_enabled: _Flag = True
    max_dispatch_attempts: _Count = 3
    redelivery_window_days: _Days = 7.0
    busy_queue: BusyQueueConfig = BusyQueueConfig()
    delivery_ledger: DeliveryLedgerConfig = Field(
        DeliveryLedgerConfig(), description=f"true, false or {_SECTION}"
    )
    housekeeping: HousekeepingConfig = HousekeepingConfig()


class KeysConfig(_Section):
    """``keys``: ``schema`` is the session-key schema (v2 by default; v1 is the original
    gateway's layout). A store records the schema it was created with and refuses another one."""

    key_schema: Literal["v1", "v2"] = Field("v2", alias="schema", description="one of: v1, v2")


class DisplayConfig(_SharedSection):
    """``display``."""

    busy_input_mode: Literal["interrupt", "queue", "steer"] = Field(
        "interrupt", description="one of: interrupt, queue, steer"
    )


class AgentCacheConfig(_Section):
    """``agent.agent_cache``; ``memory_high_mb`` is kept as given."""

    max_size: _Count = 128
    idle_ttl_secs: _Secs = 3600.0
    memory_high_mb: Annotated[
        bool | int | float | str | None, BeforeValidator(_check_memory_budget)
    ] = Field(
        "auto",
        description=f"auto, true, a positive number of MB up to {_MAX_MEMORY_MB}, "
        "or 0/false/off/none/disabled/null",
    )
    max_evictions_per_pass: _Count = 16
    protect_recent: _CountOrZero = 8

    @property
    def memory_budget_setting(self) -> MemoryBudgetSetting:
        """``"auto"``, ``None`` (pressure eviction disabled) or a positive budget in MB."""
        return _memory_budget(self.memory_high_mb)


class AgentConfig(_SharedSection):
    """``agent``; a freshness window <= 0 means every interrupted turn is fresh."""

    gateway_timeout: _Secs = 1800.0
    restart_drain_timeout: _Secs = 60.0
    gateway_auto_continue_freshness: _AnySecs = 3600.0
    agent_cache: AgentCacheConfig = AgentCacheConfig()


class PrivacyConfig(_Section):
    """``privacy``; ``pii_hmac_key_file`` is ``None`` unless set."""

    redact_pii: _Flag = False
    redact_pii_mode: Literal["hmac", "sha256"] = Field("hmac", description="one of: hmac, sha256")
    pii_hmac_key_file: _PathValue = None


class PluginsConfig(_Section):
    """``plugins``."""

    disable: _Words = Field((), description="a list of plugin names (strings without spaces)")
    autoload: _Flag = True


class GatewayConfig(_SharedSection):
    """The whole configuration: ``config.yaml`` plus the environment, validated and frozen."""

    hermes_home: Path
    source: str | None = None
    group_sessions_per_user: _Flag = True
    thread_sessions_per_user: _Flag = False
    platforms: Annotated[
        dict[str, PlatformConfig], BeforeValidator(lambda v: {} if v is None else v)
    ] = Field(default_factory=dict, description="a mapping of platform names to their settings")
    storage: StorageConfig = StorageConfig()
    gateway: GatewaySection = GatewaySection()
    keys: KeysConfig = KeysConfig()
    display: DisplayConfig = DisplayConfig()
    agent: AgentConfig = AgentConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    plugins: PluginsConfig = PluginsConfig()

    @classmethod
    def from_yaml(
        cls, path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
    ) -> GatewayConfig:
        """Load a YAML file plus the environment; an empty file means defaults."""
        name = os.fspath(path)
        try:
            text = Path(name).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError("", f"{name}: configuration file not found", source=name) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("", f"{name}: cannot read the file: {exc}", source=name) from exc
        loader = _ConfigLoader(text)
        try:
            data = loader.get_single_data()
        except yaml.YAMLError as exc:
            raise _yaml_error(exc, name) from None  # PyYAML's message quotes the file's text
        finally:
            loader.dispose()
        return cls._build({} if data is None else data, name, name, environ)

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any],
        *,
        source: str = "<dict>",
        environ: Mapping[str, str] | None = None,
    ) -> GatewayConfig:
        """Validate a parsed mapping plus the environment; ``source`` names it in errors."""
        return cls._build(data, source, source, environ)

    @classmethod
    def load(cls, *, environ: Mapping[str, str] | None = None) -> GatewayConfig:
        """``$HERMES_HOME/config.yaml`` if it exists, else defaults; the environment applies."""
        env = os.environ if environ is None else environ
        path = _hermes_home(env) / "config.yaml"
        if path.exists():
            return cls.from_yaml(path, environ=env)
        return cls._build({}, "<defaults>", None, env)

    @classmethod
    def _build(
        cls, data: object, name: str, source: str | None, environ: Mapping[str, str] | None
    ) -> GatewayConfig:
        """Validate ``data`` (errors say ``name``), then apply the environment overrides."""
        env = os.environ if environ is None else environ
        if not isinstance(data, Mapping):
            message = f"{name}: the top level must be a mapping, not {type(data).__name__}"
            raise ConfigError("", message, source=name)
        if _has_legacy_settings(data):
            _warn_once("session_reset", LEGACY_RESET_WARNING)
        for unknown, ours in _near_misses(data, cls):
            _warn_once(
                f"near-miss:{name}:{unknown}",
                "%s: ignoring unknown key %s (did you mean %s?); it may belong to the host",
                name,
                unknown,
                ours,
            )
        home = _hermes_home(env)
        try:
            config = cls.model_validate(
                {**data, "hermes_home": home, "source": source}, context={"hermes_home": home}
            )
        except ValidationError as exc:
            raise _config_error(exc, name) from None
        return _apply_environment(config, env)

    @property
    def storage_url(self) -> str:
        """``storage.url``, default ``sqlite:///<hermes_home>/state.db``."""
        return self.storage.url or f"sqlite:///{self.hermes_home / 'state.db'}"

    @property
    def sessions_dir(self) -> Path:
        """``gateway.sessions_dir``, default ``<hermes_home>/sessions``."""
        return self.gateway.sessions_dir or self.hermes_home / "sessions"

    @property
    def pii_hmac_key_file(self) -> Path:
        """``privacy.pii_hmac_key_file``, default ``<hermes_home>/pii_hmac.key``."""
        return self.privacy.pii_hmac_key_file or self.hermes_home / "pii_hmac.key"

    def session_flags(self, platform: str) -> tuple[bool, bool]:
        """Effective (group_sessions_per_user, thread_sessions_per_user) for ``platform``."""
        return self._flag(platform, _FLAGS[0])[0], self._flag(platform, _FLAGS[1])[0]

    def flag_origins(self, platform: str) -> tuple[str, str]:
        """Where each flag comes from: ``"default"``, ``"top level"`` or ``"platform override"``."""
        return self._flag(platform, _FLAGS[0])[1], self._flag(platform, _FLAGS[1])[1]

    def _flag(self, platform: str, name: str) -> tuple[bool, str]:
        settings = self.platforms.get(platform)
        override = getattr(settings, name) if settings is not None else None
        if override is not None:
            return override, "platform override"
        return getattr(self, name), "top level" if name in self.model_fields_set else "default"

    def connected_platforms(self) -> tuple[str, ...]:
        """Names of platforms with ``enabled: true``, sorted."""
        return tuple(sorted(name for name, p in self.platforms.items() if p.enabled))


def _has_legacy_settings(data: Mapping[Any, Any]) -> bool:
    """Whether a legacy (idle or daily) reset setting is present (top level, ``gateway``, a
    platform)."""
    gateway, platforms = data.get("gateway"), data.get("platforms")
    scopes = [data, gateway if isinstance(gateway, Mapping) else {}]
    if any(key in scope for scope in scopes for key in _LEGACY_KEYS):
        return True
    return isinstance(platforms, Mapping) and any(
        isinstance(p, Mapping) and "session_reset" in p for p in platforms.values()
    )


def _near_misses(
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
        if child is None or not issubclass(child, _SharedSection) or not isinstance(value, Mapping):
            continue
        if not in_mapping:
            yield from _near_misses(value, child, f"{prefix}{name}.")
            continue
        for entry, section in value.items():
            if isinstance(section, Mapping):
                yield from _near_misses(section, child, f"{prefix}{name}.{entry}.")


def _settings(model: type[BaseModel]) -> list[str]:
    """The keys a file may set in ``model``'s section."""
    return [
        field.alias or name
        for name, field in model.model_fields.items()
        if name not in _INTERNAL_FIELDS
    ]


def _is_secret(field: FieldInfo) -> bool:
    """Whether ``field`` is marked :class:`_Secret`."""
    return any(isinstance(item, _Secret) for item in field.metadata)


def _nested(field: FieldInfo) -> tuple[type[BaseModel] | None, bool]:
    """The section model ``field`` holds, and whether it holds a mapping of them (platforms)."""
    in_mapping = get_origin(field.annotation) is dict
    return _model_in(get_args(field.annotation)[1] if in_mapping else field.annotation), in_mapping


def _dotted(loc: Iterable[int | str]) -> str:
    """``gateway.reset_triggers[0]`` from its parts; empty parts (the document) are skipped."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc if p != "").lstrip(".")


def _field_at(loc: tuple[int | str, ...]) -> tuple[type[BaseModel] | None, FieldInfo | None]:
    """The model reached along ``loc`` and the last field on the way (the one that failed)."""
    model: type[BaseModel] | None = GatewayConfig
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


def _config_error(exc: ValidationError, source: str) -> ConfigError:
    """The first pydantic error as a ConfigError naming the key, the file and what is accepted."""
    error = exc.errors()[0]
    loc = tuple(part for part in error["loc"] if part != "[key]")
    key = _dotted(loc)
    model, field = _field_at(loc)
    if error["type"] == "extra_forbidden" and model is not None:
        known = _settings(model)
        match = difflib.get_close_matches(str(loc[-1]), known, 1)
        hint = f" (did you mean {_dotted((*loc[:-1], match[0]))}?)" if match else ""
        message = f"unknown key {key}{hint}; accepted keys: {', '.join(known)}"
        return ConfigError(key, f"{source}: {message}", source=source)
    if error["loc"][-1:] == ("[key]",):
        accepted = "keys that are strings"
    else:
        accepted = field.description if field and field.description else _SECTION
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
    plain = isinstance(value, bool | int | float | str | _HugeInteger | None)
    url = isinstance(value, str) and "://" in value
    if setting is None or _is_secret(setting) or not plain or url:
        return f" (a value of type {type(value).__name__})"
    try:
        return f": {reprlib.repr(value)}"
    except ValueError:  # an integer too long to print
        return f": {_HugeInteger()!r}"


def _yaml_error(exc: yaml.YAMLError, name: str) -> ConfigError:
    """A YAML problem with its line and column, without the quoted text PyYAML adds."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return ConfigError("", f"{name}: not valid YAML: {exc}", source=name)
    mark = exc.problem_mark or exc.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    if isinstance(exc, _LoadProblem):
        return ConfigError(exc.key, f"{name}: {where}{exc.problem}", source=name)
    what = ", ".join(filter(None, (exc.context, exc.problem)))
    return ConfigError("", f"{name}: {where}not valid YAML: {what}", source=name)


def _env_bool(raw: str) -> bool:
    word = raw.strip().lower()
    if word not in _TRUE_WORDS | _FALSE_WORDS:
        raise ValueError(raw)
    return word in _TRUE_WORDS


def _env_names(raw: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in raw.split(",") if name.strip())


_BOOL_WORDS = "1/true/yes/on or 0/false/no/off"
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


def _apply_environment(config: GatewayConfig, environ: Mapping[str, str]) -> GatewayConfig:
    """Apply the A.1 overrides; a blank variable is unset, an invalid one warns once."""
    for variable, (section, key), parse, syntax in _ENVIRONMENT:
        raw = environ.get(variable, "")
        if not raw.strip():
            continue
        current = getattr(config, section)
        try:
            value = _checked(type(current), key, parse, syntax, raw)
        except ValueError as exc:
            _warn_once(f"env:{variable}", "ignoring %s=%r: expected %s", variable, raw, exc)
            continue
        updated = current.model_copy(update={key: value})
        config = config.model_copy(update={section: updated})
    return config


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
