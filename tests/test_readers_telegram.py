"""The Telegram reader on Bot API ``Update`` samples.

Every sample is written from the Bot API reference, https://core.telegram.org/bots/api: the
``Update`` object (``message``, ``edited_message``, ``channel_post``, ``business_message``,
``callback_query``), ``CallbackQuery`` and ``InaccessibleMessage``, the
``Message`` object (``message_thread_id``, ``is_topic_message``, ``from``, ``sender_chat``,
``is_automatic_forward``, ``reply_to_message``, ``text``, ``caption``, ``photo`` as a list of
``PhotoSize``, ``voice``, ``document``, ``sticker``, ``location``, ``new_chat_members``), ``Chat``
(``type`` private, group, supergroup or channel; ``is_forum``) and ``User`` (``is_bot``).
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from support.readers import keyed, read

from hermes_core import MalformedEventError, MessageType, build_key_from_flags

GROUP = -1002285219667
ANA = {"id": 42, "is_bot": False, "first_name": "Ana", "last_name": "Lima", "username": "ana"}
BEN = {"id": 43, "is_bot": False, "first_name": "Ben"}


def update(**message: Any) -> dict[str, Any]:
    """An ``Update`` holding one new ``message`` (date and id filled in)."""
    return {"update_id": 900001, "message": {"message_id": 7, "date": 1735689600, **message}}


def private(text: str = "hi") -> dict[str, Any]:
    return update(
        chat={"id": 42, "type": "private", "first_name": "Ana"}, **{"from": ANA}, text=text
    )


def forum_topic(sender: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A message in topic 17585 of a forum supergroup."""
    chat = {"id": GROUP, "type": "supergroup", "title": "Team", "is_forum": True}
    return update(
        chat=chat, message_thread_id=17585, is_topic_message=True, text="topic hello",
        **{"from": sender}, **extra,
    )  # fmt: skip


KEYS = [
    ("private chat", private(), "agent:main:telegram:dm:c=42", False),
    (
        "basic group, per user",
        update(chat={"id": -4001, "type": "group", "title": "G"}, **{"from": ANA}, text="x"),
        "agent:main:telegram:group:c=-4001:u=42",
        False,
    ),
    (
        "forum topic, shared",
        forum_topic(ANA),
        f"agent:main:telegram:group:c={GROUP}:t=17585",
        True,
    ),
    (
        "reply thread of a supergroup without topics is not a thread",
        update(
            chat={"id": GROUP, "type": "supergroup", "title": "Team"},
            message_thread_id=5,
            reply_to_message={
                "message_id": 5,
                "date": 1,
                "chat": {"id": GROUP, "type": "supergroup"},
            },
            text="re",
            **{"from": ANA},
        ),
        f"agent:main:telegram:group:c={GROUP}:u=42",
        False,
    ),
    (
        "channel post, sent on behalf of the channel",
        {
            "update_id": 2,
            "channel_post": {
                "message_id": 3,
                "date": 1,
                "text": "news",
                "author_signature": "Editor",
                "chat": {"id": -100777, "type": "channel", "title": "News"},
                "sender_chat": {"id": -100777, "type": "channel", "title": "News"},
            },
        },
        "agent:main:telegram:channel:c=-100777:u=-100777",
        False,
    ),
    (
        "anonymous group admin: the sender is the group, not the placeholder bot user",
        update(
            chat={"id": GROUP, "type": "supergroup", "title": "Team"},
            text="admin here",
            sender_chat={"id": GROUP, "type": "supergroup", "title": "Team"},
            **{"from": {"id": 1087968824, "is_bot": True, "first_name": "Group"}},
        ),
        f"agent:main:telegram:group:c={GROUP}:u={GROUP}",
        False,
    ),
]


@pytest.mark.parametrize(("case", "payload", "key", "shared"), KEYS, ids=[k[0] for k in KEYS])
def test_keys(case: str, payload: Any, key: str, shared: bool, hermes_home: Path) -> None:
    assert keyed("telegram", payload, hermes_home) == (key, shared)


def test_everyone_in_a_forum_topic_shares_it_and_replies_to_the_topic_root_are_not_replies(
    hermes_home: Path,
) -> None:
    root = {"message_id": 17585, "date": 1, "chat": {"id": GROUP, "type": "supergroup"}}
    first = read("telegram", forum_topic(ANA, reply_to_message=root), hermes_home)
    real = {**root, "message_id": 20}
    second = read("telegram", forum_topic(BEN, reply_to_message=real), hermes_home)
    assert first is not None
    assert second is not None
    assert keyed("telegram", forum_topic(ANA), hermes_home) == keyed(
        "telegram", forum_topic(BEN), hermes_home
    )
    assert first.reply_to_message_id is None
    assert second.reply_to_message_id == "20"
    assert first.source.thread_id == "17585"
    assert (first.source.user_name, second.source.user_name) == ("Ana Lima", "Ben")


def test_private_text_fields(hermes_home: Path) -> None:
    event = read("telegram", private("hello"), hermes_home)
    assert event is not None
    assert (event.text, event.message_type, event.message_id) == ("hello", MessageType.TEXT, "7")
    assert event.source.chat_type == "dm"
    assert event.source.chat_name is None
    assert event.source.message_id == "7"


MEDIA = [
    (
        {"photo": [{"file_id": "small", "file_unique_id": "s", "width": 90, "height": 90},
                   {"file_id": "large", "file_unique_id": "l", "width": 800, "height": 800}],
         "caption": "look"},
        MessageType.PHOTO, "look", "large",
    ),
    (
        {"voice": {"file_id": "v1", "file_unique_id": "v", "duration": 3}},
        MessageType.VOICE, "", "v1",
    ),
    (
        {"document": {"file_id": "d1", "file_unique_id": "d", "file_name": "a"}, "caption": "cv"},
        MessageType.DOCUMENT, "cv", "d1",
    ),
    (
        {"sticker": {"file_id": "s1", "file_unique_id": "s", "type": "regular", "width": 1,
                     "height": 1, "is_animated": False, "is_video": False}},
        MessageType.STICKER, "", "s1",
    ),
    ({"location": {"latitude": 1.5, "longitude": 2.5}}, MessageType.LOCATION, "", None),
]  # fmt: skip


@pytest.mark.parametrize(("content", "kind", "text", "file_id"), MEDIA)
def test_captions_and_media(
    content: dict[str, Any], kind: MessageType, text: str, file_id: str | None, hermes_home: Path
) -> None:
    payload = update(chat={"id": 42, "type": "private"}, **{"from": ANA}, **content)
    event = read("telegram", payload, hermes_home)
    assert event is not None
    assert (event.message_type, event.text) == (kind, text)
    assert event.metadata == ({"media_ids": [file_id]} if file_id else {})


NOT_MESSAGES = [
    ("edit", {"update_id": 1, "edited_message": private()["message"]}),
    ("callback query", {"update_id": 1, "callback_query": {"id": "q", "from": ANA}}),
    ("bot author", update(chat={"id": -4001, "type": "group"}, text="beep",
                          **{"from": {"id": 99, "is_bot": True, "first_name": "B"}})),
    ("service message", update(chat={"id": -4001, "type": "group"}, **{"from": ANA},
                               new_chat_members=[BEN])),
    ("automatic forward", update(chat={"id": GROUP, "type": "supergroup"}, text="post",
                                 is_automatic_forward=True,
                                 sender_chat={"id": -100777, "type": "channel"})),
    ("poll", update(chat={"id": 42, "type": "private"}, **{"from": ANA},
                    poll={"id": "p", "question": "?"})),
]  # fmt: skip


@pytest.mark.parametrize(("case", "payload"), NOT_MESSAGES, ids=[n[0] for n in NOT_MESSAGES])
def test_not_user_messages(case: str, payload: Any, hermes_home: Path) -> None:
    assert read("telegram", payload, hermes_home) is None


MALFORMED = [
    ("update.message.chat", update(text="no chat")),
    ("update.message.chat.id", update(chat={"id": 1.5, "type": "private"}, text="x")),
    ("update.message.chat.id", update(chat={"id": 2**70, "type": "private"}, text="x")),
    ("update.message.chat.type", update(chat={"id": 1, "type": "secret"}, text="x")),
    ("update.message.text", update(chat={"id": 1, "type": "private"}, text=["x"])),
    ("update.message.from.is_bot", update(chat={"id": 1, "type": "private"}, text="x",
                                          **{"from": {"id": 1, "is_bot": "no"}})),
    ("update.message", {"update_id": 1, "message": "hi"}),
]  # fmt: skip


@pytest.mark.parametrize(("field", "payload"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_updates_name_the_field(field: str, payload: Any, hermes_home: Path) -> None:
    with pytest.raises(MalformedEventError) as caught:
        read("telegram", payload, hermes_home)
    assert caught.value.field == field
    assert str(caught.value).startswith(field)


def test_a_reply_carries_the_replied_to_text(hermes_home: Path) -> None:
    # Message.reply_to_message is a Message: its text, else its caption (Bot API, "Message").
    original = {"message_id": 5, "date": 1, "chat": {"id": 42, "type": "private"}, "text": "when?"}
    captioned = {**original, "text": None, "caption": "this photo", "photo": []}
    chat = {"id": 42, "type": "private"}
    event = read("telegram", update(chat=chat, reply_to_message=original, text="at 5"), hermes_home)
    shown = read("telegram", update(chat=chat, reply_to_message=captioned, text="ok"), hermes_home)
    assert event is not None
    assert shown is not None
    assert (event.text, event.reply_to_message_id) == ("at 5", "5")
    assert event.metadata == {"reply_to_text": "when?"}
    assert shown.metadata == {"reply_to_text": "this photo"}
    # A forum topic's root is not a reply, so its text is not carried either.
    root = {"message_id": 17585, "date": 1, "chat": {"id": GROUP, "type": "supergroup"}}
    topic = read("telegram", forum_topic(ANA, reply_to_message={**root, "text": "x"}), hermes_home)
    assert topic is not None
    assert (topic.reply_to_message_id, topic.metadata) == (None, {})
    assert topic.source.thread_id == "17585"


def test_the_message_date_is_the_event_time(hermes_home: Path) -> None:
    # Message.date: "Date the message was sent in Unix time" (Bot API, "Message").
    event = read("telegram", private(), hermes_home)
    assert event is not None
    assert event.received_at == datetime(2025, 1, 1, tzinfo=timezone.utc)
    with pytest.raises(MalformedEventError) as caught:
        read("telegram", update(chat={"id": 42, "type": "private"}, text="x", date=10**20),
             hermes_home)  # fmt: skip
    assert caught.value.field == "update.message.date"


def test_album_parts_carry_their_media_group_id(hermes_home: Path) -> None:
    # Message.media_group_id: "The unique identifier of a media message group this message
    # belongs to" (Bot API, "Message"); each photo of an album is its own Message.
    photo = [{"file_id": "p1", "file_unique_id": "u", "width": 90, "height": 90}]
    payload = update(chat={"id": 42, "type": "private"}, **{"from": ANA}, photo=photo,
                     caption="trip", media_group_id="13579")  # fmt: skip
    event = read("telegram", payload, hermes_home)
    assert event is not None
    assert (event.text, event.message_type) == ("trip", MessageType.PHOTO)
    assert event.metadata == {"media_ids": ["p1"], "media_group_id": "13579"}


def test_a_venue_reads_as_its_title_and_address(hermes_home: Path) -> None:
    # Message.venue is a Venue (location, title, address); "for backward compatibility, when
    # this field is set, the location field will also be set" (Bot API, "Message", "Venue").
    place = {"latitude": 38.7, "longitude": -9.1}
    venue = {"location": place, "title": "Cafe Luso", "address": "Tv. da Queimada 10, Lisboa"}
    payload = update(chat={"id": 42, "type": "private"}, **{"from": ANA}, location=place,
                     venue=venue)  # fmt: skip
    event = read("telegram", payload, hermes_home)
    assert event is not None
    assert (event.message_type, event.text) == (
        MessageType.LOCATION,
        "Cafe Luso, Tv. da Queimada 10, Lisboa",
    )
    assert keyed("telegram", payload, hermes_home) == ("agent:main:telegram:dm:c=42", False)


def callback(**query: Any) -> dict[str, Any]:
    """An ``Update`` with a ``callback_query``: Ben pressed a button under the bot's message 30
    in topic 17585 (Bot API, "CallbackQuery": id, from, message, chat_instance, data)."""
    chat = {"id": GROUP, "type": "supergroup", "title": "Team", "is_forum": True}
    shown = {
        "message_id": 30,
        "date": 1735689000,
        "chat": chat,
        "message_thread_id": 17585,
        "is_topic_message": True,
        "from": {"id": 777, "is_bot": True, "first_name": "Hermes"},
        "text": "Deploy now?",
        "reply_markup": {"inline_keyboard": [[{"text": "Yes", "callback_data": "deploy:yes"}]]},
    }
    body = {"id": "4382bfdwdsb323b2d9", "from": BEN, "message": shown, "chat_instance": "-73"}
    return {"update_id": 900002, "callback_query": {**body, **query}}


def test_a_button_press_reads_as_its_data_in_the_message_lane(hermes_home: Path) -> None:
    event = read("telegram", callback(data="deploy:yes"), hermes_home)
    assert event is not None
    assert (event.text, event.message_type) == ("deploy:yes", MessageType.TEXT)
    assert (event.message_id, event.reply_to_message_id) == ("4382bfdwdsb323b2d9", "30")
    assert (event.source.user_id, event.source.user_name) == ("43", "Ben")
    assert event.source.thread_id == "17585"
    assert keyed("telegram", callback(data="deploy:yes"), hermes_home) == keyed(
        "telegram", forum_topic(BEN), hermes_home
    )
    # InaccessibleMessage (Bot API): only chat, message_id and date 0 are left of a message
    # too old to show; the press still reads, in the chat's lane.
    gone = {"chat": {"id": 42, "type": "private"}, "message_id": 30, "date": 0}
    old = read("telegram", callback(data="again", message=gone), hermes_home)
    assert old is not None
    assert (old.text, old.reply_to_message_id) == ("again", "30")
    assert keyed("telegram", callback(data="again", message=gone), hermes_home) == (
        "agent:main:telegram:dm:c=42",
        False,
    )


def test_presses_with_no_chat_or_no_data_are_not_messages(hermes_home: Path) -> None:
    # A button under an inline-mode message has inline_message_id and no message; a game's
    # button has game_short_name and no data (Bot API, "CallbackQuery").
    inline = callback(data="x", message=None, inline_message_id="AAQ")
    game = callback(game_short_name="tetris")
    assert read("telegram", inline, hermes_home) is None
    assert read("telegram", game, hermes_home) is None


def test_business_messages_read_with_their_connection(hermes_home: Path) -> None:
    # Update.business_message is a Message with business_connection_id; the bot's own messages
    # sent on behalf of the account come back with sender_business_bot (Bot API, "Message").
    chat = {"id": 5150, "type": "private", "first_name": "Cleo"}
    cleo = {"id": 5150, "is_bot": False, "first_name": "Cleo"}
    message = {"message_id": 8, "date": 1735689600, "chat": chat, "from": cleo,
               "business_connection_id": "bc-1", "text": "open today?"}  # fmt: skip
    event = read("telegram", {"update_id": 3, "business_message": message}, hermes_home)
    assert event is not None
    assert (event.text, event.message_id, event.source.user_id) == ("open today?", "8", "5150")
    assert event.metadata == {"business_connection_id": "bc-1"}
    assert keyed("telegram", {"update_id": 3, "business_message": message}, hermes_home) == (
        "agent:main:telegram:dm:c=5150",
        False,
    )
    echo = {**message, "sender_business_bot": {"id": 777, "is_bot": True, "first_name": "H"}}
    assert read("telegram", {"update_id": 4, "business_message": echo}, hermes_home) is None


FORUM = {"id": GROUP, "type": "supergroup", "title": "Team", "is_forum": True}
GENERAL_KEY = f"agent:main:telegram:group:c={GROUP}:t=1"


def test_a_forum_message_outside_any_topic_is_in_the_general_topic(hermes_home: Path) -> None:
    # Chat.is_forum: "True, if the supergroup chat is a forum (has topics enabled)";
    # Message.message_thread_id: "Unique identifier of a message thread or forum topic to which
    # the message belongs; for supergroups only"; Message.is_topic_message: "True, if the
    # message is sent to a topic in a forum supergroup" (Bot API, "Chat", "Message"). A message
    # in the General topic has neither, so it is keyed as thread 1, as the original gateway does.
    ana = read("telegram", update(chat=FORUM, text="general hello", **{"from": ANA}), hermes_home)
    assert ana is not None
    assert (ana.text, ana.source.thread_id, ana.reply_to_message_id) == ("general hello", "1", None)
    assert keyed("telegram", update(chat=FORUM, text="x", **{"from": ANA}), hermes_home) == (
        GENERAL_KEY,
        True,
    )
    assert keyed("telegram", update(chat=FORUM, text="y", **{"from": BEN}), hermes_home) == (
        GENERAL_KEY,
        True,
    )
    # A reply inside the General topic carries the reply chain's message_thread_id without
    # is_topic_message: still the General topic, and a real reply.
    earlier = {"message_id": 5, "date": 1, "chat": FORUM, "text": "lunch?"}
    reply = update(chat=FORUM, message_thread_id=5, reply_to_message=earlier, text="yes",
                   **{"from": BEN})  # fmt: skip
    event = read("telegram", reply, hermes_home)
    assert event is not None
    assert (event.source.thread_id, event.reply_to_message_id) == ("1", "5")
    assert event.metadata == {"reply_to_text": "lunch?"}
    assert keyed("telegram", reply, hermes_home) == (GENERAL_KEY, True)
    # A supergroup without topics keeps its per-user lanes.
    plain = update(chat={**FORUM, "is_forum": False}, text="x", **{"from": ANA})
    assert keyed("telegram", plain, hermes_home) == (
        f"agent:main:telegram:group:c={GROUP}:u=42",
        False,
    )


def test_general_topic_keys_in_v1_are_the_original_gateways(hermes_home: Path) -> None:
    event = read("telegram", update(chat=FORUM, text="hi", **{"from": ANA}), hermes_home)
    assert event is not None
    assert build_key_from_flags(event.source, schema="v1") == f"agent:main:telegram:group:{GROUP}:1"
    per_user = build_key_from_flags(event.source, thread_sessions_per_user=True)
    assert per_user == f"{GENERAL_KEY}:u=42"


def test_a_button_press_under_a_general_topic_message_reads_in_the_general_topic(
    hermes_home: Path,
) -> None:
    # CallbackQuery.message (Bot API): the bot's message in the General topic carries no
    # message_thread_id; an InaccessibleMessage keeps only chat, message_id and date 0.
    shown = {"message_id": 31, "date": 1735689000, "chat": FORUM, "text": "Deploy now?",
             "from": {"id": 777, "is_bot": True, "first_name": "Hermes"}}  # fmt: skip
    for message in (shown, {"chat": FORUM, "message_id": 31, "date": 0}):
        payload = callback(data="deploy:no", message=message)
        event = read("telegram", payload, hermes_home)
        assert event is not None
        assert (event.text, event.reply_to_message_id) == ("deploy:no", "31")
        assert event.source.thread_id == "1"
        assert keyed("telegram", payload, hermes_home) == (GENERAL_KEY, True)


def test_edits_in_the_general_topic_are_not_messages(hermes_home: Path) -> None:
    edit = update(chat=FORUM, text="fixed", edit_date=1735689700, **{"from": ANA})["message"]
    assert read("telegram", {"update_id": 5, "edited_message": edit}, hermes_home) is None
