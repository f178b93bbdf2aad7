"""The ``hermes-sessions`` console script.

Errors a user can cause print one line, ``hermes-sessions: error: <message>``, and exit 2 (a
traceback too under ``--debug``); exit 1 is kept for commands that report problems found.
Usage errors print the command's usage, then the same error line (exit 2).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from hermes_core.cli.options import global_options, logging_to_stderr, store_options
from hermes_core.domain.errors import GatewayLockedError, HermesError

if TYPE_CHECKING:
    from hermes_core.config.schema import GatewayConfig

PROG = "hermes-sessions"
EXIT_ERROR = 2
MAX_ERROR_CHARS = 2000  # the longest error line (values are cut by errors.shown already)
COMMAND_MODULES = (
    "keying", "browse", "lanes", "doctor", "migrate", "importing", "console", "serving",
)  # fmt: skip
"""The modules of :mod:`hermes_core.cli` that register the commands, in help order."""

Handler = Callable[[argparse.Namespace, "GatewayConfig"], int]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if _asks_version(argv):  # answered before the commands (and what they import) are loaded
        print(_version_line())
        return 0
    try:
        args = _parser().parse_args(argv)
        source_parser = getattr(args, "source_parser", None)  # set by the commands taking a source
        if source_parser is not None and args.source_json is None and args.platform is None:
            source_parser.error("--platform is required unless --source-json is given")
    except SystemExit as exc:  # --help, --version and usage errors: argparse has printed them
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else EXIT_ERROR
    with logging_to_stderr(args):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """Run the parsed command; a user's error becomes one line and exit 2."""
    from hermes_core.cli.common import load_config  # with the configuration's imports

    handler: Handler = args.handler
    try:
        config = load_config(args)
        return handler(args, config)
    except BrokenPipeError:  # the reader went away (| head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except HermesError as exc:
        if args.debug:
            traceback.print_exc()
        message = " ".join(_message(exc, args).split())  # one line, whatever it holds
        if len(message) > MAX_ERROR_CHARS:  # a value quoted without errors.shown: cut anyway
            message = f"{message[: MAX_ERROR_CHARS // 2]} ... {message[-MAX_ERROR_CHARS // 2 :]}"
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return EXIT_ERROR


def _message(exc: HermesError, args: argparse.Namespace) -> str:
    """The error's message, with advice for the command line where the library's is for code:
    a writer lock held elsewhere is answered by stopping that process (or only reading)."""
    if isinstance(exc, GatewayLockedError) and exc.situation != str(exc):
        return (
            f"{exc.situation}; `{PROG} {args.command}` writes to it, and one process may write "
            "to a database at a time: stop that process first, or use a command that only "
            "reads (ls, show, search, export, recover --dry-run, doctor, prune --dry-run, rekey "
            "--dry-run), which may run beside it."
        )
    return str(exc)


class _Parser(argparse.ArgumentParser):
    """argparse with the one error prefix of every command (its subcommands are of this class
    too): the usage, then ``hermes-sessions: error: <message>``, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{PROG}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    """The argument parser: global options and one subcommand per command."""
    parser = _Parser(
        prog=PROG,
        description="Session lifecycle for chat-agent gateways: keys, plugins, a demo and the "
        "operator commands over a gateway's store.",
        allow_abbrev=False,
        parents=[global_options(top=True), store_options(top=True)],
    )
    parser.add_argument("--version", action="version", version=_version_line())
    commands: Any = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parents = [global_options(top=False), store_options(top=False)]
    for name in COMMAND_MODULES:  # imported here: --version does not need them
        importlib.import_module(f"hermes_core.cli.{name}").register(commands, parents)
    return parser


class _ProbeError(Exception):
    """The light parser of :func:`_asks_version` met what only the full parser can report."""


class _Probe(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _ProbeError(message)


def _asks_version(argv: list[str]) -> bool:
    """Whether ``--version`` comes before the command, read with the global options alone."""
    probe = _Probe(
        add_help=False, allow_abbrev=False,
        parents=[global_options(top=True), store_options(top=True)],
    )  # fmt: skip
    probe.add_argument("--version", action="store_true")
    probe.add_argument("rest", nargs=argparse.REMAINDER)  # the command and all after it
    try:
        known, _ = probe.parse_known_args(argv)
    except _ProbeError:
        return False
    return bool(known.version)


def _version_line() -> str:
    from hermes_core import __version__

    return f"{PROG} {__version__ or 'unknown'}"
