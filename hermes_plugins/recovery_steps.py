"""Built-in recovery steps that keep the store's derived and fallback data in step (SPEC §7.2).

``jsonl_backlog_replay`` (100) imports messages stored while the SQL store was unavailable;
``fts_rebuild_if_stale`` (200) rebuilds the full-text index after it failed open.
"""

from __future__ import annotations

from hermes_core import GatewayConfig, RecoveryContext, RecoveryStep, hookimpl


def jsonl_backlog_replay(context: RecoveryContext) -> None:
    """Replay the JSONL backlog into SQL (no-op while still degraded)."""
    report = context.store.replay_backlog()
    if report is not None:
        context.report["jsonl_backlog_replay"] = {
            "files": report.files_replayed,
            "messages": report.messages_imported,
            "routes": report.routes_inserted + report.routes_updated,
            "skipped": [name for name, _reason in report.skipped],
        }


def fts_rebuild_if_stale(context: RecoveryContext) -> None:
    """Rebuild the full-text index when a failed write left it stale."""
    if context.store.health()["fts"] == "stale":
        context.report["fts_rebuild_if_stale"] = context.store.rebuild_search_index()


@hookimpl
def hermes_register_recovery_steps(config: GatewayConfig) -> list[RecoveryStep]:
    """The store-maintenance steps; the crash-recovery steps follow from order 300."""
    return [
        RecoveryStep(name="jsonl_backlog_replay", order=100, run=jsonl_backlog_replay),
        RecoveryStep(name="fts_rebuild_if_stale", order=200, run=fts_rebuild_if_stale),
    ]
