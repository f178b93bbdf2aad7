"""``export``: every stored record as JSONL, or every session as Markdown, read a page at a
time; a file is written beside its target and renamed once complete (see :mod:`.outputs`)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
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
from hermes_core.domain.errors import InvalidValueError, StoreUnavailableError, shown
from hermes_core.domain.terminal import inert_json, safe_text
from hermes_core.store import SessionStore
from hermes_core.store.operator import OperatorBackend

EXPORT_PAGE = 2000
"""The records ``export`` reads in one query."""
EXPORT_SPAN = 10_000
"""The records one worker process reads and encodes at a time (see :func:`export_jsonl`): some
4 MB of text, of which the command holds two per worker; 50,000 was no faster and held 1.7 times
the memory (the command and its workers together)."""


def export_jobs() -> int:
    """``export --jobs``'s default: the CPUs this process may run on, at most 4."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def _pages(
    backend: OperatorBackend, name: str, after: Any = None, upto: Any = None
) -> Iterator[list[dict[str, Any]]]:
    """Every record of a kind after the key ``after`` and at most ``upto`` (None: unbounded),
    :data:`EXPORT_PAGE` at a time in primary-key order. Where the backend ``reads_ahead``,
    the next page is read on a thread of its own while the caller writes this one: the
    server's work and the driver's waiting overlap the encoding instead of adding to it (on
    SQLite such a thread made the export 1.4 times slower)."""
    if not backend.reads_ahead:
        rows = backend.table_rows(name, after, EXPORT_PAGE, upto)
        while rows:
            yield rows
            key = backend.primary_key(name, rows[-1])
            rows = backend.table_rows(name, key, EXPORT_PAGE, upto)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="export-read") as reader:
        ahead = reader.submit(backend.table_rows, name, after, EXPORT_PAGE, upto)
        while rows := ahead.result():
            key = backend.primary_key(name, rows[-1])
            ahead = reader.submit(backend.table_rows, name, key, EXPORT_PAGE, upto)
            yield rows


def _lines(name: str, rows: list[dict[str, Any]]) -> str:
    """The export's lines of ``rows`` (records of the kind ``name``), made inert at once."""
    head, times = f'{{"table": {json_text(name)}, "row": ', time_fields(rows[0])
    return inert_json(
        "".join(head + json_text(iso_times(row, times), inert=False) + "}\n" for row in rows)
    )


_WORKER: list[OperatorBackend] = []
"""In a worker process of :class:`_Workers`: the store it reads."""


ORPHAN_CHECK_SECS = 0.5
"""How often a worker process checks that the export that started it still runs."""


def _open_worker(config: GatewayConfig, parent: int) -> None:
    """Start a worker process: open the store to read. Ctrl-C is the parent's to handle (it
    stops the workers once their current span is written); a parent that is killed cannot,
    and its workers, waiting on a queue the others hold open too, would wait for good, so a
    thread ends the worker once its parent (the pid ``parent``, given by the parent itself:
    it may be gone before this runs) is."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_CHECK_SECS)
        os._exit(1)

    threading.Thread(target=watch, name="export-orphan-check", daemon=True).start()
    backend = open_operator(config, write=False)
    atexit.register(backend.close)
    _WORKER.append(backend)


def _span_lines(name: str, after: Any, upto: Any) -> tuple[str, int]:
    """In a worker process: the lines of the records of ``name`` after ``after`` and at most
    ``upto``, and how many. A failure comes back as a :class:`StoreUnavailableError` (its
    message the original's: what crosses between processes is kept plain)."""
    parts, count = [], 0
    try:
        for rows in _pages(_WORKER[0], name, after, upto):
            parts.append(_lines(name, rows))
            count += len(rows)
    except Exception as exc:  # noqa: BLE001 - re-raised plainly, to cross into the parent
        raise StoreUnavailableError(f"export: reading {name} failed: {exc}") from None
    return "".join(parts), count


class _Workers:
    """Processes that read and encode spans of :data:`EXPORT_SPAN` records each, started on
    first use (spawned: a fork would share this process's connections)."""

    def __init__(self, config: GatewayConfig | None, jobs: int) -> None:
        self.enabled = config is not None and jobs > 1
        self._start = (
            None if config is None else functools.partial(_open_worker, config, os.getpid())
        )
        self._jobs = jobs
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def lines(self, backend: OperatorBackend, name: str) -> Iterator[tuple[str, int]]:
        """The kind's lines in key order, span by span: ``backend`` finds where each span ends
        (its keys only) while the workers read and encode, at most two spans each ahead of
        the one written."""
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self._jobs, mp_context=multiprocessing.get_context("spawn"),
                initializer=self._start,
            )  # fmt: skip
        pending: deque[Future[tuple[str, int]]] = deque()
        after, more = None, True
        try:
            while more or pending:
                while more and len(pending) < 2 * self._jobs:
                    upto = backend.span_end(name, after, EXPORT_SPAN)
                    pending.append(self._pool.submit(_span_lines, name, after, upto))
                    after, more = upto, upto is not None
                yield pending.popleft().result()
        except BrokenProcessPool as exc:
            raise StoreUnavailableError(
                "export: a worker process ended before its part was written (killed, or out "
                "of memory); the export is incomplete (a file named with --output is left as it "
                "was). Run export again, with --jobs 1 to export in this process alone."
            ) from exc
        finally:
            for future in pending:
                future.cancel()


def export_jsonl(
    backend: OperatorBackend,
    out: TextIO,
    *,
    config: GatewayConfig | None = None,
    jobs: int = 1,
) -> int:
    """Every record of the kinds the backend exports (``RecordKinds.export``) as
    ``{"table": ..., "row": ...}`` lines in primary-key order, times as ISO strings
    (byte-identical for the same state in SQLite and PostgreSQL); the line count.

    With ``config`` (the store's) and ``jobs`` above 1, a kind of at least two spans of
    :data:`EXPORT_SPAN` records is read and encoded by ``jobs`` worker processes, each
    opening the store itself, a span each at a time, and written here in order: the same
    bytes, with every core at work (the encoding is CPU in one interpreter otherwise)."""
    lines = 0
    kinds = backend.record_kinds().export
    with progress("export", len(kinds)) as bar, _Workers(config, jobs) as workers:
        for name in kinds:
            if workers.enabled and backend.span_end(name, None, 2 * EXPORT_SPAN) is not None:
                parts = workers.lines(backend, name)
            else:
                parts = ((_lines(name, rows), len(rows)) for rows in _pages(backend, name))
            for text, count in parts:
                out.write(text)
                lines += count
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
    """``export [--format jsonl|markdown] [--output FILE] [--jobs N]``: the output is opened
    after the store, never onto one of the store's own files, and a file is renamed into place
    only once complete (see :mod:`.outputs`)."""
    if args.jobs < 1:
        raise InvalidValueError("jobs", "--jobs must be at least 1 (1: export in this process).")
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
                    export_jsonl(backend, out, config=config, jobs=args.jobs)
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
