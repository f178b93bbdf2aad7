"""WhatsApp: one person, one key, whichever identifier form the bridge reports.

A person may appear as ``<digits>@s.whatsapp.net`` (optionally ``:<device>``), ``+<digits>`` or
``<digits>@lid``. DM chat ids and participants are canonicalised to the shortest alias found
through the bridge's ``lid-mapping-*.json`` files (read only, never written here). Reads Cloud
API webhooks and WhatsApp Web messages (:mod:`hermes_plugins.readers.whatsapp`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import stat
import threading
from collections import deque
from pathlib import Path

from hermes_core import ConnectorSpec, GatewayConfig, PlatformSpec, hookimpl
from hermes_plugins.connectors import lazy_connector
from hermes_plugins.readers.whatsapp import read_whatsapp_payload

MAX_ALIASES = 64
MAX_MAPPING_BYTES = 4096
_LOOKUP_RE = re.compile(r"[A-Za-z0-9@.+\-]+")
_CACHE_LIMIT = 10_000

logger = logging.getLogger(__name__)
_WARNED_LOCK = threading.Lock()
_warned: set[tuple[Path, str]] = set()


def normalize_whatsapp_identifier(value: object) -> str:
    """Strip, drop the first ``+``, cut at the first ``:`` (device) and ``@`` (server)."""
    text = "" if value is None else str(value)
    text = text.strip().replace("+", "", 1)
    return text.split(":", 1)[0].split("@", 1)[0]


@functools.lru_cache(maxsize=16)
def _candidates(hermes_home: Path | None) -> tuple[Path, Path]:
    """Modern and legacy mapping directories of a state directory (None: ``$HERMES_HOME``)."""
    home = hermes_home or Path(os.environ.get("HERMES_HOME") or "~/.hermes").expanduser()
    return home / "platforms" / "whatsapp" / "session", home / "whatsapp" / "session"


def _existing_mapping_dir(hermes_home: Path | None) -> tuple[Path, int] | None:
    """The mapping directory in use and its mtime, or None when neither location exists."""
    for directory in _candidates(hermes_home):
        try:
            info = os.stat(directory)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode):
            return directory, info.st_mtime_ns
    return None


def whatsapp_state_dirs(hermes_home: Path) -> tuple[Path, ...]:
    """The mapping directory ``doctor`` checks: ``platforms/whatsapp/session``."""
    return (_candidates(hermes_home)[0],)


def _unusable(path: Path, problem: str) -> None:
    """Log once per process that a mapping file is ignored; the file name (an id) is not logged."""
    tag = (path.parent, problem)
    with _WARNED_LOCK:
        if tag in _warned:
            return
        _warned.add(tag)
    logger.warning("ignoring a WhatsApp lid-mapping file in %s: %s", path.parent, problem)


def _read_alias(path: Path) -> str | None:
    """The JSON string in a mapping file; None when missing, unsafe, too big or not a string.

    A file that exists but cannot be used (wrong shape, nested too deeply, not JSON) is logged
    once and ignored, so key building never fails because of what the bridge wrote.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_MAPPING_BYTES:
            _unusable(path, f"not a regular file of at most {MAX_MAPPING_BYTES} bytes")
            return None
        raw = os.read(fd, MAX_MAPPING_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        value = json.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        _unusable(path, "not valid JSON (or nested too deeply)")
        return None
    if not isinstance(value, str):
        _unusable(path, "expected one JSON string")
        return None
    return value


def _walk(start: str, directory: Path) -> tuple[str, ...]:
    """Breadth-first alias walk from ``start`` (included first), at most MAX_ALIASES ids."""
    seen = [start]
    queue = deque(seen)
    while queue and len(seen) < MAX_ALIASES:
        current = queue.popleft()
        if not _LOOKUP_RE.fullmatch(current):
            continue
        for name in (f"lid-mapping-{current}.json", f"lid-mapping-{current}_reverse.json"):
            target = _read_alias(directory / name)
            alias = normalize_whatsapp_identifier(target) if target is not None else ""
            if alias and alias not in seen and len(seen) < MAX_ALIASES:
                seen.append(alias)
                queue.append(alias)
    return tuple(seen)


class _AliasCache:
    """Alias walks per mapping directory, valid while the directory's mtime is unchanged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Path, tuple[int, dict[str, tuple[str, ...]]]] = {}

    def aliases(self, normalized: str, hermes_home: Path | None) -> tuple[str, ...]:
        found = _existing_mapping_dir(hermes_home)
        if found is None:
            return (normalized,)
        directory, mtime = found
        with self._lock:
            stamp, walks = self._entries.get(directory, (None, {}))
            if stamp != mtime or len(walks) > _CACHE_LIMIT:
                walks = {}
                self._entries[directory] = (mtime, walks)
            cached = walks.get(normalized)
        if cached is None:
            cached = _walk(normalized, directory)
            with self._lock:
                walks[normalized] = cached
        return cached


_CACHE = _AliasCache()


def whatsapp_aliases(value: object, *, hermes_home: Path | None = None) -> tuple[str, ...]:
    """Every alias of ``value`` (normalised input first), or ``()`` for an empty id."""
    normalized = normalize_whatsapp_identifier(value)
    if not normalized:
        return ()
    return _CACHE.aliases(normalized, hermes_home)


def canonical_whatsapp_identifier(value: object, *, hermes_home: Path | None = None) -> str:
    """The canonical id of a WhatsApp person: the shortest alias, ties broken lexicographically,
    so a phone number beats a 15-digit LID; the normalised input when no mapping exists."""
    aliases = whatsapp_aliases(value, hermes_home=hermes_home)
    return min(aliases, key=lambda alias: (len(alias), alias)) if aliases else ""


@hookimpl
def hermes_register_platforms(config: GatewayConfig) -> list[PlatformSpec]:
    """Register ``whatsapp`` (PII-safe) with canonicalisers reading ``config.hermes_home`` and
    its payload reader."""
    canonical = functools.partial(canonical_whatsapp_identifier, hermes_home=config.hermes_home)
    return [
        PlatformSpec(
            name="whatsapp",
            pii_safe=True,
            canonical_dm_chat_id=canonical,
            canonical_participant=canonical,
            aliases=functools.partial(whatsapp_aliases, hermes_home=config.hermes_home),
            read_event=read_whatsapp_payload,
            state_dirs=whatsapp_state_dirs,
        )
    ]


@hookimpl
def hermes_register_connectors(config: GatewayConfig) -> list[ConnectorSpec]:
    """Register the WhatsApp Cloud API connector (:mod:`hermes_plugins.connectors.whatsapp`)."""
    summary = "WhatsApp Cloud API: Meta's signed webhook in, /<phone-number-id>/messages out"
    return [lazy_connector("whatsapp", "whatsapp:WhatsAppConnector", summary)]
