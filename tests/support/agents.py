"""An agent for ``--agent`` tests: built from the lane's entry, it answers with that lane's key."""

from __future__ import annotations

from hermes_core import Agent, SessionEntry, TurnRequest


class LaneAgent(Agent):
    """Replies ``<session key of its entry> heard <message>``."""

    def __init__(self, entry: SessionEntry) -> None:
        self.entry = entry

    async def run_turn(self, request: TurnRequest) -> str | None:
        return f"{self.entry.session_key} heard {request.message}"


def no_entry() -> LaneAgent:
    """A factory that takes no entry (refused by ``--agent``)."""
    raise AssertionError("never called")
