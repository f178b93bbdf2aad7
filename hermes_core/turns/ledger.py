"""The delivery ledger: every final reply is recorded before its first send,
so a crash never loses an owed reply, and every ambiguous re-send carries a visible prefix.

States: ``pending`` → ``attempting`` (written just before the platform call; a turn's reply is
recorded already claimed) → delivered (the row is deleted) | ``failed`` | ``abandoned``. The
ledger is a helper of the store: it exists only while the SQL store is available and
``gateway.delivery_ledger.enabled`` is true; its failures are logged and swallowed, never
blocking a send. It decides what is owed and with which prefix; the runtime sends.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import time
import unicodedata
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from hermes_core.config.schema import DeliveryLedgerConfig
from hermes_core.domain.errors import StoreError
from hermes_core.domain.specs import LifecycleEvent

if TYPE_CHECKING:  # the store imports this module; annotations only
    from hermes_core.store.backend import LedgerRows, Obligation

logger = logging.getLogger(__name__)

RESTART_PREFIX = (
    "♻️ Recovered reply — the gateway restarted during delivery, so this may be a duplicate:"
)
TAKEOVER_PREFIX = (
    "♻️ Recovered reply — the gateway process answering this chat stopped responding during "
    "delivery and another one took over, so this may be a duplicate:"
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

FailureKind = Literal["rejected", "disconnected", "rate_limited", "crashed", "permanent"]
"""Why a send failed: ``rejected`` (the platform refused it; tried again at the next occasion
while attempts are left), ``disconnected`` (no connection), ``rate_limited`` (tried again after
``SendResult.retry_after``), ``crashed`` (the process died mid-send), ``permanent`` (it can never
be delivered, e.g. the bot is blocked or the chat is gone: abandoned at once)."""
_SPACES = re.compile(r"\s+")


def is_silent_reply(text: object) -> bool:
    """Whether a reply is only a silence marker: 1-64 characters after trimming whose
    upper-cased, whitespace-collapsed form is a marker, also after stripping leading and trailing
    punctuation other than square brackets (so ``[SILENT`` never becomes ``SILENT``)."""
    if not isinstance(text, str):
        return False
    trimmed = text.strip()
    if not 1 <= len(trimmed) <= 64:
        return False
    form, stripped = _marker_forms(trimmed)
    return form in SILENT_MARKERS or stripped in SILENT_MARKERS


def could_become_silent(text: str) -> bool:
    """Whether a reply written so far may still end as silence only: nothing but whitespace
    yet, or at most 64 characters that a marker starts with (in either form of
    :func:`is_silent_reply`). A streamed reply is not shown while this holds."""
    trimmed = text.strip()
    if len(trimmed) > 64:
        return False
    forms = _marker_forms(trimmed)
    return any(marker.startswith(form) for marker in SILENT_MARKERS for form in forms)


def _marker_forms(trimmed: str) -> tuple[str, str]:
    """A trimmed text upper-cased with its whitespace collapsed, and that form without its
    leading and trailing punctuation (square brackets kept)."""
    form = _SPACES.sub(" ", trimmed.upper())
    start, end = 0, len(form)
    while start < end and _strippable(form[start]):
        start += 1
    while end > start and _strippable(form[end - 1]):
        end -= 1
    return form, form[start:end].strip()


def _strippable(char: str) -> bool:
    return char not in "[]" and unicodedata.category(char).startswith("P")


def obligation_id(session_key: str, message_ref: str, content: str) -> str:
    """SHA-256 hex of ``<session_key>|<message_ref>|<content>``: re-recording is a no-op."""
    return hashlib.sha256(f"{session_key}|{message_ref}|{content}".encode()).hexdigest()


@dataclass(frozen=True)
class SendResult:
    """What the host's send function reports: success, or a failure kind."""

    ok: bool
    failure_kind: FailureKind | None = None
    error: str | None = None
    retry_after: float | None = None
    """For ``rate_limited``: the seconds the platform asked to wait, when it said."""


Occasion = Literal["boot", "takeover", "reconnect", "rate_limit"]
"""When owed replies are sent outside their turn (see :meth:`DeliveryLedger.due`)."""


class DeliveryLedger:
    """Claims, sends and settles ledger rows through the store's SQL backend."""

    def __init__(
        self,
        rows: LedgerRows,
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
                    detail={
                        "obligation_id": row.obligation_id, "state": state,
                        "platform": row.platform, **detail,
                    },
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
        kind = changes.get("failure_kind")
        self._transition(row, state, **({"failure_kind": kind} if kind else {}))

    def claim_state(self, attempts: int = 1, marked_sends: int = 0) -> dict[str, Any]:
        """The fields of a row claimed now: ``attempting`` with ``attempts`` spent (and
        ``marked_sends``), owned by this instance for the lease."""
        owner, boot = self.owner
        now = self._clock()
        return {
            "state": "attempting", "attempts": attempts, "owner_instance": owner,
            "owner_boot": boot, "lease_expires_at": now + self.settings.lease_secs,
            "updated_at": now, "marked_sends": marked_sends,
        }  # fmt: skip

    def claimed(self, row: Obligation, *, marked: bool = False) -> Obligation:
        """``row`` as it is once claimed: one more attempt spent (a ``marked`` one when the
        send carries a duplicate prefix), see :meth:`claim_state`."""
        claim = self.claim_state(row.attempts + 1, row.marked_sends + int(marked))
        return dataclasses.replace(row, **claim)

    def claim(self, row: Obligation, *, marked: bool = False) -> Obligation | None:
        """Mark a row ``attempting`` just before the platform call, spending an attempt; the
        claimed row, or None (the row abandoned) when no attempt is left."""
        if row.attempts >= self.settings.max_attempts:
            self.abandon(row, f"{row.attempts} attempts used")
            return None
        claimed = self.claimed(row, marked=marked)
        self._update(
            row, "attempting", attempts=claimed.attempts, owner_instance=claimed.owner_instance,
            owner_boot=claimed.owner_boot, lease_expires_at=claimed.lease_expires_at,
            updated_at=claimed.updated_at, marked_sends=claimed.marked_sends,
        )  # fmt: skip
        return claimed

    def settle(
        self,
        row: Obligation,
        result: SendResult,
        delete: Callable[[str], object] | None = None,
    ) -> bool:
        """Record a claimed row's send: delivered (row deleted, by ``delete`` when given: the
        store may fold the delete into another statement) or failed with its kind. True when
        the platform accepted it."""
        if result.ok:
            try:
                (delete or self.rows.delete_obligation)(row.obligation_id)
            except StoreError as exc:
                logger.error("delivery ledger: could not mark a reply delivered: %s", exc)
                return True
            self._transition(row, "delivered")
            return True
        kind = result.failure_kind or "rejected"
        state = "abandoned" if kind == "permanent" else "failed"
        if state == "abandoned":
            logger.warning(
                "delivery ledger: abandoned a reply for %s: the platform will never accept it "
                "(%s)", row.session_key, result.error or "permanent failure",
            )  # fmt: skip
        self._update(row, state, failure_kind=kind, last_error=result.error)
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

    def due(
        self,
        occasion: Occasion,
        platforms: Sequence[str],
        skip: Container[str] = (),
        lanes: Callable[[str], bool] | None = None,
    ) -> list[tuple[Obligation, str | None]]:
        """The rows to send now on ``platforms``, each with the prefix it needs, for one of the
        occasions below; stale rows and rows without an attempt left are abandoned here.

        - ``boot``: what the previous process left; ``attempting`` and ``failed`` rows
          (rate-limited ones too: their retry timer died with that process) and crash-recorded
          replies carry the restart prefix, ``pending`` rows go plainly;
        - ``takeover``: the same for a lane taken over from another process of a shared store
          that let its lease expire, with the takeover prefix (nothing here restarted);
        - ``reconnect``: a platform (re)connected: ``pending`` rows go plainly, ``attempting``
          and ``failed`` ones (not rate-limited: this process's timer retries those) with the
          reconnect prefix;
        - ``rate_limit``: rate-limited rows, with the rate-limit prefix.

        ``skip`` holds the obligation ids being sent right now (never sent twice at once);
        ``lanes``, when given, says which lanes' rows to consider (a shared store's holder).
        """
        states = ("failed",) if occasion == "rate_limit" else ("pending", "attempting", "failed")
        plan: list[tuple[Obligation, str | None]] = []
        for row in self.rows.obligations(states, list(platforms)):
            limited = row.state == "failed" and row.failure_kind == "rate_limited"
            if row.obligation_id in skip or (limited and occasion == "reconnect"):
                continue
            if occasion == "rate_limit" and not limited:
                continue
            if lanes is not None and not lanes(row.session_key):
                continue
            if self._stale(row):
                continue
            if row.state == "attempting" and row.marked_sends:
                # A marked re-send was under way when its process died: it may have arrived,
                # and a reply arrives at most once plainly and once marked.
                self.abandon(row, "a marked re-send may already have arrived")
                continue
            if row.attempts >= self.settings.max_attempts:
                self.abandon(row, f"{row.attempts} attempts used")
                continue
            plan.append((row, self._prefix(row, occasion)))
        return plan

    @staticmethod
    def _prefix(row: Obligation, occasion: Occasion) -> str | None:
        if occasion == "rate_limit":
            return RATE_LIMIT_PREFIX
        if row.state == "pending" and row.origin_kind != "crash":
            return None
        if occasion == "boot":
            return RESTART_PREFIX
        return TAKEOVER_PREFIX if occasion == "takeover" else RECONNECT_PREFIX

    def housekeeping(self, delete: Callable[[list[str]], int] | None = None) -> int:
        """Abandon stale rows, then apply retention and the row cap; returns rows pruned. The
        rows to prune are read first, then handed to ``delete`` (the store's deletes them in
        short writer steps; by default they go in one transaction)."""
        for row in self.rows.obligations(("pending", "failed")):
            self._stale(row)
        retention = self.settings.retention_days * 86_400
        doomed = self.rows.obligations_to_prune(self._clock() - retention, self.settings.max_rows)
        return (delete or self.rows.delete_terminal_obligations)(doomed)
