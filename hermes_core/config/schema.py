"""GatewayConfig: the validated, frozen configuration of hermes-sessions.

Built only by :meth:`GatewayConfig.from_yaml`, :meth:`GatewayConfig.from_dict` and
:meth:`GatewayConfig.load`; precedence is environment > file > default. An invalid file value is a
:class:`~hermes_core.domain.errors.ConfigError` naming the dotted key, the file and what is accepted
(every number has a range), so a typo never silently falls back to a default; an environment value
gets the same checks, and an invalid one warns once and is ignored. Credentials are never echoed:
not in messages, not in ``repr``.

Section fields hold what the file said (paths already expanded; ``None`` where the default depends
on other settings); the properties of :class:`GatewayConfig` give the effective values.

This module is the schema, whole on purpose (one reference, read beside docs/configuration.md),
and the constructors, which log the warnings; the value types are in
:mod:`hermes_core.config.values`, the file reader in :mod:`hermes_core.config.loading`, the texts of
rejected values in :mod:`hermes_core.config.messages`, the environment overrides in
:mod:`hermes_core.config.environment`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from hermes_core.config.environment import apply_environment
from hermes_core.config.loading import read_yaml
from hermes_core.config.messages import config_error, near_misses
from hermes_core.config.values import (
    SECTION_TEXT,
    AnySecs,
    ChatId,
    Count,
    CountOrZero,
    Days,
    DaysOrZero,
    Flag,
    OptFlag,
    PathValue,
    Secs,
    SecsOrZero,
    Section,
    SharedSection,
    Url,
    WholeDaysOrZero,
    Words,
    hermes_home,
    unencodable_setting,
)
from hermes_core.domain.errors import ConfigError

__all__ = [
    "LEGACY_RESET_WARNING", "AgentCacheConfig", "AgentConfig", "BusyQueueConfig",
    "DeliveryLedgerConfig", "DisplayConfig", "GatewayConfig", "GatewaySection",
    "HomeChannelConfig", "HousekeepingConfig", "KeysConfig", "MemoryBudgetSetting",
    "PlatformConfig", "PluginsConfig", "PrivacyConfig", "ServerConfig", "StorageConfig",
    "StreamingConfig",
]  # fmt: skip

logger = logging.getLogger(__name__)

LEGACY_RESET_WARNING = (
    "session_reset settings are ignored: hermes-sessions never ends a conversation because of "
    "idle time or the clock; use /new or /reset."
)
_LEGACY_KEYS = ("session_reset", "reset_by_type", "reset_by_platform")
_FLAGS = ("group_sessions_per_user", "thread_sessions_per_user")
_MEMORY_OFF = frozenset({"0", "false", "off", "none", "disabled", ""})
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


class HomeChannelConfig(SharedSection):
    """``platforms.<name>.home_channel``: default destination of scheduled deliveries."""

    chat_id: ChatId = Field(min_length=1, description="a non-empty chat id (string or integer)")
    name: str = Field("Home", description="a channel name (string)")


class PlatformConfig(SharedSection):
    """``platforms.<name>``; a ``None`` flag inherits the top-level value. ``bot_username``
    is this bot's name there: ``/new@<name>`` and the like are obeyed only when addressed to it.
    The other keys are kept as written (``model_extra``): they belong to the platform's connector
    (see :meth:`~hermes_core.domain.connectors.ConnectorContext.settings_as`) or to the host."""

    model_config = ConfigDict(extra="allow")

    enabled: Flag = False
    home_channel: HomeChannelConfig | None = Field(None, description="{chat_id, name} or null")
    group_sessions_per_user: OptFlag = None
    thread_sessions_per_user: OptFlag = None
    bot_username: str | None = Field(
        None, pattern=r"^[^\s@]+$", description="the bot's user name, without @ or spaces"
    )


class ServerConfig(Section):
    """``server``: the HTTP app that ``hermes-sessions serve`` runs (webhooks, health, metrics)."""

    host: str = Field("127.0.0.1", min_length=1, description="a host name or address to bind")
    port: int = Field(8080, ge=0, le=65535, description="a port number from 0 to 65535")
    public_url: str | None = Field(
        None, pattern=r"^https?://\S+$", description="the app's public base URL (http(s)://...)"
    )
    max_body_bytes: int = Field(
        1 << 20, ge=1024, le=64 << 20, description="a number of bytes from 1024 to 67108864"
    )
    metrics: Flag = True


class StreamingConfig(Section):
    """``streaming``: replies that agents write chunk by chunk, shown while they grow."""

    enabled: Flag = True
    edit_interval_secs: SecsOrZero = 1.0


class StorageConfig(Section):
    """``storage``; ``url`` is ``None`` unless set (SQLite under ``$HERMES_HOME``)."""

    url: Url = Field(
        None, description="a URL such as sqlite:///path/state.db or postgresql://host/db"
    )
    sqlite_synchronous: Literal["normal", "full"] = Field(
        "normal", description="one of: normal, full"
    )
    sqlite_busy_timeout_secs: Secs = 5.0
    turn_lease_secs: Secs = 120.0
    instances: Literal["single", "shared"] = Field("single", description="one of: single, shared")
    """``shared``: several gateway processes use one PostgreSQL database, each lane's turns under
    a lease; ``single`` (the default): one writer per database."""
    lease_scan_secs: Secs = 2.0
    """Shared mode: how often a gateway looks for lanes whose lease expired (a dead or hung
    holder) or that wait with queued messages and no holder."""
    writer_connections: int | None = Field(None, ge=1, le=16, description="an integer from 1 to 16")
    """PostgreSQL: connections the store's writer commits on in parallel, one thread each, with
    each lane's steps always on the same one (SQLite has one writer connection). Unset: see
    :attr:`writers`."""
    read_connections: int = Field(8, ge=1, le=64, description="an integer from 1 to 64")
    """PostgreSQL: pooled read connections per process, beside its writer connections (a
    process needs ``writer_connections + read_connections`` of the server's
    ``max_connections``, and one more that listens for lane wake-ups when shared)."""
    entry_cache_size: Count = 10_000
    """Routing entries the store keeps in memory (least recently used dropped first): a bound
    on the memory a gateway holds for the lanes it served, whatever the store's size. A lane
    not cached reads its routing row on its next turn."""

    @property
    def writers(self) -> int:
        """The writer connections a PostgreSQL store opens: ``writer_connections`` when set,
        else 2 for a single gateway (one batch runs on the server while the next is prepared)
        and 1 when shared (the other gateways commit in parallel already; one connection per
        process puts more steps in each commit and costs the fleet less CPU per turn)."""
        if self.writer_connections is not None:
            return self.writer_connections
        return 1 if self.instances == "shared" else 2


class BusyQueueConfig(Section):
    """``gateway.busy_queue``; a zero burst window disables merging.

    A burst stops growing at ``burst_max_parts`` messages or ``burst_max_bytes`` of text and
    media URLs (UTF-8); the next follow-up starts a new item. ``max_pending`` caps one lane's
    items, ``max_total`` all lanes' together (queued items are also held in memory)."""

    max_pending: Count = 32
    max_total: Count = 10_000
    burst_window_secs: SecsOrZero = 2.0
    burst_max_parts: int = Field(32, ge=1, le=1000, description="an integer from 1 to 1000")
    burst_max_bytes: int = Field(
        65536, ge=1024, le=16 * 1024 * 1024, description="an integer from 1024 to 16777216"
    )


class DeliveryLedgerConfig(Section):
    """``gateway.delivery_ledger``; a bare boolean means ``{enabled: <bool>}``."""

    enabled: Flag = True
    max_attempts: Count = 3
    stale_reply_max_age_secs: Secs = 86400.0
    retention_days: DaysOrZero = 7.0
    max_rows: Count = 500
    lease_secs: Secs = 120.0

    @model_validator(mode="before")
    @classmethod
    def _bare_boolean(cls, data: Any) -> Any:
        return {"enabled": data} if isinstance(data, bool) else data


class HousekeepingConfig(Section):
    """``gateway.housekeeping``; an initial delay of 0 runs the first pass at once."""

    initial_delay_secs: SecsOrZero = 60.0
    interval_secs: Secs = 300.0
    prune_interval_secs: Secs = 3600.0


class GatewaySection(SharedSection):
    """``gateway``; ``sessions_dir``, ``write_sessions_json``, ``instance_id``: None unless set."""

    sessions_dir: PathValue = None
    write_sessions_json: OptFlag = None
    sessions_json_interval_secs: Secs = 60.0
    sessions_json_max_lanes: Count = 10_000
    reset_triggers: Words = Field(
        ("/new", "/reset"), description="a list of non-empty strings without spaces"
    )
    session_store_max_age_days: WholeDaysOrZero = 90
    multiplex_profiles: Flag = False
    instance_id: str | None = Field(None, pattern=r"\S", description="a non-empty string")
    startup_restore_timeout_secs: Secs = 120.0
    busy_ack_enabled: Flag = True
    max_dispatch_attempts: Count = 3
    redelivery_window_days: Days = 7.0
    busy_queue: BusyQueueConfig = BusyQueueConfig()
    delivery_ledger: DeliveryLedgerConfig = Field(
        DeliveryLedgerConfig(), description=f"true, false or {SECTION_TEXT}"
    )
    housekeeping: HousekeepingConfig = HousekeepingConfig()


class KeysConfig(Section):
    """``keys``: ``schema`` is the session-key schema (v2 by default; v1 is the original
    gateway's layout). A store records the schema it was created with and refuses another one."""

    key_schema: Literal["v1", "v2"] = Field("v2", alias="schema", description="one of: v1, v2")


class DisplayConfig(SharedSection):
    """``display``."""

    busy_input_mode: Literal["interrupt", "queue", "steer"] = Field(
        "interrupt", description="one of: interrupt, queue, steer"
    )


class AgentCacheConfig(Section):
    """``agent.agent_cache``; ``memory_high_mb`` is kept as given."""

    max_size: Count = 128
    idle_ttl_secs: Secs = 3600.0
    memory_high_mb: Annotated[
        bool | int | float | str | None, BeforeValidator(_check_memory_budget)
    ] = Field(
        "auto",
        description=f"auto, true, a positive number of MB up to {_MAX_MEMORY_MB}, "
        "or 0/false/off/none/disabled/null",
    )
    max_evictions_per_pass: Count = 16
    protect_recent: CountOrZero = 8

    @property
    def memory_budget_setting(self) -> MemoryBudgetSetting:
        """``"auto"``, ``None`` (pressure eviction disabled) or a positive budget in MB."""
        return _memory_budget(self.memory_high_mb)


AGENT_SPEC = r"^(?:[A-Za-z0-9][\w.-]*|[A-Za-z_][\w.]*:[A-Za-z_][\w.]*)$"
"""An entry point name (``openai``) or an import string (``package.module:factory``)."""


class AgentConfig(SharedSection):
    """``agent``; a freshness window <= 0 means every interrupted turn is fresh. ``use`` names
    the agent (see :func:`hermes_core.gateway.agent_loading.load_agent`) and ``options`` are
    handed to it as they are."""

    use: str = Field(
        "echo", pattern=AGENT_SPEC, description="an agent's entry point name in the group "
        "hermes.agents (such as echo or openai) or an import string package.module:factory",
    )  # fmt: skip
    options: Annotated[dict[str, Any], BeforeValidator(lambda v: {} if v is None else v)] = Field(
        default_factory=dict, description="a mapping of the agent's option names to values"
    )
    gateway_timeout: Secs = 1800.0
    restart_drain_timeout: Secs = 60.0
    gateway_auto_continue_freshness: AnySecs = 3600.0
    agent_cache: AgentCacheConfig = AgentCacheConfig()


class PrivacyConfig(Section):
    """``privacy``; ``pii_hmac_key_file`` is ``None`` unless set."""

    redact_pii: Flag = False
    redact_pii_mode: Literal["hmac", "sha256"] = Field("hmac", description="one of: hmac, sha256")
    pii_hmac_key_file: PathValue = None


class PluginsConfig(Section):
    """``plugins``."""

    disable: Words = Field((), description="a list of plugin names (strings without spaces)")
    autoload: Flag = True


class GatewayConfig(SharedSection):
    """The whole configuration: ``config.yaml`` plus the environment, validated and frozen."""

    hermes_home: Path
    source: str | None = None
    group_sessions_per_user: Flag = True
    thread_sessions_per_user: Flag = False
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
    server: ServerConfig = ServerConfig()
    streaming: StreamingConfig = StreamingConfig()

    @classmethod
    def from_yaml(
        cls, path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
    ) -> GatewayConfig:
        """Load a YAML file plus the environment; an empty file means defaults."""
        name = os.fspath(path)
        data = read_yaml(name)
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
        path = hermes_home(env) / "config.yaml"
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
        for unknown, ours in near_misses(data, cls):
            _warn_once(
                f"near-miss:{name}:{unknown}",
                "%s: ignoring unknown key %s (did you mean %s?); it may belong to the host",
                name,
                unknown,
                ours,
            )
        unencodable = unencodable_setting(data)
        if unencodable is not None:
            raise ConfigError(
                unencodable,
                f"{name}: {unencodable} holds a lone surrogate (half of a character, such as an "
                "escaped \\ud800), which cannot be stored; write the value as plain text",
                source=name,
            )
        home = hermes_home(env)
        try:
            config = cls.model_validate(
                {**data, "hermes_home": home, "source": source}, context={"hermes_home": home}
            )
        except ValidationError as exc:
            raise config_error(exc, name, GatewayConfig) from None
        config, rejected = apply_environment(config, env)
        for variable, raw, accepted in rejected:
            _warn_once(f"env:{variable}", "ignoring %s=%r: expected %s", variable, raw, accepted)
        return config

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
