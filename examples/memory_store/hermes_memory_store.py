"""A third-party storage backend kept in memory: the required contract plus transcript edits.

``storage.url: memory://<name>`` selects it; stores opened with the same name share one
database for the life of the process. Every other capability (search, pruning, the ledger,
durable queues, restart counts in the store, maintenance, atomic batches, turn leases, the
operator interface, ...) is left out: the store turns those features off, and runs one writer
for one gateway.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from hermes_core import GatewayConfig, SessionEntry, StoreSpec, hookimpl
from hermes_core.domain.errors import DuplicateSessionIdError
from hermes_core.store.backend import CounterDelta, EntryDict, Message, SessionRow, clean_message


class MemoryBackend:
    """Routing entries, session rows and transcripts in dictionaries, behind one lock."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.routes: dict[str, dict[str, Any]] = {}
        self.sessions: dict[str, SessionRow] = {}
        self.messages: dict[str, list[dict[str, Any]]] = {}
        self.next_id = 1

    # -- lifecycle
    def close(self) -> None:
        """Nothing to release: the database lives as long as the process."""

    def stats(self) -> dict[str, int]:
        return {}

    def transaction(self) -> AbstractContextManager[object]:
        return nullcontext()  # each write stands alone (no capability "atomic_batches")

    def health(self) -> dict[str, Any]:
        return {}

    # -- routing index
    def get_route(self, session_key: str) -> EntryDict | None:
        with self.lock:
            return copy.deepcopy(self.routes.get(session_key))

    def get_route_by_session_id(self, session_id: str) -> EntryDict | None:
        with self.lock:
            found = [e for e in self.routes.values() if e["session_id"] == session_id]
            return copy.deepcopy(found[0]) if found else None

    def iter_routes(self) -> Iterator[EntryDict]:
        with self.lock:
            snapshot = copy.deepcopy(list(self.routes.values()))
        yield from snapshot

    def put_route(self, entry: EntryDict, *, touch: bool = False) -> None:
        with self.lock:
            self.routes[entry["session_key"]] = copy.deepcopy(dict(entry))

    def put_routes(self, entries: Sequence[EntryDict]) -> None:
        with self.lock:
            for entry in entries:
                self.put_route(entry)

    def clear_turn_marker(self, entry: SessionEntry, token: str, *, rewrite: bool = False) -> bool:
        # the whole entry is written, so ``rewrite`` (its metadata changed too) needs nothing
        with self.lock:
            stored = self.routes.get(entry.session_key)
            if stored is None or stored.get("active_turn_token") != token:
                return False
            self.put_route(entry.to_dict())
            return True

    def begin_turn(
        self,
        entry: SessionEntry,
        consumed_event_id: int | None,
        user_message: tuple[str, Message] | None,
        seen: str | None = None,
        *,
        rewrite: bool = False,
    ) -> bool:
        with self.lock:
            if user_message is not None:
                self.append_message(*user_message)
            self.put_route(entry.to_dict())
            return True

    def routes_with_markers(self) -> list[EntryDict]:
        with self.lock:
            return [copy.deepcopy(e) for e in self.routes.values() if e.get("active_turn_token")]

    def routes_to_resume(self) -> list[EntryDict]:
        with self.lock:
            return [copy.deepcopy(e) for e in self.routes.values() if e.get("resume_pending")]

    # -- sessions
    def get_session(self, session_id: str) -> SessionRow | None:
        with self.lock:
            return self.sessions.get(session_id)

    def newest_session(self, session_key: str) -> SessionRow | None:
        with self.lock:
            rows = [row for row in self.sessions.values() if row.session_key == session_key]
            return max(rows, key=lambda row: row.started_at, default=None)

    def count_sessions(self) -> int:
        with self.lock:
            return len(self.sessions)

    def create_session(
        self, row: SessionRow, entry: EntryDict, end_previous: tuple[str, str] | None
    ) -> None:
        with self.lock:
            if row.id in self.sessions:
                raise DuplicateSessionIdError(f"session id {row.id} already exists; draw another.")
            if end_previous is not None:
                old = self.sessions.get(end_previous[0])
                if old is not None and old.ended_at is None:
                    ended = dataclasses.replace(
                        old, ended_at=time.time(), end_reason=end_previous[1]
                    )
                    self.sessions[old.id] = ended
            self.sessions[row.id] = row
            self.put_route(entry)

    def reopen_session(self, session_id: str, entry: EntryDict) -> None:
        with self.lock:
            row = self.sessions[session_id]
            self.sessions[session_id] = dataclasses.replace(row, ended_at=None, end_reason=None)
            self.put_route(entry)

    def update_counters(self, entry: EntryDict, session_id: str, delta: CounterDelta) -> None:
        with self.lock:
            self.put_route(entry)
            row = self.sessions.get(session_id)
            if row is None:
                return
            added = {
                name: getattr(row, name) + getattr(delta, name)
                for name in (
                    "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
                    "total_tokens", "estimated_cost_usd",
                )
            }  # fmt: skip
            self.sessions[session_id] = dataclasses.replace(
                row,
                cost_status=delta.cost_status or row.cost_status,
                last_activity_at=delta.last_activity_at or row.last_activity_at,
                **added,
            )

    # -- transcripts
    def append_message(self, session_id: str, message: Message) -> int:
        stored = clean_message(message)
        with self.lock:
            message_id, self.next_id = self.next_id, self.next_id + 1
            self.messages.setdefault(session_id, []).append(
                {"id": message_id, **stored, "active": True}
            )
            row = self.sessions.get(session_id)
            if row is not None:
                self.sessions[session_id] = dataclasses.replace(
                    row, message_count=row.message_count + 1, last_activity_at=stored["timestamp"]
                )
            return message_id

    def load_messages(self, session_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [
                {name: copy.deepcopy(value) for name, value in m.items() if name != "active"}
                for m in self.messages.get(session_id, [])
                if m["active"]
            ]

    # -- capability "transcript_edits"
    def rewrite_messages(self, session_id: str, messages: Sequence[Message]) -> int:
        cleaned = [clean_message(message) for message in messages]  # refuse before changing
        with self.lock:
            for stored in self.messages.get(session_id, []):
                stored["active"] = False
            for message in cleaned:
                self.append_message(session_id, message)
            return len(cleaned)

    def soft_delete_messages(self, session_id: str, message_ids: Sequence[int]) -> int:
        wanted = set(message_ids)
        with self.lock:
            hits = [
                m for m in self.messages.get(session_id, []) if m["id"] in wanted and m["active"]
            ]
            for message in hits:
                message["active"] = False
            return len(hits)


_DATABASES: dict[str, MemoryBackend] = {}
_DATABASES_LOCK = threading.Lock()


def open_memory_backend(url: str, config: GatewayConfig) -> MemoryBackend:
    """The database named by ``memory://<name>``, created on first use."""
    with _DATABASES_LOCK:
        return _DATABASES.setdefault(url, MemoryBackend())


@hookimpl
def hermes_register_stores(config: GatewayConfig) -> list[StoreSpec]:
    """The ``memory`` scheme: the required contract plus ``transcript_edits``."""
    return [
        StoreSpec(
            name="memory",
            schemes=("memory",),
            open=open_memory_backend,
            capabilities=frozenset({"transcript_edits"}),
        )
    ]
