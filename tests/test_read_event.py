"""``hermes_core.read_event``: the seam to the platforms' readers, and untrusted payloads.

Whatever JSON arrives, reading it either gives an event, gives None, or raises
``MalformedEventError``: arbitrary JSON and the documented samples of the reader tests with one
field replaced by arbitrary JSON are both tried.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import test_readers_discord as discord
import test_readers_slack as slack
import test_readers_telegram as telegram
import test_readers_whatsapp as whatsapp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hermes_core import (
    GatewayConfig,
    InvalidValueError,
    MalformedEventError,
    MessageEvent,
    PlatformSpec,
    ReadContext,
    SessionSource,
    UnknownPlatformError,
    build_session_key,
    create_plugin_manager,
    hookimpl,
    read_event,
)
from hermes_core.domain.keys import KEY_SCHEMAS
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.testing import fresh_plugin_manager

FIELD_NAMES = [
    "message", "channel_post", "chat", "id", "type", "from", "sender_chat", "text", "caption",
    "photo", "is_topic_message", "message_thread_id", "op", "t", "d", "author", "channel_id",
    "guild_id", "content", "attachments", "event", "channel", "user", "ts", "thread_ts",
    "channel_type", "payload", "files", "object", "entry", "changes", "field", "value",
    "messages", "contacts", "profile", "group_id", "key", "remoteJid", "participant",
    "remoteJidAlt", "conversation", "ephemeralMessage", "extendedTextMessage",
    "callback_query", "data", "business_message", "venue", "reply_to_message", "date",
    "is_forum", "components", "component", "custom_id", "values", "buttonsResponseMessage",
    "listResponseMessage", "singleSelectReply", "contextInfo", "externalAdReply",
]  # fmt: skip
SCALARS = (
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
    | st.sampled_from(["private", "supergroup", "MESSAGE_CREATE", "event_callback", "im",
                       "whatsapp_business_account", "messages", "text", "1@g.us", "2@lid"])
)  # fmt: skip
JSON = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), children, max_size=5)
    ),
    max_leaves=25,
)
SAMPLES: list[tuple[str, Any]] = [
    ("telegram", telegram.forum_topic(telegram.ANA)),
    ("telegram", telegram.private()),
    ("telegram", telegram.update(chat={"id": 1, "type": "group"}, photo=[{"file_id": "p"}])),
    ("telegram", telegram.callback(data="deploy:yes")),
    ("telegram", telegram.update(chat=telegram.FORUM, text="general", **{"from": telegram.ANA})),
    ("telegram", telegram.update(chat={"id": 1, "type": "private"}, venue={"title": "T"},
                                 reply_to_message={"message_id": 2, "text": "q"})),
    ("discord", discord.in_guild(discord.THREAD)),
    ("discord", discord.dispatch("900000000000000000")),
    ("discord", discord.in_guild(discord.CHANNEL, channel_type=0)),
    ("discord", discord.forward("900000000000000000")),
    ("discord", discord.interaction(5, discord.FEEDBACK)),
    ("slack", slack.callback(thread_ts="1712345000.000100")),
    ("slack", slack.callback(files=[{"mimetype": "image/png", "url_private": "https://x/y"}])),
    ("whatsapp", whatsapp.cloud(whatsapp.text())),
    ("whatsapp", whatsapp.cloud({**whatsapp.text(), "type": "audio", "audio": {"id": "7"}})),
    ("whatsapp", whatsapp.web(whatsapp.GROUP, participant="1@lid", participantAlt="2@c.us")),
    ("whatsapp", whatsapp.web(whatsapp.GROUP, {"listResponseMessage": {
        "title": "Pro", "singleSelectReply": {"selectedRowId": "pro"},
        "contextInfo": {"stanzaId": "3EB0MENU"}}}, participant="1@lid")),
    ("whatsapp", whatsapp.web(whatsapp.GROUP, {"extendedTextMessage": {
        "text": "ad", "contextInfo": {"externalAdReply": whatsapp.AD}}}, participant="1@lid")),
]  # fmt: skip
CONTEXT = ReadContext(lookup_chat=discord.CHANNELS.get)


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory) -> HermesPluginManager:
    return fresh_plugin_manager(tmp_path_factory.mktemp("home"))


LONGEST_PROFILE = "p" * 64
"""The longest profile name a gateway multiplexing profiles may key an event by."""


def _read_safely(platform: str, payload: object, manager: HermesPluginManager) -> None:
    """Reading gives an event or None, or raises the named error with a field and a message;
    an event read is keyed as ``handle_message`` would key it, in both schemas, per user and per
    thread, under the default namespace and the longest profile's (the key builder raises
    nothing for it)."""
    error: MalformedEventError | None = None
    try:
        event = read_event(platform, payload, context=CONTEXT, plugins=manager)
    except MalformedEventError as exc:
        error, event = exc, None
    if error is not None:
        assert error.field
        assert str(error).endswith(".")
    assert event is None or isinstance(event, MessageEvent)
    if event is not None:
        _key_every_way(event, manager)


def _key_every_way(event: MessageEvent, manager: HermesPluginManager) -> None:
    for schema, profile in itertools.product(KEY_SCHEMAS, (None, LONGEST_PROFILE)):
        build_session_key(
            event.source, thread_sessions_per_user=True, profile=profile, plugins=manager,
            schema=schema,
        )  # fmt: skip


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(platform=st.sampled_from(["telegram", "discord", "slack", "whatsapp"]), payload=JSON)
def test_arbitrary_json_raises_only_the_named_error(
    platform: str, payload: object, manager: HermesPluginManager
) -> None:
    _read_safely(platform, payload, manager)


def _paths(value: object, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside ``value``."""
    found = [prefix] if prefix else []
    if isinstance(value, Mapping):
        for name, item in value.items():
            found += _paths(item, (*prefix, name))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*prefix, index))
    return found


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), sample=st.sampled_from(SAMPLES), replacement=JSON)
def test_documented_samples_with_one_field_replaced_raise_only_the_named_error(
    data: st.DataObject, sample: tuple[str, Any], replacement: object, manager: HermesPluginManager
) -> None:
    platform, original = sample
    payload = copy.deepcopy(original)
    path = data.draw(st.sampled_from(_paths(payload)))
    target = payload
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = replacement
    _read_safely(platform, payload, manager)


def test_the_samples_read_to_events(manager: HermesPluginManager) -> None:
    for platform, payload in SAMPLES:
        assert read_event(platform, payload, context=CONTEXT, plugins=manager) is not None


def test_unknown_platforms_and_platforms_without_a_reader(manager: HermesPluginManager) -> None:
    with pytest.raises(UnknownPlatformError):
        read_event("icq", {}, plugins=manager)
    with pytest.raises(InvalidValueError, match="no event reader") as caught:
        read_event("signal", {}, plugins=manager)
    assert not isinstance(caught.value, MalformedEventError)


@pytest.mark.parametrize("payload", [[1, 2], "text", None, 7])
def test_a_payload_must_be_an_object(payload: object, manager: HermesPluginManager) -> None:
    with pytest.raises(MalformedEventError, match="must be a JSON object") as caught:
        read_event("telegram", payload, plugins=manager)
    assert caught.value.field == "payload"


class _Pager:
    """A third-party platform whose reader builds a source the models refuse."""

    @hookimpl
    def hermes_register_platforms(self, config: GatewayConfig) -> list[PlatformSpec]:
        return [PlatformSpec(name="pager", read_event=self.read)]

    @staticmethod
    def read(payload: Mapping[str, Any], context: ReadContext) -> MessageEvent | None:
        source = SessionSource(platform="pager", chat_id="1", chat_type=payload["kind"])
        return MessageEvent(source=source, text="page")


def test_invalid_values_met_by_a_reader_are_reported_as_malformed(hermes_home: Path) -> None:
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(hermes_home)})
    plugins = create_plugin_manager(config, load_entrypoints=False, strict=True)
    plugins.register(_Pager(), name="pager")
    event = read_event("pager", {"kind": "group"}, plugins=plugins)
    assert event is not None
    assert event.source.chat_type == "group"
    with pytest.raises(MalformedEventError, match="the pager payload cannot be read") as caught:
        read_event("pager", {"kind": ""}, plugins=plugins)
    assert caught.value.field == "chat_type"
    assert isinstance(caught.value.__cause__, InvalidValueError)


UNKEYABLE_IDS = ["a\nb", "1\x00", "\x1b]0;title\x07", "9" * 3000, "x" * 1100, "7" * 970]
"""Ids the key builder refuses: control characters, newlines, thousands of digits, and ids of
about a thousand characters, whose key fits in 1024 under ``agent:main`` but not under a long
profile's namespace."""


@pytest.mark.parametrize(("platform", "sample"), SAMPLES, ids=[p for p, _ in SAMPLES])
def test_every_event_read_has_a_session_key(
    platform: str, sample: Any, manager: HermesPluginManager
) -> None:
    """An unkeyable id anywhere in a payload is a malformed payload: whatever ``read_event``
    returns, ``handle_message`` can key (per user and per thread, in both schemas)."""
    refused = 0
    for path in _paths(sample):
        for bad in UNKEYABLE_IDS:
            payload = copy.deepcopy(sample)
            target = payload
            for step in path[:-1]:
                target = target[step]
            if not isinstance(target[path[-1]], str | int):
                continue
            target[path[-1]] = bad
            try:
                event = read_event(platform, payload, context=CONTEXT, plugins=manager)
            except MalformedEventError as exc:
                refused += exc.field == "source"
                continue
            if event is not None:
                _key_every_way(event, manager)
    assert refused


def test_an_id_whose_key_fits_only_a_short_profile_is_refused(
    manager: HermesPluginManager,
) -> None:
    """A Slack channel id of about a thousand characters (the ``event_callback`` of
    test_readers_slack, from https://api.slack.com/apis/events-api): its key under ``agent:main``
    fits in 1024 characters, under a 64-character profile it does not, so ``handle_message``
    of a gateway multiplexing profiles would fail on it; it is refused when read."""
    long_channel = "C" + "9" * 950
    payload = slack.callback(channel=long_channel)
    with pytest.raises(MalformedEventError, match="1-1024 characters") as caught:
        read_event("slack", payload, plugins=manager)
    assert caught.value.field == "source"
    short = slack.callback(channel="C" + "9" * 880)
    event = read_event("slack", short, plugins=manager)
    assert event is not None
    assert (event.text, event.reply_to_message_id, event.source.thread_id) == ("hello", None, None)
    key = build_session_key(event.source, profile=LONGEST_PROFILE, plugins=manager)
    assert key == f"agent:{LONGEST_PROFILE}:slack:group:s={slack.TEAM}:c=C{'9' * 880}:u=U1"
    default_source = event.source.model_copy(update={"chat_id": long_channel})
    assert len(build_session_key(default_source, plugins=manager)) <= 1024


def test_ids_nested_a_thousand_levels_deep_are_malformed(manager: HermesPluginManager) -> None:
    nested: list[Any] = []
    inner = nested
    for _ in range(1200):
        inner.append([])
        inner = inner[0]
    payload = telegram.private()
    payload["message"]["chat"]["id"] = nested
    with pytest.raises(MalformedEventError, match="got list") as caught:
        read_event("telegram", payload, plugins=manager)
    assert caught.value.field == "update.message.chat.id"
