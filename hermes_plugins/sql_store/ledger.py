"""The delivery ledger's rows in the SQL store."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import (
    bindparam,
    select,
    update,
)

from hermes_core.domain.errors import LeaseLostError
from hermes_core.domain.models import SessionEntry
from hermes_core.store.backend import Message, Obligation
from hermes_plugins.sql_store.connection import SqlConnection
from hermes_plugins.sql_store.dialects import postgresql_turns
from hermes_plugins.sql_store.dialects.postgresql_turns import message_params, obligation_params
from hermes_plugins.sql_store.rows import marker_params, message_row
from hermes_plugins.sql_store.schema import (
    delivery_obligations,
)
from hermes_plugins.sql_store.statements import TERMINAL, Prepared
from hermes_plugins.sql_store.transcripts import TranscriptRows

OBLIGATION_FIELDS = tuple(Obligation.__dataclass_fields__)


class SqlLedgerRows:
    """The core's ``LedgerRows`` in SQL: ledger reads and writes; each write is one
    transaction. A turn's finish stores its reply through ``transcripts``."""

    def __init__(self, conn: SqlConnection, transcripts: TranscriptRows) -> None:
        self._conn = conn
        self._sql = conn.sql
        self._one_round_trip = conn.dialect.one_round_trip
        self._transcripts = transcripts
        self._updates: dict[tuple[str, ...], Prepared] = {}
        """The statement of each set of columns :meth:`update_obligation` changed so far."""

    def add_obligation(
        self,
        obligation: Obligation,
        marker: tuple[SessionEntry, str] | None,
        reply: tuple[str, Message] | None = None,
        lease: str | None = None,
        *,
        rewrite: bool = False,
    ) -> tuple[bool, bool]:
        """Store ``reply``, insert the obligation (unless recorded already) and clear the
        marker, atomically; with ``lease`` (PostgreSQL) only while that token holds the lane's
        lease, else ``LeaseLostError`` with nothing written."""
        clear = None
        if marker is not None:
            clear = marker_params(marker[0], rewrite=rewrite) | {"token": marker[1]}
        message = message_row(*reply) if reply is not None else None

        with self._conn.write("recording a delivery obligation") as cursor:
            if self._one_round_trip:
                params = (
                    message_params(message) | obligation_params(obligation) | {"lease": lease}
                    | (clear or dict.fromkeys(("session_key", "token", "updated_at", "entry_json")))
                )  # fmt: skip
                statement = postgresql_turns.FINISH_TURN
                added, cleared, held = cursor.execute(statement, params).fetchone()
                if not held:
                    raise LeaseLostError("the lane's lease is held under another token")
                return bool(added), bool(cleared)
            if message is not None:
                self._transcripts.insert(cursor, message)
            values = {name: getattr(obligation, name) for name in OBLIGATION_FIELDS}
            added = self._sql.insert_obligation.run(cursor, values).rowcount == 1
            cleared = clear is not None and self._sql.clear_marker.run(cursor, clear).rowcount
            return bool(added), bool(cleared)

    def obligations(
        self, states: Sequence[str], platforms: Sequence[str] | None = None
    ) -> list[Obligation]:
        """Ledger rows in ``states`` (and ``platforms``), oldest first."""
        table = delivery_obligations
        query = select(table).where(table.c.state.in_(list(states)))
        if platforms is not None:
            query = query.where(table.c.platform.in_(list(platforms)))
        query = query.order_by(table.c.created_at, table.c.obligation_id)
        with self._conn.read("reading the delivery ledger") as conn:
            rows = conn.execute(query).mappings().all()
        fields = Obligation.__dataclass_fields__
        return [Obligation(**{name: row[name] for name in fields}) for row in rows]

    def obligation_since(self, session_key: str, since: float) -> bool:
        """Whether the lane has a ledger row created at or after ``since``."""
        table = delivery_obligations
        query = select(table.c.obligation_id).where(
            table.c.session_key == session_key, table.c.created_at >= since
        )
        with self._conn.read("reading the delivery ledger") as conn:
            return conn.execute(query.limit(1)).first() is not None

    def update_obligation(self, obligation_id: str, changes: Mapping[str, Any]) -> None:
        """Change columns of one ledger row (one prepared statement per set of columns)."""
        columns = tuple(sorted(changes))
        prepared = self._updates.get(columns)
        if prepared is None:
            table = delivery_obligations
            statement = (
                update(table)
                .where(table.c.obligation_id == bindparam("obligation_id"))
                .values({name: bindparam(name) for name in columns})
            )
            prepared = self._updates[columns] = self._conn.prepare(statement)
        with self._conn.write("updating the delivery ledger") as cursor:
            prepared.run(cursor, {**changes, "obligation_id": obligation_id})

    def delete_obligation(self, obligation_id: str) -> None:
        """Remove one ledger row."""
        with self._conn.write("updating the delivery ledger") as cursor:
            self._sql.delete_obligation.run(cursor, {"obligation_id": obligation_id})

    def obligations_to_prune(self, terminal_before: float, max_rows: int) -> list[str]:
        """Terminal (failed or abandoned) rows past retention or beyond the row cap, oldest
        first (read on a connection of its own, never the writer's)."""
        table = delivery_obligations
        query = (
            select(table.c.obligation_id, table.c.updated_at)
            .where(table.c.state.in_(TERMINAL))
            .order_by(table.c.updated_at.desc(), table.c.obligation_id.desc())
        )
        with self._conn.read("reading the delivery ledger") as conn:
            rows = conn.execute(query).all()
        doomed = [
            row.obligation_id
            for rank, row in enumerate(rows)
            if rank >= max_rows or row.updated_at < terminal_before
        ]
        return doomed[::-1]

    def delete_terminal_obligations(self, obligation_ids: Sequence[str]) -> int:
        """Delete those of the rows still terminal (one transaction); how many went."""
        removed = 0
        with self._conn.write("pruning the delivery ledger") as cursor:
            for obligation_id in obligation_ids:
                params = {"obligation_id": obligation_id}
                removed += self._sql.delete_terminal_obligation.run(cursor, params).rowcount
        return removed
