"""The delivery ledger (SPEC §7.5, §7.6): every final reply is recorded before its first send,
so a crash never loses an owed reply, and every ambiguous re-send carries a visible prefix.

States: ``pending`` → ``attempting`` (written just before the platform call) → delivered (the
row is deleted) | ``failed`` | ``abandoned``. The ledger is a helper of the store: it exists only
while the SQL store is available and ``gateway.delivery_ledger.enabled`` is true; its failures
are logged and swallowed, never blocking a send.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hermes_core.config import DeliveryLedgerConfig
from hermes_core.crashpoints import crash_point
from hermes_core.errors import StoreError
from hermes_core.specs import LifecycleEvent

if TYPE_CHECKING:  # the store imports this module; annotations only
    from hermes_core.store.backend import Obligation, SqlMaintenance

logger = logging.getLogger(__name__)

RESTART_PREFIX = (
    "♻️ Recovered reply — the gateway restarted during delivery, so this may be a duplicate:"
)
RECONNECT_PREFIX = (
    "♻️ Recovered reply — the messaging platform reconnected after the original delivery failed, "
    "so this may be a duplicate:"
)
RATE_LIMIT_PREFIX = (
    "♻️ Recovered reply — the messaging platform's rate limit refused the original, so part of it "
    "may already have arrived above:"
)
SILENCE_NOTICE = "⚠️ The agent ended this turn without a reply (it returned only a silence marker)."
SILENT_MARKERS = frozenset(
    {"[SILENT]", "SILENT", "NO_REPLY", "NO REPLY", "[静默]", "静默", "[沉默]", "沉默"}
)

FailureKind = Literal["rejected", "disconnected", "rate_limited", "crashed"]
_SPACES = re.compile(r"\s+")


def is_silent_reply(text: object) -> bool:
    """Whether a reply is only a silence marker (SPEC §7.6): 1-64 characters after trimming whose
    upper-cased, whitespace-collapsed form is a marker, also after stripping leading and trailing
    punctuation other than square brackets (so ``[SILENT`` never becomes ``SILENT``)."""
    if not isinstance(text, str):
        return False
    trimmed = text.strip()
    if not 1 <= len(trimmed) <= 64:
        return False
    form = _SPACES.sub(" ", trimmed.upper())
    if form in SILENT_MARKERS:
        return True
    start, end = 0, len(form)
    while start < end and _strippable(form[start]):
        start += 1
    while end > start and _strippable(form[end - 1]):
        end -= 1
    return form[start:end].strip() in SILENT_MARKERS


def _strippable(char: str) -> bool:
    return char not in "[]" and unicodedata.category(char).startswith("P")


def obligation_id(session_key: str, message_ref: str, content: str) -> str:
    """SHA-256 hex of ``<session_key>|<message_ref>|<content>``: re-recording is a no-op."""
    return hashlib.sha256(f"{session_key}|{message_ref}|{content}".encode()).hexdigest()


@dataclass(frozen=True)
class SendResult:
    """What the host's send function reports: success, or a failure kind (Appendix B.3)."""

    ok: bool
    failure_kind: FailureKind | None = None
    error: str | None = None


SendFunction = Callable[["Obligation", str], SendResult]
"""Sends the text (the reply, prefixed when ambiguous) to the obligation's chat."""


@dataclass(frozen=True)
class SweepReport:
    """What a sweep did, by obligation id."""

    delivered: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    abandoned: tuple[str, ...] = ()


class DeliveryLedger:
    """Claims, sends and settles ledger rows through the store's SQL backend."""

    def __init__(
        self,
        rows: SqlMaintenance,
        settings: DeliveryLedgerConfig,
        notify: Callable[[LifecycleEvent], None] | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.rows = rows
        self.settings = settings
        self._notify = notify
        self._clock = clock
        self.owner: tuple[str | None, str | None] = (None, None)

    def _transition(self, row: Obligation, state: str, **detail: object) -> None:
        if self._notify is not None:
            self._notify(
                LifecycleEvent(
                    kind="ledger_transition", session_key=row.session_key,
                    session_id=row.session_id,
                    detail={"obligation_id": row.obligation_id, "state": state, **detail},
                )
            )  # fmt: skip

    def _update(self, row: Obligation, state: str, **changes: object) -> None:
        try:
            self.rows.update_obligation(
                row.obligation_id, {"state": state, "updated_at": self._clock(), **changes}
            )
        except StoreError as exc:
            logger.error("delivery ledger: could not mark a reply %s: %s", state, exc)
            return
        self._transition(row, state)

    def deliver(self, row: Obligation, send: SendFunction, prefix: str | None = None) -> bool:
        """Claim (spending an attempt), send, settle. True when the platform accepted it."""
        if not self.claim(row):
            return False
        text = f"{prefix}\n\n{row.content}" if prefix else row.content
        try:
            result = send(row, text)
        except Exception as exc:  # noqa: BLE001 - a raising adapter is a failed delivery
            result = SendResult(ok=False, failure_kind="disconnected", error=repr(exc))
        return self.settle(row, result)

    def claim(self, row: Obligation) -> bool:
        """Mark a row ``attempting`` just before the platform call, spending an attempt;
        False (the row abandoned) when no attempt is left."""
        if row.attempts >= self.settings.max_attempts:
            self.abandon(row, f"{row.attempts} attempts used")
            return False
        owner, boot = self.owner
        lease = self._clock() + self.settings.lease_secs
        self._update(row, "attempting", attempts=row.attempts + 1, owner_instance=owner,
                     owner_boot=boot, lease_expires_at=lease)  # fmt: skip
        return True

    def settle(self, row: Obligation, result: SendResult) -> bool:
        """Record a claimed row's send: delivered (row deleted) or failed with its kind."""
        if result.ok:
            crash_point("sent")
            try:
                self.rows.delete_obligation(row.obligation_id)
            except StoreError as exc:
                logger.error("delivery ledger: could not mark a reply delivered: %s", exc)
                return True
            self._transition(row, "delivered")
            crash_point("delivered")
            return True
        kind = result.failure_kind or "rejected"
        self._update(row, "failed", failure_kind=kind, last_error=result.error)
        return False

    def abandon(self, row: Obligation, reason: str) -> None:
        """Give up on a reply without sending it."""
        logger.warning("delivery ledger: abandoned a reply for %s (%s)", row.session_key, reason)
        self._update(row, "abandoned", last_error=reason)

    def _stale(self, row: Obligation) -> bool:
        age = self._clock() - row.created_at
        if age <= self.settings.stale_reply_max_age_secs:
            return False
        logger.warning(
            "delivery ledger: not sending a reply for %s: it is %.0f s old, over "
            "gateway.delivery_ledger.stale_reply_max_age_secs",
            row.session_key, age,
        )  # fmt: skip
        self._update(row, "abandoned", last_error=f"stale: {age:.0f} s old")
        return True

    def boot_sweep(
        self,
        platforms: Iterable[str],
        send: SendFunction,
        settled: Callable[[str], object] | None = None,
    ) -> SweepReport:
        """Deliver what the previous boot left (SPEC §7.5 boot sweep) for connected platforms.

        Rows found ``attempting`` or ``failed``, and every crash-recorded reply, carry the restart
        prefix; ``pending`` rows are sent plainly. ``settled(session_key)`` runs after each send
        attempt (the store's ``clear_resume_pending``) so the turn is not rerun too.
        """
        return self._sweep(
            self.rows.obligations(("pending", "attempting", "failed"), list(platforms)),
            send, settled, boot=True,
        )  # fmt: skip

    def retry_failed(
        self, platform: str, send: SendFunction, *, rate_limited: bool = False
    ) -> SweepReport:
        """After a reconnect (or a rate-limit back-off): retry that platform's failed rows."""
        rows = [
            row for row in self.rows.obligations(("failed",), [platform])
            if (row.failure_kind == "rate_limited") == rate_limited
        ]  # fmt: skip
        return self._sweep(rows, send, None, boot=False)

    def _sweep(
        self,
        rows: Sequence[Obligation],
        send: SendFunction,
        settled: Callable[[str], object] | None,
        *,
        boot: bool,
    ) -> SweepReport:
        delivered: list[str] = []
        failed: list[str] = []
        abandoned: list[str] = []
        for row in rows:
            if self._stale(row):
                abandoned.append(row.obligation_id)
                continue
            if row.attempts >= self.settings.max_attempts:
                self.abandon(row, f"{row.attempts} attempts used")
                abandoned.append(row.obligation_id)
                continue
            prefix = self._prefix(row, boot=boot)
            outcome = delivered if self.deliver(row, send, prefix) else failed
            outcome.append(row.obligation_id)
            if settled is not None:
                settled(row.session_key)
        return SweepReport(tuple(delivered), tuple(failed), tuple(abandoned))

    @staticmethod
    def _prefix(row: Obligation, *, boot: bool) -> str | None:
        if boot:
            ambiguous = row.state in ("attempting", "failed") or row.origin_kind == "crash"
            return RESTART_PREFIX if ambiguous else None
        return RATE_LIMIT_PREFIX if row.failure_kind == "rate_limited" else RECONNECT_PREFIX

    def housekeeping(self) -> int:
        """Abandon stale rows, then apply retention and the row cap; returns rows pruned."""
        for row in self.rows.obligations(("pending", "failed")):
            self._stale(row)
        retention = self.settings.retention_days * 86_400
        return self.rows.prune_obligations(self._clock() - retention, self.settings.max_rows)
