"""The ``sessions.json`` mirror of the routing index.

With a SQL store the file only mirrors ``gateway_routing`` for inspection and disaster recovery;
while degraded it is the routing index itself. Writing is atomic and ordered by a
monotonic revision; reading is tolerant: a damaged file or entry is reported and skipped, never
repaired or deleted, so nothing a user might still recover is lost.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import InvalidValueError, StoreError, UnknownPlatformError, shown
from hermes_core.domain.models import SessionEntry
from hermes_core.domain.specs import StoreSpec
from hermes_core.state.files import atomic_write_stream

if TYPE_CHECKING:
    from hermes_core.plugins.manager import HermesPluginManager

logger = logging.getLogger(__name__)

MIRROR_FILENAME = "sessions.json"
"""Name of the mirror inside ``sessions_dir``."""

MIRROR_README = (
    "Mirror of the hermes-sessions routing index, kept for inspection and recovery only. The "
    "canonical index lives in the SQL store (storage.url); edits to this file are not read back "
    "while that store is available. Set gateway.write_sessions_json: false to stop writing it."
)
"""The exact ``_README`` value, the first member of the file."""


MirrorEntries = Mapping[str, Mapping[str, Any]] | Iterable[tuple[str, Mapping[str, Any]]]
"""Entries by session key: a mapping (sorted here), or (key, entry) pairs in key order (streamed
as they come, never all held at once)."""


class MirrorTooLargeError(StoreError):
    """More entries than a mirror may hold (``max_entries``): nothing was written."""


def _member(key: str, value: Any) -> bytes:
    """One member of the document as ``json.dumps(..., indent=2)`` renders it inside it."""
    try:
        text = json.dumps({key: value}, ensure_ascii=False, indent=2, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StoreError(
            f"cannot write {MIRROR_FILENAME}: a routing entry is not plain JSON ({exc})."
        ) from exc
    return text[2:-2].encode("utf-8")  # without the enclosing "{\n" and "\n}"


def mirror_chunks(entries: MirrorEntries, max_entries: int | None = None) -> Iterator[bytes]:
    """The file content, one member at a time: ``_README`` first, then one member per key.

    Byte for byte what ``json.dumps`` renders for the whole document (UTF-8 without BOM,
    2-space indent, non-ASCII kept, final newline), without building it. An entry that is not
    plain JSON (a non-serialisable value, NaN) raises :class:`StoreError`; pairs out of key
    order raise it too (the file would not be sorted); more than ``max_entries`` entries raise
    :class:`MirrorTooLargeError`.
    """
    pairs = sorted(entries.items()) if isinstance(entries, Mapping) else entries
    yield b"{\n" + _member("_README", MIRROR_README)
    previous: str | None = None
    for count, (key, value) in enumerate(pairs, 1):
        if max_entries is not None and count > max_entries:
            raise MirrorTooLargeError(f"more than {max_entries} routing entries")
        if previous is not None and key <= previous:
            raise StoreError(f"cannot write {MIRROR_FILENAME}: entries arrived out of key order.")
        previous = key
        yield b",\n" + _member(key, value)
    yield b"\n}\n"


class MirrorWriter:
    """Serialised, revision-ordered atomic writer of one mirror file.

    Revisions come from the caller's snapshot (the routing index revision, or the degraded
    backend's change counter). A snapshot older than the last one written is dropped, so a slow
    writer never replaces a newer file with stale content; an equal revision is written again.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._written: int | None = None

    @property
    def revision(self) -> int | None:
        """Revision of the last successful write (None before the first)."""
        return self._written

    def _stale(self, revision: int) -> bool:
        return self._written is not None and revision < self._written

    @contextmanager
    def _turn(self, revision: int) -> Iterator[bool]:
        """Under the lock: whether ``revision`` may replace the file; recorded if it did."""
        with self._lock:
            wanted = not self._stale(revision)
            yield wanted
            if wanted:
                self._written = revision

    def write(
        self, entries: MirrorEntries, revision: int, *, max_entries: int | None = None
    ) -> bool:
        """Write ``entries`` as snapshot ``revision``; False (nothing written) if it is stale.

        The entries are streamed to a temp file outside the lock, so memory stays bounded by one
        entry and a write buffer whatever the number of entries; the staleness check and the
        replace happen under the lock, in that order. A failed write raises :class:`StoreError`
        (:class:`MirrorTooLargeError` past ``max_entries``) with the old file kept.
        """
        if self._stale(revision):
            return False
        return atomic_write_stream(
            self.path, mirror_chunks(entries, max_entries), self._turn(revision)
        )

    def remove(self) -> bool:
        """Delete the file (a mirror no longer kept); False if there was none."""
        with self._lock:
            try:
                self.path.unlink()
            except FileNotFoundError:
                return False
            except OSError as exc:
                raise StoreError(
                    f"cannot remove the outdated {self.path} ({exc.strerror}); delete it by hand."
                ) from exc
            self._written = None
        return True


@dataclass(frozen=True)
class MirrorContents:
    """What :func:`load_mirror` found in a mirror file."""

    entries: dict[str, SessionEntry] = field(default_factory=dict)
    """Loadable entries by session key."""
    unregistered: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Members skipped only because their origin platform is not registered, kept verbatim so a
    writer can preserve them until the platform's plugin loads again."""
    problem: str | None = None
    """Why the file as a whole could not be used (unreadable, not JSON, not an object)."""


def _origin_platform(value: Mapping[str, Any]) -> str:
    origin = value.get("origin")
    platform = origin.get("platform") if isinstance(origin, Mapping) else None
    return platform if isinstance(platform, str) else "?"


def load_mirror(
    path: Path, plugins: HermesPluginManager | None = None, *, strict: bool = False
) -> MirrorContents:
    """Read a mirror file leniently; the file is never modified.

    A missing file is simply empty. An unreadable or unparsable file logs one warning naming it
    and yields nothing; ``strict`` (a file an operator named for import) raises
    :class:`InvalidValueError` for it instead, and for a missing file. ``_``-prefixed members are
    skipped; an invalid entry, or one stored under a key other than its own ``session_key``, is
    skipped with a warning naming the key. Entries of unregistered platforms get one warning per
    platform.
    """

    def unusable(problem: str) -> MirrorContents:
        if strict:
            raise InvalidValueError(
                "path", f"{path} {problem}; name a sessions.json: a JSON object of routing "
                "entries by session key, as a gateway writes it."
            )  # fmt: skip
        logger.warning("routing mirror %s %s; no entries loaded from it", path, problem)
        return MirrorContents(problem=problem)

    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return unusable("does not exist") if strict else MirrorContents()
    except OSError as exc:
        return unusable(f"cannot be read ({exc.strerror or type(exc).__name__})")
    try:
        document = json.loads(raw.decode("utf-8-sig"))
    except (ValueError, RecursionError):
        return unusable("is not valid UTF-8 JSON (truncated or edited?)")
    if not isinstance(document, dict):
        return unusable("does not hold a JSON object")
    entries: dict[str, SessionEntry] = {}
    unregistered: dict[str, dict[str, Any]] = {}
    by_platform: dict[str, list[str]] = {}
    for key, value in document.items():
        if key.startswith("_"):
            continue
        try:
            entry = SessionEntry.from_dict(value, plugins=plugins)
        except UnknownPlatformError:
            unregistered[key] = dict(value)
            by_platform.setdefault(_origin_platform(value), []).append(key)
            continue
        except InvalidValueError as exc:
            logger.warning(
                "routing mirror %s: skipping entry %s: field %s is invalid", path, shown(key),
                shown(exc.field),
            )  # fmt: skip
            continue
        if entry.session_key != key:
            logger.warning(
                "routing mirror %s: skipping entry %s: it is stored under a key other than its "
                "session_key",
                path,
                shown(key),
            )
            continue
        entries[key] = entry
    for platform, keys in by_platform.items():
        logger.warning(
            "routing mirror %s: skipping %d entries of platform %s, which no loaded plugin "
            "registers (first: %s); they load again once its plugin is enabled",
            path,
            len(keys),
            shown(platform),
            shown(keys[0]),
        )
    return MirrorContents(entries=entries, unregistered=unregistered)


def read_mirror(path: Path, plugins: HermesPluginManager | None = None) -> dict[str, SessionEntry]:
    """The loadable entries of a mirror file by session key (see :func:`load_mirror`)."""
    return load_mirror(path, plugins).entries


def writes_mirror(config: GatewayConfig, spec: StoreSpec) -> bool:
    """Whether ``sessions.json`` is kept: ``gateway.write_sessions_json``, by default for a
    local store (capability ``local_state``) only."""
    explicit = config.gateway.write_sessions_json
    return "local_state" in spec.capabilities if explicit is None else explicit
