"""The session-key schema a store records (``state_meta`` ``key_schema``) and its check against
``keys.schema`` at open."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import InvalidValueError, KeySchemaError
from hermes_core.domain.keys import KeySchema, resolve_key
from hermes_core.domain.models import SessionSource
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.store.backend import Maintenance, StoreBackend
from hermes_core.store.base import KEY_SCHEMA_META, MIRROR_IMPORTED, REKEYING
from hermes_core.store.mirror import read_mirror
from hermes_core.store.rekey_report import Forum

ROUTE_PAGE = 1_000
"""Routing entries read at a time while a store's key schema is told from its lanes."""


def keys_in_both(
    source: SessionSource, config: GatewayConfig, plugins: HermesPluginManager
) -> tuple[str, str]:
    """The v1 and v2 keys of ``source`` under ``config``'s settings."""
    v1 = resolve_key(source, config, plugins, schema="v1").key
    return v1, resolve_key(source, config, plugins, schema="v2").key


def check_forums(forums: frozenset[Forum], plugins: HermesPluginManager) -> None:
    """Raise :class:`InvalidValueError` unless every forum's platform is registered and declares
    the thread of a forum's messages outside any topic (``PlatformSpec.forum_general_thread``)."""
    for platform, chat in sorted(forums):
        spec = plugins.platforms().require(platform, field="forum")
        if spec.forum_general_thread is None or not chat.strip():
            raise InvalidValueError(
                "forum", f"{platform} {chat!r} cannot be moved to a general topic: name the chat "
                "id of a forum whose platform has one (Telegram's forum supergroups do)."
            )  # fmt: skip


def general_topic_keys(
    source: SessionSource,
    config: GatewayConfig,
    plugins: HermesPluginManager,
    schema: KeySchema,
    forums: frozenset[Forum],
) -> tuple[str, str]:
    """The key of ``source`` under ``schema``, and the key it has now that a group message
    outside any topic of a forum (in ``forums``) is in the forum's general topic: the same key
    for every other source."""
    key = resolve_key(source, config, plugins, schema=schema).key
    if (source.platform, source.chat_id) not in forums or source.chat_type != "group":
        return key, key
    general = plugins.platforms()[source.platform].forum_general_thread
    if source.thread_id or general is None:
        return key, key
    moved = source.replace(thread_id=general)
    return key, resolve_key(moved, config, plugins, schema=schema).key


def recorded_key_schema(
    backend: StoreBackend,
    sql: Maintenance,
    config: GatewayConfig,
    plugins: HermesPluginManager,
    mirror: Path,
    *,
    rekeying: bool,
    read_only: bool,
) -> KeySchema:
    """The key schema recorded in ``backend`` (``sql`` is its maintenance capability),
    recorded first for a store that has none (see :func:`_unrecorded_schema`; not by a
    ``read_only`` store). Unless ``rekeying``, it must be ``keys.schema``:
    :class:`KeySchemaError` otherwise."""
    wanted = config.keys.key_schema
    recorded = sql.get_meta(KEY_SCHEMA_META)
    if recorded is None:
        recorded = _unrecorded_schema(backend, sql, config, plugins, mirror)
        if not read_only:  # a reader tells it the same way each time
            sql.set_meta(KEY_SCHEMA_META, recorded)
    if recorded not in ("v1", "v2", REKEYING):
        raise KeySchemaError(
            f"the store records key schema {recorded!r}, which this hermes-sessions does not "
            "know; upgrade hermes-sessions."
        )
    if rekeying:
        return "v2" if recorded == "v2" else "v1"
    if recorded == REKEYING:
        raise KeySchemaError(
            "a re-key of this store to key schema v2 was interrupted; run `hermes-sessions "
            "rekey --to v2` again to finish it before starting the gateway."
        )
    if recorded == "v1" and wanted == "v2":
        raise KeySchemaError(
            "this store's session keys follow key schema v1 (the original gateway's layout) "
            "but keys.schema is v2 (the default): set keys.schema: v1 to keep them, or stop "
            "the gateway and run `hermes-sessions rekey --to v2` to move every lane to v2."
        )
    if recorded != wanted:
        raise KeySchemaError(
            "this store's session keys follow key schema v2 but keys.schema is v1: set "
            "keys.schema: v2 (or remove it); a v2 store is never moved back to v1."
        )
    return wanted


def lane_schema(
    key: str, origin: object, config: GatewayConfig, plugins: HermesPluginManager
) -> KeySchema | None:
    """The key schema lane ``key`` follows, told by its ``origin`` (a :class:`SessionSource`
    or its dict): None when the origin is missing, cannot be keyed, keys alike in v1 and v2 or
    keys to neither, so that this lane cannot tell."""
    try:
        source = (
            origin
            if isinstance(origin, SessionSource)
            else SessionSource.from_dict(origin, plugins=plugins)
        )
        v1, v2 = keys_in_both(source, config, plugins)
    except InvalidValueError:
        return None
    if v1 == v2 or key not in (v1, v2):
        return None
    return "v1" if key == v1 else "v2"


def told_schema(
    lanes: Iterable[tuple[str, object]], config: GatewayConfig, plugins: HermesPluginManager
) -> KeySchema | None:
    """The key schema of the first of ``lanes`` (key, origin) that tells one (see
    :func:`lane_schema`), reading no further; None when none does."""
    for key, origin in lanes:
        if (schema := lane_schema(key, origin, config, plugins)) is not None:
            return schema
    return None


def _stored_lanes(sql: Maintenance) -> Iterator[tuple[str, object]]:
    """Every routing entry's key and origin, read :data:`ROUTE_PAGE` entries at a time."""
    after: str | None = None
    while entries := sql.route_page(after, ROUTE_PAGE):
        yield from ((entry["session_key"], entry.get("origin")) for entry in entries)
        after = entries[-1]["session_key"]


def _unrecorded_schema(
    backend: StoreBackend,
    sql: Maintenance,
    config: GatewayConfig,
    plugins: HermesPluginManager,
    mirror: Path,
) -> KeySchema:
    """The schema of a store written before schemas were recorded: the one its routing
    entries (or the sessions.json ``mirror`` it is about to import) are keyed in, told by the
    first whose key is one of its origin's keys that differ in v1 and v2 (the entries are read
    a page at a time, and no further); v1 when no entry tells or only session rows exist (they
    predate v2); ``keys.schema`` for new state."""
    if sql.has_routes():
        return told_schema(_stored_lanes(sql), config, plugins) or "v1"
    if sql.get_meta(MIRROR_IMPORTED) is None:
        mirrored = read_mirror(mirror, plugins).values()
        if mirrored:
            lanes = ((entry.session_key, entry.origin) for entry in mirrored)
            return told_schema(lanes, config, plugins) or "v1"
    return "v1" if backend.count_sessions() > 0 else config.keys.key_schema
