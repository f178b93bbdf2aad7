"""Re-keying a v1 store to key schema v2: the schema record, the CLI, and a restart that
recovers everything in flight under the new keys."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import create_engine, text

from hermes_core import GatewayConfig, MessageEvent, SessionSource, build_session_key
from hermes_core.cli.main import main
from hermes_core.domain.errors import KeySchemaError, MessageRedeliveredError
from hermes_core.gateway.agents import EchoAgent, InMemoryAdapter
from hermes_core.gateway.runtime import Gateway
from hermes_core.store import SessionStore, keyschema
from hermes_core.store.backend import EntryDict
from hermes_core.testing import fresh_plugin_manager, telegram_dm
from hermes_plugins.sql_store.backend import SqlBackend

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

G = "-1002285219667"
TOPIC = SessionSource(
    platform="telegram", chat_id=G, chat_type="group", thread_id="17585", user_id="111"
)
MEMBER = SessionSource(platform="telegram", chat_id=G, chat_type="group", user_id="17585")
DM = telegram_dm("99")
QUIET = telegram_dm("7")


def v1(source: SessionSource) -> str:
    return build_session_key(source, schema="v1")


def v2(source: SessionSource) -> str:
    return build_session_key(source)


def configure(home: Path, settings: dict[str, Any], schema: str | None) -> GatewayConfig:
    """Write ``config.yaml`` (the CLI reads it) and return the same configuration."""
    data = dict(settings, **({"keys": {"schema": schema}} if schema else {}))
    (home / "config.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    return GatewayConfig.load(environ={"HERMES_HOME": str(home)})


@pytest.fixture
def v1_store(hermes_home: Path, settings: dict[str, Any]) -> Iterator[SessionStore]:
    config = configure(hermes_home, settings, "v1")
    with SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)) as store:
        yield store


def populate(store: SessionStore) -> dict[str, str]:
    """A crashed v1 gateway's state; returns session ids by lane name."""
    topic = store.get_or_create_session(TOPIC)
    store.append_to_transcript(topic.session_id, {"role": "user", "content": "topic talk"})
    # The v1 leak: the member shares the topic's key; a /new from the member starts a session
    # whose origin is the member, under the same key.
    member = store.get_or_create_session(MEMBER, force_new=True)
    assert member.session_key == topic.session_key == v1(TOPIC)
    store.append_to_transcript(member.session_id, {"role": "user", "content": "member talk"})
    store.mark_turn_active(v1(MEMBER))  # a turn in flight when the gateway died
    dm = store.get_or_create_session(DM)
    store.set_session_metadata(v1(DM), "model", "small")
    token = store.mark_turn_active(v1(DM))
    store._turns.record_delivery_obligation(
        v1(DM), dm.session_id, "telegram", "99", None, "the owed reply", "m1", None, token,
        reply={"role": "assistant", "content": "the owed reply"},
    )  # fmt: skip
    store._queue.add(v1(DM), MessageEvent(source=DM, text="waiting in line", message_id="m2"))
    quiet = store.get_or_create_session(QUIET)
    store.suspend_session(v1(QUIET))
    store._counts.current.save({v1(MEMBER): 1})
    legacy = quiet.to_dict() | {"session_key": "agent:main:telegram:dm:legacy"}
    legacy.pop("origin")  # written by an old gateway: the source is unknown
    store.run(store._backing.backend.put_route, legacy)
    return {"topic": topic.session_id, "member": member.session_id, "dm": dm.session_id,
            "quiet": quiet.session_id}  # fmt: skip


def rekey_cli(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    status = main(["rekey", "--to", "v2", "--json", *args])
    return status, json.loads(capsys.readouterr().out)


@pytest.mark.slow
async def test_rekey_then_restart_recovers_everything_under_v2_keys(
    hermes_home: Path, settings: dict[str, Any], v1_store: SessionStore,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    ids = populate(v1_store)
    v1_store.close()

    status, plan = rekey_cli("--dry-run", capsys=capsys)
    assert status == 1  # a collision and a lane left as it is
    assert {(m["from"], m["to"]) for m in plan["moves"]} == {
        (v1(MEMBER), v2(MEMBER)), (v1(DM), v2(DM)), (v1(QUIET), v2(QUIET)),
    }  # fmt: skip
    assert plan["collisions"] == [
        {"key": v1(TOPIC), "targets": sorted([v2(TOPIC), v2(MEMBER)]), "recorded": True}
    ]
    assert [left["key"] for left in plan["left"]] == ["agent:main:telegram:dm:legacy"]
    assert (plan["sessions"], plan["queued"], plan["counts"], plan["batches"]) == (4, 1, 1, 0)
    with pytest.raises(KeySchemaError, match="rekey --to v2"):  # the dry run wrote nothing
        SessionStore.open(configure(hermes_home, settings, None))

    status, done = rekey_cli(capsys=capsys)
    assert status == 1
    assert {k: v for k, v in done.items() if k not in ("dry_run", "batches")} == {
        k: v for k, v in plan.items() if k not in ("dry_run", "batches")
    }
    config = configure(hermes_home, settings, None)  # v2, the default
    with SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)) as store:
        assert store.peek_session_id(v2(MEMBER)) == ids["member"]
        assert store.session_row(ids["topic"]).session_key == v2(TOPIC)  # type: ignore[union-attr]
        assert store.get_session_metadata(v2(DM), "model") == "small"
        quiet = store.lookup_by_session_key(v2(QUIET))
        assert quiet is not None
        assert quiet.suspended
        assert store.lookup_by_session_key("agent:main:telegram:dm:legacy") is not None
        assert [key for _id, key, _event in store._queue.restore()] == [v2(DM)]
        with pytest.raises(MessageRedeliveredError):  # the redelivery record moved too
            store._queue.add(v2(DM), MessageEvent(source=DM, text="again", message_id="m2"))
        assert store._counts.current.load() == {v2(MEMBER): 1}
    status, again = rekey_cli(capsys=capsys)
    assert (status, again["schema_before"], again["moves"]) == (0, "v2", [])

    adapter = InMemoryAdapter("telegram")
    gateway = Gateway(config, fresh_plugin_manager(hermes_home), lambda _e: EchoAgent(), [adapter])
    await gateway.start()
    await gateway.idle()
    assert "the owed reply" in adapter.texts("99")
    assert "echo: waiting in line" in adapter.texts("99")
    assert any(text.startswith("echo:") for text in adapter.texts(G))  # the resumed turn
    store = gateway.store
    assert store.peek_session_id(v2(MEMBER)) == ids["member"]
    assert store.peek_session_id(v2(DM)) == ids["dm"]
    recovery = gateway.state.context
    assert recovery is not None
    assert recovery.report.stuck_loop is not None
    assert recovery.report.stuck_loop.counts == {v2(MEMBER): 2}  # on from the moved 1
    transcript = [m["content"] for m in store.load_transcript(ids["member"])]
    assert transcript[0] == "member talk"
    assert [m["content"] for m in store.load_transcript(ids["topic"])] == ["topic talk"]
    await gateway.stop()


@pytest.mark.slow
@pytest.mark.parametrize("first", [TOPIC, MEMBER], ids=["topic-first", "member-first"])
def test_dry_run_reports_the_topic_member_collision_when_they_shared_one_session(
    v1_store: SessionStore, first: SessionSource, capsys: pytest.CaptureFixture[str]
) -> None:
    """The common case of the v1 leak: the topic and the member wrote to one session, so only
    the first one's origin is recorded; the dry run still names both v2 keys."""
    for source in (first, MEMBER if first is TOPIC else TOPIC):
        entry = v1_store.get_or_create_session(source)
        v1_store.append_to_transcript(entry.session_id, {"role": "user", "content": "hi"})
    junk = v1_store.get_or_create_session(DM)  # and a routing row whose entry is junk
    v1_store.close()
    _set_entry_json(v1_store, v1(DM), "junk")
    status, plan = rekey_cli("--dry-run", capsys=capsys)
    assert status == 1
    assert plan["collisions"] == [
        {"key": v1(TOPIC), "targets": sorted([v2(TOPIC), v2(MEMBER)]), "recorded": False}
    ]
    assert plan["moves"] == [{"from": v1(TOPIC), "to": v2(first)}]
    assert [left["key"] for left in plan["left"]] == [junk.session_key]
    assert main(["rekey", "--to", "v2", "--dry-run"]) == 1
    out = capsys.readouterr().out
    assert f"collision: {v1(TOPIC)} is the v1 key of sources with different v2 keys" in out


def _set_entry_json(store: SessionStore, key: str, value: str) -> None:
    """Write ``value`` into the routing row's ``entry_json`` behind the store's back."""
    url = store.config.storage_url
    engine = create_engine(url if "://" in url else f"sqlite:///{url}")
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE gateway_routing SET entry_json = :value WHERE session_key = :key"),
            {"value": value, "key": key},
        )
    engine.dispose()


@pytest.mark.slow
def test_an_interrupted_rekey_is_refused_at_start_and_finished_by_running_it_again(
    hermes_home: Path, settings: dict[str, Any], v1_store: SessionStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    ids = populate(v1_store)
    v1_store.close()
    config = configure(hermes_home, settings, None)
    store = SessionStore(config.sessions_dir, config, rekeying=True)
    real = store._backing.backend.move_keys  # type: ignore[attr-defined]
    calls: list[int] = []

    def crash_after_one(moves: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed mid-way")
        real(moves)

    monkeypatch.setattr(store._backing.backend, "move_keys", crash_after_one)
    with pytest.raises(KeyboardInterrupt):
        store.rekey(batch_size=1)
    store.close()
    with pytest.raises(KeySchemaError, match="was interrupted; run `hermes-sessions rekey"):
        SessionStore.open(config)
    resumed = SessionStore(config.sessions_dir, config, rekeying=True)
    report = resumed.rekey(batch_size=1)
    resumed.close()
    assert report.schema_before == "v1>v2"
    assert report.unchanged == 1  # the lane the first run moved
    with SessionStore.open(config) as store:
        assert store.peek_session_id(v2(MEMBER)) == ids["member"]
        assert store.peek_session_id(v2(DM)) == ids["dm"]
        assert store.peek_session_id(v2(QUIET)) == ids["quiet"]
        assert store._counts.current.load() == {v2(MEMBER): 1}


def test_rekey_refuses_while_a_writer_holds_the_store(
    hermes_home: Path, settings: dict[str, Any], v1_store: SessionStore,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    populate(v1_store)  # v1_store stays open: it holds the database as a gateway would
    assert main(["rekey", "--to", "v2"]) == 2
    assert "another writer" in capsys.readouterr().err
    assert main(["rekey", "--to", "v2", "--dry-run"]) == 1  # a dry run may run beside it
    v1_store.close()
    capsys.readouterr()
    with SessionStore.open(configure(hermes_home, settings, "v1")) as store:
        assert store.peek_session_id(v1(DM)) is not None  # nothing moved


def test_the_configured_schema_must_match_the_store(
    hermes_home: Path, settings: dict[str, Any]
) -> None:
    with SessionStore.open(configure(hermes_home, settings, None)) as store:
        store.get_or_create_session(DM)
        assert store.key_schema == "v2"
    with pytest.raises(KeySchemaError, match=r"follow key schema v2 but keys\.schema is v1"):
        SessionStore.open(configure(hermes_home, settings, "v1"))


def _forget_key_schema(url: str) -> None:
    """Delete the store's key-schema record, as a store from before schemas were recorded."""
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM state_meta WHERE key = 'key_schema'"))
    engine.dispose()


@pytest.mark.parametrize("schema", ["v1", "v2"])
def test_an_unrecorded_schema_is_told_by_the_first_lane_that_tells_it(
    hermes_home: Path, settings: dict[str, Any], schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lanes that cannot tell (no origin) fill the first pages; the DM after them tells the
    schema, and the pages after it are never read."""
    config = configure(hermes_home, settings, schema)
    with SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)) as store:
        entry = store.get_or_create_session(DM)
        assert entry.session_key == (v1(DM) if schema == "v1" else v2(DM))
        legacy = entry.to_dict()
        legacy.pop("origin")
        for prefix in ("agent:main:a", "agent:main:z"):  # before and after the DM's key
            for n in range(5):
                route = legacy | {"session_key": f"{prefix}:dm:{n}"}
                store.run(store._backing.backend.put_route, route)
    _forget_key_schema(config.storage_url)
    monkeypatch.setattr(keyschema, "ROUTE_PAGE", 2)
    pages: list[str | None] = []
    read_page = SqlBackend.route_page

    def counted(self: SqlBackend, after: str | None, limit: int) -> list[EntryDict]:
        pages.append(after)
        return read_page(self, after, limit)

    monkeypatch.setattr(SqlBackend, "route_page", counted)
    with SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)) as store:
        assert store.key_schema == schema
    assert len(pages) == 3  # five lanes without an origin, then the DM in the third page
    monkeypatch.undo()
    other = "v2" if schema == "v1" else "v1"
    with pytest.raises(KeySchemaError, match=f"follow key schema {schema}"):
        SessionStore.open(configure(hermes_home, settings, other))


def test_a_store_from_before_schemas_were_recorded_is_v1(
    hermes_home: Path, settings: dict[str, Any], v1_store: SessionStore
) -> None:
    v1_store.get_or_create_session(DM)
    v1_store.close()
    _forget_key_schema(v1_store.config.storage_url)
    with pytest.raises(KeySchemaError, match="follow key schema v1"):
        SessionStore.open(configure(hermes_home, settings, None))
    with SessionStore.open(configure(hermes_home, settings, "v1")) as store:
        assert store.peek_session_id(v1(DM)) is not None
