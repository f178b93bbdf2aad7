"""Bulk import of whole lanes (routing entry, session row and transcript) into a store.

The lanes are written in batches of :data:`BATCH_LANES`, each one transaction of the backend's
:meth:`~hermes_core.store.operator.OperatorBackend.import_lanes`, which skips a lane whose key is
routed already or whose session row exists. A lane's entry, session and messages commit together,
so a run interrupted anywhere is resumed by running it again: what committed is skipped, the rest
is written, nothing is lost or doubled.

The source here is a gateway's sessions directory, the layout of the original gateway and of this
store's degraded mode: ``sessions.json`` (the routing entries) and one ``<session_id>.jsonl``
transcript per session, in the line format of :mod:`hermes_core.store.replay`. The directory is
only read. ``benchmarks/bench_scale.py`` feeds :func:`import_lanes` lanes it generates instead.
"""

from __future__ import annotations

import logging
import os
import stat
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hermes_core.domain.errors import HermesError, InvalidValueError, KeySchemaError, shown
from hermes_core.domain.keys import KeySchema, origin_keys_to
from hermes_core.domain.models import SessionEntry
from hermes_core.store.backend import EntryDict, Message, SessionRow, clean_message
from hermes_core.store.base import KEY_SCHEMA_META
from hermes_core.store.keyschema import lane_schema, told_schema
from hermes_core.store.mirror import MIRROR_FILENAME, load_mirror
from hermes_core.store.replay import (
    TRANSCRIPT_SUFFIX,
    parse_lines,
    read_from,
    session_row_from_entry,
)

if TYPE_CHECKING:
    from hermes_core.config.schema import GatewayConfig
    from hermes_core.plugins.manager import HermesPluginManager
    from hermes_core.store.operator import OperatorBackend

logger = logging.getLogger(__name__)

BATCH_LANES = 1_000
"""Lanes per transaction: large enough that a commit's cost is spread over thousands of rows,
small enough that a batch's rows stay a few megabytes."""


@dataclass(frozen=True, slots=True)
class ImportedLane:
    """One lane to import: its routing entry, its current session's row and that session's
    transcript, in order."""

    entry: EntryDict
    session: SessionRow
    messages: Sequence[Message]


@dataclass(slots=True)
class ImportCounts:
    """What a batch (or a whole import) wrote."""

    lanes: int = 0
    """Lanes written: entry, session row and messages."""
    messages: int = 0
    skipped: int = 0
    """Lanes the store had already (imported by an earlier run, or its own), left as they are."""

    def add(self, other: ImportCounts) -> None:
        self.lanes += other.lanes
        self.messages += other.messages
        self.skipped += other.skipped


def import_lanes(
    target: OperatorBackend,
    lanes: Iterable[ImportedLane],
    *,
    config: GatewayConfig,
    plugins: HermesPluginManager,
    batch: int = BATCH_LANES,
    advance: Callable[[int], None] | None = None,
) -> ImportCounts:
    """Write ``lanes`` into ``target`` in transactions of ``batch`` lanes; ``advance`` is told
    how many lanes each batch held once it committed.

    A store that records no key schema is given the one the lanes are keyed in (before the
    batch of the first lane that tells it, see :func:`~hermes_core.store.keyschema.lane_schema`;
    when none tells, ``config``'s ``keys.schema`` for a store that was empty), so that its
    first open finds it recorded instead of reading the routing index to tell it. The store is
    then made ready as after a ``migrate`` (``finish_transfer``: on PostgreSQL the planner's
    statistics of the rows written)."""
    if batch < 1:
        raise InvalidValueError("batch", f"the batch size {batch} must be at least 1.")
    recorded = target.get_meta(KEY_SCHEMA_META)
    empty = recorded is None and _holds_nothing(target)
    schema: KeySchema | None = None
    total = ImportCounts()
    pending: list[ImportedLane] = []

    def write() -> None:
        nonlocal recorded
        if recorded is None and schema is not None:
            target.set_meta(KEY_SCHEMA_META, schema)
            recorded = schema
        total.add(target.import_lanes(pending))
        if advance is not None:
            advance(len(pending))
        pending.clear()

    for lane in lanes:
        if recorded is None and schema is None:
            entry = lane.entry
            schema = lane_schema(entry["session_key"], entry.get("origin"), config, plugins)
        pending.append(lane)
        if len(pending) >= batch:
            write()
    if pending:
        write()
    if recorded is None and empty:
        target.set_meta(KEY_SCHEMA_META, config.keys.key_schema)
    target.finish_transfer()
    return total


def _holds_nothing(target: OperatorBackend) -> bool:
    """Whether ``target`` has neither a routing entry nor a session row."""
    kinds = target.record_kinds()
    return not any(target.table_rows(kind, None, 1) for kind in (kinds.routes, kinds.sessions))


# -- a gateway's sessions directory ---------------------------------------------------------------


@dataclass
class GatewayImport:
    """A sessions directory read for import: its lanes (:meth:`lanes`) and what was left out."""

    directory: Path
    entries: list[SessionEntry]
    """The entries to import, by session key."""
    left_out: list[tuple[str, str]] = field(default_factory=list)
    """(file or key, reason) of what is not imported, one line each."""
    invalid_lines: int = 0
    """Transcript lines that are not a valid message (counted as the lanes are read)."""
    orphans: int = 0
    """Transcript files that no entry names (an earlier session of a lane, for instance)."""

    def lanes(self) -> Iterator[ImportedLane]:
        """Each entry with its session row and transcript, read one file at a time."""
        for entry in self.entries:
            yield ImportedLane(
                entry.to_dict(),
                session_row_from_entry(entry, parent_session_id=entry.prev_session_id),
                self._transcript(entry.session_id),
            )

    def _transcript(self, session_id: str) -> list[Message]:
        """The valid messages of ``<session_id>.jsonl`` (none when there is no such file)."""
        path = self.directory / (session_id + TRANSCRIPT_SUFFIX)
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                self._leave_out(path.name, "it is not a regular file")
                return []
            parsed = parse_lines(read_from(path, 0))
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            self._leave_out(path.name, f"cannot be read: {exc}")
            return []
        if parsed.torn:
            self._leave_out(path.name, "its last line is incomplete; that line is not imported")
        kept: list[Message] = []
        for message in parsed.messages:
            try:
                clean_message(message)
            except HermesError:
                self.invalid_lines += 1
                continue
            kept.append(message)
        self.invalid_lines += parsed.invalid + len(parsed.messages) - len(kept)
        return kept

    def _leave_out(self, name: str, reason: str) -> None:
        self.left_out.append((name, reason))
        logger.warning("import %s: %s left out: %s", self.directory, shown(name), reason)


def read_gateway_directory(
    directory: Path, config: GatewayConfig, plugins: HermesPluginManager | None
) -> GatewayImport:
    """The lanes of a sessions directory: the entries of its ``sessions.json`` whose origin is
    their own chat and whose session no other entry names (as ``import-sessions-json`` skips
    them), with their transcripts. Raises :class:`InvalidValueError` for a directory without a
    readable ``sessions.json``."""
    if not directory.is_dir():
        raise InvalidValueError(
            "directory", f"{directory}: no such directory; name a gateway's sessions directory."
        )
    contents = load_mirror(directory / MIRROR_FILENAME, plugins, strict=True)
    found = GatewayImport(directory, [])
    named = Counter(entry.session_id for entry in contents.entries.values())
    for key, entry in sorted(contents.entries.items()):
        if entry.origin is not None and not origin_keys_to(entry.origin, key, config, plugins):
            found._leave_out(key, "its origin is another chat than its key names")
        elif named[entry.session_id] > 1:
            found._leave_out(key, f"its session {entry.session_id} is named by several entries")
        else:
            found.entries.append(entry)
    wanted = {entry.session_id + TRANSCRIPT_SUFFIX for entry in found.entries}
    with os.scandir(directory) as files:
        found.orphans = sum(
            1 for item in files if item.name.endswith(TRANSCRIPT_SUFFIX) and item.name not in wanted
        )
    return found


def check_key_schema(
    source: GatewayImport,
    target: OperatorBackend,
    config: GatewayConfig,
    plugins: HermesPluginManager,
) -> None:
    """Raise :class:`KeySchemaError` when the store records a key schema and the lanes to
    import follow the other one: no message would ever find them under their keys."""
    recorded = target.get_meta(KEY_SCHEMA_META)
    lanes = ((entry.session_key, entry.origin) for entry in source.entries)
    schema = told_schema(lanes, config, plugins)
    if recorded in ("v1", "v2") and schema not in (None, recorded):
        raise KeySchemaError(
            f"the lanes of {source.directory} are keyed in key schema {schema}, but this store "
            f"records {recorded}, so no message would find them; nothing was imported. Import "
            f"them into an empty store (then set keys.schema: {schema} or run `hermes-sessions "
            "rekey --to v2` there)."
        )
