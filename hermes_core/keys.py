"""Session keys (SPEC §4) and the multi-user predicate (SPEC §5), from one computation."""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

from hermes_core.config import GatewayConfig
from hermes_core.errors import InvalidValueError
from hermes_core.models import SessionSource, session_key_problem
from hermes_core.plugins import HermesPluginManager, platform_registry
from hermes_core.specs import PlatformSpec

_PROFILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@functools.lru_cache(maxsize=256)
def profile_namespace(profile: str | None) -> str:
    """Key namespace of a profile (SPEC §4.2); ``main`` maps to ``agent:main~``, not the default."""
    if not profile or profile == "default":
        return "agent:main"
    if not _PROFILE_RE.fullmatch(profile):
        raise InvalidValueError(
            "profile",
            f"profile {profile!r} is not valid: use 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit.",
        )
    return "agent:main~" if profile == "main" else f"agent:{profile}"


def profile_from_namespace(namespace: str) -> str:
    """Inverse of :func:`profile_namespace` for the part after ``agent:``."""
    name = namespace.removeprefix("agent:")
    return {"main": "default", "main~": "main"}.get(name, name)


class KeyResolution(NamedTuple):
    """Everything the key rule decided for one source."""

    key: str
    namespace: str
    rule: str
    """``dm-chat``, ``dm-participant``, ``dm-thread``, ``dm-sink``, ``group-shared``,
    ``group-per-user``, ``thread-shared`` or ``thread-per-user``."""
    prospective_thread: bool
    shared: bool
    """Not a DM and no participant component: several users share the session."""
    chat_id: str
    thread: str
    participant: str
    scope: str


def resolve_session_key(
    source: SessionSource,
    *,
    group_sessions_per_user: bool = True,
    thread_sessions_per_user: bool = False,
    profile: str | None = None,
    plugins: HermesPluginManager | None = None,
) -> KeyResolution:
    """Apply the key algorithm of SPEC §4.3 to ``source``; both public functions derive from it."""
    spec = platform_registry(plugins).require(source.platform)
    return _resolve(
        source, spec, group_sessions_per_user, thread_sessions_per_user, profile_namespace(profile)
    )


def _resolve(
    source: SessionSource, spec: PlatformSpec, group_per_user: bool, thread_per_user: bool,
    namespace: str,
) -> KeyResolution:  # fmt: skip
    is_dm = source.chat_type == "dm"
    chat_id = source.chat_id
    if is_dm and chat_id and spec.canonical_dm_chat_id is not None:
        chat_id = spec.canonical_dm_chat_id(chat_id)
    thread = source.thread_id or ""
    prospective = False
    if not thread and not is_dm and source.prospective_thread_id:
        thread, prospective = source.prospective_thread_id, True
    isolate = not chat_id if is_dm else group_per_user and (not thread or thread_per_user)
    participant = source.user_id_alt or source.user_id or ""
    if isolate and participant and spec.canonical_participant is not None:
        participant = spec.canonical_participant(participant) or participant
    with_participant = isolate and bool(participant)
    scope = (spec.scope(source) or "") if spec.scope is not None else ""

    parts = [namespace, source.platform, "thread" if prospective else source.chat_type]
    if scope:
        parts.append(scope)
    if chat_id:
        parts.append(chat_id)
    if is_dm:
        if with_participant:
            parts.append(participant)
        if thread:
            parts.append(thread)
        rule = (
            "dm-chat" if chat_id else "dm-participant" if with_participant
            else "dm-thread" if thread else "dm-sink"
        )  # fmt: skip
    else:
        if thread:
            parts.append(thread)
        if with_participant:
            parts.append(participant)
        rule = ("thread-" if thread else "group-") + ("per-user" if with_participant else "shared")
    key = ":".join(parts)
    # The namespace rules out a leading separator or drive; check the rest (fast path first).
    problem = None
    if len(key) > 1024 or ".." in key or not key.isprintable():
        problem = session_key_problem(key)
    if problem is not None:
        raise InvalidValueError(
            "source",
            f"the session key {key!r} built from this {source.platform} source is not valid: "
            f"{problem}; fix the ids the adapter puts in the source (chat_id, thread_id, user_id).",
        )
    return KeyResolution(
        key, namespace, rule, prospective, not is_dm and not with_participant, chat_id, thread,
        participant if with_participant else "", scope,
    )  # fmt: skip


def build_session_key(
    source: SessionSource,
    *,
    group_sessions_per_user: bool = True,
    thread_sessions_per_user: bool = False,
    profile: str | None = None,
    plugins: HermesPluginManager | None = None,
) -> str:
    """The deterministic session key of ``source`` (SPEC §4); ``plugins`` None: the built-ins."""
    return resolve_session_key(
        source,
        group_sessions_per_user=group_sessions_per_user,
        thread_sessions_per_user=thread_sessions_per_user,
        profile=profile,
        plugins=plugins,
    ).key


def is_shared_multi_user_session(
    source: SessionSource,
    *,
    group_sessions_per_user: bool = True,
    thread_sessions_per_user: bool = False,
    plugins: HermesPluginManager | None = None,
) -> bool:
    """True iff ``source`` is not a DM and its key has no participant (SPEC §5)."""
    return resolve_session_key(
        source,
        group_sessions_per_user=group_sessions_per_user,
        thread_sessions_per_user=thread_sessions_per_user,
        plugins=plugins,
    ).shared


def config_profile(source: SessionSource, config: GatewayConfig) -> str | None:
    """The profile the store keys by: ``source.profile`` (else ``default``) when multiplexing."""
    if not config.gateway.multiplex_profiles:
        return None
    return source.profile or "default"


def resolve_for_config(
    source: SessionSource, config: GatewayConfig, plugins: HermesPluginManager | None = None
) -> KeyResolution:
    """Resolve with the effective per-platform flags and profile of ``config``; ``plugins`` None
    uses the built-in platforms for ``config.hermes_home``."""
    group_per_user, thread_per_user = config.session_flags(source.platform)
    spec = platform_registry(plugins, config).require(source.platform)
    namespace = profile_namespace(config_profile(source, config))
    return _resolve(source, spec, group_per_user, thread_per_user, namespace)
