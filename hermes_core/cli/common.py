"""What every operator command shares: the configuration and store they work on (a state
directory, a URL, or the configuration's; the options that choose them are in ``options``),
opening it read-only or for writing, JSON and table output, and a progress bar on a
terminal."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import HermesError, InvalidValueError, StoreUnavailableError, shown
from hermes_core.domain.models import SessionEntry
from hermes_core.domain.specs import StoreSpec
from hermes_core.domain.terminal import inert_json, safe_text
from hermes_core.plugins.manager import HermesPluginManager, create_plugin_manager
from hermes_core.store import SessionStore
from hermes_core.store.capabilities import bind_backend
from hermes_core.store.leases import CLOCK_SLACK_SECS, lease_state
from hermes_core.store.operator import OperatorBackend

Handler = Callable[[argparse.Namespace, GatewayConfig], int]
Commands = "argparse._SubParsersAction[argparse.ArgumentParser]"
CHAT_TYPES = ("dm", "group", "channel", "thread")
"""The chat types the commands accept (another type would key a new lane)."""


class UnknownLaneError(HermesError):
    """A command named a session key or session id the store does not know."""


def load_config(args: argparse.Namespace) -> GatewayConfig:
    """The configuration a command runs with: ``--config`` or ``$HERMES_HOME/config.yaml``;
    ``--state-dir`` reads that directory as ``$HERMES_HOME`` (its config.yaml unless
    ``--config`` is given; commands that run a gateway create it); ``--url`` replaces
    ``storage.url``."""
    directory: Path | None = getattr(args, "store_dir", None)
    if directory is not None and getattr(args, "creates_state_dir", False):
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidValueError(
                "state_dir", f"{directory}: cannot be used as a state directory "
                f"({exc.strerror}); name a directory."
            ) from exc  # fmt: skip
    if directory is None:
        config = GatewayConfig.from_yaml(args.config) if args.config else GatewayConfig.load()
    elif not directory.is_dir():
        raise InvalidValueError(
            "state_dir", f"{directory}: no such state directory; pass the HERMES_HOME of a "
            "gateway (--state-dir) or a store URL (--url)."
        )  # fmt: skip
    else:
        environ = {**os.environ, "HERMES_HOME": str(directory.absolute())}
        path = Path(args.config) if args.config else directory / "config.yaml"
        if path.exists() or args.config:
            config = GatewayConfig.from_yaml(path, environ=environ)
        else:
            config = GatewayConfig.from_dict({}, source="<defaults>", environ=environ)
    url: str | None = getattr(args, "store_url", None)
    return config if url is None else with_url(config, url)


def with_url(config: GatewayConfig, url: str) -> GatewayConfig:
    """``config`` with ``storage.url`` set to ``url`` (which must name a scheme and be UTF-8
    text: bytes that are not arrive from the command line as lone surrogates)."""
    try:
        url.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidValueError(
            "url", "the store URL holds bytes that are not UTF-8 text; write it in UTF-8 "
            "(a database file needs a name that is UTF-8 text)."
        ) from None  # fmt: skip
    if "://" not in url:  # not echoed: 'postgres:PASSWORD@host/db' holds a credential
        raise InvalidValueError(
            "url", "the URL given is not a store URL: it names no scheme (no '://'); write "
            "e.g. sqlite:////srv/hermes/state.db or postgresql+psycopg://user@host/db."
        )  # fmt: skip
    return config.model_copy(update={"storage": config.storage.model_copy(update={"url": url})})


def open_store(
    config: GatewayConfig, *, write: bool, plugins: HermesPluginManager | None = None
) -> SessionStore:
    """The store of ``config``: read-only (works beside a running gateway) or for writing (refused
    with ``GatewayLockedError`` naming the gateway that holds it)."""
    plugins = plugins or create_plugin_manager(config)
    store = SessionStore.open(config, plugins=plugins, read_only=not write)
    if store.degraded:
        reason = store.health().get("degraded_reason") or "the SQL store cannot be opened"
        store.close()
        raise StoreUnavailableError(
            f"{config.storage_url}: {reason}; run `hermes-sessions doctor` to see why."
        )
    return store


def store_spec(config: GatewayConfig, plugins: HermesPluginManager | None = None) -> StoreSpec:
    """The storage backend that ``storage.url`` names."""
    scheme = config.storage_url.split("://", 1)[0]
    spec = (plugins or create_plugin_manager(config)).stores().get(scheme)
    if spec is None:  # the scheme only: the rest of a URL may hold a password
        raise StoreUnavailableError(
            f"storage.url uses the scheme {shown(scheme)}, which no loaded plugin provides; fix "
            "the URL or install the plugin for it."
        )
    return spec


def open_operator(
    config: GatewayConfig, *, write: bool, plugins: HermesPluginManager | None = None
) -> OperatorBackend:
    """The backend of ``config`` with its operator interface (capability ``operator``), opened
    directly (no routing import, no key-schema check): for ``doctor``, ``migrate``, ``export``
    and the dead-letter commands."""
    plugins = plugins or create_plugin_manager(config)
    spec = store_spec(config, plugins)
    opener = spec.open if write or spec.open_read_only is None else spec.open_read_only
    backend = opener(config.storage_url, config)
    try:
        operator = bind_backend(spec, backend, plugins.store_plugin(spec), warn=False).operator
    except BaseException:
        backend.close()
        raise
    if operator is None:
        backend.close()
        raise StoreUnavailableError(
            f"the {spec.name} store has no operator interface (its StoreSpec does not declare "
            "the capability 'operator'); this command needs a store that does, such as SQLite "
            "or PostgreSQL."
        )
    return operator


def check_chat_type(value: str, what: str) -> str:
    """``value`` when it is one of :data:`CHAT_TYPES`; else a named error about ``what``."""
    if value not in CHAT_TYPES:
        raise InvalidValueError(
            "chat_type",
            f"{what} {shown(value)} is not a chat type; use one of {', '.join(CHAT_TYPES)} "
            "(lowercase).",
        )
    return value


def find_lane(store: SessionStore, name: str) -> SessionEntry:
    """The lane named by its session key or its current session id."""
    entry = store.lookup_by_session_key(name) or store.lookup_by_session_id(name)
    if entry is None:
        raise UnknownLaneError(
            f"no lane has the session key or current session id {shown(name)}; "
            "`hermes-sessions ls` lists them."
        )
    return entry


def say(line: str) -> None:
    """Print one line of a command's human-readable output, with :func:`safe_text`."""
    print(safe_text(line))


_ENCODER = json.JSONEncoder(ensure_ascii=False, default=str)
"""What :func:`json_text` writes on one line with (``json.dumps`` builds one per call)."""


def json_text(data: Any, *, indent: int | None = None, inert: bool = True) -> str:
    """``data`` as JSON in which C1 controls and bidi overrides are ``\\u`` escapes too (JSON
    escapes C0 itself), so no output of ours can steer a terminal; parsed, it is ``data``.
    ``inert=False``: JSON as it comes, for a caller that passes what it joins through
    :func:`inert_json` at once."""
    if indent is None:
        text = _ENCODER.encode(data)
    else:
        text = json.dumps(data, indent=indent, ensure_ascii=False, default=str)
    return inert_json(text) if inert else text


def print_json(data: Any) -> None:
    """Pretty JSON on standard output (:func:`json_text`)."""
    print(json_text(data, indent=2))


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Left-aligned columns separated by two spaces (the last column is not padded); every cell
    through :func:`safe_text`."""
    rows = [[safe_text(cell) for cell in row] for row in rows]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[-1]]).rstrip())


def iso(epoch: float | None) -> str | None:
    """An epoch time as the ISO 8601 string of every ``--json`` output, the form the lanes' own
    times have (``2026-11-30T19:46:37.694483+00:00``); None stays None, and a number that is no
    time (a junk row's) stays as it is, so the output still shows it."""
    try:
        return None if epoch is None else datetime.fromtimestamp(epoch, timezone.utc).isoformat()
    except (OverflowError, ValueError, OSError):
        return str(epoch)


def time_fields(names: Iterable[str]) -> tuple[str, ...]:
    """The names of ``names`` that hold times: ``timestamp`` and those ending in ``_at``."""
    return tuple(name for name in names if name == "timestamp" or name.endswith("_at"))


def iso_times(row: Mapping[str, Any], times: Sequence[str] | None = None) -> dict[str, Any]:
    """``row`` with its epoch times (numbers under its :func:`time_fields`, or under ``times``
    when the caller knows them for many rows alike) as :func:`iso` strings."""
    converted = dict(row)
    for name in time_fields(row) if times is None else times:
        value = converted[name]
        if isinstance(value, int | float) and not isinstance(value, bool):
            converted[name] = iso(value)
    return converted


def short_time(text: str | None) -> str:
    """An :func:`iso` time to the second, as tables print it: ``YYYY-MM-DDTHH:MM:SSZ``."""
    return "-" if text is None else text[:19] + "Z"


def stamp(epoch: float | None) -> str:
    """An epoch time to the second, as tables print it (``-`` for none)."""
    return short_time(iso(epoch))


REDRAW_SECS = 0.1
"""Least time between two redraws of a progress bar: a million advances draw a few hundred."""


class Progress:
    """A progress bar on standard error, drawn only when it is a terminal (and the command
    does not print JSON), redrawn at most every :data:`REDRAW_SECS`. A ``total`` of 0 means
    unknown: a running count is drawn instead of a bar."""

    def __init__(
        self, label: str, total: int, stream: TextIO | None = None, *, quiet: bool = False
    ) -> None:
        self.label, self.total, self.done = label, total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.shown = not quiet and self.stream.isatty()
        self._drawn_at = -math.inf

    def advance(self, count: int = 1) -> None:
        """Count ``count`` more items done; redraw unless the last redraw is recent."""
        self.done += count
        if self.shown and time.monotonic() - self._drawn_at >= REDRAW_SECS:
            self._draw()

    def phase(self, label: str, total: int) -> None:
        """Go on to another phase of the same work (its own label and total), ending the line
        drawn for the one before."""
        if self.shown and self.done:
            self._draw()
            self.stream.write("\n")
        self.label, self.total, self.done, self._drawn_at = label, total, 0, -math.inf

    def told(self, phase: str, count: int, *, total: int) -> None:
        """:meth:`advance` by ``count`` in ``phase`` (the label's suffix), entering it first
        (:meth:`phase`) if it is another; the form a store's progress callback takes."""
        label = f"{self.label.partition(':')[0]}: {phase}"
        if label != self.label:
            self.phase(label, total)
        self.advance(count)

    def _draw(self) -> None:
        if self.total > 0:
            width = 30
            filled = width * min(self.done, self.total) // self.total
            bar = "#" * filled + "-" * (width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {self.done:,}/{self.total:,}")
        else:
            self.stream.write(f"\r{self.label} {self.done:,}")
        self.stream.flush()
        self._drawn_at = time.monotonic()

    def close(self) -> None:
        """Draw the final count and end the bar's line."""
        if self.shown:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()


@contextmanager
def progress(label: str, total: int, *, quiet: bool = False) -> Iterator[Progress]:
    """A :class:`Progress` closed on leaving; ``quiet``: never drawn (``--json``)."""
    bar = Progress(label, total, quiet=quiet)
    try:
        yield bar
    finally:
        bar.close()


def lease_details(store: SessionStore, key: str) -> dict[str, Any] | None:
    """The lane's turn lease on a shared store, as ``show`` prints it (owner instance, seconds
    until it expires on this host's clock, and ``state``: live, expired or invalid, see
    ``lease_state``), or None."""
    if not store.shared:
        return None
    backend = open_operator(store.config, write=False, plugins=store.plugins)
    try:
        rows = backend.lease_rows(key)
    finally:
        backend.close()
    if not rows:
        return None
    _, owner, expires = rows[0]
    now, ttl = time.time(), store.config.storage.turn_lease_secs
    left = expires - now if math.isfinite(expires) else None
    return {"owner_instance": owner, "expires_in_secs": left,
            "state": lease_state(expires, now, ttl, CLOCK_SLACK_SECS)}  # fmt: skip
