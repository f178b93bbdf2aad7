"""Agents for ``--agent`` and ``agent.use`` tests: one built from the lane's entry, answering
with that lane's key, and a builder taking options."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hermes_core import Agent, GatewayConfig, SessionEntry, TurnRequest


class LaneAgent(Agent):
    """Replies ``<session key of its entry> heard <message>``."""

    def __init__(self, entry: SessionEntry) -> None:
        self.entry = entry

    async def run_turn(self, request: TurnRequest) -> str | None:
        return f"{self.entry.session_key} heard {request.message}"


def no_entry() -> LaneAgent:
    """A factory that takes no entry (refused by ``--agent``)."""
    raise AssertionError("never called")


def two_entries(entry: SessionEntry, other: SessionEntry, third: SessionEntry) -> LaneAgent:
    """Requires three arguments: neither a factory nor a builder."""
    raise AssertionError("never called")


class Greeter(Agent):
    """Replies ``<greeting>, <message>``."""

    def __init__(self, greeting: str) -> None:
        self.greeting = greeting

    async def run_turn(self, request: TurnRequest) -> str | None:
        return f"{self.greeting}, {request.message}"


def greeters(options: Mapping[str, Any], config: GatewayConfig) -> Callable[[SessionEntry], Agent]:
    """A builder: ``options["greeting"]`` (default ``hello``) for every lane's agent."""
    greeting = str(options.get("greeting", "hello"))
    return lambda entry: Greeter(greeting)


def broken_builder(options: Mapping[str, Any], config: GatewayConfig) -> Any:
    """A builder that returns no factory."""
    return None
