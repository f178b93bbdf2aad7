"""Key-building throughput through ``build_key_from_flags`` with a plugin manager, beside a floor.

The floor applies the same generic rule to plain dicts with no plugins, validation or models,
joined as key schema v1 does: the least any key builder must do. Both schemas are measured (v2
tags and escapes its components). Run: ``python -m benchmarks.bench_keys [--seconds S]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from hermes_core import (
    GatewayConfig,
    HermesPluginManager,
    SessionSource,
    build_key_from_flags,
    create_plugin_manager,
)
from hermes_core.domain.keys import KEY_SCHEMAS, KeySchema

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
    """The generic rule on a plain dict, joined as in v1 (no canonicalisers, scope hooks or
    validation)."""
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


def key_of(manager: HermesPluginManager, schema: KeySchema, source: SessionSource) -> str:
    """One key, as the benchmark calls it."""
    return build_key_from_flags(source, plugins=manager, schema=schema)


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
        v1_keys = [build_key_from_flags(s, plugins=manager, schema="v1") for s in sources]
        if v1_keys != list(map(floor_key, ROWS)):
            raise SystemExit("the floor computes different keys; fix floor_key before comparing")
        floor = rate(floor_key, ROWS, args.seconds)
        figures = {
            (schema, name): rate(functools.partial(key_of, manager, schema), items, args.seconds)
            for schema in KEY_SCHEMAS
            for name, items in (("mixed", sources), ("whatsapp", whatsapp))
        }
    print(f"cpu: {os.cpu_count()} cores visible, single-threaded run, {args.seconds:.1f} s each")
    print(f"{'plain-dict floor (v1 join)':<31}: {floor:12,.0f} keys/s")
    for (schema, name), keys in figures.items():
        label = f"build_key_from_flags {schema} ({name})"
        note = f"ratio to floor {keys / floor:.2f}" if name == "mixed" else "(mapping dir absent)"
        print(f"{label:<31}: {keys:12,.0f} keys/s  {note}")
    print("targets (mixed, either schema): >= 300,000 keys/s and >= 0.2 of the floor")


if __name__ == "__main__":
    main()
