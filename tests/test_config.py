"""GatewayConfig: defaults, file loading, ``load()`` and unknown keys.

Every test passes ``environ=`` explicitly so the developer's real environment never leaks in.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pydantic
import pytest
from support.config_files import APPENDIX_A2_DEFAULTS, LOGGER, attr, load_yaml, warnings_of, write

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import ConfigError, HermesError

pytestmark = pytest.mark.usefixtures("fresh_config_warnings")


# --- defaults -------------------------------------------------------------------------------------


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


@pytest.mark.parametrize(
    ("storage", "writers"),
    [
        ({}, 2),
        ({"instances": "shared"}, 1),
        ({"instances": "shared", "writer_connections": 3}, 3),
        ({"writer_connections": 1}, 1),
        ({"writer_connections": None}, 2),
    ],
)
def test_writer_connections_default_to_two_alone_and_one_when_shared(
    storage: dict[str, object], writers: int, home: Path
) -> None:
    config = GatewayConfig.from_dict({"storage": storage}, environ={"HERMES_HOME": str(home)})
    assert config.storage.writers == writers


def test_writer_connections_out_of_range_is_a_config_error(home: Path) -> None:
    with pytest.raises(ConfigError, match=r"storage\.writer_connections.*1 to 16"):
        GatewayConfig.from_dict(
            {"storage": {"writer_connections": 0}}, environ={"HERMES_HOME": str(home)}
        )


@pytest.mark.parametrize(
    ("yaml_text", "key"),
    [
        ('storage:\n  url: "sqlite:///tmp/x\\ud800.db"\n', "storage.url"),
        ('gateway:\n  sessions_dir: "/tmp/\\udfff"\n', "gateway.sessions_dir"),
        (
            "platforms:\n  telegram:\n    home_channel: "
            '{platform: telegram, chat_id: "1", name: "caf\\ud83d"}\n',
            "platforms.telegram.home_channel.name",
        ),
        ('plugins:\n  disable: [slack, "x\\ud800"]\n', "plugins.disable[1]"),
        ('"\\ud800": 1\n', "(top level)"),
    ],
    ids=["url", "path", "home-channel", "list", "key"],
)
def test_a_lone_surrogate_is_refused_at_load_naming_the_key(
    tmp_path: Path, yaml_text: str, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A YAML escape such as \\ud800 gives half a character, which nothing can store: refused
    when the file is read (not later, when the settings are serialised), by the console too."""
    from hermes_core.cli.main import main

    with pytest.raises(ConfigError, match="lone surrogate") as caught:
        load_yaml(tmp_path, yaml_text, HERMES_HOME=str(tmp_path))
    assert caught.value.key == key
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    write(home, yaml_text)
    assert main(["ls", "--state-dir", str(home)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("hermes-sessions: error: ")
    assert len(error.splitlines()) == 1
    assert f"{key} holds a lone surrogate" in error
