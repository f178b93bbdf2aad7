"""``chat`` and ``replay``: the real :class:`Gateway` on a state directory, fed by the operator
at a console or by a file of recorded events. A console adapter per registered platform prints
what the gateway sends; after each message come its session key and the lane's session id.

Each message's turn runs to its end before the next is read, so what is printed belongs to it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import re
import stat
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from hermes_core.cli.common import CHAT_TYPES, check_chat_type
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import HermesError, InvalidValueError, MessageNotStoredError
from hermes_core.domain.models import MessageEvent, SessionSource
from hermes_core.domain.terminal import safe_text
from hermes_core.gateway.agent_loading import LoadedAgent, load_agent
from hermes_core.gateway.agents import ConsoleAdapter
from hermes_core.gateway.runtime import Gateway
from hermes_core.plugins.manager import HermesPluginManager, create_plugin_manager

PROG = "hermes-sessions"
MAX_EVENT_LINE = 1 << 20
"""``replay`` skips a line over 1 MiB (an event is far smaller), reading past it in pieces."""
CONSOLE_COMMAND = re.compile(r":([a-z]+)(?:\s+(.*))?")
"""A console command line (``:as bob``); other lines, ``:)`` included, are messages."""
HELP = """console commands (other lines are sent as messages, /new /reset /stop /queue included):
  :as USER [NAME]     send as another user (NAME: the display name)
  :chat ID [TYPE]     go to another chat (TYPE: dm, group, channel or thread; default: the
                      current type); leaves the thread
  :thread [ID]        go to a thread of this chat (no ID: leave the thread)
  :platform NAME      go to the same chat ids on another platform
  :where              print where messages go and their session key
  :quit               stop the gateway (so does the end of input)"""

USAGES = {
    line.split()[0][1:]: re.split(r"\s{2,}", line.strip())[0]
    for line in HELP.splitlines()
    if line.startswith("  :")
}
"""Each console command's usage line (``chat: ":chat ID [TYPE]"``), read from :data:`HELP`."""


def register(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Add ``chat`` and ``replay``."""
    agent = agent_argument()
    chat = commands.add_parser(
        "chat", parents=[*parents, agent], allow_abbrev=False,
        help="talk to a gateway on the state directory as a user of a platform",
    )  # fmt: skip
    chat.add_argument("--platform", required=True, help="registered platform name")
    chat.add_argument("--chat-id", required=True, metavar="ID", help="chat id")
    chat.add_argument(
        "--chat-type", default="dm", choices=CHAT_TYPES, help="chat type (default: dm)"
    )
    chat.add_argument("--thread-id", metavar="ID", help="thread id (default: none)")
    chat.add_argument("--user-id", default="operator", metavar="ID", help="default: operator")
    chat.add_argument("--user-name", metavar="NAME", help="display name (default: none)")
    chat.set_defaults(handler=chat_command, creates_state_dir=True)

    replay = commands.add_parser(
        "replay", parents=[*parents, agent], allow_abbrev=False,
        help="feed recorded events (one JSON object per line) through a gateway, in order",
    )  # fmt: skip
    replay.add_argument("events", metavar="EVENTS.jsonl", type=Path)
    replay.set_defaults(handler=replay_command, creates_state_dir=True)


def agent_argument() -> argparse.ArgumentParser:
    """The ``--agent`` option of the commands that run a gateway."""
    agent = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    agent.add_argument(
        "--agent", metavar="NAME", help="the agent, instead of the configuration's agent.use: "
        "an entry point of hermes.agents (echo, openai, ...) or MODULE:ATTR naming a factory "
        "called with the lane's SessionEntry or a builder called with (options, config)",
    )  # fmt: skip
    return agent


def _gateway(args: argparse.Namespace, config: GatewayConfig) -> tuple[Gateway, LoadedAgent]:
    """A gateway with the agent of ``--agent`` or ``agent.use`` and a console adapter for every
    registered platform; and that agent, to close after the gateway stops."""
    agent = load_agent(config, args.agent)
    plugins = create_plugin_manager(config)
    adapters = [ConsoleAdapter(name) for name in plugins.platforms()]
    return Gateway(config, plugins, agent.factory, adapters), agent


async def _run(gateway: Gateway, agent: LoadedAgent, body: Callable[[], Awaitable[int]]) -> int:
    """Start ``gateway`` (refused with ``GatewayLockedError`` while another holds the state),
    run ``body``, stop it with a drain, close ``agent`` and say how it stopped; ``body``'s exit
    status."""
    await gateway.start()
    try:
        status = await body()
    finally:
        drained = await gateway.stop()
        await agent.aclose()
    print("gateway stopped" if drained else
          "gateway stopped; the turns left running resume at its next start")  # fmt: skip
    return status


async def _feed(gateway: Gateway, event: MessageEvent, where: str) -> bool:
    """Hand ``event`` to the gateway and wait for its turn to end (the console adapters print
    the replies); then print its key and the lane's session id. False when it was not stored
    (the error is printed)."""
    try:
        await gateway.handle_message(event)
    except MessageNotStoredError as exc:
        _error(f"{where}not stored: {exc}")
        return False
    await gateway.idle()
    key = gateway.store.session_key_for(event.source)
    entry = await asyncio.to_thread(gateway.store.lookup_by_session_key, key)
    print(f"  key {key}  session {entry.session_id if entry else '-'}", flush=True)
    return True


def _error(message: str) -> None:
    """One error line, with the prefix of every command's errors; the command goes on."""
    print(safe_text(f"{PROG}: error: {' '.join(message.split())}"), file=sys.stderr, flush=True)


def _sender(source: SessionSource) -> str:
    return source.user_name or source.user_id or "?"


# -- chat ----------------------------------------------------------------------------------------


class Console:
    """Where the operator's messages go: the source fields the console commands change."""

    def __init__(self, args: argparse.Namespace, plugins: HermesPluginManager) -> None:
        self.plugins = plugins
        self.fields: dict[str, str | None] = {
            "platform": args.platform, "chat_id": args.chat_id, "chat_type": args.chat_type,
            "thread_id": args.thread_id, "user_id": args.user_id, "user_name": args.user_name,
        }  # fmt: skip
        self.source = self._source(self.fields)

    def _source(self, fields: dict[str, str | None]) -> SessionSource:
        return SessionSource.from_dict(
            {name: value for name, value in fields.items() if value is not None},
            plugins=self.plugins,
        )

    def describe(self) -> str:
        """``telegram group 43 thread 17 as bob``."""
        source = self.source
        thread = f" thread {source.thread_id}" if source.thread_id else ""
        where = f"{source.platform} {source.chat_type} {source.chat_id}{thread}"
        return f"{where} as {_sender(source)}"

    def command(self, name: str, rest: str) -> bool:
        """Carry out the console command ``:name rest``; False for ``:quit``. A bad command
        raises a :class:`HermesError` and changes nothing."""
        words = rest.split()
        changes: dict[str, str | None]
        if name == "quit":
            return False
        if name == "help":
            print(HELP)
            return True
        if name == "where":
            return True
        if name == "as" and words:
            changes = {"user_id": words[0], "user_name": " ".join(words[1:]) or None}
        elif name == "chat" and 1 <= len(words) <= 2:
            chat_type = check_chat_type(words[1], ":chat") if len(words) == 2 else None
            changes = {"chat_id": words[0], "thread_id": None}
            changes["chat_type"] = chat_type or self.fields["chat_type"]
        elif name == "thread" and len(words) <= 1:
            changes = {"thread_id": words[0] if words else None}
        elif name == "platform" and len(words) == 1:
            changes = {"platform": words[0]}
        elif name in USAGES:
            raise InvalidValueError(
                "command", f"usage: {USAGES[name]} (:help says what it does); nothing changed."
            )
        else:
            raise InvalidValueError(
                "command", f":{name} {rest}".strip() + " is not a console command; :help "
                "lists them."
            )  # fmt: skip
        fields = {**self.fields, **changes}
        self.source = self._source(fields)
        self.fields = fields
        return True


async def _read_line(prompt: str) -> str | None:
    """The next line of standard input without its newline (None at its end). On a terminal
    the prompt is shown; otherwise the line is echoed after it. Read in a daemon thread, so a
    pending read neither blocks the event loop nor holds up the exit."""
    loop = asyncio.get_running_loop()
    line: asyncio.Future[str | None] = loop.create_future()
    interactive = sys.stdin.isatty()

    def deliver(text: str | None) -> None:
        if not line.done():
            line.set_result(text)

    def read() -> None:
        text: str | None
        try:
            text = input(prompt) if interactive else sys.stdin.readline() or None
        except EOFError:
            text = None
        with contextlib.suppress(RuntimeError):  # a closed loop (interrupted) waits for nothing
            loop.call_soon_threadsafe(deliver, text)

    threading.Thread(target=read, name="console-input", daemon=True).start()
    text = await line
    if text is not None and not interactive:
        text = text.removesuffix("\n")
        print(f"{prompt}{text}", flush=True)
    return text


async def _chat(gateway: Gateway, console: Console) -> int:
    print(f"gateway on {gateway.config.hermes_home}; :help lists the console commands, :quit "
          "or the end of input stops it")  # fmt: skip
    print(f"{console.describe()}: {gateway.store.session_key_for(console.source)}")
    while (line := await _read_line(f"{_sender(console.source)}> ")) is not None:
        command = CONSOLE_COMMAND.fullmatch(line.strip())
        if command is None:
            if line.strip():
                await _feed(gateway, MessageEvent(source=console.source, text=line), "")
            continue
        try:
            if not console.command(command.group(1), command.group(2) or ""):
                break
        except HermesError as exc:
            _error(str(exc))
            continue
        print(f"{console.describe()}: {gateway.store.session_key_for(console.source)}")
    return 0


def chat_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``chat --platform P --chat-id C [...]``: an interactive console gateway."""
    gateway, agent = _gateway(args, config)
    console = Console(args, gateway.plugins)  # a bad --platform or id: an error before the start
    try:
        return asyncio.run(_run(gateway, agent, lambda: _chat(gateway, console)))
    except KeyboardInterrupt:
        print()
        return 130


# -- replay --------------------------------------------------------------------------------------


def _parse(raw: bytes, plugins: HermesPluginManager) -> MessageEvent:
    """One recorded event; a named error saying what is wrong with the line."""
    try:
        data = json.loads(raw.decode("utf-8").strip())
    except UnicodeDecodeError:
        raise InvalidValueError("event", "not UTF-8 text") from None
    except ValueError as exc:
        raise InvalidValueError("event", f"not JSON ({exc})") from None
    return MessageEvent.from_dict(data, plugins=plugins)


def _lines(stream: BinaryIO) -> Iterator[bytes | None]:
    """The lines of ``stream``, each read with a bound: None stands for a line over
    :data:`MAX_EVENT_LINE` bytes, which is read past in pieces and never held whole."""
    while raw := stream.readline(MAX_EVENT_LINE + 1):
        if len(raw) <= MAX_EVENT_LINE or raw.endswith(b"\n"):
            yield raw
            continue
        while (rest := stream.readline(MAX_EVENT_LINE)) and not rest.endswith(b"\n"):
            pass
        yield None


async def _replay(gateway: Gateway, path: Path, lines: BinaryIO) -> int:
    fed = skipped = 0
    for number, raw in enumerate(_lines(lines), start=1):
        if raw is not None and not raw.strip():
            continue
        where = f"{path}:{number}: "
        try:
            if raw is None:
                raise InvalidValueError("event", f"longer than {MAX_EVENT_LINE:,} bytes")
            event = _parse(raw, gateway.plugins)
            gateway.store.session_key_for(event.source)  # ids no key can hold: a bad line too
        except InvalidValueError as exc:
            _error(f"{where}skipped: {exc}")
            skipped += 1
            continue
        print(safe_text(f"line {number}: {_sender(event.source)}> {event.text}"), flush=True)
        if await _feed(gateway, event, where):
            fed += 1
        else:
            skipped += 1
    print(f"replayed {fed} event(s), skipped {skipped} line(s)")
    return 1 if skipped else 0


def replay_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``replay EVENTS.jsonl``: exit 0 when every line was fed, 1 when some were skipped."""
    path: Path = args.events
    try:
        if not stat.S_ISREG(mode := path.stat().st_mode) and not stat.S_ISFIFO(mode):
            raise OSError(errno.EINVAL, "not a regular file or a pipe")  # /dev/zero never ends
        lines = path.open("rb")
    except OSError as exc:
        raise InvalidValueError(
            "events", f"{path}: cannot read it ({exc.strerror}); name a file of recorded "
            "events, one JSON object per line."
        ) from exc  # fmt: skip
    with lines:
        gateway, agent = _gateway(args, config)
        return asyncio.run(_run(gateway, agent, lambda: _replay(gateway, path, lines)))
