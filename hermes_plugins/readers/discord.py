"""Discord gateway ``MESSAGE_CREATE`` dispatches into events.

The payload is the gateway dispatch (``{"op": 0, "t": "MESSAGE_CREATE", "d": {...}}``) or its
``d`` object alone. Other dispatches (``MESSAGE_UPDATE``, reactions, ...) are not user messages,
nor are messages written by bots or webhooks, system messages and message types other than a plain
message or a reply (thread-created notices, pins, joins, ...), nor messages with no content,
attachment or sticker.

A message without ``guild_id`` is a DM. A guild message's channel may be a thread (or a forum
post, which is a thread): the payload does not say, so the host's ``ReadContext.lookup_chat``
must return the channel object (``type`` and ``parent_id``). In a thread the source is
``chat_type="thread"`` with the parent channel as ``chat_id`` and the thread as ``thread_id``; a
message in a channel the host answers in a new thread (``ReadContext.answer_in_thread``) gets its
own id as ``prospective_thread_id``, which is the id of a thread started from it, so both map to
one key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hermes_core.domain.models import MessageEvent, MessageType, SessionSource
from hermes_core.domain.specs import ReadContext
from hermes_plugins.readers.fields import Fields, malformed, media_type

_THREAD_TYPES = frozenset({10, 11, 12})
"""Announcement thread, public thread (also a forum or media post), private thread."""
_USER_MESSAGE_TYPES = frozenset({0, 19})
"""A plain message and a reply."""
_VOICE_MESSAGE_FLAG = 1 << 13


def read_discord_message(payload: Mapping[str, Any], context: ReadContext) -> MessageEvent | None:
    """The event of a ``MESSAGE_CREATE`` dispatch (see the module docstring)."""
    dispatch = Fields(payload, "dispatch")
    if "d" in dispatch.data or "op" in dispatch.data:
        if dispatch.integer("op") != 0 or dispatch.text("t") != "MESSAGE_CREATE":
            return None
        message = dispatch.obj("d")
    else:
        message = Fields(payload, "message")
    author = message.obj("author")
    kind = message.integer("type") or 0
    if (
        author.flag("bot") or author.flag("system") or message.has("webhook_id")
        or kind not in _USER_MESSAGE_TYPES
    ):  # fmt: skip
        return None
    content = _content(message)
    if content is None:
        return None
    text, message_type, urls = content
    message_id = message.id("id")
    channel_id = message.id("channel_id")
    guild_id = message.opt_id("guild_id")
    member = message.opt_obj("member")
    names = (member.text("nick") if member else None, author.text("global_name"))
    common: dict[str, Any] = {
        "platform": "discord",
        "user_id": author.id("id"),
        "user_name": next((name for name in names if name), None) or author.text("username"),
        "scope_id": guild_id,
        "message_id": message_id,
    }
    if guild_id is None:
        source = SessionSource(chat_id=channel_id, chat_type="dm", **common)
    else:
        source = _guild_source(message, context, common)
    reference = message.opt_obj("message_reference")
    return MessageEvent(
        source=source,
        text=text,
        message_type=message_type,
        message_id=message_id,
        reply_to_message_id=reference.opt_id("message_id") if kind == 19 and reference else None,
        media_urls=urls,
    )


def _guild_source(message: Fields, context: ReadContext, common: dict[str, Any]) -> SessionSource:
    """The source of a guild message: a thread under its parent, or a channel."""
    channel_id = message.id("channel_id")
    found = context.lookup_chat(channel_id) if context.lookup_chat is not None else None
    if found is None:
        raise malformed(
            f"{message.path}.channel_id",
            f"names channel {channel_id}, whose type and parent the payload does not give",
            "pass ReadContext(lookup_chat=...) returning the channel object (type, parent_id) "
            "from the host's channel cache, so that a thread is not read as a channel",
        )
    channel = Fields(found, f"channel {channel_id}")
    if channel.integer("type") in _THREAD_TYPES:
        parent = channel.id("parent_id")
        return SessionSource(
            chat_id=parent, chat_name=channel.text("name"), chat_type="thread",
            thread_id=channel_id, parent_chat_id=parent, **common,
        )  # fmt: skip
    return SessionSource(
        chat_id=channel_id,
        chat_name=channel.text("name"),
        chat_type="group",
        chat_topic=channel.text("topic"),
        prospective_thread_id=common["message_id"] if context.answer_in_thread else None,
        **common,
    )


def _content(message: Fields) -> tuple[str, MessageType, tuple[str, ...]] | None:
    """Text, message type and attachment URLs; None when the message has none of them."""
    text = message.text("content") or ""
    attachments = message.objs("attachments")
    urls = tuple(url for attachment in attachments if (url := attachment.text("url")))
    if attachments:
        if (message.integer("flags") or 0) & _VOICE_MESSAGE_FLAG:
            return text, MessageType.VOICE, urls
        return text, media_type(attachments[0].text("content_type")), urls
    if message.objs("sticker_items"):
        return text, MessageType.STICKER, ()
    return (text, MessageType.TEXT, ()) if text else None
