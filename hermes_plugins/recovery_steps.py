"""Built-in recovery steps, run once per start in this order:

- 100 ``jsonl_backlog_replay``: import messages stored while SQL was unavailable;
- 200 ``fts_rebuild_if_stale``: rebuild a full-text index that failed open;
- 300 ``clean_shutdown`` (critical): after a clean stop discard the turn markers, else record
  crash-left replies and arm the interrupted turns;
- 400 ``stuck_loop`` (critical): count interrupted lanes; suspend those interrupted three
  starts in a row;
- 500 ``queue_restore``: reload the durable queues (through the runtime's ``queue_restore``
  callback; without a runtime it only counts the persisted events).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import replace

from hermes_core import GatewayConfig, RecoveryContext, RecoveryStep, hookimpl
from hermes_core.domain.specs import BacklogReplayResult, CrashRecoveryResult, StuckLoopResult
from hermes_core.state.instance import CLEAN_SHUTDOWN_FILE
from hermes_core.turns.recovery import (
    STUCK_LOOP_THRESHOLD,
    RecoveryAbortedError,
    marker_max_age,
    record_crash_left_replies,
)

logger = logging.getLogger(__name__)


def jsonl_backlog_replay(context: RecoveryContext) -> None:
    """Replay the JSONL backlog into SQL (no-op while still degraded)."""
    report = context.store._fallback.replay_backlog()
    if report is not None:
        context.report.backlog = BacklogReplayResult(
            files=report.files_replayed,
            messages=report.messages_imported,
            routes=report.routes_inserted + report.routes_updated,
            skipped=tuple(name for name, _reason in report.skipped),
        )


def fts_rebuild_if_stale(context: RecoveryContext) -> None:
    """Rebuild the full-text index when a failed write left it stale."""
    if context.store.health()["fts"] == "stale":
        context.report.search_index_rebuilt = context.store.rebuild_search_index()


def clean_shutdown(context: RecoveryContext) -> None:
    """After a clean stop discard the turn markers (durably) and only then delete the marker
    file, failing closed; after a crash record crash-left replies, then arm interrupted turns.
    On a shared store the lanes start-up found without a lease get the crash treatment either
    way: a clean stop of this instance says nothing about the process that left their markers."""
    store, config = context.store, context.config
    marker = config.hermes_home / CLEAN_SHUTDOWN_FILE
    if not context.last_stop_clean:
        context.report.crash_recovery = _recover(context, None, CrashRecoveryResult(clean=False))
        marker.unlink(missing_ok=True)  # an invalid or foreign marker proves nothing; drop it
        return
    logger.info("Previous gateway exited cleanly — skipping crash recovery")
    try:
        discarded = store._turns.discard_active_turn_markers()
        marker.unlink()
    except Exception as exc:
        raise RecoveryAbortedError("clean-start recovery cleanup failed") from exc
    report = CrashRecoveryResult(clean=True, markers_discarded=discarded)
    foreign = store._leases.found_unleased()
    context.report.crash_recovery = _recover(context, foreign, report) if foreign else report


def _recover(
    context: RecoveryContext, lanes: Collection[str] | None, report: CrashRecoveryResult
) -> CrashRecoveryResult:
    """Crash recovery of ``lanes`` (None: every lane this instance holds): record crash-left
    replies, then arm the interrupted turns; ``report`` with what was done."""
    store, config = context.store, context.config
    replies = record_crash_left_replies(store, config, context.diagnostic_muted, lanes=lanes)
    recovered = store._turns.recover_turn_markers(marker_max_age(config), lanes=lanes)
    return replace(
        report,
        crash_left_replies=replies,
        armed=tuple(recovered.armed),
        kept=tuple(recovered.kept),
        markers_cleared=recovered.cleared,
        interrupted=tuple(recovered.struck),
    )


def stuck_loop(context: RecoveryContext) -> None:
    """Count this start's interrupted lanes (others drop to zero), durably, before any resume;
    a lane reaching three is suspended so its next message starts a fresh session."""
    crash = context.report.crash_recovery
    interrupted = crash.interrupted if crash is not None else ()
    counts = context.store._counts.open()
    previous = counts.load()
    updated = {key: previous.get(key, 0) + 1 for key in interrupted}
    suspended = []
    for key, count in list(updated.items()):
        if count < STUCK_LOOP_THRESHOLD:
            continue
        entry = context.store.lookup_by_session_key(key)
        if entry is not None and not entry.suspended:
            context.store.suspend_session(key)
            logger.warning(
                "Auto-suspended stuck session %s after %d interrupted restarts",
                key, STUCK_LOOP_THRESHOLD,
            )  # fmt: skip
            suspended.append(key)
            del updated[key]
    counts.save(updated)
    context.report.stuck_loop = StuckLoopResult(counts=updated, suspended=tuple(suspended))


def queue_restore(context: RecoveryContext) -> None:
    """Reload the events that were queued when the previous process stopped."""
    restore = context.queue_restore
    restored = restore() if restore is not None else len(context.store._queue.restore())
    context.report.queued_events_restored = restored


@hookimpl
def hermes_register_recovery_steps(config: GatewayConfig) -> list[RecoveryStep]:
    """The built-in steps; plugins may add their own around them."""
    return [
        RecoveryStep(name="jsonl_backlog_replay", order=100, run=jsonl_backlog_replay),
        RecoveryStep(name="fts_rebuild_if_stale", order=200, run=fts_rebuild_if_stale),
        RecoveryStep(name="clean_shutdown", order=300, run=clean_shutdown, critical=True),
        RecoveryStep(name="stuck_loop", order=400, run=stuck_loop, critical=True),
        RecoveryStep(name="queue_restore", order=500, run=queue_restore),
    ]
