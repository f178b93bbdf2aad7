"""Commands that change lanes and the queue (``reset``, ``suspend``, ``resume``, ``requeue``,
``drop``, ``prune``, ``import-sessions-json``) and ``recover --dry-run``. The writing ones open
the store for writing, which a running gateway's writer lock refuses (one clear line)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from hermes_core.cli.common import (
    UnknownLaneError,
    find_lane,
    open_operator,
    open_store,
    print_json,
    progress,
)
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import InvalidValueError
from hermes_core.domain.timeutil import checked_span
from hermes_core.state.files import read_file_nofollow
from hermes_core.state.instance import LOCK_FILE, lock_holder, read_clean_shutdown
from hermes_core.store import SessionStore
from hermes_core.turns.recovery import STUCK_LOOP_THRESHOLD, last_reply, marker_max_age


def register(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Add the lane, queue and recovery commands."""
    for name, help_text, handler in (
        ("reset", "end a lane's session; its next message starts a new one", reset_command),
        ("suspend", "suspend a lane: its next message starts a new session", suspend_command),
        ("resume", "clear a lane's suspension", resume_command),
    ):
        command = commands.add_parser(name, parents=parents, help=help_text, allow_abbrev=False)
        command.add_argument("lane", metavar="KEY|SESSION_ID")
        command.add_argument("--json", action="store_true", help="print one JSON object")
        command.set_defaults(handler=handler)
    for name, help_text, handler in (
        ("requeue", "put dead-lettered events back in their lane's queue", requeue_command),
        ("drop", "delete dead-lettered events", drop_command),
    ):
        command = commands.add_parser(name, parents=parents, help=help_text, allow_abbrev=False)
        command.add_argument("event_ids", metavar="EVENT_ID", type=int, nargs="*")
        command.add_argument("--all", action="store_true", help="every dead-lettered event")
        command.add_argument("--json", action="store_true", help="print one JSON object")
        command.set_defaults(handler=handler)

    prune = commands.add_parser(
        "prune", parents=parents, help="remove lanes idle for N days (sessions stay)",
        allow_abbrev=False,
    )  # fmt: skip
    prune.add_argument("--days", type=float, required=True, metavar="N")
    prune.add_argument("--dry-run", action="store_true", help="list them, remove nothing")
    prune.add_argument("--json", action="store_true", help="print one JSON object")
    prune.set_defaults(handler=prune_command)

    imported = commands.add_parser(
        "import-sessions-json", parents=parents, allow_abbrev=False,
        help="add the lanes of a sessions.json that the routing table lacks",
    )  # fmt: skip
    imported.add_argument("path", metavar="PATH", type=Path)
    imported.add_argument("--json", action="store_true", help="print one JSON object")
    imported.set_defaults(handler=import_command)

    recover = commands.add_parser(
        "recover", parents=parents, allow_abbrev=False,
        help="what the next gateway start-up would recover (writes nothing)",
    )  # fmt: skip
    recover.add_argument(
        "--dry-run", action="store_true", help="required: recovery itself is what a gateway "
        "does when it starts"
    )  # fmt: skip
    recover.add_argument("--json", action="store_true", help="print one JSON object")
    recover.set_defaults(handler=recover_command)


def _report(args: argparse.Namespace, data: dict[str, Any], line: str) -> int:
    if args.json:
        print_json(data)
    else:
        print(line)
    return 0


def reset_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``reset KEY``: a new session for the lane."""
    with open_store(config, write=True) as store:
        entry = find_lane(store, args.lane)
        created = store.reset_session(entry.session_key)
    assert created is not None  # the lane exists: the writer lock keeps it so
    data = {"session_key": entry.session_key, "ended": entry.session_id,
            "session_id": created.session_id}  # fmt: skip
    return _report(args, data, f"{entry.session_key}: {entry.session_id} -> {created.session_id}")


def suspend_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``suspend KEY``."""
    return _set_suspended(args, config, True)


def resume_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``resume KEY``: clear the suspension."""
    return _set_suspended(args, config, False)


_SUSPENSION_TEXT = {
    (True, True): "suspended",
    (True, False): "was already suspended",
    (False, True): "no longer suspended",
    (False, False): "was not suspended",
}
"""What ``suspend`` / ``resume`` say, by (the flag asked for, whether it changed)."""


def _set_suspended(args: argparse.Namespace, config: GatewayConfig, suspended: bool) -> int:
    """Suspend or resume the lane ``args`` names; both report ``{session_key, suspended,
    changed}`` (the flag afterwards, and whether this run changed it)."""
    with open_store(config, write=True) as store:
        entry = find_lane(store, args.lane)
        changed = entry.suspended != suspended  # the writer lock keeps the lane as read
        if changed:
            (store.suspend_session if suspended else store.unsuspend_session)(entry.session_key)
    line = f"{entry.session_key}: " + _SUSPENSION_TEXT[suspended, changed]
    data = {"session_key": entry.session_key, "suspended": suspended, "changed": changed}
    return _report(args, data, line)


def _dead_letter_ids(args: argparse.Namespace, config: GatewayConfig) -> list[int]:
    """The dead letters named (or all with ``--all``); an id that is none is an error."""
    if bool(args.event_ids) == bool(args.all):
        raise InvalidValueError("event_ids", "name dead-lettered event ids or give --all.")
    with open_store(config, write=False) as store:
        dead = [letter.event_id for letter in store.dead_letters()]
    if args.all:
        return dead
    unknown = sorted(set(args.event_ids) - set(dead))
    if unknown:
        raise UnknownLaneError(
            f"no dead-lettered event has the id {unknown[0]}; `hermes-sessions ls "
            "--dead-lettered` and `show KEY` list them."
        )
    return list(args.event_ids)


def requeue_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``requeue EVENT_ID... | --all``."""
    return _dead_letters(args, config, "requeued")


def drop_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``drop EVENT_ID... | --all``."""
    return _dead_letters(args, config, "dropped")


def _dead_letters(args: argparse.Namespace, config: GatewayConfig, done: str) -> int:
    """Requeue or drop the dead-lettered events ``args`` names, reporting what was ``done``."""
    ids = _dead_letter_ids(args, config)
    backend = open_operator(config, write=True)
    try:
        change = backend.revive_queued if done == "requeued" else backend.remove_queued
        count = change(ids)
    finally:
        backend.close()
    return _report(args, {done: ids}, f"{done} {count} event(s)")


def prune_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``prune --days N [--dry-run]``: routing entries only; sessions and messages stay."""
    days = checked_span(args.days, "--days")
    if args.dry_run:
        backend = open_operator(config, write=False)
        try:
            keys = backend.prune_candidates(time.time() - days * 86_400)
        finally:
            backend.close()
    else:
        with (
            open_store(config, write=True) as store,
            progress("prune: idle lanes examined", 0, quiet=args.json) as bar,
        ):
            keys = store.prune_idle_lanes(days, progress=bar.advance)
    verb = "would remove" if args.dry_run else "removed"
    data = {"lanes": keys, "count": len(keys), "dry_run": args.dry_run}
    return _report(args, data, "\n".join([*keys, f"{verb} {len(keys)} lane(s)"]))


def import_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``import-sessions-json PATH``."""
    if not args.path.is_file():
        raise InvalidValueError("path", f"{args.path}: no such file; name a sessions.json.")
    with (
        open_store(config, write=True) as store,
        progress("import-sessions-json", 0, quiet=args.json) as bar,
    ):
        imported = store.import_sessions_json(args.path, strict=True, progress=bar.told)
    return _report(args, {"imported": imported}, f"imported {imported} lane(s)")


def _previous_boot(home: Path) -> str | None:
    try:
        record = json.loads(read_file_nofollow(home / LOCK_FILE) or b"{}")
    except (OSError, ValueError):
        return None
    boot = record.get("boot_id") if isinstance(record, dict) else None
    return boot if isinstance(boot, str) else None


def recovery_plan(store: SessionStore, config: GatewayConfig) -> dict[str, Any]:
    """What the next start-up's recovery would do to this store, computed without writing."""
    home = config.hermes_home
    clean = read_clean_shutdown(home, _previous_boot(home))
    markers = store._turns.entries_with_fresh_markers(marker_max_age(config))
    fresh = {entry.session_key: entry for entry in markers}
    ledger = store._obligations.ledger
    resume, replies, cleared = [], [], []
    if not clean:
        for key, entry in fresh.items():
            started = entry.active_turn_started_at
            if entry.suspended or started is None:
                continue
            if ledger is not None and entry.origin is not None:
                if ledger.rows.obligation_since(key, started.timestamp()):
                    cleared.append(key)
                    continue
                reply, _ = last_reply(store.load_transcript(entry.session_id))
                if reply is not None and float(reply.get("timestamp", 0)) >= started.timestamp():
                    replies.append(key)
                    continue
            resume.append(key)
    pending = [e.session_key for e in store.list_sessions() if e.resume_pending]
    counts = store._counts.current.load()
    suspend = [key for key in resume if counts.get(key, 0) + 1 >= STUCK_LOOP_THRESHOLD]
    owed = ledger.rows.obligations(("pending", "attempting", "failed")) if ledger else []
    return {
        "last_stop_clean": clean,
        "markers_discarded": len(store._turns.entries_with_fresh_markers(0)) if clean else 0,
        "resume": sorted(set(resume) - set(suspend) | set(pending)),
        "record_crash_left_replies": replies,
        "markers_already_ledgered": cleared,
        "resend": [
            {"session_key": row.session_key, "state": row.state, "content": row.content}
            for row in owed
        ],
        "suspend": suspend,
        "queued_events": len(store._queue.restore()),
        "fts_rebuild": store.health()["fts"] == "stale",
        "gateway_running": lock_holder(home),
    }


def recover_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``recover --dry-run``."""
    if not args.dry_run:
        raise InvalidValueError(
            "dry_run", "recovery runs when a gateway starts, so `recover` only shows what the "
            "next start-up would recover: run `hermes-sessions recover --dry-run`, or start the "
            "gateway to recover."
        )  # fmt: skip
    with open_store(config, write=False) as store:
        plan = recovery_plan(store, config)
    if args.json:
        print_json(plan)
        return 0
    lines = []
    if plan["gateway_running"] is not None:
        lines.append(f"a gateway (pid {plan['gateway_running']}) is running; it recovered at "
                     "its own start-up, this is what a restart would do now")  # fmt: skip
    if plan["last_stop_clean"]:
        lines.append(f"last stop: clean; {plan['markers_discarded']} turn marker(s) discarded")
    else:
        lines.append("last stop: unclean (crash recovery runs)")
    lines += [f"resume: {key}" for key in plan["resume"]]
    lines += [f"record stored reply: {key}" for key in plan["record_crash_left_replies"]]
    lines += [f"re-send ({row['state']}): {row['session_key']}" for row in plan["resend"]]
    lines += [f"suspend (stuck loop): {key}" for key in plan["suspend"]]
    lines.append(f"queued events to restore: {plan['queued_events']}")
    if plan["fts_rebuild"]:
        lines.append("rebuild the full-text index")
    print("\n".join(lines))
    return 0
