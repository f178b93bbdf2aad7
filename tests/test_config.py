"""GatewayConfig: defaults, file loading, strict validation, environment and resolved values.

Every test passes ``environ=`` explicitly so the developer's real environment never leaks in.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hermes_core import config as config_module
from hermes_core.config import LEGACY_RESET_WARNING, GatewayConfig
from hermes_core.errors import ConfigError, HermesError
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager, telegram_dm

LOGGER = "hermes_core.config"


@pytest.fixture(autouse=True)
def _fresh_warnings() -> Iterator[None]:
    """Each test sees the once-per-process warnings as not yet logged."""
    config_module._reset_warnings()
    yield
    config_module._reset_warnings()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load_yaml(tmp_path: Path, text: str, **environ: str) -> GatewayConfig:
    return GatewayConfig.from_yaml(write(tmp_path, text), environ=environ)


def attr(obj: object, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelname == "WARNING"]


# --- defaults -------------------------------------------------------------------------------------

APPENDIX_A2_DEFAULTS: list[tuple[str, object]] = [
    ("group_sessions_per_user", True),
    ("thread_sessions_per_user", False),
    ("platforms", {}),
    ("storage.url", None),
    ("storage.sqlite_synchronous", "normal"),
    ("storage.turn_lease_secs", 120),
    ("gateway.sessions_dir", None),
    ("gateway.write_sessions_json", None),
    ("gateway.sessions_json_interval_secs", 60),
    ("gateway.reset_triggers", ("/new", "/reset")),
    ("gateway.session_store_max_age_days", 90),
    ("gateway.multiplex_profiles", False),
    ("gateway.instance_id", None),
    ("gateway.startup_restore_timeout_secs", 120),
    ("gateway.busy_ack_enabled", True),
    ("gateway.busy_queue.max_pending", 32),
    ("gateway.busy_queue.burst_window_secs", 2.0),
    ("gateway.delivery_ledger.enabled", True),
    ("gateway.delivery_ledger.max_attempts", 3),
    ("gateway.delivery_ledger.stale_reply_max_age_secs", 86400),
    ("gateway.delivery_ledger.retention_days", 7),
    ("gateway.delivery_ledger.max_rows", 500),
    ("gateway.delivery_ledger.lease_secs", 120),
    ("gateway.housekeeping.initial_delay_secs", 60),
    ("gateway.housekeeping.interval_secs", 300),
    ("gateway.housekeeping.prune_interval_secs", 3600),
    ("display.busy_input_mode", "interrupt"),
    ("agent.gateway_timeout", 1800),
    ("agent.restart_drain_timeout", 60),
    ("agent.gateway_auto_continue_freshness", 3600),
    ("agent.agent_cache.max_size", 128),
    ("agent.agent_cache.idle_ttl_secs", 3600),
    ("agent.agent_cache.memory_high_mb", "auto"),
    ("agent.agent_cache.max_evictions_per_pass", 16),
    ("agent.agent_cache.protect_recent", 8),
    ("privacy.redact_pii", False),
    ("privacy.redact_pii_mode", "hmac"),
    ("privacy.pii_hmac_key_file", None),
    ("plugins.disable", ()),
    ("plugins.autoload", True),
]


@pytest.mark.parametrize(("key", "expected"), APPENDIX_A2_DEFAULTS)
def test_default_of_every_appendix_key(key: str, expected: object, home: Path) -> None:
    value = attr(GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(home)}), key)
    assert value == expected


def test_resolved_defaults_live_under_hermes_home(home: Path) -> None:
    cfg = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(home)})
    assert cfg.hermes_home == home
    assert cfg.storage_url == f"sqlite:///{home}/state.db"
    assert cfg.storage_url.startswith("sqlite:////")  # an absolute SQLite path has four slashes
    assert cfg.sessions_dir == home / "sessions"
    assert cfg.pii_hmac_key_file == home / "pii_hmac.key"
    assert cfg.gateway.write_sessions_json is None  # the backend decides (StoreSpec.local)
    assert cfg.agent.agent_cache.memory_budget_setting == "auto"
    assert cfg.connected_platforms() == ()
    assert cfg.source == "<dict>"


def test_default_hermes_home_is_dot_hermes_in_the_user_home() -> None:
    assert GatewayConfig.from_dict({}, environ={}).hermes_home == Path("~/.hermes").expanduser()
    blank = GatewayConfig.from_dict({}, environ={"HERMES_HOME": "  "})
    assert blank.hermes_home == Path("~/.hermes").expanduser()


def test_hermes_home_is_expanded_and_absolute_without_resolving_symlinks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert GatewayConfig.from_dict({}, environ={"HERMES_HOME": "rel"}).hermes_home == (
        tmp_path / "rel"
    )
    tilde = GatewayConfig.from_dict({}, environ={"HERMES_HOME": "~/h"})
    assert tilde.hermes_home == Path("~/h").expanduser()
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    linked = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(tmp_path / "link")})
    assert linked.hermes_home == tmp_path / "link"
    assert not (tmp_path / "rel").exists()  # never created


def test_config_is_frozen(home: Path) -> None:
    cfg = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(home)})
    with pytest.raises(pydantic.ValidationError):
        cfg.gateway.multiplex_profiles = True  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        cfg.group_sessions_per_user = False  # type: ignore[misc]


# --- file loading ---------------------------------------------------------------------------------

FULL_FILE = """
group_sessions_per_user: false
thread_sessions_per_user: true
platforms:
  telegram:
    enabled: true
    home_channel: {chat_id: -1001234, name: Ops}
  discord:
    enabled: false
    thread_sessions_per_user: false
storage:
  url: postgresql+psycopg://db.example/hermes
  sqlite_synchronous: full
  turn_lease_secs: 30.5
gateway:
  sessions_dir: /srv/sessions
  write_sessions_json: true
  sessions_json_interval_secs: 15
  reset_triggers: ["/new", "/fresh"]
  session_store_max_age_days: 0
  multiplex_profiles: true
  instance_id: node-a
  startup_restore_timeout_secs: 10
  busy_ack_enabled: false
  busy_queue: {max_pending: 4, burst_window_secs: 0}
  delivery_ledger: {enabled: false, max_attempts: 5, stale_reply_max_age_secs: 60,
                    retention_days: 0, max_rows: 10, lease_secs: 9}
  housekeeping: {initial_delay_secs: 0, interval_secs: 5, prune_interval_secs: 7}
display: {busy_input_mode: steer}
agent:
  gateway_timeout: 99
  restart_drain_timeout: 3
  gateway_auto_continue_freshness: -1
  agent_cache: {max_size: 2, idle_ttl_secs: 0.5, memory_high_mb: 2048,
                max_evictions_per_pass: 1, protect_recent: 0}
privacy: {redact_pii: true, redact_pii_mode: sha256, pii_hmac_key_file: /srv/key}
plugins: {disable: [slack, my_plugin], autoload: false}
"""

FULL_FILE_VALUES: list[tuple[str, object]] = [
    ("group_sessions_per_user", False),
    ("thread_sessions_per_user", True),
    ("platforms.telegram.enabled", True),
    ("platforms.telegram.home_channel.chat_id", "-1001234"),
    ("platforms.telegram.home_channel.name", "Ops"),
    ("platforms.discord.thread_sessions_per_user", False),
    ("platforms.discord.group_sessions_per_user", None),
    ("storage.url", "postgresql+psycopg://db.example/hermes"),
    ("storage.sqlite_synchronous", "full"),
    ("storage.turn_lease_secs", 30.5),
    ("gateway.sessions_dir", Path("/srv/sessions")),
    ("gateway.write_sessions_json", True),
    ("gateway.sessions_json_interval_secs", 15),
    ("gateway.reset_triggers", ("/new", "/fresh")),
    ("gateway.session_store_max_age_days", 0),
    ("gateway.multiplex_profiles", True),
    ("gateway.instance_id", "node-a"),
    ("gateway.startup_restore_timeout_secs", 10),
    ("gateway.busy_ack_enabled", False),
    ("gateway.busy_queue.max_pending", 4),
    ("gateway.busy_queue.burst_window_secs", 0),
    ("gateway.delivery_ledger.enabled", False),
    ("gateway.delivery_ledger.max_attempts", 5),
    ("gateway.delivery_ledger.stale_reply_max_age_secs", 60),
    ("gateway.delivery_ledger.retention_days", 0),
    ("gateway.delivery_ledger.max_rows", 10),
    ("gateway.delivery_ledger.lease_secs", 9),
    ("gateway.housekeeping.initial_delay_secs", 0),
    ("gateway.housekeeping.interval_secs", 5),
    ("gateway.housekeeping.prune_interval_secs", 7),
    ("display.busy_input_mode", "steer"),
    ("agent.gateway_timeout", 99),
    ("agent.restart_drain_timeout", 3),
    ("agent.gateway_auto_continue_freshness", -1),
    ("agent.agent_cache.max_size", 2),
    ("agent.agent_cache.idle_ttl_secs", 0.5),
    ("agent.agent_cache.memory_high_mb", 2048),
    ("agent.agent_cache.max_evictions_per_pass", 1),
    ("agent.agent_cache.protect_recent", 0),
    ("privacy.redact_pii", True),
    ("privacy.redact_pii_mode", "sha256"),
    ("privacy.pii_hmac_key_file", Path("/srv/key")),
    ("plugins.disable", ("slack", "my_plugin")),
    ("plugins.autoload", False),
]


@pytest.fixture
def full_config(tmp_path: Path) -> GatewayConfig:
    return load_yaml(tmp_path, FULL_FILE, HERMES_HOME=str(tmp_path / "home"))


@pytest.mark.parametrize(("key", "expected"), FULL_FILE_VALUES)
def test_file_sets_every_key(full_config: GatewayConfig, key: str, expected: object) -> None:
    assert attr(full_config, key) == expected


def test_file_resolved_values(full_config: GatewayConfig, tmp_path: Path) -> None:
    assert full_config.source == str(tmp_path / "config.yaml")
    assert full_config.storage_url == "postgresql+psycopg://db.example/hermes"
    assert full_config.sessions_dir == Path("/srv/sessions")
    assert full_config.gateway.write_sessions_json is True
    assert full_config.pii_hmac_key_file == Path("/srv/key")
    assert full_config.connected_platforms() == ("telegram",)
    assert full_config.agent.agent_cache.memory_budget_setting == 2048.0


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n"])
def test_empty_file_means_defaults(tmp_path: Path, text: str) -> None:
    cfg = load_yaml(tmp_path, text, HERMES_HOME=str(tmp_path))
    assert cfg == GatewayConfig.from_dict(
        {}, source=cfg.source or "", environ={"HERMES_HOME": str(tmp_path)}
    )


def test_from_yaml_accepts_a_path_object(tmp_path: Path) -> None:
    path = write(tmp_path, "display: {busy_input_mode: queue}\n")
    assert GatewayConfig.from_yaml(path, environ={}).display.busy_input_mode == "queue"


def test_missing_file_is_an_error_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found") as info:
        GatewayConfig.from_yaml(path, environ={})
    assert str(path) in str(info.value)
    assert info.value.source == str(path)


def test_yaml_syntax_error_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "gateway: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as info:
        GatewayConfig.from_yaml(path, environ={})
    assert str(path) in str(info.value)


def test_yaml_syntax_error_never_quotes_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "storage:\n  url: 'postgresql://hermes:hunter2@db/hermes\n  x: [\n")
    with pytest.raises(ConfigError, match=r"line \d+, column \d+: not valid YAML") as info:
        GatewayConfig.from_yaml(path, environ={})
    assert str(path) in str(info.value)
    assert "hunter2" not in str(info.value)
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__


DUPLICATES = [
    ("top level", "group_sessions_per_user: true\nplatforms: {}\ngroup_sessions_per_user: false\n",
     "group_sessions_per_user", 3, 1),
    ("nested", "gateway:\n  busy_ack_enabled: true\n  busy_ack_enabled: false\n",
     "gateway.busy_ack_enabled", 3, 2),
    ("platform", "platforms:\n  telegram: {enabled: true, enabled: false}\n",
     "platforms.telegram.enabled", 2, 2),
    ("quoted and plain", "storage:\n  url: sqlite:///a.db\n  'url': sqlite:///b.db\n",
     "storage.url", 3, 2),
    ("host section", "model:\n  name: a\n  name: b\n", "model.name", 3, 2),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "key", "line", "first"), [d[1:] for d in DUPLICATES], ids=[d[0] for d in DUPLICATES]
)
def test_duplicate_key_is_an_error_naming_key_line_and_file(
    tmp_path: Path, text: str, key: str, line: int, first: int
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        GatewayConfig.from_yaml(path, environ={})
    message = str(info.value)
    assert info.value.key == key
    assert message.startswith(f"{path}: line {line}, column ")
    assert f"duplicate key {key} (first on line {first})" in message


def test_a_key_may_override_one_it_merged(tmp_path: Path) -> None:
    cfg = load_yaml(
        tmp_path,
        "defaults: &d {busy_ack_enabled: false, multiplex_profiles: true}\n"
        "gateway:\n  <<: *d\n  busy_ack_enabled: true\n",
    )
    assert (cfg.gateway.busy_ack_enabled, cfg.gateway.multiplex_profiles) == (True, True)
    assert load_yaml(tmp_path, "a: {1: x, '1': y}\n").group_sessions_per_user is True


@pytest.mark.parametrize("where", ["gateway:\n  port: ", "gateway:\n  multiplex_profiles: "])
def test_deep_nesting_is_a_config_error_naming_key_line_and_file(
    tmp_path: Path, where: str
) -> None:
    path = write(tmp_path, where + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested more than 32 levels deep") as info:
        GatewayConfig.from_yaml(path, environ={})
    assert info.value.key.startswith(where.replace(":\n  ", ".").rstrip(": ") + "[0]")
    assert str(info.value).startswith(f"{path}: line 2, column ")


def test_nesting_a_host_may_use_is_accepted(tmp_path: Path) -> None:
    deep = "{a: " * 20 + "1" + "}" * 20
    assert load_yaml(tmp_path, f"host: {deep}\n").gateway.busy_ack_enabled is True


def test_huge_integer_is_a_config_error_naming_key_range_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, "gateway:\n  session_store_max_age_days: " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError) as info:
        GatewayConfig.from_yaml(path, environ={})
    assert info.value.key == "gateway.session_store_max_age_days"
    assert str(info.value) == (
        f"{path}: invalid value for gateway.session_store_max_age_days: "
        "<an integer of 100+ digits>; expected a whole number of days >= 0 and up to 36500"
    )


def test_huge_integer_in_a_host_key_is_ignored(tmp_path: Path) -> None:
    cfg = load_yaml(
        tmp_path, "host: " + "9" * 5000 + "\nplatforms: {t: {port: -" + "1" * 999 + "}}\n"
    )
    assert cfg.platforms["t"].enabled is False


def test_unsafe_yaml_tag_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, "x: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        GatewayConfig.from_yaml(path, environ={})


@pytest.mark.parametrize("text", ["- a\n- b\n", "42\n", "just text\n"])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="top level must be a mapping") as info:
        GatewayConfig.from_yaml(path, environ={})
    assert str(path) in str(info.value)


def test_from_dict_rejects_a_non_mapping_naming_the_source() -> None:
    with pytest.raises(ConfigError, match=r"^settings\.json: the top level must be a mapping"):
        GatewayConfig.from_dict([1, 2], source="settings.json", environ={})  # type: ignore[arg-type]


def test_directory_instead_of_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        GatewayConfig.from_yaml(tmp_path, environ={})


def test_config_error_is_a_value_error_carrying_key_and_source() -> None:
    with pytest.raises(ValueError, match=r"display\.busy_input_mode") as info:
        GatewayConfig.from_dict({"display": {"busy_input_mode": "x"}}, source="s", environ={})
    assert isinstance(info.value, ConfigError)
    assert isinstance(info.value, HermesError)
    assert info.value.key == "display.busy_input_mode"
    assert info.value.field == "display.busy_input_mode"
    assert info.value.source == "s"


def test_file_cannot_set_hermes_home_or_source(tmp_path: Path) -> None:
    cfg = load_yaml(tmp_path, "hermes_home: /elsewhere\nsource: fake\n", HERMES_HOME=str(tmp_path))
    assert cfg.hermes_home == tmp_path
    assert cfg.source == str(tmp_path / "config.yaml")


# --- load() ---------------------------------------------------------------------------------------


def test_load_reads_config_yaml_in_hermes_home(home: Path) -> None:
    home.mkdir()
    write(home, "gateway: {multiplex_profiles: true}\n")
    cfg = GatewayConfig.load(environ={"HERMES_HOME": str(home)})
    assert cfg.gateway.multiplex_profiles is True
    assert cfg.source == str(home / "config.yaml")


def test_load_without_a_file_gives_defaults_plus_environment(home: Path) -> None:
    cfg = GatewayConfig.load(environ={"HERMES_HOME": str(home), "HERMES_AGENT_TIMEOUT": "12"})
    assert cfg.source is None
    assert cfg.agent.gateway_timeout == 12
    assert cfg.gateway == GatewayConfig.from_dict({}, environ={}).gateway
    assert not home.exists()


def test_load_reports_errors_in_the_home_file(home: Path) -> None:
    home.mkdir()
    path = write(home, "storage: {bogus: 1}\n")
    with pytest.raises(ConfigError, match=r"storage\.bogus") as info:
        GatewayConfig.load(environ={"HERMES_HOME": str(home)})
    assert str(path) in str(info.value)


# --- unknown keys ---------------------------------------------------------------------------------

OWNED_SECTIONS = [
    ("storage", "storage:\n  urll: sqlite:///x.db\n", "storage.urll"),
    ("privacy", "privacy:\n  redact: true\n", "privacy.redact"),
    ("plugins", "plugins:\n  disabled: [x]\n", "plugins.disabled"),
    ("agent_cache", "agent:\n  agent_cache:\n    maxsize: 3\n", "agent.agent_cache.maxsize"),
    ("busy_queue", "gateway:\n  busy_queue:\n    max: 3\n", "gateway.busy_queue.max"),
    (
        "delivery_ledger",
        "gateway:\n  delivery_ledger:\n    enable: true\n",
        "gateway.delivery_ledger.enable",
    ),
    (
        "housekeeping",
        "gateway:\n  housekeeping:\n    interval: 3\n",
        "gateway.housekeeping.interval",
    ),
]


@pytest.mark.parametrize(
    ("section", "text", "key"), OWNED_SECTIONS, ids=[s[0] for s in OWNED_SECTIONS]
)
def test_owned_section_rejects_unknown_key(
    tmp_path: Path, section: str, text: str, key: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        GatewayConfig.from_yaml(path, environ={})
    message = str(info.value)
    assert info.value.key == key
    assert key in message
    assert str(path) in message
    assert "unknown key" in message
    assert "accepted keys:" in message


@pytest.mark.parametrize(
    ("text", "suggestion"),
    [
        ("storage: {sqlite_synchronus: full}\n", "storage.sqlite_synchronous"),
        ("agent: {agent_cache: {maxsize: 3}}\n", "agent.agent_cache.max_size"),
        (
            "gateway: {delivery_ledger: {retention_day: 1}}\n",
            "gateway.delivery_ledger.retention_days",
        ),
        ("privacy: {redact: true}\n", "privacy.redact_pii"),
    ],
)
def test_unknown_key_in_an_owned_section_suggests_the_closest_key(
    tmp_path: Path, text: str, suggestion: str
) -> None:
    with pytest.raises(ConfigError, match=rf"\(did you mean {re.escape(suggestion)}\?\); accepted"):
        load_yaml(tmp_path, text)


def test_unknown_key_without_a_close_match_has_no_suggestion(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_yaml(tmp_path, "storage: {zzz: 1}\n")
    assert "did you mean" not in str(info.value)


def test_unknown_key_message_lists_the_accepted_keys(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match="accepted keys: url, sqlite_synchronous, sqlite_busy_timeout_secs, turn_lease_secs",
    ):
        load_yaml(tmp_path, "storage: {uri: x}\n")


def test_shared_sections_and_top_level_ignore_unknown_keys(tmp_path: Path) -> None:
    cfg = load_yaml(
        tmp_path,
        """
model: gpt-x
host_section: {anything: [1, 2]}
gateway: {port: 8080, busy_ack_enabled: false}
platforms:
  telegram: {token: secret, enabled: true, home_channel: {chat_id: "1", topic: x}}
display: {theme: dark}
agent: {model: x, gateway_timeout: 5}
""",
    )
    assert cfg.gateway.busy_ack_enabled is False
    assert cfg.platforms["telegram"].enabled is True
    assert cfg.agent.gateway_timeout == 5
    dumped = cfg.model_dump()
    assert "model" not in dumped
    assert "host_section" not in dumped
    assert "port" not in dumped["gateway"]


NEAR_MISSES = [
    ("group_session_per_user: false\n", "group_session_per_user", "group_sessions_per_user"),
    ("thread_session_per_user: true\n", "thread_session_per_user", "thread_sessions_per_user"),
    ("platform: {}\n", "platform", "platforms"),
    (
        "platforms: {telegram: {grop_sessions_per_user: false}}\n",
        "platforms.telegram.grop_sessions_per_user",
        "platforms.telegram.group_sessions_per_user",
    ),
    (
        "platforms: {slack: {home_channel: {chat_id: C1, names: x}}}\n",
        "platforms.slack.home_channel.names",
        "platforms.slack.home_channel.name",
    ),
    ("gateway: {busy_ack_enable: false}\n", "gateway.busy_ack_enable", "gateway.busy_ack_enabled"),
    ("display: {busy_input_mod: queue}\n", "display.busy_input_mod", "display.busy_input_mode"),
    ("agent: {gateway_timout: 5}\n", "agent.gateway_timout", "agent.gateway_timeout"),
]


@pytest.mark.parametrize(
    ("text", "key", "suggestion"), NEAR_MISSES, ids=[n[1] for n in NEAR_MISSES]
)
def test_near_miss_in_a_shared_section_warns_once_and_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str, key: str, suggestion: str
) -> None:
    path = write(tmp_path, text)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        GatewayConfig.from_yaml(path, environ={})
        GatewayConfig.from_yaml(path, environ={})
    assert warnings_of(caplog) == [
        f"{path}: ignoring unknown key {key} (did you mean {suggestion}?); "
        "it may belong to the host"
    ]


def test_a_misspelt_flag_does_not_change_session_keys(tmp_path: Path) -> None:
    cfg = load_yaml(
        tmp_path,
        "group_session_per_user: false\nplatforms: {telegram: {grop_sessions_per_user: false}}\n",
    )
    assert cfg.session_flags("telegram") == (True, False)
    assert cfg.flag_origins("telegram") == ("default", "default")


def test_host_keys_unlike_ours_do_not_warn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        load_yaml(
            tmp_path,
            "model: gpt-x\nproviders: {a: 1}\ngateway: {port: 8080}\n"
            "platforms: {telegram: {token: t, allowed_users: [1]}}\n"
            "display: {theme: dark}\nagent: {max_turns: 3}\n",
        )
    assert warnings_of(caplog) == []


# --- invalid values -------------------------------------------------------------------------------

INVALID_VALUES: list[tuple[str, str, str]] = [
    # (yaml, dotted key, text of what is accepted)
    ("group_sessions_per_user: 'yes'", "group_sessions_per_user", "true or false"),
    ("thread_sessions_per_user: 1", "thread_sessions_per_user", "true or false"),
    ("gateway: {multiplex_profiles: 'true'}", "gateway.multiplex_profiles", "true or false"),
    ("gateway: {write_sessions_json: 0}", "gateway.write_sessions_json", "true, false or null"),
    ("agent: {agent_cache: {max_size: true}}", "agent.agent_cache.max_size", "a positive integer"),
    ("agent: {agent_cache: {max_size: 0}}", "agent.agent_cache.max_size", "a positive integer"),
    ("agent: {agent_cache: {max_size: -3}}", "agent.agent_cache.max_size", "a positive integer"),
    ("agent: {agent_cache: {max_size: 4.0}}", "agent.agent_cache.max_size", "a positive integer"),
    ("agent: {agent_cache: {max_size: '8'}}", "agent.agent_cache.max_size", "a positive integer"),
    (
        "agent: {agent_cache: {max_evictions_per_pass: 0}}",
        "agent.agent_cache.max_evictions_per_pass",
        "a positive integer",
    ),
    ("agent: {agent_cache: {protect_recent: -1}}", "agent.agent_cache.protect_recent", ">= 0"),
    ("agent: {agent_cache: {protect_recent: 1.5}}", "agent.agent_cache.protect_recent", ">= 0"),
    ("agent: {agent_cache: {idle_ttl_secs: 0}}", "agent.agent_cache.idle_ttl_secs", "positive"),
    ("agent: {agent_cache: {idle_ttl_secs: 1h}}", "agent.agent_cache.idle_ttl_secs", "positive"),
    ("agent: {agent_cache: {memory_high_mb: lots}}", "agent.agent_cache.memory_high_mb", "auto"),
    ("agent: {agent_cache: {memory_high_mb: -5}}", "agent.agent_cache.memory_high_mb", "auto"),
    ("agent: {agent_cache: {memory_high_mb: 'on'}}", "agent.agent_cache.memory_high_mb", "auto"),
    ("agent: {agent_cache: {memory_high_mb: [1]}}", "agent.agent_cache.memory_high_mb", "auto"),
    ("agent: {agent_cache: {memory_high_mb: .inf}}", "agent.agent_cache.memory_high_mb", "auto"),
    ("agent: {gateway_timeout: true}", "agent.gateway_timeout", "a positive number"),
    ("agent: {gateway_timeout: -1}", "agent.gateway_timeout", "a positive number"),
    ("agent: {restart_drain_timeout: '60'}", "agent.restart_drain_timeout", "a positive number"),
    (
        "agent: {gateway_auto_continue_freshness: soon}",
        "agent.gateway_auto_continue_freshness",
        "a number",
    ),
    (
        "agent: {gateway_auto_continue_freshness: .nan}",
        "agent.gateway_auto_continue_freshness",
        "a number",
    ),
    ("storage: {sqlite_synchronous: extra}", "storage.sqlite_synchronous", "normal, full"),
    ("storage: {sqlite_synchronous: FULL}", "storage.sqlite_synchronous", "normal, full"),
    ("storage: {turn_lease_secs: 0}", "storage.turn_lease_secs", "a positive number"),
    ("storage: {url: ''}", "storage.url", "a URL"),
    ("storage: {url: 5}", "storage.url", "a URL"),
    ('storage: {url: "sqlite:///x.db\\n"}', "storage.url", "a URL"),
    ('storage: {url: "sqlite:///x\\0.db"}', "storage.url", "a URL"),
    ('gateway: {reset_triggers: ["/new\\n"]}', "gateway.reset_triggers[0]", "a list of non-empty"),
    ("storage: 5", "storage", "a mapping"),
    ("gateway: [1]", "gateway", "a mapping"),
    ("agent: {agent_cache: off}", "agent.agent_cache", "a mapping"),
    ("display: {busy_input_mode: loud}", "display.busy_input_mode", "interrupt, queue, steer"),
    ("privacy: {redact_pii_mode: md5}", "privacy.redact_pii_mode", "hmac, sha256"),
    ("privacy: {redact_pii: 'no'}", "privacy.redact_pii", "true or false"),
    ("privacy: {pii_hmac_key_file: ''}", "privacy.pii_hmac_key_file", "a non-empty path"),
    ("gateway: {sessions_dir: 5}", "gateway.sessions_dir", "a non-empty path"),
    ("gateway: {reset_triggers: /new}", "gateway.reset_triggers", "a list of non-empty strings"),
    ("gateway: {reset_triggers: ['']}", "gateway.reset_triggers[0]", "a list of non-empty strings"),
    ("gateway: {reset_triggers: [/new, 3]}", "gateway.reset_triggers[1]", "a list of non-empty"),
    ("gateway: {reset_triggers: null}", "gateway.reset_triggers", "a list of non-empty strings"),
    ("gateway: {session_store_max_age_days: -1}", "gateway.session_store_max_age_days", ">= 0"),
    ("gateway: {session_store_max_age_days: 1.5}", "gateway.session_store_max_age_days", ">= 0"),
    ("gateway: {instance_id: ''}", "gateway.instance_id", "a non-empty string"),
    ("gateway: {instance_id: 7}", "gateway.instance_id", "a non-empty string"),
    (
        "gateway: {sessions_json_interval_secs: .inf}",
        "gateway.sessions_json_interval_secs",
        "positive",
    ),
    (
        "gateway: {startup_restore_timeout_secs: 0}",
        "gateway.startup_restore_timeout_secs",
        "positive",
    ),
    ("gateway: {busy_ack_enabled: 'on'}", "gateway.busy_ack_enabled", "true or false"),
    (
        "gateway: {busy_queue: {max_pending: -1}}",
        "gateway.busy_queue.max_pending",
        "positive integer",
    ),
    (
        "gateway: {busy_queue: {burst_window_secs: -0.5}}",
        "gateway.busy_queue.burst_window_secs",
        ">= 0",
    ),
    ("gateway: {delivery_ledger: 5}", "gateway.delivery_ledger", "true, false or a mapping"),
    ("gateway: {delivery_ledger: 'off'}", "gateway.delivery_ledger", "true, false or a mapping"),
    (
        "gateway: {delivery_ledger: {max_attempts: 0}}",
        "gateway.delivery_ledger.max_attempts",
        "positive integer",
    ),
    (
        "gateway: {delivery_ledger: {max_rows: true}}",
        "gateway.delivery_ledger.max_rows",
        "positive integer",
    ),
    (
        "gateway: {delivery_ledger: {enabled: 1}}",
        "gateway.delivery_ledger.enabled",
        "true or false",
    ),
    (
        "gateway: {housekeeping: {interval_secs: 0}}",
        "gateway.housekeeping.interval_secs",
        "positive",
    ),
    (
        "gateway: {housekeeping: {initial_delay_secs: -1}}",
        "gateway.housekeeping.initial_delay_secs",
        ">= 0",
    ),
    ("plugins: {disable: [1]}", "plugins.disable[0]", "a list of plugin names"),
    ("plugins: {disable: slack}", "plugins.disable", "a list of plugin names"),
    ("plugins: {autoload: 0}", "plugins.autoload", "true or false"),
    ("platforms: [telegram]", "platforms", "a mapping of platform names"),
    ("platforms: {telegram: true}", "platforms.telegram", "a mapping"),
    ("platforms: {1: {enabled: true}}", "platforms[1]", "strings"),
    ("platforms: {telegram: {enabled: 'true'}}", "platforms.telegram.enabled", "true or false"),
    (
        "platforms: {slack: {group_sessions_per_user: 0}}",
        "platforms.slack.group_sessions_per_user",
        "true, false or null",
    ),
    ("platforms: {slack: {home_channel: C1}}", "platforms.slack.home_channel", "{chat_id, name}"),
    (
        "platforms: {slack: {home_channel: {name: x}}}",
        "platforms.slack.home_channel.chat_id",
        "chat id",
    ),
    (
        "platforms: {slack: {home_channel: {chat_id: ''}}}",
        "platforms.slack.home_channel.chat_id",
        "chat id",
    ),
    (
        "platforms: {slack: {home_channel: {chat_id: 1, name: 2}}}",
        "platforms.slack.home_channel.name",
        "a channel name",
    ),
]


@pytest.mark.parametrize(
    ("text", "key", "accepted"), INVALID_VALUES, ids=[v[0] for v in INVALID_VALUES]
)
def test_invalid_value_names_key_file_and_accepted(
    tmp_path: Path, text: str, key: str, accepted: str
) -> None:
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as info:
        GatewayConfig.from_yaml(path, environ={})
    message = str(info.value)
    assert info.value.key == key
    assert info.value.source == str(path)
    assert message.startswith(f"{path}: ")
    assert key in message
    assert accepted in message.split("; expected ", 1)[1]


def test_invalid_value_message_shows_the_rejected_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"invalid value for gateway.busy_ack_enabled: 'yes'"):
        load_yaml(tmp_path, "gateway: {busy_ack_enabled: 'yes'}\n")


def test_invalid_storage_url_is_not_echoed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"storage\.url") as info:
        load_yaml(tmp_path, "storage: {url: 'admin:hunter2@db/hermes'}\n")
    assert "hunter2" not in str(info.value)


SECRET_URL = "postgresql://hermes:hunter2@db.example/hermes"
SECRET_PLACES = [
    ("storage given a string", {"storage": SECRET_URL}, "storage"),
    ("storage given a list", {"storage": [SECRET_URL]}, "storage"),
    ("storage.url given a list", {"storage": {"url": [SECRET_URL]}}, "storage.url"),
    ("storage.url with a newline", {"storage": {"url": SECRET_URL + "\n"}}, "storage.url"),
    ("gateway given a string", {"gateway": SECRET_URL}, "gateway"),
    ("a URL in another setting", {"gateway": {"reset_triggers": SECRET_URL}},
     "gateway.reset_triggers"),
    ("platform given a list", {"platforms": {"telegram": [{"token": "hunter2"}]}},
     "platforms.telegram"),
    ("platform given a string", {"platforms": {"telegram": "hunter2"}}, "platforms.telegram"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("data", "key"), [p[1:] for p in SECRET_PLACES], ids=[p[0] for p in SECRET_PLACES]
)
def test_errors_never_echo_a_credential(data: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        GatewayConfig.from_dict(data, source="c.yaml", environ={})
    assert info.value.key == key
    assert str(info.value).startswith(f"c.yaml: invalid value for {key} (a value of type ")
    assert "hunter2" not in str(info.value)


def test_repr_and_str_never_show_the_storage_url() -> None:
    cfg = GatewayConfig.from_dict({"storage": {"url": SECRET_URL}}, environ={})
    for shown in (repr(cfg), str(cfg), repr(cfg.storage), str(cfg.storage)):
        assert "hunter2" not in shown
        assert "url='***'" in shown
    assert cfg.storage_url == SECRET_URL  # the value itself is intact
    assert "url=None" in repr(GatewayConfig.from_dict({}, environ={}).storage)


def test_from_dict_errors_name_the_given_source() -> None:
    with pytest.raises(ConfigError, match=r"^overrides: invalid value for storage.turn_lease_secs"):
        GatewayConfig.from_dict(
            {"storage": {"turn_lease_secs": "x"}}, source="overrides", environ={}
        )


def test_huge_integer_in_a_message_does_not_crash() -> None:
    with pytest.raises(ConfigError, match=r"gateway\.instance_id"):
        GatewayConfig.from_dict({"gateway": {"instance_id": 10**5000}}, environ={})


def test_deeply_nested_value_from_a_caller_is_a_config_error() -> None:
    nested: list[Any] = []
    for _ in range(5000):
        nested = [nested]
    with pytest.raises(ConfigError, match=r"gateway\.reset_triggers\[0\]"):
        GatewayConfig.from_dict({"gateway": {"reset_triggers": nested}}, environ={})


# (dotted key, smallest refused value above the range, largest accepted value, range text)
RANGES: list[tuple[str, object, object, str]] = [
    ("gateway.session_store_max_age_days", 36501, 36500, "up to 36500"),
    ("gateway.session_store_max_age_days", 10**400, 36500, "up to 36500"),
    ("gateway.redelivery_window_days", 36500.5, 36500, "positive number of days up to 36500"),
    ("gateway.delivery_ledger.retention_days", 1e300, 36500, "days >= 0 and up to 36500"),
    ("gateway.sessions_json_interval_secs", 31536001, 31536000, "up to 31536000 (one year)"),
    ("gateway.startup_restore_timeout_secs", 1e20, 31536000, "up to 31536000"),
    ("gateway.max_dispatch_attempts", 1000001, 1000000, "a positive integer up to 1000000"),
    ("gateway.busy_queue.max_pending", 10**30, 1000000, "up to 1000000"),
    ("gateway.busy_queue.burst_window_secs", 31536001, 31536000, ">= 0 and up to 31536000"),
    ("gateway.delivery_ledger.max_rows", 1000001, 1000000, "up to 1000000"),
    ("gateway.delivery_ledger.stale_reply_max_age_secs", 31536001, 31536000, "up to 31536000"),
    ("gateway.housekeeping.initial_delay_secs", 31536001, 0, "up to 31536000"),
    ("gateway.housekeeping.prune_interval_secs", 31536001, 31536000, "up to 31536000"),
    ("storage.sqlite_busy_timeout_secs", 31536001, 31536000, "up to 31536000"),
    ("storage.turn_lease_secs", 31536001, 31536000, "up to 31536000"),
    ("agent.gateway_timeout", 10**400, 31536000, "up to 31536000"),
    ("agent.gateway_auto_continue_freshness", -31536001, -31536000, "from -31536000 to 31536000"),
    ("agent.agent_cache.max_size", 1000001, 1000000, "up to 1000000"),
    ("agent.agent_cache.protect_recent", 1000001, 1000000, "up to 1000000"),
    ("agent.agent_cache.idle_ttl_secs", 31536001, 31536000, "up to 31536000"),
    ("agent.agent_cache.memory_high_mb", 16777217, 16777216, "MB up to 16777216"),
    ("agent.agent_cache.memory_high_mb", "1e30", "16777216", "MB up to 16777216"),
]


def _nest(dotted: str, value: object) -> dict[str, Any]:
    *sections, key = dotted.split(".")
    data: dict[str, Any] = {key: value}
    for section in reversed(sections):
        data = {section: data}
    return data


@pytest.mark.parametrize(
    ("key", "refused", "accepted", "range_text"),
    RANGES,
    ids=[f"{key}={str(refused)[:8]}" for key, refused, _, _ in RANGES],
)
def test_number_out_of_range_is_refused_naming_key_and_range(
    key: str, refused: object, accepted: object, range_text: str
) -> None:
    with pytest.raises(ConfigError) as info:
        GatewayConfig.from_dict(_nest(key, refused), source="c.yaml", environ={})
    assert info.value.key == key
    assert str(info.value).startswith(f"c.yaml: invalid value for {key}")
    assert range_text in str(info.value).split("; expected ", 1)[1]
    assert attr(GatewayConfig.from_dict(_nest(key, accepted), environ={}), key) == accepted


def test_largest_ages_still_prune(home: Path) -> None:
    days = {"session_store_max_age_days": 36500, "redelivery_window_days": 36500}
    cfg = GatewayConfig.from_dict(
        {"gateway": {**days, "delivery_ledger": {"retention_days": 36500}}},
        environ={"HERMES_HOME": str(home)},
    )
    store = SessionStore.open(cfg, plugins=fresh_plugin_manager(home))
    try:
        store.get_or_create_session(telegram_dm("old"))
        assert store.prune_old_entries(cfg.gateway.session_store_max_age_days) == 0
        assert store.prune_seen_messages() == 0
        assert store.ledger is not None
        assert store.ledger.housekeeping() == 0
    finally:
        store.close()


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        (
            "gateway: {busy_queue: {burst_window_secs: 0}}",
            "gateway.busy_queue.burst_window_secs",
            0,
        ),
        (
            "gateway: {housekeeping: {initial_delay_secs: 0}}",
            "gateway.housekeeping.initial_delay_secs",
            0,
        ),
        (
            "gateway: {delivery_ledger: {retention_days: 0}}",
            "gateway.delivery_ledger.retention_days",
            0,
        ),
        ("gateway: {session_store_max_age_days: 0}", "gateway.session_store_max_age_days", 0),
        ("agent: {agent_cache: {protect_recent: 0}}", "agent.agent_cache.protect_recent", 0),
        (
            "agent: {gateway_auto_continue_freshness: -10.5}",
            "agent.gateway_auto_continue_freshness",
            -10.5,
        ),
        ("agent: {gateway_timeout: 0.25}", "agent.gateway_timeout", 0.25),
        ("gateway: {reset_triggers: []}", "gateway.reset_triggers", ()),
        ("platforms: {t: {home_channel: null}}", "platforms.t.home_channel", None),
        (
            "platforms: {t: {group_sessions_per_user: null}}",
            "platforms.t.group_sessions_per_user",
            None,
        ),
    ],
)
def test_boundary_values_that_are_accepted(
    tmp_path: Path, text: str, key: str, expected: object
) -> None:
    assert attr(load_yaml(tmp_path, text + "\n"), key) == expected


@pytest.mark.parametrize("text", ["storage:\n", "storage: null\n", "gateway: ~\nagent:\n"])
def test_null_section_means_defaults(tmp_path: Path, text: str) -> None:
    cfg = load_yaml(tmp_path, text)
    defaults = GatewayConfig.from_dict({}, environ={})
    assert (cfg.storage, cfg.gateway, cfg.agent) == (
        defaults.storage,
        defaults.gateway,
        defaults.agent,
    )


def test_null_platforms_and_null_platform_mean_defaults(tmp_path: Path) -> None:
    assert load_yaml(tmp_path, "platforms:\n").platforms == {}
    cfg = load_yaml(tmp_path, "platforms:\n  telegram:\n")
    assert cfg.platforms["telegram"].enabled is False
    assert cfg.platforms["telegram"].home_channel is None


def test_home_channel_integer_chat_id_becomes_a_string_and_name_defaults(tmp_path: Path) -> None:
    cfg = load_yaml(tmp_path, "platforms: {telegram: {home_channel: {chat_id: -100}}}\n")
    channel = cfg.platforms["telegram"].home_channel
    assert channel is not None
    assert (channel.chat_id, channel.name) == ("-100", "Home")


# --- delivery_ledger bare boolean -----------------------------------------------------------------


@pytest.mark.parametrize("flag", [True, False])
def test_bare_boolean_delivery_ledger_means_enabled(tmp_path: Path, flag: bool) -> None:
    cfg = load_yaml(tmp_path, f"gateway:\n  delivery_ledger: {str(flag).lower()}\n")
    ledger = cfg.gateway.delivery_ledger
    assert ledger.enabled is flag
    assert (ledger.max_attempts, ledger.max_rows, ledger.lease_secs) == (3, 500, 120)


# --- memory_high_mb -------------------------------------------------------------------------------

MEMORY_FORMS: list[tuple[object, object]] = [
    ("auto", "auto"),
    ("AUTO", "auto"),
    (" Auto ", "auto"),
    (True, "auto"),
    ("true", "auto"),
    ("TRUE", "auto"),
    (2048, 2048.0),
    (512.5, 512.5),
    ("1024", 1024.0),
    (" 768.5 ", 768.5),
    (0, None),
    (0.0, None),
    ("0", None),
    (False, None),
    ("false", None),
    ("False", None),
    ("off", None),
    ("OFF", None),
    ("none", None),
    ("None", None),
    ("disabled", None),
    ("DISABLED", None),
    ("", None),
    (None, None),
]


@pytest.mark.parametrize(("given", "setting"), MEMORY_FORMS, ids=[repr(f[0]) for f in MEMORY_FORMS])
def test_memory_high_mb_forms(given: object, setting: object) -> None:
    cache = GatewayConfig.from_dict(
        {"agent": {"agent_cache": {"memory_high_mb": given}}}, environ={}
    ).agent.agent_cache
    assert cache.memory_high_mb == given  # kept as given
    assert cache.memory_budget_setting == setting
    assert type(cache.memory_budget_setting) is type(setting)


@pytest.mark.parametrize(
    "given", ["lots", "-1", -1, "on", "yes", "nan", "inf", math.inf, [512], {}]
)
def test_memory_high_mb_invalid_forms(given: object) -> None:
    with pytest.raises(ConfigError, match=r"agent\.agent_cache\.memory_high_mb.*expected auto"):
        GatewayConfig.from_dict({"agent": {"agent_cache": {"memory_high_mb": given}}}, environ={})


# --- environment ----------------------------------------------------------------------------------

ENV_FILE = """
agent: {gateway_timeout: 100, gateway_auto_continue_freshness: 200}
gateway: {multiplex_profiles: false, busy_ack_enabled: true}
plugins: {disable: [from_file], autoload: true}
"""


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    cfg = load_yaml(
        tmp_path,
        ENV_FILE,
        HERMES_AGENT_TIMEOUT="42.5",
        HERMES_AUTO_CONTINUE_FRESHNESS="-1",
        GATEWAY_MULTIPLEX_PROFILES="YES",
        HERMES_GATEWAY_BUSY_ACK_ENABLED=" off ",
        HERMES_DISABLE_PLUGINS="slack,discord",
        HERMES_PLUGINS_AUTOLOAD="0",
    )
    assert cfg.agent.gateway_timeout == 42.5
    assert cfg.agent.gateway_auto_continue_freshness == -1
    assert cfg.gateway.multiplex_profiles is True
    assert cfg.gateway.busy_ack_enabled is False
    assert cfg.plugins.disable == ("slack", "discord")
    assert cfg.plugins.autoload is False


def test_without_environment_the_file_wins(tmp_path: Path) -> None:
    cfg = load_yaml(tmp_path, ENV_FILE)
    assert cfg.agent.gateway_timeout == 100
    assert cfg.plugins.disable == ("from_file",)


def test_environment_overrides_defaults_without_a_file() -> None:
    cfg = GatewayConfig.from_dict({}, environ={"GATEWAY_MULTIPLEX_PROFILES": "on"})
    assert cfg.gateway.multiplex_profiles is True
    assert cfg.gateway.busy_ack_enabled is True


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(w, True) for w in ("1", "true", "TRUE", "Yes", "on", " On\n")]
    + [(w, False) for w in ("0", "false", "False", "NO", "off", "\toff ")],
)
def test_environment_boolean_words(raw: str, expected: bool) -> None:
    cfg = GatewayConfig.from_dict(
        {"gateway": {"busy_ack_enabled": not expected}, "plugins": {"autoload": not expected}},
        environ={"HERMES_GATEWAY_BUSY_ACK_ENABLED": raw, "HERMES_PLUGINS_AUTOLOAD": raw},
    )
    assert cfg.gateway.busy_ack_enabled is expected
    assert cfg.plugins.autoload is expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("a", ("a",)),
        (" a , b ", ("a", "b")),
        ("a,,b,", ("a", "b")),
        (",", ()),
        ("my-plugin, other_plugin", ("my-plugin", "other_plugin")),
    ],
)
def test_disable_plugins_parsing(raw: str, expected: tuple[str, ...]) -> None:
    cfg = GatewayConfig.from_dict(
        {"plugins": {"disable": ["from_file"]}}, environ={"HERMES_DISABLE_PLUGINS": raw}
    )
    assert cfg.plugins.disable == expected


def test_blank_environment_variable_counts_as_unset(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cfg = GatewayConfig.from_dict(
            {"plugins": {"disable": ["x"]}, "agent": {"gateway_timeout": 7}},
            environ={"HERMES_DISABLE_PLUGINS": "", "HERMES_AGENT_TIMEOUT": "  "},
        )
    assert cfg.plugins.disable == ("x",)
    assert cfg.agent.gateway_timeout == 7
    assert warnings_of(caplog) == []


INVALID_ENV = [
    ("HERMES_AGENT_TIMEOUT", "soon", "agent.gateway_timeout", 100),
    ("HERMES_AGENT_TIMEOUT", "0", "agent.gateway_timeout", 100),
    ("HERMES_AGENT_TIMEOUT", "-5", "agent.gateway_timeout", 100),
    ("HERMES_AGENT_TIMEOUT", "inf", "agent.gateway_timeout", 100),
    ("HERMES_AUTO_CONTINUE_FRESHNESS", "an hour", "agent.gateway_auto_continue_freshness", 200),
    ("HERMES_AUTO_CONTINUE_FRESHNESS", "nan", "agent.gateway_auto_continue_freshness", 200),
    ("GATEWAY_MULTIPLEX_PROFILES", "maybe", "gateway.multiplex_profiles", False),
    ("GATEWAY_MULTIPLEX_PROFILES", "2", "gateway.multiplex_profiles", False),
    ("HERMES_GATEWAY_BUSY_ACK_ENABLED", "enabled", "gateway.busy_ack_enabled", True),
    ("HERMES_PLUGINS_AUTOLOAD", "never", "plugins.autoload", True),
    ("HERMES_AGENT_TIMEOUT", "31536001", "agent.gateway_timeout", 100),
    ("HERMES_AGENT_TIMEOUT", "1e400", "agent.gateway_timeout", 100),
    ("HERMES_AUTO_CONTINUE_FRESHNESS", "-1e12", "agent.gateway_auto_continue_freshness", 200),
]


@pytest.mark.parametrize(("variable", "raw", "key", "file_value"), INVALID_ENV)
def test_invalid_environment_value_warns_once_and_is_ignored(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    variable: str,
    raw: str,
    key: str,
    file_value: object,
) -> None:
    path = write(tmp_path, ENV_FILE)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = GatewayConfig.from_yaml(path, environ={variable: raw})
        second = GatewayConfig.from_yaml(path, environ={variable: raw})
    assert attr(first, key) == file_value
    assert attr(second, key) == file_value
    warnings = warnings_of(caplog)
    assert len(warnings) == 1
    assert variable in warnings[0]
    assert raw in warnings[0]
    assert "expected" in warnings[0]


def test_each_invalid_variable_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    environ = {"GATEWAY_MULTIPLEX_PROFILES": "x", "HERMES_PLUGINS_AUTOLOAD": "y"}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            GatewayConfig.from_dict({}, environ=environ)
    warnings = warnings_of(caplog)
    assert len(warnings) == 2
    assert any("GATEWAY_MULTIPLEX_PROFILES" in w for w in warnings)
    assert any("HERMES_PLUGINS_AUTOLOAD" in w for w in warnings)


def test_environment_value_out_of_range_warns_with_the_range(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cfg = GatewayConfig.from_dict({}, environ={"HERMES_AGENT_TIMEOUT": "1e12"})
    assert cfg.agent.gateway_timeout == 1800
    assert warnings_of(caplog) == [
        "ignoring HERMES_AGENT_TIMEOUT='1e12': expected a positive number of seconds up to "
        "31536000 (one year)"
    ]


def test_boolean_warning_lists_the_accepted_words(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        GatewayConfig.from_dict({}, environ={"GATEWAY_MULTIPLEX_PROFILES": "si"})
    assert "1/true/yes/on or 0/false/no/off" in warnings_of(caplog)[0]


def test_invalid_file_value_is_reported_even_when_the_environment_overrides_it() -> None:
    with pytest.raises(ConfigError, match=r"agent\.gateway_timeout"):
        GatewayConfig.from_dict(
            {"agent": {"gateway_timeout": "long"}}, environ={"HERMES_AGENT_TIMEOUT": "5"}
        )


def test_crash_point_variable_is_not_config() -> None:
    cfg = GatewayConfig.from_dict({}, environ={"HERMES_CRASH_AT": "after_send"})
    assert cfg == GatewayConfig.from_dict({}, environ={})


def test_environ_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HERMES_HOME", str(tmp_path))
    monkeypatch.setenv("HERMES_AGENT_TIMEOUT", "33")
    cfg = GatewayConfig.from_dict({})
    assert cfg.hermes_home == tmp_path
    assert cfg.agent.gateway_timeout == 33


# --- paths and storage URL ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("$HERMES_HOME/s", "{home}/s"),
        ("${HERMES_HOME}/s", "{home}/s"),
        ("~/s", "{user}/s"),
        ("/abs/s", "/abs/s"),
        ("$HERMES_HOMEX/s", "$HERMES_HOMEX/s"),  # another variable: left alone
        ("$OTHER/s", "$OTHER/s"),
    ],
)
def test_path_expansion(home: Path, given: str, expected: str) -> None:
    want = Path(expected.format(home=home, user=Path("~").expanduser()))
    cfg = GatewayConfig.from_dict(
        {"gateway": {"sessions_dir": given}, "privacy": {"pii_hmac_key_file": given}},
        environ={"HERMES_HOME": str(home), "OTHER": "/nope"},
    )
    assert cfg.gateway.sessions_dir == want
    assert cfg.sessions_dir == want
    assert cfg.privacy.pii_hmac_key_file == want
    assert cfg.pii_hmac_key_file == want


def test_path_objects_from_python_callers_are_expanded_too(home: Path) -> None:
    cfg = GatewayConfig.from_dict(
        {"gateway": {"sessions_dir": Path("$HERMES_HOME/s")}},
        environ={"HERMES_HOME": str(home)},
    )
    assert cfg.sessions_dir == home / "s"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("sqlite:///$HERMES_HOME/other.db", "sqlite:///{home}/other.db"),
        ("sqlite:///${HERMES_HOME}/other.db", "sqlite:///{home}/other.db"),
        ("sqlite:///~/other.db", "sqlite:///{user}/other.db"),
        ("sqlite:///relative.db", "sqlite:///relative.db"),
        ("postgresql://u@db/hermes", "postgresql://u@db/hermes"),
        ("postgresql+psycopg://u:p@db:5432/h", "postgresql+psycopg://u:p@db:5432/h"),
    ],
)
def test_storage_url_expansion(home: Path, given: str, expected: str) -> None:
    want = expected.format(home=home, user=Path("~").expanduser())
    cfg = GatewayConfig.from_dict({"storage": {"url": given}}, environ={"HERMES_HOME": str(home)})
    assert cfg.storage.url == want
    assert cfg.storage_url == want


# --- session flags --------------------------------------------------------------------------------


def test_session_flags_default_everywhere() -> None:
    cfg = GatewayConfig.from_dict({"platforms": {"slack": {"enabled": True}}}, environ={})
    assert cfg.session_flags("slack") == (True, False)
    assert cfg.flag_origins("slack") == ("default", "default")
    assert cfg.session_flags("unknown") == (True, False)


def test_session_flags_top_level_and_platform_override() -> None:
    cfg = GatewayConfig.from_dict(
        {
            "group_sessions_per_user": True,  # explicitly set, even though it is the default
            "platforms": {
                "discord": {"group_sessions_per_user": False, "thread_sessions_per_user": True},
                "slack": {"thread_sessions_per_user": True},
                "telegram": {"group_sessions_per_user": None},
            },
        },
        environ={},
    )
    assert cfg.session_flags("discord") == (False, True)
    assert cfg.flag_origins("discord") == ("platform override", "platform override")
    assert cfg.session_flags("slack") == (True, True)
    assert cfg.flag_origins("slack") == ("top level", "platform override")
    assert cfg.session_flags("telegram") == (True, False)
    assert cfg.flag_origins("telegram") == ("top level", "default")
    assert cfg.flag_origins("matrix") == ("top level", "default")


def test_platform_override_can_restore_the_default_against_the_top_level() -> None:
    cfg = GatewayConfig.from_dict(
        {"thread_sessions_per_user": True, "platforms": {"x": {"thread_sessions_per_user": False}}},
        environ={},
    )
    assert cfg.session_flags("x") == (True, False)
    assert cfg.session_flags("y") == (True, True)
    assert cfg.flag_origins("y") == ("default", "top level")


def test_connected_platforms_are_enabled_ones_sorted() -> None:
    cfg = GatewayConfig.from_dict(
        {
            "platforms": {
                "telegram": {"enabled": True},
                "discord": {"enabled": True},
                "slack": {"enabled": False},
                "matrix": {},
                "bluebubbles": {"enabled": True},
            }
        },
        environ={},
    )
    assert cfg.connected_platforms() == ("bluebubbles", "discord", "telegram")


# --- legacy settings ------------------------------------------------------------------------------

LEGACY_FORMS: list[Mapping[str, Any]] = [
    {"session_reset": {"mode": "idle", "idle_minutes": 60}},
    {"reset_by_type": {"dm": "daily"}},
    {"reset_by_platform": {"telegram": "idle"}},
    {"gateway": {"session_reset": {"mode": "daily"}}},
    {"gateway": {"reset_by_type": None}},
    {"gateway": {"reset_by_platform": {}}},
    {"platforms": {"telegram": {"session_reset": {"mode": "idle"}, "enabled": True}}},
]


@pytest.mark.parametrize("data", LEGACY_FORMS)
def test_legacy_reset_settings_are_ignored_with_one_warning(
    caplog: pytest.LogCaptureFixture, data: Mapping[str, Any]
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cfg = GatewayConfig.from_dict(data, environ={})
        GatewayConfig.from_dict(data, environ={})
        GatewayConfig.from_dict(LEGACY_FORMS[0], environ={})
    assert warnings_of(caplog) == [LEGACY_RESET_WARNING]
    assert cfg.gateway == GatewayConfig.from_dict({}, environ={}).gateway


def test_legacy_warning_text_is_exact() -> None:
    assert LEGACY_RESET_WARNING == (
        "session_reset settings are ignored: hermes-sessions never ends a conversation because "
        "of idle time or the clock; use /new or /reset."
    )


def test_no_legacy_warning_without_legacy_settings(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        GatewayConfig.from_dict({"platforms": {"slack": {"reset_by_type": 1}}}, environ={})
        GatewayConfig.from_dict({"gateway": {"reset_triggers": ["/new"]}}, environ={})
    assert warnings_of(caplog) == []


def test_legacy_warning_from_a_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        load_yaml(tmp_path, "session_reset:\n  mode: daily\n  at_hour: 4\n")
    assert warnings_of(caplog) == [LEGACY_RESET_WARNING]


# --- property: untrusted mappings never raise anything but ConfigError ----------------------------


KNOWN_KEYS = sorted(
    {part for key, _ in APPENDIX_A2_DEFAULTS for part in key.split(".")}
    | {"enabled", "home_channel", "chat_id", "name", "telegram", "slack"}
    | {"session_reset", "reset_by_type", "reset_by_platform"}
)
_keys = st.one_of(st.sampled_from(KNOWN_KEYS), st.text(max_size=6))
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=12),
    st.sampled_from(
        [
            "auto",
            "off",
            "",
            "sqlite:///$HERMES_HOME/x.db",
            "~/x",
            "interrupt",
            "hmac",
            "full",
            "/new",
        ]
    ),
)
_json_like = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_keys, children, max_size=5),
    max_leaves=25,
)
_env_values = st.one_of(st.text(max_size=8), st.sampled_from(["1", "off", "-3", "2.5", "a,,b"]))
ENV_VARIABLES = [
    "HERMES_AGENT_TIMEOUT",
    "HERMES_AUTO_CONTINUE_FRESHNESS",
    "GATEWAY_MULTIPLEX_PROFILES",
    "HERMES_GATEWAY_BUSY_ACK_ENABLED",
    "HERMES_DISABLE_PLUGINS",
    "HERMES_PLUGINS_AUTOLOAD",
]
_environ = st.dictionaries(st.sampled_from(ENV_VARIABLES), _env_values, max_size=3)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.dictionaries(_keys, _json_like, max_size=6), environ=_environ)
def test_from_dict_returns_a_config_or_raises_config_error(
    data: dict[str, Any], environ: dict[str, str]
) -> None:
    env = {"HERMES_HOME": "/tmp/hermes-property", **environ}
    error: ConfigError | None = None
    try:
        cfg = GatewayConfig.from_dict(data, source="fuzz.yaml", environ=env)
    except ConfigError as exc:
        error = exc
    if error is not None:
        assert error.source == "fuzz.yaml"
        assert str(error).startswith("fuzz.yaml: ")
        assert error.key in str(error)
        return
    assert cfg.hermes_home == Path("/tmp/hermes-property")
    assert isinstance(cfg.storage_url, str)
    assert cfg.gateway.write_sessions_json in (None, True, False)
    budget = cfg.agent.agent_cache.memory_budget_setting
    assert budget in ("auto", None) or (isinstance(budget, float) and budget > 0)
    for name in cfg.platforms:
        assert len(cfg.session_flags(name)) == 2


_SECTIONS = ["storage", "gateway", "agent", "privacy", "plugins", "platforms", "display"]


@settings(max_examples=200, deadline=None)
@given(data=st.dictionaries(st.sampled_from(_SECTIONS), _json_like, max_size=4))
def test_section_shaped_inputs_never_raise_other_errors(data: dict[str, Any]) -> None:
    with contextlib.suppress(ConfigError):
        GatewayConfig.from_dict(data, environ={"HERMES_HOME": os.sep + "h"})
