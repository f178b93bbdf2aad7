"""Transcripts in the SQL store: messages appended, loaded, rewritten and soft-deleted, and the
JSONL backlog replayed. A session's message count follows each insert by trigger."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select

from hermes_core.store.backend import Message, SessionRow
from hermes_plugins.sql_store.connection import SqlConnection
from hermes_plugins.sql_store.rows import message_dict, message_row, session_values
from hermes_plugins.sql_store.schema import messages


class TranscriptRows:
    """Message rows; each write is one transaction. Every message the store inserts one by one
    goes through :meth:`insert` (a turn's start and its reply, on the store's other parts,
    too)."""

    def __init__(self, conn: SqlConnection) -> None:
        self._conn = conn
        self._sql = conn.sql
        self._returning_ids = conn.dialect.returning_ids
        self._index = conn.index

    def insert(self, cursor: Any, row: Mapping[str, Any]) -> int:
        """Insert one message row on the writer's cursor; its id."""
        self._sql.insert_message.run(cursor, row)
        if self._returning_ids:
            return int(cursor.fetchone()[0])
        message_id = int(cursor.lastrowid)
        self._index.inserted(message_id)
        return message_id  # the session's count follows by trigger (schema version 3)

    def append_message(self, session_id: str, message: Message) -> int:
        """Insert one message; returns its id."""
        row = message_row(session_id, message)

        with self._conn.write("appending a message") as cursor:
            return self.insert(cursor, row)

    def load_messages(self, session_id: str) -> list[dict[str, Any]]:
        """Active messages of a session in insertion order."""
        query = (
            select(messages)
            .where(messages.c.session_id == session_id, messages.c.active == 1)
            .order_by(messages.c.id)
        )
        with self._conn.read("loading a transcript") as conn:
            return [message_dict(dict(row)) for row in conn.execute(query).mappings()]

    def rewrite_messages(self, session_id: str, new_messages: Sequence[Message]) -> int:
        """Deactivate the active messages and append ``new_messages``, in one transaction."""
        rows = [message_row(session_id, message) for message in new_messages]

        with self._conn.write("rewriting a transcript") as cursor:
            self._sql.deactivate_messages.run(cursor, {"session_id": session_id})
            self._sql.set_message_count.run(cursor, {"session_id": session_id, "message_count": 0})
            for row in rows:
                self.insert(cursor, row)
        return len(rows)

    def soft_delete_messages(self, session_id: str, message_ids: Sequence[int]) -> int:
        """Deactivate messages of the session; never deletes rows."""
        if not message_ids:
            return 0
        count = 0
        with self._conn.write("deleting messages") as cursor:
            for message_id in message_ids:
                params = {"session_id": session_id, "message_id": message_id}
                count += self._sql.deactivate_message.run(cursor, params).rowcount
            self._sql.uncount_messages.run(cursor, {"session_id": session_id, "removed": count})
        return count

    def import_backlog(
        self,
        session_id: str,
        new_messages: Sequence[Message],
        offset: tuple[str, str],
        create_row: SessionRow | None,
    ) -> None:
        """Create the session row if needed, append messages, store the offset: one transaction."""
        rows = [message_row(session_id, message) for message in new_messages]

        with self._conn.write("replaying the JSONL backlog") as cursor:
            if create_row is not None:
                self._sql.insert_session.run(cursor, session_values(create_row))
            for row in rows:
                self.insert(cursor, row)
            self._conn.put_meta(cursor, *offset)
