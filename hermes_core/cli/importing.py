"""``hermes-sessions import-gateway DIR``: bring a gateway's sessions directory (its
``sessions.json`` and ``<session_id>.jsonl`` transcripts, as the original gateway leaves them)
into the store in bulk (see :mod:`hermes_core.store.bulk`): batches of lanes, each one
transaction, with a progress bar on a terminal. Run again after an interruption, it writes the
lanes the first run did not commit and skips the rest."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hermes_core.cli.common import open_operator, print_json, progress
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import InvalidValueError
from hermes_core.plugins.manager import create_plugin_manager
from hermes_core.store.bulk import (
    BATCH_LANES,
    check_key_schema,
    import_lanes,
    read_gateway_directory,
)


def register(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Add ``import-gateway``."""
    command = commands.add_parser(
        "import-gateway", parents=parents, allow_abbrev=False,
        help="import a gateway's sessions.json and transcripts in bulk (resumable)",
    )  # fmt: skip
    command.add_argument(
        "directory", metavar="DIR", type=Path,
        help="the directory holding sessions.json and the .jsonl transcripts",
    )  # fmt: skip
    command.add_argument("--batch", type=int, default=BATCH_LANES, metavar="N",
                         help=f"lanes per transaction (default {BATCH_LANES:,})")  # fmt: skip
    command.add_argument("--json", action="store_true", help="print one JSON object")
    command.set_defaults(handler=import_gateway_command, creates_state_dir=True)


def import_gateway_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``import-gateway DIR``: exit 0, or 1 when some of the directory was left out."""
    if args.batch < 1:
        raise InvalidValueError("batch", f"--batch {args.batch}: give at least 1 lane.")
    plugins = create_plugin_manager(config)
    source = read_gateway_directory(args.directory, config, plugins)
    target = open_operator(config, write=True, plugins=plugins)
    try:
        check_key_schema(source, target, config, plugins)
        with progress("import", len(source.entries), quiet=args.json) as bar:
            counts = import_lanes(
                target, source.lanes(), config=config, plugins=plugins, batch=args.batch,
                advance=bar.advance,
            )  # fmt: skip
    finally:
        target.close()
    left_out = [f"{name}: {reason}" for name, reason in source.left_out]
    report = {
        "lanes": counts.lanes, "messages": counts.messages, "skipped": counts.skipped,
        "invalid_lines": source.invalid_lines, "orphan_transcripts": source.orphans,
        "left_out": left_out,
    }  # fmt: skip
    if args.json:
        print_json(report)
    else:
        print(*left_out, sep="\n") if left_out else None
        print(
            f"imported {counts.lanes} lane(s) with {counts.messages} message(s); "
            f"{counts.skipped} already in the store; {source.invalid_lines} invalid line(s) "
            f"skipped; {source.orphans} transcript(s) no entry names not imported"
        )
    return 1 if left_out else 0
