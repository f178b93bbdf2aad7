"""GatewayConfig: environment variables, paths, session flags, legacy settings, and
properties over arbitrary input.

Every test passes ``environ=`` explicitly so the developer's real environment never leaks in.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.config_files import (
    APPENDIX_A2_DEFAULTS,
    CONFIG_VARIABLES,
    LOGGER,
    attr,
    load_yaml,
    warnings_of,
    write,
)

from hermes_core.config.schema import LEGACY_RESET_WARNING, GatewayConfig
from hermes_core.domain.errors import ConfigError

pytestmark = pytest.mark.usefixtures("fresh_config_warnings")


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
_environ = st.dictionaries(st.sampled_from(CONFIG_VARIABLES), _env_values, max_size=3)


@pytest.mark.slow
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


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(data=st.dictionaries(st.sampled_from(_SECTIONS), _json_like, max_size=4))
def test_section_shaped_inputs_never_raise_other_errors(data: dict[str, Any]) -> None:
    with contextlib.suppress(ConfigError):
        GatewayConfig.from_dict(data, environ={"HERMES_HOME": os.sep + "h"})
