"""The commands about keys and plugins rather than a gateway's store: ``plugins``, ``key`` and
``explain`` (a source's key, writing nothing), ``rekey`` (every lane of a store to key schema
v2) and ``demo``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from hermes_core.cli.common import check_chat_type, progress
from hermes_core.cli.explain import explain_session_key, format_explanation
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import InvalidValueError
from hermes_core.domain.keys import resolve_key
from hermes_core.domain.models import SessionSource
from hermes_core.plugins.events import read_event
from hermes_core.plugins.manager import HermesPluginManager, create_plugin_manager
from hermes_core.state.files import read_at_most, read_user_file
from hermes_core.store import SessionStore
from hermes_core.store.rekey_report import RekeyReport

MAX_JSON_BYTES = 16 << 20
"""A ``--source-json`` or ``--payload`` file (or standard input) may hold at most 16 MiB."""

# One option per SessionSource field, derived from the model so a new field gets its option.
_SOURCE_FIELDS = tuple(SessionSource.model_fields.items())
_SOURCE_FLAGS = tuple(name for name, field in _SOURCE_FIELDS if field.annotation is bool)
_SOURCE_VALUES = tuple(name for name, field in _SOURCE_FIELDS if field.annotation is not bool)
_SOURCE_HELP = {
    "platform": "registered platform name (required unless --source-json is given)",
    "chat_id": 'chat id (default: ""); negative ids work: --chat-id -100123',
    "chat_type": "dm (default), group, channel or thread",
}


def register(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Add ``plugins``, ``key``, ``explain``, ``rekey`` and ``demo`` (``parents``: the global
    options, then the store options)."""
    source = _source_options()

    plugins = commands.add_parser(
        "plugins", parents=parents, help="list the loaded plugins", allow_abbrev=False
    )
    plugins.add_argument("--json", action="store_true", help="print a JSON list")
    plugins.set_defaults(handler=plugins_command)

    key = commands.add_parser(
        "key",
        parents=[*parents, source],
        help="print the session key of a source",
        allow_abbrev=False,
    )
    key.set_defaults(handler=key_command, source_parser=key)

    explain = commands.add_parser(
        "explain",
        parents=[*parents, source],
        help="explain how a source is keyed (writes nothing)",
        allow_abbrev=False,
    )
    explain.add_argument("--json", action="store_true", help="print one JSON object")
    explain.add_argument(
        "--payload", metavar="FILE",
        help="a raw event as the platform delivered it (JSON; '-' reads stdin), read by the "
        "plugin of --platform; the source is the one read from it, field options override it",
    )  # fmt: skip
    explain.set_defaults(handler=explain_command, source_parser=explain)

    rekey = commands.add_parser(
        "rekey",
        parents=parents,
        help="move every lane of a key schema v1 store to its v2 key, or the thread-less lanes "
        "of forum chats to their general topic (the gateway stopped)",
        allow_abbrev=False,
    )
    change = rekey.add_mutually_exclusive_group(required=True)
    change.add_argument("--to", choices=["v2"], help="the target schema")
    change.add_argument(
        "--forum", nargs=2, metavar=("PLATFORM", "CHAT_ID"), action="append", dest="forums",
        help="a forum chat, e.g. a Telegram forum supergroup (repeatable): its lanes keyed "
        "without a topic move to its general topic (Telegram: thread 1), in the store's schema",
    )  # fmt: skip
    rekey.add_argument(
        "--dry-run", action="store_true", help="print what would move and the collisions found"
    )
    rekey.add_argument("--json", action="store_true", help="print one JSON object")
    rekey.set_defaults(handler=rekey_command)

    demo = commands.add_parser(
        "demo",
        parents=[parents[0]],
        help="run the gateway with an echo agent over a bundled script, crash it, restart it",
        allow_abbrev=False,
    )
    demo.add_argument(
        "--state-dir", metavar="DIR", type=Path,
        help="state directory for the demo (default: a new temporary directory)",
    )  # fmt: skip
    demo.set_defaults(handler=demo_command)


def demo_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``demo [--state-dir DIR]``: the real Gateway, a real crash and the recovery."""
    from hermes_core.cli.demo import run_demo

    state_dir: Path | None = args.state_dir or args.store_dir
    if state_dir is not None:
        try:
            state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            used = next(state_dir.iterdir(), None) is not None
        except OSError as exc:
            raise InvalidValueError(
                "state_dir", f"{state_dir}: cannot be used as the demo's state directory "
                f"({exc.strerror}); name a directory, or leave --state-dir out."
            ) from exc  # fmt: skip
        if used:  # its script's messages were answered there already: the crash would not come
            raise InvalidValueError(
                "state_dir", f"{state_dir} is not empty; the demo runs on a new or empty "
                "directory: name another, or leave --state-dir out for a temporary one."
            )  # fmt: skip
    return run_demo(state_dir)


def rekey_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``rekey (--to v2 | --forum PLATFORM CHAT_ID ...) [--dry-run] [--json]``: exit 1 when
    collisions were found or lanes were left as they are (both are listed)."""
    plugins = create_plugin_manager(config)
    with (
        SessionStore(
            config.sessions_dir, config, plugins=plugins, rekeying=True, read_only=args.dry_run
        ) as store,
        progress("rekey", 0, quiet=args.json) as bar,
    ):
        # the real run takes the database's writer lock: never beside a gateway
        forums = [(platform, chat) for platform, chat in args.forums or ()]
        report = store.rekey(dry_run=args.dry_run, forums=forums, progress=bar.told)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, ensure_ascii=False))
    else:
        print("\n".join(_rekey_lines(report, config)))
    return 1 if report.collisions or report.left else 0


def _rekey_lines(report: RekeyReport, config: GatewayConfig) -> list[str]:
    """The human-readable report of ``rekey``."""
    if report.forums:
        return _general_topic_lines(report)
    if report.schema_before == "v2":
        return ["the store already uses key schema v2; nothing to do"]
    verb = "would move" if report.dry_run else "moved"
    lines = [f"{old} -> {new}" for old, new in report.moves]
    lines.append(
        f"{verb} {len(report.moves)} lanes, {report.sessions} session rows, {report.queued} "
        f"queued events and {report.counts} restart counts; {report.unchanged} lanes already "
        "had their v2 key"
    )
    lines += [collision.describe() for collision in report.collisions]
    lines += [f"left as it is: {key}: {why}" for key, why in report.left]
    if not report.dry_run:
        lines.append(f"the store now uses key schema v2 ({report.batches} transactions)")
        if config.keys.key_schema != "v2":
            lines.append("set keys.schema: v2 (or remove it) before starting the gateway")
    return lines


def _general_topic_lines(report: RekeyReport) -> list[str]:
    """The human-readable report of ``rekey --forum``."""
    verb = "would move" if report.dry_run else "moved"
    lines = [f"{old} -> {new}" for old, new in report.moves]
    lines.append(
        f"{verb} {len(report.moves)} lanes, {report.sessions} session rows, {report.queued} "
        f"queued events and {report.counts} restart counts of "
        f"{', '.join(f'{platform} {chat}' for platform, chat in report.forums)} "
        "to the general topic"
    )
    lines += [f"left as it is: {key}: {why}" for key, why in report.left]
    return lines


def _source_options() -> argparse.ArgumentParser:
    """Parent parser with the source options shared by ``key`` and ``explain``."""
    parent = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    group = parent.add_argument_group(
        "source", "one option per SessionSource field; options override --source-json fields"
    )
    group.add_argument(
        "--source-json", metavar="FILE", help="SessionSource JSON object ('-' reads stdin)"
    )
    for name, _ in _SOURCE_FIELDS:
        option = "--" + name.replace("_", "-")
        help_text = _SOURCE_HELP.get(name, f"source field {name}")
        if name in _SOURCE_FLAGS:
            # None when absent, so an absent flag never overrides --source-json.
            group.add_argument(option, action="store_true", default=None, help=help_text)
        else:
            group.add_argument(option, metavar=name.upper(), help=help_text)
    return parent


def plugins_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``plugins [--json]``: every plugin, built-ins first, with its status and what it provides,
    then each problem (conflicts, lost essentials, failures) with its fix. Conflicts do not stop
    it: this is the command that diagnoses them."""
    infos = create_plugin_manager(config, check=False).list_plugins()
    if args.json:
        rows = [
            {
                "name": info.name,
                "status": info.status,
                "distribution": info.distribution,
                "version": info.version,
                "builtin": info.builtin,
                "hooks": list(info.hooks),
                "provides": dataclasses.asdict(info.provides),
                "problems": list(info.problems),
                "replaced": dict(info.replaced),
            }
            for info in infos
        ]
        print(json.dumps(rows, indent=2, ensure_ascii=False))
        return 0
    table = [("NAME", "STATUS", "DISTRIBUTION", "VERSION", "PROVIDES")]
    table += [
        (
            info.name,
            info.status,
            info.distribution or "-",
            info.version or "-",
            "; ".join(filter(None, [info.provides.describe(), _replaced(info.replaced)])) or "-",
        )
        for info in infos
    ]
    widths = [max(len(row[column]) for row in table) for column in range(4)]
    for row in table:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[4]]))
    problems = dict.fromkeys(problem for info in infos for problem in info.problems)
    if problems:
        print("\nProblems:")
        for problem in problems:
            print(f"- {problem}")
    return 0


def _replaced(replaced: tuple[tuple[str, str], ...]) -> str:
    """``replaced: matrix (by acme_matrix)``, or nothing."""
    named = ", ".join(f"{platform} (by {by})" for platform, by in replaced)
    return f"replaced: {named}" if named else ""


def key_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``key <source>``: only the key."""
    plugins = create_plugin_manager(config)
    print(resolve_key(_source(args, plugins), config, plugins).key)
    return 0


def explain_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``explain <source> [--json]``: how the source is keyed, as lines or one JSON object;
    with ``--payload`` the source read from the payload comes first."""
    plugins = create_plugin_manager(config)
    source = _source(args, plugins)
    explanation = explain_session_key(source, config, plugins)
    if args.payload is not None:
        explanation = {"source": source.to_dict(), **explanation}
    if args.json:
        print(json.dumps(explanation, indent=2, ensure_ascii=False))
    else:
        if args.payload is not None:
            print(f"source: {json.dumps(explanation.pop('source'), ensure_ascii=False)}")
        print("\n".join(format_explanation(explanation)))
    return 0


def _source(args: argparse.Namespace, plugins: HermesPluginManager) -> SessionSource:
    """The source given by ``--source-json`` and the field options (options win).

    Parsed with ``SessionSource.from_dict`` so bad values raise the library's named errors.
    ``is_bot`` and ``role_authorized`` are never read from data, so the flags are
    applied to the parsed source.
    """
    if getattr(args, "payload", None) is not None:
        data = _payload_source(args, plugins).to_dict()
    elif args.source_json is None:
        data = {"chat_id": ""}
    else:
        data = _read_json_object(args.source_json, "source_json", "the source")
    data.update(
        {name: getattr(args, name) for name in _SOURCE_VALUES if getattr(args, name) is not None}
    )
    check_chat_type(data.get("chat_type", "dm"), "--chat-type")
    source = SessionSource.from_dict(data, plugins=plugins)
    flags = {name: True for name in _SOURCE_FLAGS if getattr(args, name)}
    return source.replace(**flags) if flags else source


def _payload_source(args: argparse.Namespace, plugins: HermesPluginManager) -> SessionSource:
    """The source of the event the ``--platform`` plugin reads in the ``--payload`` file."""
    if args.source_json is not None or args.platform is None:
        raise InvalidValueError(
            "payload",
            "--payload takes the source from the payload: give --platform NAME with it and "
            "leave out --source-json.",
        )
    event = read_event(
        args.platform, _read_json_object(args.payload, "payload", "a payload"), plugins=plugins
    )
    if event is None:
        raise InvalidValueError(
            "payload",
            f"{args.payload}: this {args.platform} payload is not a user message (an edit, a "
            "reaction, a bot's or a service message), so no session key is built for it.",
        )
    return event.source


def _read_json_object(name: str, field: str, what: str) -> dict[str, Any]:
    """The JSON object in file ``name`` (``-``: stdin); unreadable or malformed → named error."""
    label = "standard input" if name == "-" else name
    try:
        if name == "-":  # its bytes, unless a caller of main() put a text stream there
            raw = read_at_most(getattr(sys.stdin, "buffer", sys.stdin), MAX_JSON_BYTES)
        else:
            raw = read_user_file(name, MAX_JSON_BYTES)
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise InvalidValueError(field, f"{label}: cannot read the file: {reason}") from exc
    try:
        data = json.loads(text)
    except RecursionError:
        raise InvalidValueError(
            field,
            f"{label}: the JSON is nested too deeply to read; {what} is a JSON object a "
            "few levels deep.",
        ) from None
    except ValueError as exc:
        raise InvalidValueError(field, f"{label}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidValueError(
            field, f"{label}: {what} must be a JSON object, not {type(data).__name__}"
        )
    return data
