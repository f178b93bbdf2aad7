"""Typed, frozen records that plugins return from the registration hooks (``hermes_hookspecs``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hermes_core.config import GatewayConfig
from hermes_core.models import PLATFORM_NAME_RE, SessionEntry, SessionSource
from hermes_core.timeutil import utc_now

_SPEC_CONFIG = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)


class PlatformSpec(BaseModel):
    """A platform and what is specific to it; anything not supplied follows the generic rule.

    Callables run on every inbound message: they must be pure, deterministic and do no network I/O.
    """

    model_config = _SPEC_CONFIG

    name: str
    """Unique platform name, ``^[a-z0-9_]+$`` (the key's platform component)."""
    label: str | None = None
    """Display label in the prompt; default: the title-cased name."""
    pii_safe: bool = False
    """Whether user and chat ids may be pseudonymised in the prompt (SPEC §9.4)."""
    scope: Callable[[SessionSource], str | None] | None = None
    """Key scope component (e.g. Slack's workspace), or None for none."""
    canonical_dm_chat_id: Callable[[str], str] | None = None
    """Canonicalises DM chat ids before they enter the key (group ids never are)."""
    canonical_participant: Callable[[str], str] | None = None
    """Canonicalises sender ids for the key and for pseudonym inputs; ``""`` keeps the raw id."""
    aliases: Callable[[str], Sequence[str]] | None = None
    """Ids the canonicalisers consider equivalent to a value, shown by ``explain``."""
    describe: Callable[[SessionSource], str] | None = None
    """Replaces ``SessionSource.description`` for this platform."""
    prompt_notes: Callable[[SessionSource, SessionEntry | None], Sequence[str]] | None = None
    """Extra prompt lines (e.g. continuity or tool guidance); untrusted values must be quoted."""
    validate_source: Callable[[SessionSource], None] | None = None
    """Raises ``InvalidValueError`` when an id has the wrong shape for this platform; run on
    untrusted input (``SessionSource.from_dict``, so also stored entries and events)."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not PLATFORM_NAME_RE.fullmatch(value):
            raise ValueError(f"platform name {value!r} must match ^[a-z0-9_]+$")
        return value

    @property
    def display_label(self) -> str:
        """The label shown in the prompt."""
        return self.label or self.name.title()


class StoreSpec(BaseModel):
    """A storage backend serving the URL schemes it names."""

    model_config = _SPEC_CONFIG

    name: str
    schemes: tuple[str, ...] = Field(min_length=1)
    open: Callable[[str, GatewayConfig], Any]
    """Opens the backend for ``storage.url`` (the first argument) and the configuration, for
    writing: a backend that allows one writer per database takes its lock here and raises
    ``GatewayLockedError`` naming the holder when another process has it."""
    open_read_only: Callable[[str, GatewayConfig], Any] | None = None
    """Opens the backend to read only: no writer lock, no schema changes, every write refused
    (``ReadOnlyStoreError``); None when the backend cannot be opened that way."""
    single_instance: bool = True
    """True when the backend has no turn leases, so one gateway may use it at a time."""


@dataclass
class RecoveryContext:
    """What a recovery step receives: the store, the configuration, whether the previous stop
    was clean, a report shared by all steps, and the host callbacks steps may consult (e.g.
    ``diagnostic_muted(session_key, text) -> bool``, SPEC §7.4)."""

    store: Any
    config: GatewayConfig
    last_stop_clean: bool
    report: dict[str, Any] = field(default_factory=dict)
    callbacks: dict[str, Callable[..., Any]] = field(default_factory=dict)


class RecoveryStep(BaseModel):
    """A named, ordered unit of start-up (or shutdown) work."""

    model_config = _SPEC_CONFIG

    name: str = Field(min_length=1)
    order: int
    run: Callable[[RecoveryContext], None]
    critical: bool = False
    """A critical step's failure aborts start-up; others are logged and the next step runs."""
    phase: Literal["startup", "shutdown"] = "startup"


EvictionReason = Literal["capacity", "idle", "pressure"]


class EvictionCandidate(BaseModel):
    """One cached agent offered to the eviction policy."""

    model_config = _SPEC_CONFIG

    session_key: str
    last_activity: float | None
    """Monotonic seconds of the last use, None when unknown."""
    in_flight: bool
    persisted: bool


class EvictionPolicy(BaseModel):
    """A named eviction planner."""

    model_config = _SPEC_CONFIG

    name: str = Field(min_length=1)
    plan: Callable[[Sequence[EvictionCandidate], EvictionReason, int], Sequence[str]]
    """Given candidates in LRU order, the reason and a limit, the keys to release, in order."""


LifecycleKind = Literal[
    "session_created", "session_reset", "session_suspended", "session_replaced",
    "session_reopened", "resume_marked", "resume_cleared", "turn_started", "turn_ended",
    "agent_soft_released", "agent_cleaned_up", "queue_accepted", "queue_refused", "queue_merged",
    "queue_discarded", "ledger_transition", "recovery_step",
]  # fmt: skip


class LifecycleEvent(BaseModel):
    """Something that was committed, as observers see it."""

    model_config = _SPEC_CONFIG

    kind: LifecycleKind
    session_key: str | None = None
    session_id: str | None = None
    at: datetime = Field(default_factory=utc_now)
    detail: Mapping[str, Any] = Field(default_factory=dict)
