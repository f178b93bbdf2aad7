"""Telegram Bot API ``Update`` objects (from ``getUpdates`` or a webhook) into events.

``message``, ``channel_post`` and ``business_message`` updates are read, and button presses
(``callback_query``) as the button's ``data``; edits (``edited_*``), reactions and every other
update kind are not user messages. A message is read when it has text, a caption or media the
event model carries (photo, video, animation, video note, audio, voice, document, sticker,
location, venue); service messages (members joining, topics created, pins, ...) and content it
cannot carry (polls, dice, contacts, games) are not. Messages sent by bots (a business account's
bot included), and channel posts the platform copied into a discussion group
(``is_automatic_forward``), are not user messages either.

Besides the source, an event carries the message's ``date`` as ``received_at``, and in
``metadata`` the replied-to message's text or caption (``reply_to_text``), an album's
``media_group_id`` and a business message's ``business_connection_id``; a venue's text is its
title and address. In a forum supergroup a message outside any topic is in the General topic,
thread ``"1"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from hermes_core.domain.models import MessageEvent, MessageType, SessionSource
from hermes_core.domain.specs import ReadContext
from hermes_plugins.readers.fields import Fields, malformed

_CHAT_TYPES = {"private": "dm", "group": "group", "supergroup": "group", "channel": "channel"}
_MEDIA = (
    ("photo", MessageType.PHOTO),
    ("video", MessageType.VIDEO),
    ("animation", MessageType.VIDEO),
    ("video_note", MessageType.VIDEO),
    ("audio", MessageType.AUDIO),
    ("voice", MessageType.VOICE),
    ("document", MessageType.DOCUMENT),
    ("sticker", MessageType.STICKER),
    ("venue", MessageType.LOCATION),  # before location: a venue carries its location too
    ("location", MessageType.LOCATION),
)
_LAST_DATE = 253402300799
"""9999-12-31T23:59:59Z, the last Unix time a ``datetime`` holds."""
_MESSAGE_KEYS = ("message", "channel_post", "business_message")
GENERAL_TOPIC = "1"
"""The thread of a forum's General topic, whose messages carry no topic id: the original
gateway's, so its v1 keys stay byte-compatible and the topic is one shared lane like the others."""


def read_telegram_update(payload: Mapping[str, Any], context: ReadContext) -> MessageEvent | None:
    """The event of a Telegram ``Update`` (see the module docstring for what is read)."""
    update = Fields(payload, "update")
    query = update.opt_obj("callback_query")
    if query is not None:
        return _button_press(query)
    key = next((name for name in _MESSAGE_KEYS if update.has(name)), None)
    if key is None:
        return None
    message = update.obj(key)
    _chat_kind(message.obj("chat"))
    sender = message.opt_obj("sender_chat")
    user = message.opt_obj("from")
    if message.flag("is_automatic_forward") or (sender is None and user and user.flag("is_bot")):
        return None
    if message.has("sender_business_bot"):  # sent by a bot on behalf of the business account
        return None
    content = _content(message)
    if content is None:
        return None
    text, kind, file_id = content
    author = sender or user
    thread = _thread(message)
    source = _source(message, author, _name(sender, user, message), message.id("message_id"))
    metadata: dict[str, Any] = {"media_ids": [file_id]} if file_id else {}
    reply = message.opt_obj("reply_to_message")
    reply_id = reply.id("message_id") if reply is not None else None
    # In a forum topic a message that replies to nothing points at the topic's first message.
    if reply is not None and reply_id != thread:
        quoted = reply.text("text") or reply.text("caption")
        if quoted:
            metadata["reply_to_text"] = quoted
    else:
        reply_id = None
    connection = message.text("business_connection_id")
    if connection:
        metadata["business_connection_id"] = connection
    album = message.text("media_group_id")
    if album:
        metadata["media_group_id"] = album
    sent = _date(message)
    return MessageEvent(
        source=source,
        text=text,
        message_type=kind,
        message_id=source.message_id,
        reply_to_message_id=reply_id,
        metadata=metadata,
        **({"received_at": sent} if sent is not None else {}),
    )


def _button_press(query: Fields) -> MessageEvent | None:
    """A ``callback_query``: the pressed button's ``data`` as text, in the lane of the message
    the button is under; None for inline-mode messages (no chat) and game buttons (no data)."""
    message = query.opt_obj("message")
    data = query.text("data")
    user = query.obj("from")
    if message is None or not data or user.flag("is_bot"):
        return None
    query_id = query.id("id")
    return MessageEvent(
        source=_source(message, user, _name(None, user, message), query_id),
        text=data,
        message_id=query_id,
        reply_to_message_id=message.id("message_id"),
    )


def _chat_kind(chat: Fields) -> str:
    """The chat's ``type``, checked."""
    kind = chat.text("type")
    if kind not in _CHAT_TYPES:
        raise malformed(f"{chat.path}.type", f"must be one of {', '.join(_CHAT_TYPES)}")
    return kind


def _thread(message: Fields) -> str | None:
    """The forum topic of ``message``: its ``message_thread_id`` in a topic, else
    :data:`GENERAL_TOPIC` in a forum (``chat.is_forum``); a supergroup's reply chain (a
    ``message_thread_id`` without ``is_topic_message``) is not a topic."""
    if message.flag("is_topic_message"):
        return message.opt_id("message_thread_id")
    return GENERAL_TOPIC if message.obj("chat").flag("is_forum") else None


def _source(
    message: Fields, author: Fields | None, name: str | None, message_id: str
) -> SessionSource:
    """The source of an event in ``message``'s chat and topic, from ``author``."""
    chat = message.obj("chat")
    kind = _chat_kind(chat)
    return SessionSource(
        platform="telegram",
        chat_id=chat.id("id"),
        chat_name=chat.text("title") if kind != "private" else None,
        chat_type=_CHAT_TYPES[kind],
        user_id=author.id("id") if author is not None else None,
        user_name=name,
        thread_id=_thread(message),
        message_id=message_id,
    )


def _date(message: Fields) -> datetime | None:
    """The time the message was sent (its Unix-time ``date``); None when absent or 0."""
    value = message.integer("date")
    if not value:
        return None
    if not 0 < value <= _LAST_DATE:
        raise malformed(f"{message.path}.date", "must be a Unix time (seconds since 1970)")
    return datetime.fromtimestamp(value, timezone.utc)


def _content(message: Fields) -> tuple[str, MessageType, str | None] | None:
    """Text, message type and media file id; None when the message carries none of them."""
    text = message.text("text")
    if text is not None:
        return text, MessageType.TEXT, None
    caption = message.text("caption") or ""
    for name, kind in _MEDIA:
        if not message.has(name):
            continue
        if name == "photo":  # sizes of one picture, smallest first
            sizes = message.objs("photo")
            return caption, kind, sizes[-1].id("file_id") if sizes else None
        media = message.obj(name)
        if name == "venue":
            place = ", ".join(part for part in (media.text("title"), media.text("address")) if part)
            return caption or place, kind, None
        return caption, kind, media.opt_id("file_id")
    return None


def _name(sender: Fields | None, user: Fields | None, message: Fields) -> str | None:
    """The sender's display name: the chat's title when sent on behalf of a chat (or a
    channel post's signature), else the user's first and last name, else the username."""
    if sender is not None:
        return message.text("author_signature") or sender.text("title")
    if user is None:
        return message.text("author_signature")
    full = " ".join(part for part in (user.text("first_name"), user.text("last_name")) if part)
    return full or user.text("username")
