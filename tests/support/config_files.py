"""Helpers of the GatewayConfig tests: config files written and loaded, values looked up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hermes_core.config.schema import GatewayConfig

LOGGER = "hermes_core.config.schema"

CONFIG_VARIABLES = (
    "HERMES_AGENT_TIMEOUT",
    "HERMES_AUTO_CONTINUE_FRESHNESS",
    "GATEWAY_MULTIPLEX_PROFILES",
    "HERMES_GATEWAY_BUSY_ACK_ENABLED",
    "HERMES_DISABLE_PLUGINS",
    "HERMES_PLUGINS_AUTOLOAD",
)
"""The environment variables the configuration reads."""

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
    ("gateway.sessions_json_max_lanes", 10000),
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
"""Every key of the configuration appendix with its default."""


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
