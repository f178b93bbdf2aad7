"""The options every command takes, before or after the command (``--config``, ``--debug``, the
log level, ``--state-dir``, ``--url``), and the log lines they choose. Kept apart from the
commands and light to import: ``hermes-sessions --version`` reads these options alone."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
"""The ``--log-level`` names (any case)."""


def global_options(*, top: bool) -> argparse.ArgumentParser:
    """``--config``, ``--debug`` and the log level (``-v``, ``--quiet``, ``--log-level``),
    accepted before or after the subcommand: the subcommand's copies default to "absent" so
    they never undo what was given before it."""
    parent = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    default: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    parent.add_argument(
        "--debug", action="store_true", help="print tracebacks of errors", **default
    )
    parent.add_argument(
        "-v", "--verbose", action="count",
        help="log more: -v adds info lines, -vv debug lines (default: warnings and errors)",
        **default,
    )  # fmt: skip
    parent.add_argument(
        "-q", "--quiet", action="store_true", help="log errors only, no warnings", **default
    )
    parent.add_argument(
        "--log-level", type=str.lower, choices=LOG_LEVELS, metavar="LEVEL",
        help=f"log lines of this level and above ({', '.join(LOG_LEVELS)}); wins over -v and "
        "--quiet", **default,
    )  # fmt: skip
    parent.add_argument(
        "--config",
        metavar="PATH",
        help="YAML configuration file (default: $HERMES_HOME/config.yaml if present)",
        **default,
    )
    return parent


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the ``sys.stderr`` of the moment (which a test may have replaced)."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # always the current sys.stderr


_LOG_HANDLER = _StderrHandler()
_LOG_HANDLER.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))


@contextmanager
def logging_to_stderr(args: argparse.Namespace) -> Iterator[None]:
    """While a command runs: log lines on standard error, each with its level and logger, from
    the level the options chose (``--log-level``, else ``--quiet``: errors, else warnings,
    ``-v`` info, ``-vv`` debug). The root logger is put back afterwards (``main`` may be called
    by a program with its own logging)."""
    if args.log_level is not None:
        level = logging.getLevelName(args.log_level.upper())
    elif args.quiet:
        level = logging.ERROR
    else:
        level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose or 0, logging.DEBUG)
    root = logging.getLogger()
    before = root.level
    root.setLevel(level)
    root.addHandler(_LOG_HANDLER)
    try:
        yield
    finally:
        root.removeHandler(_LOG_HANDLER)
        root.setLevel(before)


def store_options(*, top: bool) -> argparse.ArgumentParser:
    """``--state-dir DIR`` and ``--url URL``: which store a command works on (before or after
    the subcommand, like :func:`global_options`)."""
    parent = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    group = parent.add_argument_group("store", "default: the configuration's storage.url")
    default: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    group.add_argument(
        "--state-dir", dest="store_dir", metavar="DIR", type=Path,
        help="a gateway's state directory (its HERMES_HOME): its config.yaml and store", **default,
    )  # fmt: skip
    group.add_argument(
        "--url", dest="store_url", metavar="URL", help="a store URL (storage.url)", **default
    )
    return parent
