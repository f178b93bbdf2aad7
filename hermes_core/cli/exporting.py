"""``export``: every stored record as JSONL, or every session as Markdown, read a page at a
time; a file is written beside its target and renamed once complete (see :mod:`.outputs`)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TextIO

from hermes_core.cli.common import (
    iso_times,
    json_text,
    open_operator,
    open_store,
    progress,
    stamp,
    time_fields,
)
from hermes_core.cli.outputs import written_output
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import InvalidValueError, shown
from hermes_core.domain.terminal import inert_json, safe_text
from hermes_core.store import SessionStore
from hermes_core.store.operator import OperatorBackend

EXPORT_PAGE = 2000
"""The records ``export`` reads in one query."""


def _pages(backend: OperatorBackend, name: str) -> Iterator[list[dict[str, Any]]]:
    """Every record of a kind, :data:`EXPORT_PAGE` at a time in primary-key order. Where the
    backend ``reads_ahead``, the next page is read on a thread of its own while the caller
    writes this one: the server's work and the driver's waiting overlap the encoding instead
    of adding to it (on SQLite such a thread made the export 1.4 times slower)."""
    if not backend.reads_ahead:
        rows = backend.table_rows(name, None, EXPORT_PAGE)
        while rows:
            yield rows
            rows = backend.table_rows(name, backend.primary_key(name, rows[-1]), EXPORT_PAGE)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="export-read") as reader:
        ahead = reader.submit(backend.table_rows, name, None, EXPORT_PAGE)
        while rows := ahead.result():
            ahead = reader.submit(
                backend.table_rows, name, backend.primary_key(name, rows[-1]), EXPORT_PAGE
            )
            yield rows


def export_jsonl(backend: OperatorBackend, out: TextIO) -> int:
    """Every record of the kinds the backend exports (``RecordKinds.export``) as
    ``{"table": ..., "row": ...}`` lines in primary-key order, times as ISO strings
    (byte-identical for the same state in SQLite and PostgreSQL); the line count. A page of
    lines is written at once, the kind's part of each line made once."""
    lines = 0
    kinds = backend.record_kinds().export
    with progress("export", len(kinds)) as bar:
        for name in kinds:
            head, times = f'{{"table": {json_text(name)}, "row": ', None
            for rows in _pages(backend, name):
                times = time_fields(rows[0]) if times is None else times
                page = (
                    head + json_text(iso_times(row, times), inert=False) + "}\n" for row in rows
                )
                out.write(inert_json("".join(page)))
                lines += len(rows)
            bar.advance()
    return lines


def export_markdown(store: SessionStore, backend: OperatorBackend, out: TextIO) -> int:
    """One section per session (oldest first) with its active transcript; the session count."""
    name = backend.record_kinds().sessions
    with progress("export", backend.count_records(name)) as bar:
        for row in (row for rows in _pages(backend, name) for row in rows):
            ended = stamp(row["ended_at"])
            section = [
                f"## {row['session_key']} — {row['id']}\n\n",
                f"- started: {stamp(row['started_at'])}\n",
                f"- ended: {ended} ({row['end_reason']})\n" if row["ended_at"] else "",
                f"- messages: {row['message_count']}\n\n",
            ]
            for message in store.load_transcript(row["id"]):
                when = stamp(message.get("timestamp"))
                section.append(
                    f"**{message['role']}** ({when}): {message.get('content') or ''}\n\n"
                )
            out.write(safe_text("".join(section), keep_lines=True))
            bar.advance()
    return bar.done


def export_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``export [--format jsonl|markdown] [--output FILE]``: the output is opened after the
    store, never onto one of the store's own files, and a file is renamed into place only once
    complete (see :mod:`.outputs`)."""
    with open_store(config, write=False) as store:
        backend = open_operator(config, write=False, plugins=store.plugins)
        output = (
            contextlib.nullcontext(sys.stdout)
            if args.output is None
            else written_output(args.output, config)
        )
        try:
            with output as out:
                if args.format == "jsonl":
                    export_jsonl(backend, out)
                else:
                    export_markdown(store, backend, out)
                out.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:  # a full disk, /dev/full: the export is incomplete
            where = "standard output" if args.output is None else shown(str(args.output))
            raise InvalidValueError(
                "output", f"{where}: cannot write: {exc.strerror or exc}; the export is "
                "incomplete (a file named is left as it was), free space or name another output."
            ) from exc  # fmt: skip
        finally:
            backend.close()
    return 0
