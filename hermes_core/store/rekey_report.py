"""What a re-key (``hermes-sessions rekey``) moved or would move, and the collisions it found."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Forum = tuple[str, str]
"""A forum chat: (platform, chat id)."""


@dataclass(frozen=True)
class Collision:
    """A v1 key that sources with different v2 keys share today."""

    key: str
    targets: tuple[str, ...]
    """Their v2 keys, sorted."""
    recorded: bool = True
    """Rows of both sources are stored. False: one source is recorded, and another source
    (a forum topic read as a group member, or the other way round) has the same v1 key, so
    their messages may share one session: the common case, as the key records no more."""

    def describe(self) -> str:
        """The collision as ``rekey`` prints it."""
        targets = ", ".join(self.targets)
        if self.recorded:
            return (
                f"collision: {self.key} is shared today by sources with different v2 keys "
                f"({targets}); each row follows its own source, nothing is merged"
            )
        return (
            f"collision: {self.key} is the v1 key of sources with different v2 keys ({targets}); "
            "one of them is recorded, so if both wrote, their messages share one session, which "
            "moves with the recorded source (check the transcript)"
        )


@dataclass(frozen=True)
class RekeyReport:
    """What ``rekey`` moved (or, in a dry run, would move) and what it found."""

    dry_run: bool
    schema_before: str
    """``v1``, ``v2`` (nothing to do) or ``v1>v2`` (an interrupted run)."""
    moves: tuple[tuple[str, str], ...] = ()
    """Lanes (routing rows), old key → v2 key, in the order they move."""
    sessions: int = 0
    """Session rows whose key changes."""
    queued: int = 0
    """Queued events (dead letters included) whose key changes."""
    unchanged: int = 0
    """Lanes already under their v2 key (moved by an earlier run, or the same in both)."""
    collisions: tuple[Collision, ...] = ()
    left: tuple[tuple[str, str], ...] = ()
    """Lanes left as they are: (key, why)."""
    counts: int = 0
    """Stuck-loop counts whose key changes."""
    batches: int = 0
    """Transactions committed (0 in a dry run)."""
    forums: tuple[Forum, ...] = ()
    """The forum chats, (platform, chat id), whose thread-less lanes move to their general
    topic; empty for the move to schema v2."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping."""
        return {
            "dry_run": self.dry_run, "schema_before": self.schema_before,
            "moves": [{"from": old, "to": new} for old, new in self.moves],
            "sessions": self.sessions, "queued": self.queued, "unchanged": self.unchanged,
            "collisions": [
                {"key": c.key, "targets": list(c.targets), "recorded": c.recorded}
                for c in self.collisions
            ],
            "left": [{"key": key, "reason": why} for key, why in self.left],
            "counts": self.counts, "batches": self.batches,
            "forums": [{"platform": p, "chat_id": chat} for p, chat in self.forums],
        }  # fmt: skip
