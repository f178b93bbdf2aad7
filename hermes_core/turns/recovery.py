"""Start-up and shutdown of a gateway's persistent state.

:class:`GatewayState` takes the instance lock, opens the store and runs the recovery steps at
start-up; at a graceful stop it runs the shutdown steps, closes the store and writes
``.clean_shutdown`` only after a drain that finished in time. The crash-recovery logic the
built-in steps use lives here too, so hosts and tests can call it directly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import HermesError
from hermes_core.domain.specs import LifecycleEvent, RecoveryContext, RecoveryStep
from hermes_core.plugins.manager import HermesPluginManager, default_plugin_manager
from hermes_core.state.instance import InstanceLock, read_clean_shutdown, write_clean_shutdown
from hermes_core.store import SessionStore
from hermes_core.turns.crashpoints import arm, crash_point
from hermes_core.turns.ledger import SILENCE_NOTICE, is_silent_reply

logger = logging.getLogger(__name__)

STUCK_LOOP_THRESHOLD = 3
INTERNAL_NOTIFICATION = "internal_notification"


class RecoveryAbortedError(HermesError):
    """A critical recovery step failed: the gateway must not start (or stop cleanly)."""


def marker_max_age(config: GatewayConfig) -> float:
    """Markers older than ``max(3600, 2 * agent.gateway_timeout)`` seconds are stale."""
    return max(3600.0, 2 * config.agent.gateway_timeout)


def run_recovery_steps(
    steps: list[RecoveryStep], context: RecoveryContext, plugins: HermesPluginManager
) -> None:
    """Run ``steps`` in order: a failing step is logged with its name and the next one runs,
    unless it is critical, which raises :class:`RecoveryAbortedError`."""
    results = context.report.outcomes
    for step in steps:
        try:
            step.run(context)
        except Exception as exc:
            results[step.name] = f"failed: {exc}"
            logger.error("recovery step %s failed: %s", step.name, exc, exc_info=exc)
            outcome = "failed"
            if step.critical:
                _notify_step(plugins, step, outcome)
                raise RecoveryAbortedError(f"recovery step {step.name} failed: {exc}") from exc
        else:
            results[step.name] = outcome = "ok"
        _notify_step(plugins, step, outcome)


def _notify_step(plugins: HermesPluginManager, step: RecoveryStep, outcome: str) -> None:
    if plugins.observing:
        plugins.notify(
            LifecycleEvent(kind="recovery_step", detail={"step": step.name, "outcome": outcome})
        )


def record_crash_left_replies(
    store: SessionStore,
    config: GatewayConfig,
    diagnostic_muted: Callable[[str, str], bool] | None = None,
    lanes: Collection[str] | None = None,
) -> dict[str, str]:
    """Before markers are turned into resumes, find turns whose reply was stored but
    never recorded for delivery, and record it (origin ``crash``) so the turn is not rerun.

    Returns what happened per session key: ``ledgered`` (a ledger row already covers it),
    ``recorded``, ``silence_notice``, ``nothing_owed``; lanes not listed keep their marker and
    resume once. Without a ledger nothing is recorded. ``lanes``: only these (default: every
    lane, on a shared store every lane this process holds).
    """
    ledger = store._obligations.ledger
    if ledger is None:
        return {}
    outcome: dict[str, str] = {}
    max_age = marker_max_age(config)
    for entry in store._turns.entries_with_fresh_markers(max_age, lanes):
        key, token, started = (
            entry.session_key,
            entry.active_turn_token,
            entry.active_turn_started_at,
        )
        if entry.suspended or entry.origin is None or token is None or started is None:
            continue
        if ledger.rows.obligation_since(key, started.timestamp()):
            store.clear_turn_active(key, token)
            outcome[key] = "ledgered"
            continue
        reply, user = last_reply(store.load_transcript(entry.session_id))
        if reply is None or float(reply.get("timestamp", 0)) < started.timestamp():
            continue
        text = reply["content"]
        machinery = user is not None and user.get("display_kind") == INTERNAL_NOTIFICATION
        muted = diagnostic_muted is not None and diagnostic_muted(key, text)
        if machinery and (is_silent_reply(text) or muted):
            store.clear_turn_active(key, token)
            outcome[key] = "nothing_owed"
            continue
        content = SILENCE_NOTICE if is_silent_reply(text) else text
        origin = entry.origin
        answers = user.get("platform_message_id") if user is not None else None
        recorded = store._turns.record_delivery_obligation(
            key, entry.session_id, origin.platform, origin.chat_id, origin.thread_id, content,
            f"crash:{token}", reply_to_message_id=str(answers) if answers else None,
            turn_token=token, origin_kind="crash",
        )  # fmt: skip
        if recorded is not None:
            outcome[key] = "silence_notice" if content == SILENCE_NOTICE else "recorded"
    return outcome


def last_reply(
    messages: list[dict[str, Any]],
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The last visible message if it is an assistant reply with text and no tool calls (and
    the user row before it)."""
    visible = [m for m in messages if m.get("role") not in ("system", "session_meta")]
    if not visible:
        return None, None
    last = visible[-1]
    if (
        last.get("role") != "assistant"
        or last.get("tool_calls")
        or not isinstance(last.get("content"), str)
    ):
        return None, None
    user = next((m for m in reversed(visible[:-1]) if m.get("role") == "user"), None)
    return last, user


@dataclass
class GatewayState:
    """The lock, the store and the recovery report of one gateway process."""

    config: GatewayConfig
    plugins: HermesPluginManager | None = None
    has_active_processes_fn: Callable[[str], bool] | None = None
    diagnostic_muted: Callable[[str, str], bool] | None = None
    """The host callback the ``clean_shutdown`` step consults (see :class:`RecoveryContext`)."""
    queue_restore: Callable[[], int] | None = None
    """The gateway's queue reload the ``queue_restore`` step calls."""
    lock: InstanceLock | None = None
    store: SessionStore | None = None
    context: RecoveryContext | None = None

    def start(self) -> SessionStore:
        """The first steps of a start: lock, open the store, run the start-up recovery steps."""
        arm()
        plugins = self.plugins or default_plugin_manager(self.config)
        self.plugins = plugins
        home = self.config.hermes_home
        self.lock = InstanceLock.acquire(home)
        try:
            self.store = SessionStore.open(
                self.config, has_active_processes_fn=self.has_active_processes_fn, plugins=plugins
            )
            self.store._leases.claim_orphaned_lanes()  # a shared store: recovery touches only these
            clean = read_clean_shutdown(home, self.lock.previous_boot_id)
            self.context = RecoveryContext(
                store=self.store, config=self.config, last_stop_clean=clean,
                diagnostic_muted=self.diagnostic_muted, queue_restore=self.queue_restore,
            )  # fmt: skip
            run_recovery_steps(plugins.recovery_steps("startup"), self.context, plugins)
        except BaseException:
            self._release()
            raise
        crash_point("recovery_done")
        return self.store

    def stop(self, *, drained: bool) -> bool:
        """Run the shutdown steps, close the store and, iff the drain finished in time and no
        critical step failed, write ``.clean_shutdown``; then release the lock. Returns whether
        the stop was recorded as clean."""
        clean = drained
        try:
            if self.plugins is not None and self.context is not None:
                try:
                    steps = self.plugins.recovery_steps("shutdown")
                    run_recovery_steps(steps, self.context, self.plugins)
                except RecoveryAbortedError:
                    clean = False
            if self.store is not None:
                self.store.close()
            if clean and self.lock is not None:
                write_clean_shutdown(self.config.hermes_home, self.lock.boot_id)
                crash_point("clean_shutdown_written")
        finally:
            self._release()
        return clean

    def _release(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.lock is not None:
            self.lock.release()
