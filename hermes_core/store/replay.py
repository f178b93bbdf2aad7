"""Replay of the degraded-mode backlog into the SQL store.

While SQL is unusable, transcripts go to ``<sessions_dir>/<session_id>.jsonl`` and routing to
``sessions.json``. Once SQL opens again, each transcript file is imported past the byte offset
stored in ``state_meta`` (``jsonl_import:<session_id>``), in the same transaction as that new
offset, and then renamed ``<session_id>.jsonl.imported``. A crash between the commit and the
rename re-runs with the stored offset and imports nothing twice. When a run replays a backlog
file, the routing entries of ``sessions.json`` (written while degraded) are merged: a key SQL
lacks is inserted, otherwise the newer entry by ``(created_at, updated_at)`` wins, SQL winning
ties. Without a backlog the mirror is only a copy of SQL and is never read back (a hand edit or
an old mirror must not bring back pruned lanes or overwrite newer routes).

This module also owns the transcript line format, shared with :mod:`hermes_core.store.jsonl`.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hermes_core.domain.errors import shown
from hermes_core.domain.models import SessionEntry, session_id_problem
from hermes_core.domain.timeutil import parse_utc
from hermes_core.store.backend import (
    MESSAGE_ROLES,
    BacklogTarget,
    Message,
    SessionRow,
    clean_message,
)
from hermes_core.store.mirror import MIRROR_FILENAME, read_mirror

if TYPE_CHECKING:
    from hermes_core.plugins.manager import HermesPluginManager

logger = logging.getLogger(__name__)

TRANSCRIPT_SUFFIX = ".jsonl"
IMPORTED_SUFFIX = ".jsonl.imported"


def offset_meta_key(session_id: str) -> str:
    """The ``state_meta`` key holding the imported byte offset of a session's file."""
    return f"jsonl_import:{session_id}"


# -- the transcript line format -------------------------------------------------------------------


def encode_message_line(message: Message) -> bytes:
    """One transcript line: compact JSON of ``message`` as :func:`clean_message` has it."""
    text = json.dumps(clean_message(message), ensure_ascii=False, separators=(",", ":"))
    return (text + "\n").encode("utf-8")


@dataclass(frozen=True)
class ParsedLines:
    """The complete lines of a chunk of transcript bytes."""

    messages: list[dict[str, Any]]
    """Valid messages, in file order."""
    consumed: int
    """Bytes up to and including the last newline; a torn final line is not part of it."""
    invalid: int
    """Complete lines that are not a JSON object with a known ``role``."""
    torn: bool
    """Whether the chunk ends in a line without its newline."""


def parse_lines(data: bytes) -> ParsedLines:
    """Parse transcript bytes, skipping invalid lines and leaving a torn final line out."""
    consumed = data.rfind(b"\n") + 1
    messages: list[dict[str, Any]] = []
    invalid = 0
    for raw in data[:consumed].split(b"\n"):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            invalid += 1
            continue
        if isinstance(record, dict) and record.get("role") in MESSAGE_ROLES:
            messages.append(record)
        else:
            invalid += 1
    return ParsedLines(messages, consumed, invalid, consumed < len(data))


# -- session rows from routing entries ------------------------------------------------------------


def session_row_from_entry(
    entry: SessionEntry, *, parent_session_id: str | None = None
) -> SessionRow:
    """A session row describing ``entry``'s current session, for stores that lack the row.

    ``source`` is the entry's platform, else its origin's, else ``"unknown"`` (the column is
    NOT NULL). The row is open; its counters are the entry's.
    """
    origin = entry.origin
    return SessionRow(
        id=entry.session_id,
        session_key=entry.session_key,
        source=entry.platform or (origin.platform if origin else "unknown"),
        started_at=entry.created_at.timestamp(),
        chat_id=origin.chat_id if origin else None,
        chat_type=entry.chat_type,
        thread_id=origin.thread_id if origin else None,
        user_id=origin.user_id if origin else None,
        display_name=entry.display_name,
        origin_json=(
            json.dumps(origin.to_dict(), ensure_ascii=False, separators=(",", ":"))
            if origin
            else None
        ),
        profile_name=origin.profile if origin else None,
        parent_session_id=parent_session_id,
        last_activity_at=entry.updated_at.timestamp(),
        input_tokens=entry.input_tokens,
        output_tokens=entry.output_tokens,
        cache_read_tokens=entry.cache_read_tokens,
        cache_write_tokens=entry.cache_write_tokens,
        total_tokens=entry.total_tokens,
        estimated_cost_usd=entry.estimated_cost_usd,
        cost_status=entry.cost_status,
        expiry_finalized=entry.expiry_finalized,
    )


# -- replay ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayReport:
    """What one :func:`replay_backlog` run did."""

    files_replayed: int = 0
    """Transcript files imported completely and renamed ``.jsonl.imported``."""
    messages_imported: int = 0
    invalid_lines: int = 0
    """Complete lines skipped as invalid (never imported; the offset moves past them)."""
    routes_inserted: int = 0
    routes_updated: int = 0
    skipped: tuple[tuple[str, str], ...] = field(default=())
    """(file name, reason) of files left in place; some may have been imported in part."""


def read_from(path: Path, offset: int) -> bytes:
    """The bytes of regular file ``path`` from ``offset`` on, without following a symlink."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if offset > size:
            raise ValueError(f"the stored offset {offset} is past its end ({size} bytes)")
        handle.seek(offset)
        return handle.read()


def _stored_offset(target: BacklogTarget, session_id: str) -> int:
    """The imported byte offset of a session's file (0 when none is stored)."""
    value = target.get_meta(offset_meta_key(session_id))
    if value is None:
        return 0
    offset = int(value)
    if offset < 0:
        raise ValueError(f"the stored offset {shown(value)} is negative")
    return offset


def _newer(mirror: SessionEntry, stored: Mapping[str, Any]) -> bool:
    """Whether the mirror entry beats the SQL one; SQL wins ties and unreadable times."""
    created, updated = parse_utc(stored.get("created_at")), parse_utc(stored.get("updated_at"))
    if created is None or updated is None:
        return False
    return (mirror.created_at, mirror.updated_at) > (created, updated)


class _Replay:
    """State of one replay run."""

    def __init__(self, target: BacklogTarget, mirror: dict[str, SessionEntry]) -> None:
        self.target = target
        self.by_id = {entry.session_id: entry for entry in mirror.values()}
        self.replayed = 0
        self.imported = 0
        self.invalid = 0
        self.skipped: list[tuple[str, str]] = []

    def skip(self, name: str, reason: str) -> None:
        self.skipped.append((name, reason))
        logger.warning("JSONL backlog %s left in place: %s", name, reason)

    def row_for(self, session_id: str) -> SessionRow | None:
        """The row to create for ``session_id``, from its mirror entry (None: no entry)."""
        entry = self.by_id.get(session_id)
        if entry is None:
            return None
        parent = entry.prev_session_id
        if parent is not None and self.target.get_session(parent) is None:
            parent = None  # the predecessor exists only in the backlog; keep the key valid
        return session_row_from_entry(entry, parent_session_id=parent)

    def ensure_row(self, entry: SessionEntry) -> None:
        """Create the session row a routed entry needs (a lane created while degraded that has
        no transcript yet), so later appends to that session find their row."""
        session_id = entry.session_id
        if self.target.get_session(session_id) is not None:
            return
        meta_key = offset_meta_key(session_id)
        offset = (meta_key, self.target.get_meta(meta_key) or "0")  # rewritten unchanged
        self.target.import_backlog(session_id, [], offset, self.row_for(session_id))

    def replay_file(self, path: Path) -> None:
        name = path.name
        session_id = name[: -len(TRANSCRIPT_SUFFIX)]
        if session_id_problem(session_id) is not None:
            self.skip(name, "its name is not a session id")
            return
        try:
            info = os.lstat(path)
            if not stat.S_ISREG(info.st_mode):
                self.skip(name, "it is not a regular file")
                return
            offset = _stored_offset(self.target, session_id)
            data = read_from(path, offset)
        except (OSError, ValueError) as exc:
            self.skip(name, f"cannot be replayed: {exc}")
            return
        parsed = parse_lines(data)
        if parsed.consumed:
            create_row = None
            if parsed.messages and self.target.get_session(session_id) is None:
                create_row = self.row_for(session_id)
                if create_row is None:
                    self.skip(name, "no session row and no sessions.json entry describe it")
                    return
            new_offset = str(offset + parsed.consumed)
            self.target.import_backlog(
                session_id, parsed.messages, (offset_meta_key(session_id), new_offset), create_row
            )
            self.imported += len(parsed.messages)
            self.invalid += parsed.invalid
            if parsed.invalid:
                logger.warning("JSONL backlog %s: skipped %d invalid lines", name, parsed.invalid)
        if parsed.torn:
            self.skip(name, "its last line is incomplete; it is kept for a later replay")
            return
        imported = path.with_name(session_id + IMPORTED_SUFFIX)
        if os.path.lexists(imported):
            self.skip(name, f"{imported.name} already exists; the stored offset covers the file")
            return
        try:
            os.rename(path, imported)
        except OSError as exc:
            self.skip(name, f"cannot be renamed: {exc.strerror}; the stored offset covers it")
            return
        self.replayed += 1


def replay_backlog(
    sessions_dir: Path, target: BacklogTarget, plugins: HermesPluginManager | None = None
) -> ReplayReport:
    """Import the JSONL backlog of ``sessions_dir`` into ``target`` exactly once.

    Run it only while nothing appends to the backlog (the degraded backend is closed): a line
    being written at that moment looks torn, so its file is left for the next run. Store errors
    of ``target`` propagate; files already imported stay imported.
    """
    mirror = read_mirror(sessions_dir / MIRROR_FILENAME, plugins)
    run = _Replay(target, mirror)
    for path in sorted(sessions_dir.glob("*" + TRANSCRIPT_SUFFIX)):
        run.replay_file(path)
    inserted = updated = 0
    for key, entry in sorted(mirror.items()) if run.replayed else ():
        stored = target.get_route(key)
        if stored is not None and not _newer(entry, stored):
            continue
        run.ensure_row(entry)
        target.put_route(entry.to_dict())
        if stored is None:
            inserted += 1
        else:
            updated += 1
    report = ReplayReport(
        files_replayed=run.replayed,
        messages_imported=run.imported,
        invalid_lines=run.invalid,
        routes_inserted=inserted,
        routes_updated=updated,
        skipped=tuple(run.skipped),
    )
    if run.replayed or inserted or updated:
        logger.info(
            "replayed the JSONL backlog: %d files, %d messages, %d routes inserted, %d updated",
            run.replayed,
            run.imported,
            inserted,
            updated,
        )
    return report
