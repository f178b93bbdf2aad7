"""Session keys and the multi-user predicate, from one computation.

Two key schemas encode the same components. **v1** joins them with ``:`` exactly as the original
gateway does; it is ambiguous (a forum topic and a group member can share a key, and so can ids
holding ``:``). **v2**, the default, tags every variable component (``s=`` scope, ``c=`` chat,
``t=`` thread, ``u=`` participant) and escapes ``%``, ``:`` and the second ``.`` of ``..`` inside
values, so different components always give different keys and :func:`parse_session_key`
recovers them.

Which function to call: a host keys a message with :func:`resolve_key`, which applies its
configuration (the per-platform per-user flags, the profile when profiles are multiplexed, the key
schema) exactly as the store and the gateway do. :func:`resolve_key_from_flags` and
:func:`build_key_from_flags` read no configuration: they take the flags, profile and schema as
arguments (defaults: per user in groups, shared in threads, no profile, v2), for tools and tests
that state them. ``resolve_for_config``, ``resolve_session_key`` and ``build_session_key`` are the
names earlier releases published for these three and keep working.
"""

from __future__ import annotations

import functools
import re
from typing import Literal, NamedTuple

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import InvalidValueError, shown
from hermes_core.domain.models import SessionSource, session_key_problem
from hermes_core.domain.specs import PlatformSpec
from hermes_core.plugins.manager import HermesPluginManager, platform_registry

_PROFILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_WIDEST_NAMESPACE = "agent:" + "p" * 64
"""As long as a profile's namespace can be (``agent:`` and a 64-character profile name)."""

KeySchema = Literal["v1", "v2"]
KEY_SCHEMAS: tuple[KeySchema, ...] = ("v1", "v2")
DEFAULT_KEY_SCHEMA: KeySchema = "v2"
"""The schema of new state, and of :func:`build_key_from_flags` without ``schema``."""

_ESCAPES = {"%": "%25", ":": "%3A", ".": "%2E"}
_UNESCAPES = {code: char for char, code in _ESCAPES.items()}
_ESCAPED_RE = re.compile(r"%|:|\.(?<=\.\.)")
"""What v2 escapes in a value: ``%``, ``:`` and a ``.`` right after another ``.``."""
_ESCAPE_RE = re.compile(r"%(?:25|3A|2E)|%")
_PLATFORM_RE = re.compile(r"^[a-z0-9_]+$")
_TAGS = ("s", "c", "t", "u")
"""v2 tags, in key order: scope, chat id, thread, participant."""


@functools.lru_cache(maxsize=256)
def profile_namespace(profile: str | None) -> str:
    """Key namespace of a profile; ``main`` maps to ``agent:main~``, not the default."""
    if not profile or profile == "default":
        return "agent:main"
    if not _PROFILE_RE.fullmatch(profile):
        raise InvalidValueError(
            "profile",
            f"profile {shown(profile)} is not valid: use 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit.",
        )
    return "agent:main~" if profile == "main" else f"agent:{profile}"


def profile_from_namespace(namespace: str) -> str:
    """Inverse of :func:`profile_namespace` for the part after ``agent:``."""
    name = namespace.removeprefix("agent:")
    return {"main": "default", "main~": "main"}.get(name, name)


def _encode(value: str) -> str:
    """A v2 value: ``%`` → ``%25``, ``:`` → ``%3A``, a ``.`` following a ``.`` → ``%2E``, so a
    value never holds a separator or ``..`` and decoding is unambiguous."""
    if "%" not in value and ":" not in value and ".." not in value:
        return value
    return _ESCAPED_RE.sub(lambda m: _ESCAPES[m.group()], value)


def _decode(value: str, key: str) -> str:
    """Inverse of :func:`_encode`; any other ``%`` sequence is not a v2 key."""

    def replace(match: re.Match[str]) -> str:
        code = match.group()
        if code == "%":
            raise _not_v2(key, "a '%' that is not one of the escapes %25, %3A, %2E")
        return _UNESCAPES[code]

    return _ESCAPE_RE.sub(replace, value) if "%" in value else value


def _not_v2(key: str, problem: str) -> InvalidValueError:
    return InvalidValueError(
        "session_key",
        f"{shown(key)} is not a v2 session key ({problem}); pass a key built by build_session_key "
        "with schema='v2' (v1 keys are ambiguous and cannot be parsed).",
    )


class SessionKeyParts(NamedTuple):
    """The components of a v2 session key (empty strings for absent ones)."""

    namespace: str
    platform: str
    slot: str
    scope: str
    chat_id: str
    thread: str
    participant: str


def _join(
    namespace: str, platform: str, slot: str, scope: str, chat_id: str, thread: str,
    participant: str, schema: KeySchema,
) -> str:  # fmt: skip
    """The key of these components in ``schema`` (v1: DMs put the participant first)."""
    if schema == "v1":
        pair = (participant, thread) if slot == "dm" else (thread, participant)
        return ":".join(filter(None, (namespace, platform, slot, scope, chat_id, *pair)))
    key = f"{namespace}:{platform}:{_encode(slot)}"
    if scope:
        key += ":s=" + _encode(scope)
    if chat_id:
        key += ":c=" + _encode(chat_id)
    if thread:
        key += ":t=" + _encode(thread)
    if participant:
        key += ":u=" + _encode(participant)
    return key


def parse_session_key(key: str) -> SessionKeyParts:
    """The components of a v2 key: the inverse of :func:`build_key_from_flags` and
    :func:`resolve_key` in schema v2.

    Raises :class:`InvalidValueError` for anything they cannot produce in v2
    (including every v1 key with a chat, thread or participant component)."""
    fields = key.split(":")
    if len(fields) < 4 or fields[0] != "agent":
        raise _not_v2(key, "it must start with agent:<profile>:<platform>:<slot>")
    values = dict.fromkeys(_TAGS, "")
    order = -1
    for field in fields[4:]:
        tag, sep, value = field.partition("=")
        if not sep or tag not in values or not value or _TAGS.index(tag) <= order:
            raise _not_v2(key, f"component {shown(field)} is not s=, c=, t= or u= in that order")
        order = _TAGS.index(tag)
        values[tag] = _decode(value, key)
    namespace = f"agent:{fields[1]}"
    if _PLATFORM_RE.match(fields[2]) is None or not _is_namespace(namespace):
        raise _not_v2(key, "the profile or platform name is not valid")
    parts = SessionKeyParts(namespace, fields[2], _decode(fields[3], key), *values.values())
    if not parts.slot or _join(*parts, "v2") != key:
        raise _not_v2(key, "it is not in the canonical form build_session_key writes")
    return parts


def _is_namespace(namespace: str) -> bool:
    """Whether some profile has ``namespace``."""
    try:
        return profile_namespace(profile_from_namespace(namespace)) == namespace
    except InvalidValueError:
        return False


class KeyResolution(NamedTuple):
    """Everything the key rule decided for one source."""

    key: str
    schema: KeySchema
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


def resolve_key_from_flags(
    source: SessionSource,
    *,
    group_sessions_per_user: bool = True,
    thread_sessions_per_user: bool = False,
    profile: str | None = None,
    plugins: HermesPluginManager | None = None,
    schema: KeySchema = DEFAULT_KEY_SCHEMA,
) -> KeyResolution:
    """Apply the key algorithm to ``source`` with the flags, profile and schema given here, not
    a configuration's (a host calls :func:`resolve_key`); ``plugins`` None: the built-ins."""
    spec = platform_registry(plugins).require(source.platform)
    return _resolve(
        source, spec, group_sessions_per_user, thread_sessions_per_user,
        profile_namespace(profile), schema,
    )  # fmt: skip


def _resolve(
    source: SessionSource, spec: PlatformSpec, group_per_user: bool, thread_per_user: bool,
    namespace: str, schema: KeySchema,
) -> KeyResolution:  # fmt: skip
    """The resolution of ``source``; :class:`InvalidValueError` when its key is not valid."""
    resolution = _components(source, spec, group_per_user, thread_per_user, namespace, schema)
    problem = _key_problem(resolution.key)
    if problem is not None:
        raise InvalidValueError(
            "source",
            f"the session key {shown(resolution.key)} built from this {source.platform} source "
            f"is not valid: {problem}; fix the ids the adapter puts in the source (chat_id, "
            "thread_id, user_id).",
        )
    return resolution


def _components(
    source: SessionSource, spec: PlatformSpec, group_per_user: bool, thread_per_user: bool,
    namespace: str, schema: KeySchema,
) -> KeyResolution:  # fmt: skip
    """The key algorithm applied to ``source``, its key not yet checked."""
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
    if is_dm:
        rule = (
            "dm-chat" if chat_id else "dm-participant" if with_participant
            else "dm-thread" if thread else "dm-sink"
        )  # fmt: skip
    else:
        rule = ("thread-" if thread else "group-") + ("per-user" if with_participant else "shared")
    participant = participant if with_participant else ""
    slot = "thread" if prospective else source.chat_type
    key = _join(namespace, source.platform, slot, scope, chat_id, thread, participant, schema)
    return KeyResolution(
        key, schema, namespace, rule, prospective, not is_dm and not with_participant, chat_id,
        thread, participant, scope,
    )  # fmt: skip


def _key_problem(key: str) -> str | None:
    """Why a built key is refused, or None. The namespace rules out a leading separator or
    drive; the rest is checked (fast path first)."""
    if len(key) > 1024 or ".." in key or not key.isprintable():
        return session_key_problem(key)
    return None


def source_key_problem(source: SessionSource, spec: PlatformSpec) -> str | None:
    """Why some configuration's key builder would refuse ``source``, or None: its widest key
    (per user and per thread, in either schema, under the longest profile name a gateway may key
    it by) is checked by the builder's own rule. Event readers refuse such a source, so a host
    meets it as a malformed payload rather than as an error from ``handle_message``."""
    try:
        namespace = max(profile_namespace(source.profile), _WIDEST_NAMESPACE, key=len)
    except InvalidValueError as exc:
        return str(exc)
    for schema in KEY_SCHEMAS:
        problem = _key_problem(_components(source, spec, True, True, namespace, schema).key)
        if problem is not None:
            return problem
    return None


def origin_keys_to(
    source: SessionSource, key: str, config: GatewayConfig, plugins: HermesPluginManager | None
) -> bool:
    """Whether ``source`` gives ``key`` under ``config``'s platforms and profile, with either
    per-user setting and in either schema (a key written before those settings changed still
    matches its own chat): an entry whose origin names another chat does not."""
    spec = platform_registry(plugins, config).get(source.platform)
    if spec is None:
        return False
    try:
        namespace = profile_namespace(config_profile(source, config))
    except InvalidValueError:
        return False
    return any(
        _components(source, spec, group, thread, namespace, schema).key == key
        for group in (True, False) for thread in (True, False) for schema in KEY_SCHEMAS
    )  # fmt: skip


def build_key_from_flags(
    source: SessionSource,
    *,
    group_sessions_per_user: bool = True,
    thread_sessions_per_user: bool = False,
    profile: str | None = None,
    plugins: HermesPluginManager | None = None,
    schema: KeySchema = DEFAULT_KEY_SCHEMA,
) -> str:
    """The key of :func:`resolve_key_from_flags`: the deterministic session key of ``source`` in
    ``schema`` (v2 unless told; v1 is the original gateway's layout), with the flags and profile
    given here, not a configuration's; ``plugins`` None: the built-ins."""
    return resolve_key_from_flags(
        source,
        group_sessions_per_user=group_sessions_per_user,
        thread_sessions_per_user=thread_sessions_per_user,
        profile=profile,
        plugins=plugins,
        schema=schema,
    ).key


def is_shared_multi_user_session(
    source: SessionSource,
    *,
    group_sessions_per_user: bool = True,
    thread_sessions_per_user: bool = False,
    plugins: HermesPluginManager | None = None,
) -> bool:
    """True iff ``source`` is not a DM and its key has no participant (in either schema), with the
    flags given here (``resolve_key(...).shared`` applies a configuration's)."""
    return resolve_key_from_flags(
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


def resolve_key(
    source: SessionSource,
    config: GatewayConfig,
    plugins: HermesPluginManager | None = None,
    *,
    schema: KeySchema | None = None,
) -> KeyResolution:
    """The key of ``source`` under ``config``, as the store and the gateway compute it: the one to
    call. It applies the effective per-platform flags, the profile (when
    ``gateway.multiplex_profiles`` is on) and the key schema (``keys.schema``, unless ``schema``
    is given) of ``config``; ``plugins`` None uses the built-in platforms for
    ``config.hermes_home``. ``.key`` is the key, ``.shared`` whether several users share it."""
    group_per_user, thread_per_user = config.session_flags(source.platform)
    spec = platform_registry(plugins, config).require(source.platform)
    namespace = profile_namespace(config_profile(source, config))
    chosen = schema if schema is not None else config.keys.key_schema
    return _resolve(source, spec, group_per_user, thread_per_user, namespace, chosen)


resolve_for_config = resolve_key
"""The name earlier releases gave :func:`resolve_key`."""
resolve_session_key = resolve_key_from_flags
"""The name earlier releases gave :func:`resolve_key_from_flags`."""
build_session_key = build_key_from_flags
"""The name earlier releases gave :func:`build_key_from_flags`."""
