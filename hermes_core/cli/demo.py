"""``hermes-sessions demo``: the real Gateway with ``EchoAgent`` over a bundled script, a real
crash (SIGKILL at a named crash point) and the restart that recovers from it.

The demo runs three child processes on one state directory (SQLite, the default store): the
first handles a few messages and stops cleanly; the second is killed right after a reply was
stored but before it was sent; the third starts, recovers that reply (delivered once, with the
re-send prefix) and goes on with queueing and the commands. Everything each process sends is
printed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.models import MessageEvent, SessionSource
from hermes_core.gateway.agents import ConsoleAdapter, EchoAgent
from hermes_core.gateway.runtime import Gateway
from hermes_core.plugins.manager import create_plugin_manager
from hermes_core.turns import crashpoints

CRASH_POINT = "reply_stored"


def _source(chat: str, user: str, name: str, **fields: str) -> SessionSource:
    chat_type = fields.pop("chat_type", "dm")
    return SessionSource(
        platform="telegram", chat_id=chat, chat_type=chat_type, user_id=user, user_name=name,
        **fields,
    )  # fmt: skip


ALICE_DM = _source("1001", "1001", "Alice")
BOB_DM = _source("1002", "1002", "Bob")
TOPIC_ALICE = _source("-100200", "1001", "Alice", chat_type="group", chat_name="Lab",
                      thread_id="17")  # fmt: skip
TOPIC_BOB = _source("-100200", "1002", "Bob", chat_type="group", chat_name="Lab", thread_id="17")


async def _say(gateway: Gateway, source: SessionSource, text: str, ref: str) -> None:
    who = source.user_name or source.user_id
    print(f"  {who} in {gateway.store.session_key_for(source)}: {text}", flush=True)
    await gateway.handle_message(MessageEvent(source=source, text=text, message_id=ref))


def _gateway(state_dir: Path, delay: float) -> Gateway:
    config = GatewayConfig.from_dict(
        {"display": {"busy_input_mode": "queue"}}, environ={"HERMES_HOME": str(state_dir)}
    )
    plugins = create_plugin_manager(config, load_entrypoints=False)
    return Gateway(
        config,
        plugins,
        lambda entry: EchoAgent(delay),
        [ConsoleAdapter(ALICE_DM.platform, indent="    ")],
    )


async def first_process(state_dir: Path) -> None:
    """Ordinary turns in a DM and in a shared forum topic, then a clean stop."""
    gateway = _gateway(state_dir, delay=0.0)
    await gateway.start()
    await _say(gateway, ALICE_DM, "Hi! Can you remember that my cat is called Miso?", "m1")
    await gateway.idle()
    await _say(gateway, TOPIC_ALICE, "Shall we plan the release in this topic?", "m2")
    await gateway.idle()
    await gateway.stop()


async def crashing_process(state_dir: Path) -> None:
    """A turn whose process dies (by its crash point) after the reply was stored."""
    gateway = _gateway(state_dir, delay=0.0)
    await gateway.start()
    await _say(gateway, BOB_DM, "What did we decide yesterday?", "m3")
    await gateway.idle()


async def second_process(state_dir: Path) -> None:
    """The restart: recovery, then queueing and commands."""
    gateway = _gateway(state_dir, delay=0.3)
    await gateway.start()
    print("  (gateway restarted: the stored reply above was recovered, not recomputed)")
    await _say(gateway, TOPIC_BOB, "Yes, Friday works for me.", "m4")
    await asyncio.sleep(0.05)
    await _say(gateway, TOPIC_BOB, "Also: remember the changelog.", "m5")  # queued behind it
    await _say(gateway, TOPIC_BOB, "/queue and tag the release afterwards", "m6")
    await gateway.idle()
    await _say(gateway, ALICE_DM, "/new", "m7")
    await _say(gateway, ALICE_DM, "A fresh start: what is my cat called?", "m8")
    await gateway.idle()
    await gateway.stop()
    store = gateway.store
    print("\nsessions:")
    for entry in store.list_sessions():
        count = len(store.load_transcript(entry.session_id))
        print(f"  {entry.session_key} → {entry.session_id} ({count} messages)")


def _child(state_dir: Path, phase: str, crash_at: str | None) -> int:
    environ = {key: value for key, value in os.environ.items() if key != "HERMES_CRASH_AT"}
    environ["HERMES_HOME"] = str(state_dir)
    if crash_at:
        environ["HERMES_CRASH_AT"] = crash_at
    environ.setdefault("PYTHONWARNINGS", "ignore")
    command = [sys.executable, "-m", "hermes_core.cli.demo", phase, str(state_dir)]
    return subprocess.run(command, env=environ, check=False).returncode


PHASES = {"first": first_process, "crash": crashing_process, "restart": second_process}


def run_demo(state_dir: Path | None = None) -> int:
    """Run the three phases in child processes; 0 when the demo went as described."""
    state = state_dir or Path(tempfile.mkdtemp(prefix="hermes-demo-"))
    print(f"state directory: {state}  (SQLite store: {state / 'state.db'})\n")
    print("1) a gateway handles two messages and stops cleanly:")
    if _child(state, "first", None) != 0:
        return 1
    print(f"\n2) a gateway is killed (SIGKILL) at crash point '{CRASH_POINT}':")
    crashed = _child(state, "crash", CRASH_POINT)
    if crashed != -signal.SIGKILL:
        print(f"hermes-sessions: error: the demo's second gateway was expected to die by "
              f"SIGKILL, got exit code {crashed}", file=sys.stderr)  # fmt: skip
        return 1
    print("  ✝ killed after storing Bob's reply, before sending it\n")
    print("3) a new gateway starts on the same state directory:")
    if _child(state, "restart", None) != 0:
        return 1
    where = shlex.quote(str(state))
    print(f"\nnext, see what was stored: hermes-sessions ls --state-dir {where}")
    print(f"then one lane, by a key listed: hermes-sessions show KEY --state-dir {where}")
    return 0


if __name__ == "__main__":
    # Log lines carry their level; the crash point is announced by the demo itself, not by
    # the test-only warning that arming it logs.
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger(crashpoints.__name__).setLevel(logging.ERROR)
    asyncio.run(PHASES[sys.argv[1]](Path(sys.argv[2])))
