"""GatewayConfig: invalid values, ranges and the special value forms.

Every test passes ``environ=`` explicitly so the developer's real environment never leaks in.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from support.config_files import attr, load_yaml, write

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import ConfigError
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager, telegram_dm

pytestmark = pytest.mark.usefixtures("fresh_config_warnings")


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
        assert store._queue.prune_seen() == 0
        assert store._obligations.ledger is not None
        assert store._obligations.ledger.housekeeping() == 0
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
