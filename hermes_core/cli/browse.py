"""Reading commands: ``ls``, ``show``, ``search`` and ``export`` (written by :mod:`.exporting`).
Each opens the store read-only, so it works beside a running gateway."""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hermes_core.cli.common import (
    find_lane,
    iso,
    iso_times,
    lease_details,
    open_operator,
    open_store,
    print_json,
    print_table,
    say,
    short_time,
    stamp,
)
from hermes_core.cli.exporting import export_command, export_jobs
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import InvalidValueError
from hermes_core.domain.models import SessionEntry
from hermes_core.domain.timeutil import checked_span
from hermes_core.plugins.manager import platform_registry
from hermes_core.store import SessionStore
from hermes_core.store.operator import LaneFilter, OperatorBackend

OWED_STATES = ("pending", "attempting", "failed")
"""Ledger states of a reply still owed to a chat."""
SORTS = ("created", "key", "messages", "updated")
"""``ls --sort``: newest first by activity or creation, by key, most messages first."""
LS_PAGE = 500
"""The most lanes ``ls`` reads in one query."""
SEARCH_LIMIT = 100
"""The most hits ``search`` returns (the store's own bound)."""


def register(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Add ``ls``, ``show``, ``search`` and ``export``."""
    ls = commands.add_parser("ls", parents=parents, help="list lanes", allow_abbrev=False)
    ls.add_argument("--platform", help="only lanes of this platform")
    ls.add_argument(
        "--active", type=float, metavar="MINUTES", help="only lanes active in the last MINUTES"
    )
    ls.add_argument("--suspended", action="store_true", help="only suspended lanes")
    ls.add_argument("--resume-pending", action="store_true", help="only lanes owed a resume")
    ls.add_argument(
        "--dead-lettered", action="store_true", help="only lanes with dead-lettered events"
    )
    ls.add_argument("--sort", choices=SORTS, default="updated", help="default: updated")
    ls.add_argument("--limit", type=int, metavar="N", help="at most N lanes")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    ls.set_defaults(handler=ls_command)

    show = commands.add_parser(
        "show", parents=parents, help="a lane: entry, flags, queue, owed replies, transcript",
        allow_abbrev=False,
    )  # fmt: skip
    show.add_argument("lane", metavar="KEY|SESSION_ID")
    show.add_argument("--json", action="store_true", help="print one JSON object")
    show.set_defaults(handler=show_command)

    search = commands.add_parser(
        "search", parents=parents, help="full-text search of transcripts", allow_abbrev=False
    )
    search.add_argument("query", metavar="QUERY")
    search.add_argument("--session", metavar="SESSION_ID", help="only this session")
    search.add_argument(
        "--limit", type=int, default=20, metavar="N",
        help=f"at most N hits (1-{SEARCH_LIMIT}, default 20)",
    )  # fmt: skip
    search.add_argument("--json", action="store_true", help="print a JSON list")
    search.set_defaults(handler=search_command)

    export = commands.add_parser(
        "export", parents=parents, help="write every session and message as JSONL or Markdown",
        allow_abbrev=False,
    )  # fmt: skip
    export.add_argument("--format", choices=["jsonl", "markdown"], default="jsonl")
    export.add_argument("--output", "-o", metavar="FILE", type=Path, help="default: stdout")
    export.add_argument(
        "--jobs", type=int, default=export_jobs(), metavar="N",
        help="processes that read and encode the large tables of a jsonl export (default: "
        "the CPUs this process may use, at most 4; 1: this process alone)",
    )  # fmt: skip
    export.set_defaults(handler=export_command)


def lane_summary(entry: SessionEntry, message_count: int, dead: Counter[str]) -> dict[str, Any]:
    """One lane as ``ls --json`` prints it."""
    return {
        "session_key": entry.session_key,
        "session_id": entry.session_id,
        "platform": entry.platform,
        "chat_type": entry.chat_type,
        "created_at": entry.created_at.isoformat(),
        "updated_at": entry.updated_at.isoformat(),
        "suspended": entry.suspended,
        "resume_pending": entry.resume_pending,
        "resume_reason": entry.resume_reason,
        "turn_in_progress": entry.active_turn_token is not None,
        "message_count": message_count,
        "dead_letters": dead[entry.session_key],
    }


def listed_lanes(
    store: SessionStore, backend: OperatorBackend, lanes: LaneFilter, limit: int | None
) -> Iterator[dict[str, Any]]:
    """The lanes of ``lanes`` as ``ls`` prints them, at most ``limit``: read a page at a time
    in the database's order (a lane whose stored entry cannot be loaded is skipped, with the
    store's one warning), so the first page costs the same however many lanes are stored."""
    dead = Counter(letter.session_key for letter in store.dead_letters())
    after, wanted = None, limit
    while wanted is None or wanted > 0:
        size = LS_PAGE if wanted is None else min(wanted, LS_PAGE)
        page = backend.lane_rows(lanes, after, size)
        for row in page:
            entry = store._routes.parse(row.entry)
            if entry is not None:
                wanted = None if wanted is None else wanted - 1
                yield lane_summary(entry, row.message_count, dead)
        if len(page) < size:
            return
        after = page[-1].position


def _flags(lane: dict[str, Any]) -> str:
    flags = []
    if lane["suspended"]:
        flags.append("suspended")
    if lane["resume_pending"]:
        flags.append(f"resume-pending({lane['resume_reason']})")
    if lane["turn_in_progress"]:
        flags.append("turn-marker")
    if lane["dead_letters"]:
        flags.append(f"dead-letters({lane['dead_letters']})")
    return ",".join(flags) or "-"


def ls_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``ls``: lanes, newest first unless ``--sort`` says otherwise."""
    if args.limit is not None and args.limit < 1:
        raise InvalidValueError("limit", "--limit must be at least 1.")
    active = None if args.active is None else checked_span(args.active, "--active", "minutes")
    since = None if active is None else time.time() - active * 60
    lanes = LaneFilter(args.sort, args.platform, since, args.suspended, args.resume_pending,
                       args.dead_lettered)  # fmt: skip
    with open_store(config, write=False) as store:
        backend = open_operator(config, write=False, plugins=store.plugins)
        try:
            listed = list(listed_lanes(store, backend, lanes, args.limit))
        finally:
            backend.close()
        if args.platform is not None and not listed:  # a mistyped name is not "no lanes"
            platform_registry(store.plugins).require(args.platform, field="--platform")
    if args.json:
        print_json(listed)
        return 0
    if not listed:
        print("no lanes")
        return 0
    rows = [("KEY", "SESSION", "UPDATED", "MESSAGES", "FLAGS")]
    rows += [
        (lane["session_key"], lane["session_id"], short_time(lane["updated_at"]),
         str(lane["message_count"]), _flags(lane))
        for lane in listed
    ]  # fmt: skip
    print_table(rows)
    return 0


def lane_details(store: SessionStore, entry: SessionEntry) -> dict[str, Any]:
    """A lane as ``show --json`` prints it (its queue as stored, whichever process holds the
    lane; ``lease``: its turn lease on a shared store, else None)."""
    key = entry.session_key
    queued = [
        {"event_id": event_id, "text": event.text, "internal": event.internal}
        for event_id, _, event in store._queue.restore(key)
    ]
    dead = [
        {"event_id": letter.event_id, "attempts": letter.attempts, "last_error": letter.last_error,
         "dead_at": iso(letter.dead_at), "event": _event(letter.event_json)}
        for letter in store.dead_letters()
        if letter.session_key == key
    ]  # fmt: skip
    ledger = store._obligations.ledger
    owed = [
        {"obligation_id": row.obligation_id, "state": row.state, "attempts": row.attempts,
         "origin_kind": row.origin_kind, "content": row.content,
         "created_at": iso(row.created_at)}
        for row in (ledger.rows.obligations(OWED_STATES) if ledger is not None else [])
        if row.session_key == key
    ]  # fmt: skip
    return {
        "entry": entry.to_dict(),
        "lease": lease_details(store, key),
        "queued": queued,
        "dead_letters": dead,
        "owed_replies": owed,
        "transcript": _transcript(store, entry.session_id),
    }


def _transcript(store: SessionStore, session_id: str) -> list[dict[str, Any]]:
    """A session's active transcript as ``show --json`` prints it (ISO times)."""
    return [iso_times(message) for message in store.load_transcript(session_id)]


def _event(text: str) -> Any:
    """A dead letter's stored event, or None when it is not JSON (``doctor`` names it)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def session_details(store: SessionStore, session_id: str) -> dict[str, Any]:
    """A stored session that is no lane's current one (an ended session, as ``search``
    prints its id), as ``show --json`` prints it: the session, its lane's current session id
    (None when the lane is gone) and its transcript."""
    row = store.session_row(session_id)
    if row is None:
        find_lane(store, session_id)  # the one error for a name that is nothing stored
    assert row is not None
    lane = store.lookup_by_session_key(row.session_key)
    session = {"session_id": row.id, "session_key": row.session_key,
               "started_at": iso(row.started_at), "ended_at": iso(row.ended_at),
               "end_reason": row.end_reason, "message_count": row.message_count}  # fmt: skip
    return {
        "session": session,
        "lane_session_id": lane.session_id if lane is not None else None,
        "transcript": _transcript(store, row.id),
    }


def _print_transcript(transcript: list[dict[str, Any]]) -> None:
    say(f"transcript: {len(transcript)} message(s)")
    for message in transcript:
        when = short_time(message.get("timestamp"))
        say(f"  [{when}] {message['role']}: {message.get('content')}")


def show_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``show KEY|SESSION_ID``: a lane (by its key or current session id), or any stored
    session by its id."""
    with open_store(config, write=False) as store:
        entry = store.lookup_by_session_key(args.lane) or store.lookup_by_session_id(args.lane)
        details = (
            lane_details(store, entry) if entry is not None else session_details(store, args.lane)
        )
    if args.json:
        print_json(details)
        return 0
    if "session" in details:
        session, current = details["session"], details["lane_session_id"]
        say(f"session:  {session['session_id']}")
        say(f"key:      {session['session_key']}")
        say(f"started:  {short_time(session['started_at'])}")
        say(f"ended:    {short_time(session['ended_at'])} ({session['end_reason'] or 'not ended'})")
        say(f"lane now: {current} (`show KEY`: its queue and owed replies)" if current
              else "lane now: none (the lane was pruned)")  # fmt: skip
        _print_transcript(details["transcript"])
        return 0
    entry = details["entry"]
    flags = [name for name in ("suspended", "resume_pending") if entry.get(name)]
    if entry.get("active_turn_token"):
        flags.append(f"turn marker since {entry.get('active_turn_started_at')}")
    say(f"key:      {entry['session_key']}")
    say(f"session:  {entry['session_id']}")
    say(f"platform: {entry.get('platform')} ({entry.get('chat_type')})")
    say(f"created:  {entry['created_at']}")
    say(f"updated:  {entry['updated_at']}")
    say(f"flags:    {', '.join(flags) or 'none'}")
    lease = details["lease"]
    if lease is not None:
        left = lease["expires_in_secs"]
        when = "never" if left is None else f"in {left:.0f} s" if left >= 0 else "already"
        say(f"lease:    {lease['owner_instance']} ({lease['state']}; expires {when})")
    say(f"queued:   {len(details['queued'])} event(s)")
    for item in details["queued"]:
        say(f"  #{item['event_id']}: {item['text']}")
    say(f"dead letters: {len(details['dead_letters'])}")
    for item in details["dead_letters"]:
        say(f"  #{item['event_id']} after {item['attempts']} attempts: {item['last_error']}")
    say(f"owed replies: {len(details['owed_replies'])}")
    for item in details["owed_replies"]:
        say(f"  {item['state']}: {item['content']}")
    _print_transcript(details["transcript"])
    return 0


def search_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``search QUERY``."""
    if not 1 <= args.limit <= SEARCH_LIMIT:
        raise InvalidValueError("limit", f"--limit must be from 1 to {SEARCH_LIMIT}.")
    with open_store(config, write=False) as store:
        hits = store.search(args.query, session_id=args.session, limit=args.limit)
    rows = [
        {"session_id": hit.session_id, "message_id": hit.message_id, "role": hit.role,
         "timestamp": iso(hit.timestamp), "snippet": hit.snippet}
        for hit in hits
    ]  # fmt: skip
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("no matches")
        return 0
    table = [("SESSION", "MESSAGE", "ROLE", "TIME", "SNIPPET")]
    table += [
        (hit.session_id, str(hit.message_id), hit.role, stamp(hit.timestamp), hit.snippet)
        for hit in hits
    ]
    print_table(table)
    return 0
