"""Why a source gets its session key: the data behind ``hermes-sessions explain``.

Everything is read from the :class:`~hermes_core.domain.keys.KeyResolution` the store itself would
use (:func:`~hermes_core.domain.keys.resolve_key`), so the explanation cannot disagree with
the key. Nothing is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import shown
from hermes_core.domain.keys import KeyResolution, config_profile, resolve_key
from hermes_core.domain.models import SessionSource
from hermes_core.domain.specs import PlatformSpec
from hermes_core.gateway.context import session_type_line
from hermes_core.plugins.manager import HermesPluginManager, platform_registry

__all__ = ["explain_session_key", "format_explanation"]

_FLAG_NAMES = ("group_sessions_per_user", "thread_sessions_per_user")


def explain_session_key(
    source: SessionSource, config: GatewayConfig, plugins: HermesPluginManager | None = None
) -> dict[str, Any]:
    """How ``source`` is keyed under ``config``, as a JSON-ready dict with a stable key order.

    ``plugins`` None uses the built-in plugins for ``config`` (so WhatsApp mapping files are read
    under ``config.hermes_home``). Raises the named errors of key building (unknown platform,
    invalid profile, unsafe key).
    """
    resolution = resolve_key(source, config, plugins)
    registry = platform_registry(plugins, config)
    spec = registry[source.platform]
    flags = zip(
        _FLAG_NAMES,
        config.session_flags(source.platform),
        config.flag_origins(source.platform),
        strict=True,
    )
    shared = resolution.shared
    return {
        "key": resolution.key,
        "key_schema": {
            "value": resolution.schema,
            "origin": "keys.schema" if "key_schema" in config.keys.model_fields_set else "default",
        },
        "warnings": _schema_warnings(resolution, spec),
        "platform": source.platform,
        "platform_plugin": registry.owners[source.platform],
        "namespace": resolution.namespace,
        "namespace_reason": _namespace_reason(source, config, resolution),
        "rule": resolution.rule,
        "prospective_thread": resolution.prospective_thread,
        "flags": {name: {"value": value, "origin": origin} for name, value, origin in flags},
        "canonicalisation": {
            "dm_chat_id": _dm_chat_id(source, spec, resolution),
            "participant": _participant(source, spec, resolution),
        },
        "scope": _scope(source, spec, resolution),
        "shared_multi_user_session": shared,
        "session_type_line": session_type_line(thread=bool(resolution.thread)) if shared else None,
    }


def _schema_warnings(resolution: KeyResolution, spec: PlatformSpec) -> list[str]:
    """Why this v1 key may be shared with another source: a component holds ``:``, or fewer
    components are present than the platform can have, so their kinds cannot be told apart."""
    if resolution.schema != "v1":
        return []
    values = [resolution.scope, resolution.chat_id, resolution.thread, resolution.participant]
    present = [value for value in values if value]
    possible = 4 if spec.scope is not None else 3
    if not any(":" in value for value in present) and not 0 < len(present) < possible:
        return []
    return [
        "key schema v1 is ambiguous for this source: another source can get the same key (a "
        "thread id read as a sender id or the other way round, or ids containing ':'), and its "
        "messages would join this lane; run `hermes-sessions rekey --to v2` and use schema v2"
    ]


def _namespace_reason(
    source: SessionSource, config: GatewayConfig, resolution: KeyResolution
) -> str:
    """Why the key starts with ``resolution.namespace``."""
    profile = config_profile(source, config)
    if profile is None:
        ignored = (
            f"; the source's profile {shown(source.profile)} is ignored" if source.profile else ""
        )
        return f"gateway.multiplex_profiles is off: every key uses agent:main{ignored}"
    if not source.profile:
        return (
            "multiplexing is on and the source names no profile: the default profile uses "
            f"{resolution.namespace}"
        )
    if profile == "main":
        return (
            f"multiplexing is on: profile 'main' uses {resolution.namespace} so that it does not "
            "collide with the default profile's agent:main"
        )
    return f"multiplexing is on: profile {profile!r} uses {resolution.namespace}"


def _canonical(raw: str, canonical: str, in_key: bool, spec: PlatformSpec) -> dict[str, Any]:
    """One canonicalised id: raw and canonical value, the aliases visited (if the spec says)."""
    aliases = list(spec.aliases(raw)) if spec.aliases is not None else None
    return {"raw": raw, "canonical": canonical, "in_key": in_key, "aliases": aliases}


def _dm_chat_id(
    source: SessionSource, spec: PlatformSpec, resolution: KeyResolution
) -> dict[str, Any] | None:
    """The DM chat id's canonicalisation, when the platform canonicalises DM chat ids."""
    if source.chat_type != "dm" or not source.chat_id or spec.canonical_dm_chat_id is None:
        return None
    return _canonical(source.chat_id, resolution.chat_id, True, spec)


def _participant(
    source: SessionSource, spec: PlatformSpec, resolution: KeyResolution
) -> dict[str, Any] | None:
    """The sender id's canonicalisation, when the platform canonicalises participants.

    Shown even when the participant is not a key component (it still feeds the prompt's PII
    pseudonyms).
    """
    raw = source.user_id_alt or source.user_id
    if not raw or spec.canonical_participant is None:
        return None
    in_key = bool(resolution.participant)
    canonical = resolution.participant if in_key else spec.canonical_participant(raw) or raw
    return _canonical(raw, canonical, in_key, spec)


def _scope(source: SessionSource, spec: PlatformSpec, resolution: KeyResolution) -> dict[str, Any]:
    """The scope component used (or None) and why."""
    platform = source.platform
    if spec.scope is None:
        given = f" {shown(source.scope_id)}" if source.scope_id else ""
        reason = (
            f"{platform} supplies no scope component: the guild or workspace (scope_id{given}) "
            "is never part of the key"
        )
    elif resolution.scope:
        reason = f"{platform} supplies a scope component and this source has one"
    else:
        reason = (
            f"{platform} supplies a scope component but this source has none (scope_id unset), "
            "so the key has no scope"
        )
    return {"component": resolution.scope or None, "reason": reason}


def format_explanation(explanation: Mapping[str, Any]) -> list[str]:
    """Human-readable lines of an :func:`explain_session_key` result, one per item."""
    flags = ", ".join(
        f"{name}={str(flag['value']).lower()} ({flag['origin']})"
        for name, flag in explanation["flags"].items()
    )
    rule = explanation["rule"] + (
        ", prospective-thread" if explanation["prospective_thread"] else ""
    )
    scope = explanation["scope"]
    shared = "yes" if explanation["shared_multi_user_session"] else "no"
    schema = explanation["key_schema"]
    return [
        f"key: {explanation['key']}",
        f"key schema: {schema['value']} ({schema['origin']})",
        *(f"warning: {warning}" for warning in explanation["warnings"]),
        f"platform: {explanation['platform']} (plugin {explanation['platform_plugin']})",
        f"namespace: {explanation['namespace']} ({explanation['namespace_reason']})",
        f"rule: {rule}",
        f"flags: {flags}",
        f"canonicalisation: {_canonicalisation_text(explanation['canonicalisation'])}",
        f"scope: {scope['component'] or 'none'} ({scope['reason']})",
        f"shared multi-user session: {shared}",
        f"session type line: {explanation['session_type_line'] or 'none (not shared)'}",
    ]


def _canonicalisation_text(canonicalisation: Mapping[str, Any]) -> str:
    """``DM chat id a -> b (aliases visited: a, b); participant ...``, or ``none``."""
    labels = {"dm_chat_id": "DM chat id", "participant": "participant"}
    parts = []
    for name, entry in canonicalisation.items():
        if entry is None:
            continue
        text = f"{labels.get(name, name)} {entry['raw']} -> {entry['canonical']}"
        if entry["aliases"] is not None:
            text += f" (aliases visited: {', '.join(entry['aliases'])})"
        if not entry["in_key"]:
            text += " (not in the key)"
        parts.append(text)
    return "; ".join(parts) or "none"
