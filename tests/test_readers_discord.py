"""The Discord reader on gateway ``MESSAGE_CREATE`` samples.

Samples follow Discord's developer documentation: the gateway payload (``op`` 0 dispatch with
``t`` and ``d``) and the MESSAGE_CREATE extra fields (``guild_id``, ``member``, ``mentions``) at
https://discord.com/developers/docs/events/gateway-events#message-create; the message object
(``type`` 0 default and 19 reply, ``author.bot``, ``webhook_id``, ``attachments``,
``message_reference``, flag ``IS_VOICE_MESSAGE`` 1 << 13) at
https://discord.com/developers/docs/resources/message#message-object; the channel object and its
types (0 guild text, 11 public thread, 12 private thread, 15 forum; ``parent_id``) at
https://discord.com/developers/docs/resources/channel#channel-object; and "Start Thread from
Message", whose thread takes the message's id, at
https://discord.com/developers/docs/resources/channel#start-thread-from-message. The extra field
``channel_type`` of MESSAGE_CREATE is in that event's "Message Create Extra Fields" table; a
forward (``message_reference.type`` 1, FORWARD, with empty ``content`` and the forwarded message's
``content``, ``attachments``, ``flags`` ... in ``message_snapshots[].message``) is the message
reference object and message snapshot object of the message resource page.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.readers import keyed, read

from hermes_core import MalformedEventError, MessageType, ReadContext

GUILD = "613425648685547541"
CHANNEL = "766666666666666666"
FORUM = "777777777777777777"
THREAD = "1200000000000000001"
FORUM_POST = "1200000000000000002"
ANA = {"id": "111111111111111111", "username": "ana", "global_name": "Ana", "bot": False}
BEN = {"id": "222222222222222222", "username": "ben"}
CHANNELS: dict[str, dict[str, Any]] = {
    CHANNEL: {"id": CHANNEL, "type": 0, "guild_id": GUILD, "name": "general", "topic": "chat"},
    FORUM: {"id": FORUM, "type": 15, "guild_id": GUILD, "name": "help"},
    THREAD: {"id": THREAD, "type": 11, "guild_id": GUILD, "parent_id": CHANNEL, "name": "plan"},
    FORUM_POST: {"id": FORUM_POST, "type": 11, "guild_id": GUILD, "parent_id": FORUM, "name": "q"},
}
CACHE = ReadContext(lookup_chat=CHANNELS.get)


def dispatch(
    channel_id: str, *, author: dict[str, Any] | None = ANA, **message: Any
) -> dict[str, Any]:
    """A MESSAGE_CREATE dispatch of message ``id`` 1300000000000000000 (fields overridable)."""
    data = {
        "id": "1300000000000000000", "channel_id": channel_id, "author": author,
        "content": "hello", "timestamp": "2025-01-01T00:00:00.000000+00:00", "tts": False,
        "mention_everyone": False, "mentions": [], "mention_roles": [], "attachments": [],
        "embeds": [], "pinned": False, "type": 0, **message,
    }  # fmt: skip
    return {"op": 0, "s": 42, "t": "MESSAGE_CREATE", "d": data}


def in_guild(channel_id: str, **message: Any) -> dict[str, Any]:
    return dispatch(channel_id, guild_id=GUILD, member={"nick": "Annie", "roles": []}, **message)


def forward(channel_id: str, **snapshot: Any) -> dict[str, Any]:
    """A forward into DM ``channel_id`` of a guild message (its snapshot fields overridable)."""
    forwarded = {
        "type": 0, "content": "the plan is attached", "embeds": [], "attachments": [],
        "timestamp": "2024-12-31T23:00:00.000000+00:00", "edited_timestamp": None, "flags": 0,
        "mentions": [], "mention_roles": [], **snapshot,
    }  # fmt: skip
    reference = {
        "type": 1, "message_id": "1299999999999999998", "channel_id": CHANNEL, "guild_id": GUILD,
    }  # fmt: skip
    return dispatch(
        channel_id, content="", message_reference=reference,
        message_snapshots=[{"message": forwarded}],
    )  # fmt: skip


KEYS = [
    ("DM", dispatch("900000000000000000"), None,
     "agent:main:discord:dm:c=900000000000000000", False),
    ("guild channel, per user", in_guild(CHANNEL), CACHE,
     f"agent:main:discord:group:c={CHANNEL}:u={ANA['id']}", False),
    ("thread, shared, under its parent", in_guild(THREAD), CACHE,
     f"agent:main:discord:thread:c={CHANNEL}:t={THREAD}", True),
    ("forum post, a thread of the forum", in_guild(FORUM_POST), CACHE,
     f"agent:main:discord:thread:c={FORUM}:t={FORUM_POST}", True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "payload", "context", "key", "shared"), KEYS, ids=[k[0] for k in KEYS]
)
def test_keys(
    case: str, payload: Any, context: ReadContext | None, key: str, shared: bool, hermes_home: Path
) -> None:
    assert keyed("discord", payload, hermes_home, context) == (key, shared)


def test_a_thread_message_and_its_prospective_parent_share_one_key(hermes_home: Path) -> None:
    answered = ReadContext(lookup_chat=CHANNELS.get, answer_in_thread=True)
    starter = in_guild(CHANNEL, id=THREAD)  # the thread started from it takes this id
    inside = in_guild(THREAD, id="1300000000000000009", author=BEN)
    key, shared = keyed("discord", starter, hermes_home, answered)
    assert (key, shared) == (f"agent:main:discord:thread:c={CHANNEL}:t={THREAD}", True)
    assert keyed("discord", inside, hermes_home, CACHE) == (key, shared)
    event = read("discord", starter, hermes_home, answered)
    assert event is not None
    assert event.source.prospective_thread_id == THREAD
    assert keyed("discord", starter, hermes_home, CACHE)[0] != key  # not answered in a thread


def test_guild_source_fields(hermes_home: Path) -> None:
    event = read("discord", in_guild(THREAD), hermes_home, CACHE)
    assert event is not None
    source = event.source
    assert (source.chat_id, source.thread_id, source.parent_chat_id) == (CHANNEL, THREAD, CHANNEL)
    assert (source.scope_id, source.chat_name, source.user_name) == (GUILD, "plan", "Annie")
    channel = read("discord", in_guild(CHANNEL), hermes_home, CACHE)
    assert channel is not None
    assert (channel.source.chat_topic, channel.source.prospective_thread_id) == ("chat", None)


def test_the_bare_message_object_reads_like_the_dispatch(hermes_home: Path) -> None:
    bare = dispatch("900000000000000000")["d"]
    assert keyed("discord", bare, hermes_home) == keyed(
        "discord", dispatch("900000000000000000"), hermes_home
    )


def test_channel_type_reads_a_guild_channel_without_the_host(hermes_home: Path) -> None:
    """MESSAGE_CREATE's extra field ``channel_type``: 0 (guild text) and 5 (announcement) are
    channels, so no ``lookup_chat`` is needed; the cache, when given, adds name and topic."""
    key = f"agent:main:discord:group:c={CHANNEL}:u={ANA['id']}"
    for kind in (0, 5):
        assert keyed("discord", in_guild(CHANNEL, channel_type=kind), hermes_home) == (key, False)
    event = read("discord", in_guild(CHANNEL, channel_type=0), hermes_home)
    assert event is not None
    assert (event.text, event.reply_to_message_id, event.source.thread_id) == ("hello", None, None)
    assert (event.source.chat_name, event.source.scope_id) == (None, GUILD)
    cached = read("discord", in_guild(CHANNEL, channel_type=0), hermes_home, CACHE)
    assert cached is not None
    assert (cached.source.chat_name, cached.source.chat_topic) == ("general", "chat")


def test_channel_type_of_a_thread_still_needs_its_parent(hermes_home: Path) -> None:
    payload = in_guild(THREAD, channel_type=11)
    with pytest.raises(MalformedEventError, match="a thread's parent") as caught:
        read("discord", payload, hermes_home)
    assert caught.value.field == "dispatch.d.channel_id"
    assert keyed("discord", payload, hermes_home, CACHE) == (
        f"agent:main:discord:thread:c={CHANNEL}:t={THREAD}",
        True,
    )
    event = read("discord", payload, hermes_home, CACHE)
    assert event is not None
    assert (event.source.thread_id, event.reply_to_message_id) == (THREAD, None)


def test_a_guild_channel_of_unknown_type_is_refused(hermes_home: Path) -> None:
    with pytest.raises(MalformedEventError, match="lookup_chat") as caught:
        read("discord", in_guild(THREAD), hermes_home)
    assert caught.value.field == "dispatch.d.channel_id"
    with pytest.raises(MalformedEventError, match="lookup_chat"):
        read("discord", in_guild(THREAD), hermes_home, ReadContext(lookup_chat=lambda _: None))


def test_replies_and_attachments(hermes_home: Path) -> None:
    reply = dispatch(
        "900000000000000000",
        type=19,
        message_reference={"message_id": "1299999999999999999", "channel_id": "9"},
        content="",
        attachments=[
            {"id": "1", "filename": "a.png", "size": 1, "content_type": "image/png",
             "url": "https://cdn.discordapp.com/attachments/1/1/a.png",
             "proxy_url": "https://media.discordapp.net/attachments/1/1/a.png"},
        ],
    )  # fmt: skip
    event = read("discord", reply, hermes_home)
    assert event is not None
    assert event.reply_to_message_id == "1299999999999999999"
    assert event.message_type == MessageType.PHOTO
    assert event.media_urls == ("https://cdn.discordapp.com/attachments/1/1/a.png",)
    voice = dispatch(
        "900000000000000000", flags=1 << 13, content="",
        attachments=[{"id": "2", "filename": "voice-message.ogg", "size": 1,
                      "content_type": "audio/ogg", "url": "https://cdn.discordapp.com/v.ogg"}],
    )  # fmt: skip
    voiced = read("discord", voice, hermes_home)
    assert voiced is not None
    assert voiced.message_type == MessageType.VOICE


def test_a_reply_carries_the_replied_to_content(hermes_home: Path) -> None:
    # A reply (type 19) carries the message it answers as ``referenced_message`` (message object
    # docs: null when that message was deleted); its content goes to metadata["reply_to_text"].
    answered = {"id": "1299999999999999999", "channel_id": CHANNEL, "author": BEN,
                "content": "which plan?", "type": 0}  # fmt: skip
    reply = dispatch(
        "900000000000000000", type=19, content="the first one", referenced_message=answered,
        message_reference={"type": 0, "message_id": "1299999999999999999"},
    )  # fmt: skip
    event = read("discord", reply, hermes_home)
    assert event is not None
    assert (event.text, event.reply_to_message_id, event.source.thread_id) == (
        "the first one", "1299999999999999999", None,
    )  # fmt: skip
    assert event.metadata["reply_to_text"] == "which plan?"
    assert keyed("discord", reply, hermes_home)[0] == "agent:main:discord:dm:c=900000000000000000"
    gone = {**reply, "d": {**reply["d"], "referenced_message": None}}
    deleted = read("discord", gone, hermes_home)
    assert deleted is not None
    assert "reply_to_text" not in deleted.metadata


def test_forwards_read_the_forwarded_message(hermes_home: Path) -> None:
    event = read("discord", forward("900000000000000000"), hermes_home)
    assert event is not None
    assert (event.text, event.message_type, event.media_urls) == (
        "the plan is attached",
        MessageType.TEXT,
        (),
    )
    assert (event.message_id, event.reply_to_message_id) == ("1300000000000000000", None)
    assert keyed("discord", forward("900000000000000000"), hermes_home) == (
        "agent:main:discord:dm:c=900000000000000000",
        False,
    )
    image = {"id": "3", "filename": "plan.png", "size": 1, "content_type": "image/png",
             "url": "https://cdn.discordapp.com/attachments/7/3/plan.png"}  # fmt: skip
    photo = read(
        "discord", forward("900000000000000000", content="", attachments=[image]), hermes_home
    )
    assert photo is not None
    assert (photo.text, photo.message_type, photo.media_urls) == (
        "",
        MessageType.PHOTO,
        (image["url"],),
    )
    into_thread = {**forward(THREAD)["d"], "guild_id": GUILD, "channel_type": 11}
    threaded = read("discord", into_thread, hermes_home, CACHE)
    assert threaded is not None
    assert (threaded.source.chat_id, threaded.source.thread_id) == (CHANNEL, THREAD)
    assert threaded.text == "the plan is attached"


def interaction(kind: int, data: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """An INTERACTION_CREATE dispatch after the interaction object at
    https://discord.com/developers/docs/interactions/receiving-and-responding#interaction-object
    (type 2 APPLICATION_COMMAND, 3 MESSAGE_COMPONENT; ``channel`` a partial channel; ``member`` in
    a guild, ``user`` in a DM)."""
    body = {
        "id": "1400000000000000000", "application_id": "500", "type": kind, "data": data,
        "guild_id": GUILD, "channel_id": CHANNEL,
        "channel": {"id": CHANNEL, "type": 0, "guild_id": GUILD, "name": "general"},
        "member": {"user": ANA, "nick": "Annie", "roles": []}, "token": "tok", "version": 1,
        **fields,
    }  # fmt: skip
    return {"op": 0, "s": 9, "t": "INTERACTION_CREATE", "d": body}


ASK = {"id": "600", "name": "ask", "type": 1,
       "options": [{"name": "question", "type": 3, "value": "what is due"},
                   {"name": "private", "type": 5, "value": True}]}  # fmt: skip


def test_slash_commands_read_as_their_command_line(hermes_home: Path) -> None:
    event = read("discord", interaction(2, ASK), hermes_home)
    assert event is not None
    assert (event.text, event.reply_to_message_id, event.source.thread_id) == (
        "/ask what is due true", None, None,
    )  # fmt: skip
    assert (event.source.user_id, event.source.user_name) == (ANA["id"], "Annie")
    assert keyed("discord", interaction(2, ASK), hermes_home) == (
        f"agent:main:discord:group:c={CHANNEL}:u={ANA['id']}", False,
    )  # fmt: skip
    # A sub-command (option type 1) nests its own options; in a thread the partial channel
    # names its parent; in a DM the interaction has ``user`` and no guild.
    add = {"name": "add", "type": 1, "options": [{"name": "text", "type": 3, "value": "buy milk"}]}
    nested = {"id": "601", "name": "notes", "type": 1, "options": [add]}
    thread = {"id": THREAD, "type": 11, "guild_id": GUILD, "parent_id": CHANNEL, "name": "plan"}
    inside = interaction(2, nested, channel_id=THREAD, channel=thread)
    threaded = read("discord", inside, hermes_home)
    assert threaded is not None
    assert threaded.text == "/notes add buy milk"
    assert keyed("discord", inside, hermes_home)[0] == (
        f"agent:main:discord:thread:c={CHANNEL}:t={THREAD}"
    )
    # A partial channel without ``parent_id`` leaves a thread's parent to the host's cache.
    partial = interaction(2, nested, channel_id=THREAD, channel={"id": THREAD, "type": 11})
    assert keyed("discord", partial, hermes_home, CACHE)[0] == (
        f"agent:main:discord:thread:c={CHANNEL}:t={THREAD}"
    )
    dm = interaction(2, ASK, guild_id=None, member=None, user=BEN, channel_id="900",
                     channel={"id": "900", "type": 1})  # fmt: skip
    assert keyed("discord", dm, hermes_home)[0] == "agent:main:discord:dm:c=900"


def test_components_read_as_their_custom_id_under_their_message(hermes_home: Path) -> None:
    # A button's ``data`` has ``custom_id`` and ``component_type`` 2; a select menu's adds the
    # chosen ``values``; ``message`` is the message the component is on.
    under = {"id": "1350000000000000000", "channel_id": CHANNEL, "author": BEN, "content": "ok?"}
    button = interaction(3, {"custom_id": "approve", "component_type": 2}, message=under)
    event = read("discord", button, hermes_home)
    assert event is not None
    assert (event.text, event.reply_to_message_id, event.source.thread_id) == (
        "approve", "1350000000000000000", None,
    )  # fmt: skip
    assert keyed("discord", button, hermes_home)[0] == (
        f"agent:main:discord:group:c={CHANNEL}:u={ANA['id']}"
    )
    menu = {"custom_id": "size", "component_type": 3, "values": ["s", "m"]}
    chosen = read("discord", interaction(3, menu, message=under), hermes_home)
    assert chosen is not None
    assert chosen.text == "size s m"
    bare = interaction(3, {"custom_id": "approve", "component_type": 2}, message=under)["d"]
    assert read("discord", bare, hermes_home) is not None


# MODAL_SUBMIT (interaction type 5): ``data`` is the Modal Submit Data Structure, the modal's
# ``custom_id`` and its submitted ``components``: action rows (type 1) around text inputs (type 4,
# ``custom_id`` and ``value``), or labels (type 18) around one ``component``, a text input or a
# string select (type 3, chosen ``values``); text displays (type 10) submit nothing
# (https://discord.com/developers/docs/interactions/receiving-and-responding#interaction-object-
# modal-submit-data-structure and .../components/reference).
FEEDBACK = {"custom_id": "feedback", "components": [
    {"type": 1, "components": [{"type": 4, "custom_id": "subject", "value": "Late order"}]},
    {"type": 18, "id": 2, "component": {"type": 4, "id": 3, "custom_id": "details",
                                         "value": "Arrived a day late.\nBox was open."}},
    {"type": 18, "id": 4, "component": {"type": 3, "id": 5, "custom_id": "rating",
                                         "values": ["2", "3"]}},
    {"type": 10, "id": 6},
]}  # fmt: skip


def test_modal_submissions_read_as_their_fields(hermes_home: Path) -> None:
    event = read("discord", interaction(5, FEEDBACK), hermes_home)
    assert event is not None
    assert event.text == (
        "feedback\nsubject: Late order\ndetails: Arrived a day late.\nBox was open.\nrating: 2, 3"
    )
    assert (event.reply_to_message_id, event.source.thread_id, event.message_id) == (
        None, None, None,
    )  # fmt: skip
    assert keyed("discord", interaction(5, FEEDBACK), hermes_home)[0] == (
        f"agent:main:discord:group:c={CHANNEL}:u={ANA['id']}"
    )
    # A modal opened by a button carries the button's message: the submission replies to it.
    under = {"id": "1350000000000000000", "channel_id": CHANNEL, "author": BEN, "content": "ok?"}
    opened = read("discord", interaction(5, FEEDBACK, message=under), hermes_home)
    assert opened is not None
    assert opened.reply_to_message_id == "1350000000000000000"
    empty = read("discord", interaction(5, {"custom_id": "form", "components": []}), hermes_home)
    assert empty is not None
    assert empty.text == "form"
    bot = interaction(5, FEEDBACK, member={"user": {"id": "3", "bot": True}})
    assert read("discord", bot, hermes_home) is None
    bad = {**FEEDBACK, "components": [{"type": 1, "components": [
        {"type": 3, "custom_id": "rating", "values": "2"}]}]}  # fmt: skip
    with pytest.raises(MalformedEventError) as caught:
        read("discord", interaction(5, bad), hermes_home)
    assert caught.value.field == "dispatch.d.data.components[0].components[0].values"


NOT_MESSAGES = [
    ("update", {"op": 0, "s": 2, "t": "MESSAGE_UPDATE", "d": dispatch(CHANNEL)["d"]}),
    ("reaction", {"op": 0, "s": 3, "t": "MESSAGE_REACTION_ADD", "d": {"user_id": "1"}}),
    ("heartbeat ack", {"op": 11, "d": None}),
    ("interaction ping", interaction(1, {})),
    ("autocomplete", interaction(4, ASK)),
    ("bot's interaction", interaction(2, ASK, member={"user": {"id": "3", "bot": True}})),
    ("bot author", dispatch("9", author={"id": "3", "username": "b", "bot": True})),
    ("webhook", dispatch("9", webhook_id="44")),
    ("thread created notice", dispatch("9", type=18)),
    ("empty content", dispatch("9", content="")),
    ("forward of nothing readable", forward("9", content="")),
    (
        "snapshots without a forward reference",
        {**forward("9"), "d": {**forward("9")["d"], "message_reference": {"message_id": "1"}}},
    ),
]


@pytest.mark.parametrize(("case", "payload"), NOT_MESSAGES, ids=[n[0] for n in NOT_MESSAGES])
def test_not_user_messages(case: str, payload: Any, hermes_home: Path) -> None:
    assert read("discord", payload, hermes_home, CACHE) is None


MALFORMED = [
    ("dispatch.d", {"op": 0, "t": "MESSAGE_CREATE", "d": []}),
    ("dispatch.d.author", dispatch("9", author=None)),
    ("dispatch.d.channel_id", dispatch("", content="x")),
    ("dispatch.d.author.bot", dispatch("9", author={"id": "1", "bot": "yes"})),
    ("message.id", {"channel_id": "9", "author": ANA, "content": "bare, without id"}),
    (f"channel {THREAD}.parent_id", in_guild(THREAD)),
]


@pytest.mark.parametrize(("field", "payload"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_dispatches_name_the_field(field: str, payload: Any, hermes_home: Path) -> None:
    orphan = {**CHANNELS, THREAD: {"id": THREAD, "type": 11}}
    with pytest.raises(MalformedEventError) as caught:
        read("discord", payload, hermes_home, ReadContext(lookup_chat=orphan.get))
    assert caught.value.field == field
