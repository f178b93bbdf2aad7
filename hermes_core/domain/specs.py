"""Typed, frozen records that plugins return from the registration hooks (``hermes_hookspecs``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.connectors import ConnectorContext
from hermes_core.domain.models import PLATFORM_NAME_RE, MessageEvent, SessionEntry, SessionSource
from hermes_core.domain.timeutil import utc_now

_SPEC_CONFIG = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)


def _platform_name(value: str) -> str:
    if not PLATFORM_NAME_RE.fullmatch(value):
        raise ValueError(f"platform name {value!r} must match ^[a-z0-9_]+$")
    return value


PlatformName = Annotated[str, AfterValidator(_platform_name)]
"""A platform name, ``^[a-z0-9_]+$``."""


@dataclass(frozen=True)
class ReadContext:
    """What the host tells a platform's event reader beside the payload itself."""

    lookup_chat: Callable[[str], Mapping[str, Any] | None] | None = None
    """The platform's own JSON object for a chat id (for Discord a channel object with ``type``
    and ``parent_id``; for Slack a conversation object), or None when the host does not know it;
    consulted only for what the payload does not say. It must not do network I/O per event: read
    the host's cache of the platform's chats."""
    answer_in_thread: bool = False
    """The host answers a channel message in a new thread started from it, so the message is keyed
    like the thread's later messages (``prospective_thread_id``); for platforms whose threads are
    started from a message and take its id (Discord)."""


EventReader = Callable[[Mapping[str, Any], ReadContext], MessageEvent | None]
"""Reads one raw payload of a platform, as the platform delivers it (a JSON object), into a
:class:`MessageEvent`; None when it is not a user message (an edit, a reaction, a bot's message, a
service message); :class:`~hermes_core.domain.errors.MalformedEventError` when it cannot be read."""


class PlatformSpec(BaseModel):
    """A platform and what is specific to it; anything not supplied follows the generic rule.

    Callables run on every inbound message: they must be pure, deterministic and do no network I/O.
    """

    model_config = _SPEC_CONFIG

    name: PlatformName
    """Unique platform name, ``^[a-z0-9_]+$`` (the key's platform component)."""
    label: str | None = None
    """Display label in the prompt; default: the title-cased name."""
    pii_safe: bool = False
    """Whether user and chat ids may be pseudonymised in the prompt."""
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
    read_event: EventReader | None = None
    """Reads the platform's own event payloads (:data:`EventReader`), behind
    :func:`hermes_core.read_event`; pure apart from the context's lookups."""
    local_machine: bool = False
    """The platform is the machine running the agent (a terminal): the prompt names the source
    ``Local (the machine running this agent)``, lists the platform first among the connected ones
    as ``<name> (files on this machine)``, sends scheduled output of its sessions to local files and
    offers ``"<name>"`` as the local-files delivery target."""
    state_dirs: Callable[[Path], Sequence[Path]] | None = None
    """Directories of the platform's own files under a state directory (the argument), such as
    WhatsApp's lid-mapping files: ``doctor`` reports one that exists but that it cannot read."""
    forum_general_thread: str | None = None
    """The thread the reader gives a forum chat's messages outside any topic (Telegram's General
    topic, ``"1"``); ``rekey --forum`` moves a named forum's lanes keyed without a thread to it."""

    @property
    def display_label(self) -> str:
        """The label shown in the prompt."""
        return self.label or self.name.title()


StoreCapability = Literal[
    "search", "transcript_edits", "pruning", "ledger", "queue", "restart_counts", "maintenance",
    "atomic_batches", "turn_leases", "parallel_writers", "lane_wakeups", "local_state", "operator",
    "route_batches",
]  # fmt: skip
"""What a storage backend declares it offers beyond the required ``StoreBackend`` protocol (most
have a protocol of their own in ``hermes_core.store.backend``): full-text search; transcript
rewrites and soft deletes; pruning idle routing entries; the delivery ledger; durable queues with
dead letters and redelivery records; restart counts kept in the store, tagged per instance
(without it they live in ``$HERMES_HOME/restart_counts.json``); maintenance (``state_meta``,
sessions.json and JSONL backlog imports, re-keying); ``atomic_batches`` (``transaction()`` rolls
back every write inside it together, so the store's writer may commit several callers' steps at
once); ``turn_leases`` (gateways share the store under lane leases; without it one gateway uses
it at a time); ``parallel_writers`` (several writer connections commit in parallel);
``route_batches`` (many lanes' routing entries read in one statement: a writer batch's cold
lanes);
``lane_wakeups`` (with ``turn_leases``: a process wakes the holder of a lane's lease at once);
``local_state`` (the state is a file on this machine: the sessions.json mirror is written by
default, and a backend that cannot be opened falls back to the core's JSONL store); ``operator``
(what ``doctor``, ``migrate``, ``export`` and the dead-letter commands need, ``OperatorBackend``
in ``hermes_core.store.operator``)."""

STORE_CAPABILITIES: tuple[StoreCapability, ...] = get_args(StoreCapability)

_OLDER_SPELLING: tuple[tuple[str, StoreCapability, bool], ...] = (
    ("atomic_batches", "atomic_batches", True), ("single_instance", "turn_leases", False),
    ("parallel_writers", "parallel_writers", True), ("lane_wakeups", "lane_wakeups", True),
    ("local", "local_state", True),
)  # fmt: skip
"""The boolean keyword arguments of earlier releases: (keyword, capability, the value that
declares it)."""


class StoreSpec(BaseModel):
    """A storage backend serving the URL schemes it names, and the capabilities it declares.

    The store checks the backend against this declaration when it opens it: a missing method of
    the required ``StoreBackend`` protocol, or of a declared capability, is a ``PluginError``
    naming the plugin; an undeclared capability turns its feature off (one warning each for the
    features of ``search`` to ``maintenance``).

    The keyword arguments ``atomic_batches``, ``single_instance``, ``parallel_writers``,
    ``lane_wakeups`` and ``local`` are the older spelling of capabilities, still accepted and
    readable: ``atomic_batches=True`` declares ``atomic_batches``, ``single_instance=False``
    declares ``turn_leases``, ``local=True`` declares ``local_state``, and so on. A keyword that
    contradicts ``capabilities`` is a ``ValueError``.
    """

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
    capabilities: frozenset[StoreCapability] = frozenset()
    """What the backend offers beyond the required protocol (see :data:`StoreCapability`)."""
    files: Callable[[str], Sequence[Path]] | None = None
    """The files on this machine holding the store that a URL names (a database, its journals,
    its writer lock), whether they exist or not: the operator commands never write over them
    and ``doctor`` checks their modes. None: the store keeps no files on this machine."""

    def __init__(
        self,
        *,
        name: str,
        schemes: tuple[str, ...],
        open: Callable[[str, GatewayConfig], Any],
        open_read_only: Callable[[str, GatewayConfig], Any] | None = None,
        capabilities: Iterable[StoreCapability] = frozenset(),
        files: Callable[[str], Sequence[Path]] | None = None,
        atomic_batches: bool | None = None,
        single_instance: bool | None = None,
        parallel_writers: bool | None = None,
        lane_wakeups: bool | None = None,
        local: bool | None = None,
    ) -> None:
        declared = set(capabilities)
        older = (atomic_batches, single_instance, parallel_writers, lane_wakeups, local)
        for (keyword, capability, declares), value in zip(_OLDER_SPELLING, older, strict=True):
            if value is None:
                continue
            if value == declares:
                declared.add(capability)
            elif capability in declared:
                raise ValueError(
                    f"StoreSpec {name!r}: {keyword}={value} contradicts the capability "
                    f"{capability!r} it lists; declare it once, in capabilities."
                )
        super().__init__(
            name=name, schemes=schemes, open=open, open_read_only=open_read_only,
            capabilities=frozenset(declared), files=files,
        )  # fmt: skip

    @property
    def atomic_batches(self) -> bool:
        """The older spelling of the capability ``atomic_batches``."""
        return "atomic_batches" in self.capabilities

    @property
    def single_instance(self) -> bool:
        """The older spelling of the capability ``turn_leases``, negated."""
        return "turn_leases" not in self.capabilities

    @property
    def parallel_writers(self) -> bool:
        """The older spelling of the capability ``parallel_writers``."""
        return "parallel_writers" in self.capabilities

    @property
    def lane_wakeups(self) -> bool:
        """The older spelling of the capability ``lane_wakeups``."""
        return "lane_wakeups" in self.capabilities

    @property
    def local(self) -> bool:
        """The older spelling of the capability ``local_state``."""
        return "local_state" in self.capabilities


@dataclass(frozen=True)
class BacklogReplayResult:
    """What ``jsonl_backlog_replay`` imported from the JSONL backlog into SQL."""

    files: int
    messages: int
    routes: int
    skipped: tuple[str, ...]
    """Backlog files left in place, by name."""


@dataclass(frozen=True)
class CrashRecoveryResult:
    """What ``clean_shutdown`` did: after a clean stop it discards the turn markers; after a crash
    it records crash-left replies and arms the interrupted turns."""

    clean: bool
    """Whether the previous stop was clean."""
    markers_discarded: int = 0
    """After a clean stop: turn markers discarded."""
    crash_left_replies: Mapping[str, str] = field(default_factory=dict)
    """After a crash: what happened per session key (``ledgered``, ``recorded``, ...)."""
    armed: tuple[str, ...] = ()
    """After a crash: lanes newly marked to resume."""
    kept: tuple[str, ...] = ()
    """After a crash: lanes already marked to resume (their reason kept)."""
    markers_cleared: int = 0
    interrupted: tuple[str, ...] = ()
    """Lanes this start found interrupted; ``stuck_loop`` counts them."""


@dataclass(frozen=True)
class StuckLoopResult:
    """What ``stuck_loop`` did: the interrupted-start counts it saved and the lanes it suspended."""

    counts: Mapping[str, int]
    suspended: tuple[str, ...]


@dataclass
class RecoveryReport:
    """What the recovery steps did, shared by all steps of one start (and its shutdown).

    The built-in steps write their typed field; a later step reads an earlier one's field (e.g.
    ``stuck_loop`` reads ``crash_recovery.interrupted``). Other steps record under their own
    step name in ``extra``.
    """

    outcomes: dict[str, str] = field(default_factory=dict)
    """Every step that ran, by name: ``ok`` or ``failed: <error>``."""
    backlog: BacklogReplayResult | None = None
    search_index_rebuilt: bool | None = None
    crash_recovery: CrashRecoveryResult | None = None
    stuck_loop: StuckLoopResult | None = None
    queued_events_restored: int | None = None
    extra: dict[str, object] = field(default_factory=dict)
    """What steps other than the built-in ones record, keyed by their step name."""


@dataclass
class RecoveryContext:
    """What a recovery step receives: the store, the configuration, whether the previous stop
    was clean, the report shared by all steps, and the host callbacks steps consult."""

    store: Any
    config: GatewayConfig
    last_stop_clean: bool
    report: RecoveryReport = field(default_factory=RecoveryReport)
    diagnostic_muted: Callable[[str, str], bool] | None = None
    """The host's ``diagnostic_muted(session_key, text)``: whether a machinery turn's reply is a
    diagnostic that need not be delivered after a crash."""
    queue_restore: Callable[[], int] | None = None
    """Set by the gateway: reloads the durable queues into its turn queue and returns how many
    events it restored (without a gateway, ``queue_restore`` only counts them)."""


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


class ConnectorSpec(BaseModel):
    """A connector for one platform: how its events arrive and how replies reach it
    (:class:`~hermes_core.domain.connectors.Connector`), built from ``platforms.<name>``."""

    model_config = _SPEC_CONFIG

    platform: PlatformName
    """The platform it connects (a name some plugin registers with a ``PlatformSpec``)."""
    build: Callable[[ConnectorContext], Any]
    """Builds the connector (no I/O yet: ``Connector.start`` connects); raises ``ConfigError``
    naming the ``platforms.<name>`` key to fix."""
    summary: str = ""
    """One line for ``hermes-sessions plugins``: what the connector talks to."""


LifecycleKind = Literal[
    "session_created", "session_reset", "session_suspended", "session_replaced",
    "session_reopened", "resume_marked", "resume_cleared", "turn_started", "turn_ended",
    "agent_soft_released", "agent_cleaned_up", "queue_accepted", "queue_refused", "queue_merged",
    "queue_discarded", "ledger_transition", "recovery_step", "store_committed", "lane_taken_over",
]  # fmt: skip


class LifecycleEvent(BaseModel):
    """Something that was committed, as observers see it."""

    model_config = _SPEC_CONFIG

    kind: LifecycleKind
    session_key: str | None = None
    session_id: str | None = None
    at: datetime = Field(default_factory=utc_now)
    detail: Mapping[str, Any] = Field(default_factory=dict)
