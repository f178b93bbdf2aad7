"""The degraded JSONL store backend, the core's own fallback.

Not a plugin and not selected by a ``storage.url`` scheme: ``SessionStore`` opens
:class:`JsonlBackend` itself when a local store (capability ``local_state``) cannot be used, so new
messages are still stored and can be replayed into SQL later (:mod:`hermes_core.store.replay`).

Routing lives in ``<sessions_dir>/sessions.json``, loaded at construction and rewritten
atomically before every routing write returns (tier D); writes that only move ``updated_at``
(touches) are coalesced. Transcripts are append-only ``<sessions_dir>/<session_id>.jsonl``
files, one fsynced JSON line per message. There are no session rows: rows are synthesised from
the current routing entry. It implements only the required ``StoreBackend`` protocol: transcript
edits, search, pruning, the ledger and durable queues are unavailable while degraded.

One module on purpose: one backend class whose routing and transcript writes share the routing
file's lock and revision.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hermes_core.domain.errors import (
    DuplicateSessionIdError,
    InvalidValueError,
    StoreError,
    TranscriptReadError,
    TranscriptWriteError,
    shown,
)
from hermes_core.domain.models import SessionEntry, session_id_problem
from hermes_core.domain.timeutil import utc_now
from hermes_core.state.files import (
    append_line_durably,
    child_path,
    fsync_dir,
    read_file_nofollow,
)
from hermes_core.store.backend import CounterDelta, EntryDict, Message, SessionRow
from hermes_core.store.mirror import MIRROR_FILENAME, MirrorWriter, load_mirror
from hermes_core.store.replay import (
    IMPORTED_SUFFIX,
    TRANSCRIPT_SUFFIX,
    encode_message_line,
    parse_lines,
    session_row_from_entry,
)

if TYPE_CHECKING:
    from hermes_core.plugins.manager import HermesPluginManager

logger = logging.getLogger(__name__)

# Row fields that follow the routing entry; the rest come from the row given to create_session.
_ENTRY_OWNED_ROW_FIELDS = (
    "last_activity_at", "input_tokens", "output_tokens", "cache_read_tokens",
    "cache_write_tokens", "total_tokens", "estimated_cost_usd", "cost_status",
    "expiry_finalized",
)  # fmt: skip


@dataclasses.dataclass
class _Transcript:
    """Per-session append state: appends to one file are serialised by ``lock``."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    lines: int | None = None
    """Newline-terminated lines in the file; None until counted (or after a failed append)."""
    torn: bool = False
    """The file ends in a line without its newline (a crash mid-append)."""


class JsonlBackend:
    """:class:`~hermes_core.store.backend.StoreBackend` over ``sessions.json`` and JSONL files.

    ``touch_flush_interval`` is how long coalesced touches may wait for :meth:`flush_touches`
    (at most 60 s). The caller creates ``sessions_dir`` (0700) beforehand.
    """

    def __init__(
        self,
        sessions_dir: Path,
        plugins: HermesPluginManager | None = None,
        *,
        touch_flush_interval: float = 60.0,
    ) -> None:
        self.sessions_dir = sessions_dir
        self._plugins = plugins
        self._interval = touch_flush_interval
        mirror_path = sessions_dir / MIRROR_FILENAME
        contents = load_mirror(mirror_path, plugins)
        if contents.problem is not None:
            _set_aside(mirror_path)
        self._mirror = MirrorWriter(mirror_path)
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Any]] = {}
        self._by_id: dict[str, str] = {}
        for key, entry in contents.entries.items():
            self._set_entry(key, entry.to_dict())
        self._unregistered = dict(contents.unregistered)
        self._rows: dict[str, SessionRow] = {}
        self._revision = 0
        self._dirty = False
        self._last_write = time.monotonic()
        self._transcripts: dict[str, _Transcript] = {}
        self._warned: set[str] = set()

    # -- lifecycle ------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Nothing is counted here."""
        return {}

    def transaction(self) -> AbstractContextManager[object]:
        """Every write is durable on its own here; grouping changes nothing."""
        return nullcontext()

    def close(self) -> None:
        """Write coalesced touches."""
        with self._lock:
            dirty = self._dirty
        if dirty:
            self._persist()

    def health(self) -> dict[str, Any]:
        """Nothing to add: no search index, no connection to lose."""
        return {}

    def flush_touches(self) -> bool:
        """Write coalesced touches if the last write is older than the interval (housekeeping).

        Returns whether the file was written.
        """
        with self._lock:
            if not self._dirty or time.monotonic() - self._last_write < self._interval:
                return False
        return self._persist()

    # -- routing index --------------------------------------------------------------------------

    def _set_entry(self, key: str, entry: dict[str, Any] | None) -> None:
        """Replace (or remove) the entry of ``key`` and its id index; caller holds the lock."""
        previous = self._entries.pop(key, None)
        if previous is not None and self._by_id.get(previous["session_id"]) == key:
            del self._by_id[previous["session_id"]]
        if entry is not None:
            self._entries[key] = entry
            self._by_id[entry["session_id"]] = key

    def _snapshot(self) -> tuple[dict[str, Mapping[str, Any]], int]:
        """Everything the file holds, with a new revision; caller holds the lock."""
        self._revision += 1
        self._dirty = False
        return {**self._unregistered, **self._entries}, self._revision

    def _persist(self, snapshot: tuple[dict[str, Mapping[str, Any]], int] | None = None) -> bool:
        """Write a snapshot (default: a fresh one); a failure leaves the map dirty and raises."""
        if snapshot is None:
            with self._lock:
                snapshot = self._snapshot()
        try:
            written = self._mirror.write(*snapshot)
        except StoreError:
            with self._lock:
                self._dirty = True
            raise
        self._last_write = time.monotonic()
        return written

    def _commit(self, entry: EntryDict, *, expect_token: str | None = None) -> bool:
        """Store ``entry`` and rewrite the file before returning (tier D).

        With ``expect_token`` the write happens only if the stored marker token is that token.
        If the rewrite fails the change is undone in memory and :class:`StoreError` raised.
        """
        new = copy.deepcopy(dict(entry))
        key = new["session_key"]
        with self._lock:
            old = self._entries.get(key)
            if expect_token is not None and (
                old is None or old.get("active_turn_token") != expect_token
            ):
                return False
            held = self._unregistered.pop(key, None)
            self._set_entry(key, new)
            snapshot = self._snapshot()
        try:
            self._persist(snapshot)
        except StoreError:
            with self._lock:
                if self._entries.get(key) is new:
                    self._set_entry(key, old)
                    if held is not None:
                        self._unregistered[key] = held
            raise
        return True

    def get_route(self, session_key: str) -> EntryDict | None:
        with self._lock:
            entry = self._entries.get(session_key)
        return copy.deepcopy(entry)

    def get_route_by_session_id(self, session_id: str) -> EntryDict | None:
        with self._lock:
            key = self._by_id.get(session_id)
            entry = self._entries.get(key) if key is not None else None
        return copy.deepcopy(entry)

    def iter_routes(self) -> Iterator[EntryDict]:
        with self._lock:
            entries = copy.deepcopy(list(self._entries.values()))
        yield from entries

    def put_route(self, entry: EntryDict, *, touch: bool = False) -> None:
        """Write one entry; a touch only updates memory and is written later (coalesced)."""
        if not touch:
            self._commit(entry)
            return
        new = copy.deepcopy(dict(entry))
        with self._lock:
            self._unregistered.pop(new["session_key"], None)
            self._set_entry(new["session_key"], new)
            self._dirty = True

    def clear_turn_marker(self, entry: SessionEntry, token: str, *, rewrite: bool = False) -> bool:
        return self._commit(entry.to_dict(), expect_token=token)

    def begin_turn(
        self,
        entry: SessionEntry,
        consumed_event_id: int | None,
        user_message: tuple[str, Message] | None,
        seen: str | None = None,
        lease: str | None = None,
        *,
        rewrite: bool = False,
    ) -> bool:
        """Append the user message, then write the entry with its marker (always True; no
        leases here, so ``lease`` is never given; the whole entry is written, ``rewrite`` or
        not).

        Queues are memory-only while degraded, so ``consumed_event_id`` has nothing to delete;
        redeliveries are only caught by the runtime's memory (``seen`` is not recorded).
        The message goes first: a crash in between leaves a stored message without a marker,
        never a marker whose message is missing.
        """
        if user_message is not None:
            self.append_message(*user_message)
        self._commit(entry.to_dict())
        return True

    def routes_with_markers(self) -> list[EntryDict]:
        """Every entry whose turn marker is set."""
        return self._routes_with("active_turn_token")

    def routes_to_resume(self) -> list[EntryDict]:
        """Every entry marked ``resume_pending``."""
        return self._routes_with("resume_pending")

    def _routes_with(self, field: str) -> list[EntryDict]:
        """Copies of the entries whose ``field`` is set."""
        with self._lock:
            return [copy.deepcopy(entry) for entry in self._entries.values() if entry.get(field)]

    def put_routes(self, entries: Sequence[EntryDict]) -> None:
        """Write several entries with one rewrite of the file (undone in memory if it fails)."""
        new = [copy.deepcopy(dict(entry)) for entry in entries]
        with self._lock:
            before = {
                entry["session_key"]: self._entries.get(entry["session_key"]) for entry in new
            }
            for entry in new:
                self._set_entry(entry["session_key"], entry)
            snapshot = self._snapshot()
        try:
            self._persist(snapshot)
        except StoreError:
            with self._lock:
                for key, old in before.items():
                    self._set_entry(key, old)
            raise

    # -- sessions -------------------------------------------------------------------------------

    def _row(self, entry: dict[str, Any], remembered: SessionRow | None) -> SessionRow:
        """The open row of ``entry``'s session: remembered fields overlaid with the entry's."""
        parsed = SessionEntry.from_dict(entry, plugins=self._plugins)
        synthesised = session_row_from_entry(parsed, parent_session_id=parsed.prev_session_id)
        if remembered is None:
            return synthesised
        owned = {name: getattr(synthesised, name) for name in _ENTRY_OWNED_ROW_FIELDS}
        return dataclasses.replace(remembered, ended_at=None, end_reason=None, **owned)

    def get_session(self, session_id: str) -> SessionRow | None:
        """The current session of a lane; sessions no entry points to are unknown."""
        with self._lock:
            key = self._by_id.get(session_id)
            entry = self._entries.get(key) if key is not None else None
            remembered = self._rows.get(session_id)
        return None if entry is None else self._row(entry, remembered)

    def newest_session(self, session_key: str) -> SessionRow | None:
        with self._lock:
            entry = self._entries.get(session_key)
            remembered = self._rows.get(entry["session_id"]) if entry is not None else None
        return None if entry is None else self._row(entry, remembered)

    def count_sessions(self) -> int:
        """One session per routing entry."""
        with self._lock:
            return len(self._entries)

    def create_session(
        self, row: SessionRow, entry: EntryDict, end_previous: tuple[str, str] | None
    ) -> None:
        """Write ``entry`` and remember ``row``'s fields; there is no previous row to end."""
        with self._lock:
            known = row.id in self._by_id or row.id in self._rows
        transcript = self._transcript_path(row.id)
        imported = transcript.with_name(row.id + IMPORTED_SUFFIX)
        if known or os.path.lexists(transcript) or os.path.lexists(imported):
            raise DuplicateSessionIdError(f"session id {row.id} already exists; draw another.")
        self._commit(entry)
        with self._lock:
            self._rows[row.id] = row
            if end_previous is not None:
                self._rows.pop(end_previous[0], None)

    def reopen_session(self, session_id: str, entry: EntryDict) -> None:
        self._commit(entry)

    def update_counters(self, entry: EntryDict, session_id: str, delta: CounterDelta) -> None:
        """Write ``entry``; the synthesised row reads its counters from it."""
        self._commit(entry)

    # -- transcripts ----------------------------------------------------------------------------

    def _transcript_path(self, session_id: str) -> Path:
        problem = session_id_problem(session_id)
        if problem is not None:
            raise InvalidValueError(
                "session_id", f"session_id {shown(session_id)} is invalid: {problem}."
            )
        return child_path(self.sessions_dir, session_id + TRANSCRIPT_SUFFIX)

    def _transcript(self, session_id: str) -> _Transcript:
        with self._lock:
            return self._transcripts.setdefault(session_id, _Transcript())

    def _count_lines(self, session_id: str, path: Path, state: _Transcript) -> None:
        """Learn the file's line count and torn tail before the first append to it.

        A file already imported into SQL (``.jsonl.imported``) is renamed back first, so the
        offset stored for it stays valid and the next replay imports only the new lines.
        """
        imported = path.with_name(session_id + IMPORTED_SUFFIX)
        try:
            if not os.path.lexists(path) and os.path.lexists(imported):
                os.rename(imported, path)
                fsync_dir(path.parent)
            data = read_file_nofollow(path) or b""
        except OSError as exc:
            raise TranscriptWriteError(
                f"cannot append to {path}: {exc.strerror or exc}; check the file and directory."
            ) from exc
        state.lines = data.count(b"\n")
        state.torn = not data.endswith(b"\n") and bool(data)

    def append_message(self, session_id: str, message: Message) -> int:
        """Append one fsynced line; returns its 1-based line number in the file.

        After a torn final line (a crash mid-append) a newline is written first, so the torn
        fragment stays a line of its own and is skipped by readers.
        """
        path = self._transcript_path(session_id)
        line = encode_message_line(message)
        state = self._transcript(session_id)
        with state.lock:
            if state.lines is None:
                self._count_lines(session_id, path, state)
            data = b"\n" + line if state.torn else line
            try:
                append_line_durably(path, data)
            except TranscriptWriteError:
                state.lines = None
                raise
            state.lines = (state.lines or 0) + data.count(b"\n")
            state.torn = False
            return state.lines

    def load_messages(self, session_id: str) -> list[dict[str, Any]]:
        """Messages of the file (or of its ``.imported`` copy); bad lines skipped with a warning."""
        path = self._transcript_path(session_id)
        state = self._transcript(session_id)
        try:
            with state.lock:
                data = read_file_nofollow(path)
                if data is None:
                    data = read_file_nofollow(path.with_name(session_id + IMPORTED_SUFFIX))
        except OSError as exc:
            raise TranscriptReadError(
                f"cannot read the transcript {path}: {exc.strerror or exc}; check the file's "
                "permissions."
            ) from exc
        if data is None:
            return []
        parsed = parse_lines(data)
        if (parsed.invalid or parsed.torn) and session_id not in self._warned:
            self._warned.add(session_id)
            logger.warning(
                "transcript %s: skipped %d invalid lines%s",
                path,
                parsed.invalid,
                " and an incomplete last line" if parsed.torn else "",
            )
        return parsed.messages


def _set_aside(path: Path) -> None:
    """Move an unusable mirror out of the way before the first rewrite would replace it."""
    if not os.path.lexists(path):
        return
    stamp = utc_now().strftime("%Y%m%dT%H%M%S%fZ")
    aside = path.with_name(f"{path.name}.unreadable-{stamp}")
    try:
        os.rename(path, aside)
    except OSError as exc:
        raise StoreError(
            f"cannot move the unreadable {path} aside: {exc.strerror or exc}; move or repair it "
            "yourself, then start again."
        ) from exc
    logger.warning("kept the unreadable routing mirror as %s for manual recovery", aside)
