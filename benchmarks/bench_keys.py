"""Key-building throughput through ``build_session_key`` with a plugin manager, beside a floor.

The floor applies the same generic rule to plain dicts with no plugins, validation or models: the
least any key builder must do. Run: ``python -m benchmarks.bench_keys [--seconds S]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from hermes_core import GatewayConfig, SessionSource, build_session_key, create_plugin_manager

ROWS: list[dict[str, Any]] = [
    {"platform": "telegram", "chat_id": "99"},
    {"platform": "telegram", "chat_id": "-1002285219667", "chat_type": "group", "user_id": "42"},
    {"platform": "telegram", "chat_id": "-1002285219667", "chat_type": "group", "user_id": "42",
     "thread_id": "17585"},
    {"platform": "discord", "chat_id": "channel-1", "chat_type": "channel",
     "prospective_thread_id": "msg-100", "user_id": "u1"},
    {"platform": "slack", "chat_id": "C1", "chat_type": "group", "thread_id": "1111",
     "user_id": "U1", "scope_id": "T1"},
    {"platform": "signal", "chat_id": "", "user_id": "+1555", "user_id_alt": "uuid-1"},
]  # fmt: skip
WHATSAPP_ROWS: list[dict[str, Any]] = [
    {"platform": "whatsapp", "chat_id": "60123456789@s.whatsapp.net"},
    {"platform": "whatsapp", "chat_id": "1203@g.us", "chat_type": "group",
     "user_id": "60123456789:4@s.whatsapp.net"},
]  # fmt: skip


def floor_key(row: dict[str, Any]) -> str:
    """The generic rule on a plain dict (no canonicalisers, no scope hooks, no validation)."""
    is_dm = row.get("chat_type", "dm") == "dm"
    thread = row.get("thread_id") or ""
    prospective = not thread and not is_dm and bool(row.get("prospective_thread_id"))
    if prospective:
        thread = row["prospective_thread_id"]
    chat_id = row.get("chat_id") or ""
    isolate = not chat_id if is_dm else not thread
    participant = (row.get("user_id_alt") or row.get("user_id") or "") if isolate else ""
    slot = "thread" if prospective else row.get("chat_type", "dm")
    parts = ["agent:main", row["platform"], slot, row.get("scope_id") or "", chat_id]
    parts += [participant, thread] if is_dm else [thread, participant]
    return ":".join(part for part in parts if part)


def rate(call: Callable[[Any], object], items: Sequence[Any], seconds: float) -> float:
    """Calls per second of ``call`` cycling over ``items`` for about ``seconds``."""
    done = 0
    batch = list(items) * max(1, 2000 // len(items))
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        for item in batch:
            call(item)
        done += len(batch)
    return done / (time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as home:
        config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": home})
        manager = create_plugin_manager(config, load_entrypoints=False)
        sources = [SessionSource(**row) for row in ROWS]
        whatsapp = [SessionSource(**row) for row in WHATSAPP_ROWS]
        if [build_session_key(s, plugins=manager) for s in sources] != list(map(floor_key, ROWS)):
            raise SystemExit("the floor computes different keys; fix floor_key before comparing")
        floor = rate(floor_key, ROWS, args.seconds)
        keys = rate(lambda s: build_session_key(s, plugins=manager), sources, args.seconds)
        wa = rate(lambda s: build_session_key(s, plugins=manager), whatsapp, args.seconds)
    print(f"cpu: {os.cpu_count()} cores visible, single-threaded run, {args.seconds:.1f} s each")
    print(f"plain-dict floor          : {floor:12,.0f} keys/s")
    print(f"build_session_key (mixed) : {keys:12,.0f} keys/s  ratio to floor {keys / floor:.2f}")
    print(f"build_session_key (whatsapp, mapping dir absent): {wa:12,.0f} keys/s")
    print("targets: >= 300,000 keys/s and >= 0.2 of the floor")


if __name__ == "__main__":
    main()
