"""The store's transcripts: append-only messages, rewrites by deactivation, soft deletes and
full-text search (the ``transcript_edits`` and ``search`` capabilities)."""

from __future__ import annotations

import logging
from typing import Any

from hermes_core.domain.errors import (
    InvalidValueError,
    StoreError,
    TranscriptReadError,
    TranscriptWriteError,
    TurnInProgressError,
    shown,
)
from hermes_core.domain.models import session_id_problem
from hermes_core.domain.text import clean_text
from hermes_core.store.backend import (
    Message,
    SearchHit,
)
from hermes_core.store.backing import Backing
from hermes_core.store.base import exclusive, serialised
from hermes_core.store.routing import RoutingTable
from hermes_core.store.writer import StoreWriter

logger = logging.getLogger(__name__)


class Transcripts:
    """Append-only transcripts, rewrites by deactivation, soft deletes and search, in the
    backend of ``backing`` (``routes`` tells which lane runs a turn on a session)."""

    def __init__(self, backing: Backing, routes: RoutingTable, writer: StoreWriter) -> None:
        self._backing = backing
        self._routes = routes
        self._writer = writer

    @staticmethod
    def _check_session_id(session_id: str) -> None:
        problem = session_id_problem(session_id) if isinstance(session_id, str) else "not a string"
        if problem is not None:
            raise InvalidValueError(
                "session_id", f"session_id {shown(session_id)} is invalid: {problem}."
            )

    @serialised
    def append_to_transcript(
        self, session_id: str, message: Message, skip_db: bool = False
    ) -> None:
        """Store one message durably before returning (``skip_db``: already stored by the agent)."""
        if skip_db:
            return
        self._check_session_id(session_id)
        try:
            with self._backing.canonical:
                self._backing.backend.append_message(session_id, message)
        except TranscriptWriteError:
            raise
        except StoreError as exc:
            raise TranscriptWriteError(f"the message was not stored: {exc}") from exc

    def load_transcript(self, session_id: str) -> list[dict[str, Any]]:
        """Active messages in insertion order; ``[]`` for an unknown session."""
        self._check_session_id(session_id)
        try:
            with self._backing.canonical:
                return self._backing.backend.load_messages(session_id)
        except TranscriptReadError:
            raise
        except StoreError as exc:
            raise TranscriptReadError(f"the transcript could not be read: {exc}") from exc

    @serialised
    def rewrite_transcript(
        self, session_id: str, messages: list[Message], *, force: bool = False
    ) -> int:
        """Replace the active messages (old ones are deactivated, never deleted)."""
        self._check_session_id(session_id)
        with self._backing.canonical:
            if self._backing.backend.get_session(session_id) is None:
                raise InvalidValueError("session_id", f"session {session_id} does not exist.")
        owner = self._routes.current_entry_of(session_id)
        if owner is not None and owner.active_turn_token and not force:
            raise TurnInProgressError(
                f"a turn is running on {owner.session_key}; rewrite the transcript after it "
                "ends, or pass force=True"
            )
        edits = self._backing.bound.edits
        if edits is None:
            raise TranscriptWriteError(
                self._backing.without("transcript_edits", "Rewriting a transcript")
            )
        try:
            with self._backing.canonical:
                return edits.rewrite_messages(session_id, messages)
        except TranscriptWriteError:
            raise
        except StoreError as exc:
            raise TranscriptWriteError(f"the transcript was not rewritten: {exc}") from exc

    @serialised
    def soft_delete_messages(self, session_id: str, message_ids: list[int]) -> int:
        """Deactivate messages (``active=0``); never deletes rows."""
        self._check_session_id(session_id)
        edits = self._backing.bound.edits
        if edits is None:
            raise TranscriptWriteError(
                self._backing.without("transcript_edits", "Deleting transcript messages")
            )
        with self._backing.canonical:
            return edits.soft_delete_messages(session_id, message_ids)

    def search(
        self,
        query: str,
        *,
        session_id: str | None = None,
        session_key: str | None = None,
        limit: int = 20,
    ) -> list[SearchHit]:
        """Full-text search over active messages, best rank first (``[]`` while degraded).

        ``query`` is data, never query syntax: every whitespace-separated word must occur. A
        ``session_id`` that no session can have matches nothing."""
        if not isinstance(query, str):
            raise InvalidValueError("query", "the search query must be a string.")
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise InvalidValueError("limit", f"limit must be an integer, got {shown(limit)}.")
        search = self._backing.bound.search
        if search is None or (session_id is not None and session_id_problem(session_id)):
            return []
        with self._backing.canonical:
            return search.search(
                clean_text(query),
                session_id=session_id,
                session_key=None if session_key is None else clean_text(session_key),
                limit=max(1, min(limit, 100)),
            )

    def rebuild_search_index(self) -> bool:
        """Rebuild the derived full-text index (step ``fts_rebuild_if_stale``): what is rebuilt
        in one piece off the writer (PostgreSQL's concurrent reindex), then started in one
        writer step, then the messages indexed in bounded batches, each a writer step of its
        own, so that turns' steps run between them (search stays exact meanwhile)."""
        search = self._backing.bound.search
        if search is not None:
            with self._backing.canonical:
                search.reindex_fts()
        started = self._start_search_rebuild()
        while started and self._index_search_backlog():
            pass
        return started

    @exclusive
    def _start_search_rebuild(self) -> bool:
        search = self._backing.bound.search
        if search is None:
            return False
        with self._backing.canonical:
            return search.start_fts_rebuild()

    @exclusive
    def _index_search_backlog(self) -> bool:
        search = self._backing.bound.search
        if search is None:
            return False
        with self._backing.canonical:
            return search.index_backlog()
