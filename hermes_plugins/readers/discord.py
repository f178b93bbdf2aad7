"""Discord gateway ``MESSAGE_CREATE`` and ``INTERACTION_CREATE`` dispatches into events.

The payload is the gateway dispatch (``{"op": 0, "t": "MESSAGE_CREATE", "d": {...}}``) or its
``d`` object alone. Other dispatches (``MESSAGE_UPDATE``, reactions, ...) are not user messages,
nor are messages written by bots or webhooks, system messages and message types other than a plain
message or a reply (thread-created notices, pins, joins, ...), nor messages with no content,
attachment or sticker.

A forward (``message_reference.type`` 1) has no content of its own: its text and attachments
are read from the forwarded message in ``message_snapshots``; it is not a reply.
A reply's ``referenced_message`` (null when deleted) gives the replied-to content as
``metadata["reply_to_text"]``.

An interaction (``INTERACTION_CREATE``, or the bare interaction object an HTTP interactions
endpoint receives) is read when it is a slash command, as its command line (``/ask what is
due``), a component, as its ``custom_id`` and a select menu's chosen values, replying to the
message the component is on, or a modal's submission, as the modal's ``custom_id`` and one line
``field: value`` per submitted field (replying to the message whose component opened it, if
any); pings, autocomplete and bots' interactions are not. Its ``channel`` object is used before
the host's cache; it has no message id.

A message without ``guild_id`` is a DM. A guild message's channel may be a thread (or a forum
post, which is a thread): ``MESSAGE_CREATE`` says which by its extra field ``channel_type``, so a
message in any other channel reads without the host. A thread's parent is not in the payload, so
for a thread (or a payload without ``channel_type``) the host's ``ReadContext.lookup_chat`` must
return the channel object (``type`` and ``parent_id``); it is also asked, when given, for a
channel's name and topic. In a thread the source is ``chat_type="thread"`` with the parent channel
as ``chat_id`` and the thread as ``thread_id``; a message in a channel the host answers in a new
thread (``ReadContext.answer_in_thread``) gets its own id as ``prospective_thread_id``, which is
the id of a thread started from it, so both map to one key.
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
_FORWARD = 1
"""``message_reference.type`` of a forward (0 is a reply)."""
_COMMAND, _COMPONENT, _MODAL = 2, 3, 5
"""Interaction types APPLICATION_COMMAND, MESSAGE_COMPONENT and MODAL_SUBMIT (1 is PING, 4
autocomplete)."""


def read_discord_message(payload: Mapping[str, Any], context: ReadContext) -> MessageEvent | None:
    """The event of a ``MESSAGE_CREATE`` dispatch (see the module docstring)."""
    dispatch = Fields(payload, "dispatch")
    if "d" in dispatch.data or "op" in dispatch.data:
        name = dispatch.text("t")
        if dispatch.integer("op") != 0 or name not in ("MESSAGE_CREATE", "INTERACTION_CREATE"):
            return None
        if name == "INTERACTION_CREATE":
            return _interaction(dispatch.obj("d"), context)
        message = dispatch.obj("d")
    elif "token" in dispatch.data and "application_id" in dispatch.data:
        return _interaction(Fields(payload, "interaction"), context)
    else:
        message = Fields(payload, "message")
    author = message.obj("author")
    kind = message.integer("type") or 0
    if (
        author.flag("bot") or author.flag("system") or message.has("webhook_id")
        or kind not in _USER_MESSAGE_TYPES
    ):  # fmt: skip
        return None
    reference = message.opt_obj("message_reference")
    content = _content(message, reference)
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
    replied = message.opt_obj("referenced_message") if kind == 19 else None
    replied_text = replied.text("content") if replied else None
    if guild_id is None:
        source = SessionSource(chat_id=channel_id, chat_type="dm", **common)
    else:
        source = _guild_source(message, context, common)
    return MessageEvent(
        source=source,
        text=text,
        message_type=message_type,
        message_id=message_id,
        reply_to_message_id=reference.opt_id("message_id") if kind == 19 and reference else None,
        media_urls=urls,
        metadata={"reply_to_text": replied_text} if replied_text else {},
    )


def _interaction(interaction: Fields, context: ReadContext) -> MessageEvent | None:
    """A slash command (its command line), a component (its ``custom_id`` and chosen values,
    replying to the message it is on) or a modal's submission (its fields); other interactions
    and bots' are None."""
    kind = interaction.integer("type")
    if kind not in (_COMMAND, _COMPONENT, _MODAL):
        return None
    member = interaction.opt_obj("member")
    user = member.obj("user") if member else interaction.obj("user")
    if user.flag("bot"):
        return None
    data = interaction.obj("data")
    message = interaction.opt_obj("message")
    reply_to = message.opt_id("id") if message and kind != _COMMAND else None
    if kind == _COMMAND:
        text = " ".join(["/" + (data.text("name") or ""), *_options(data)])
    elif kind == _MODAL:
        text = "\n".join([data.text("custom_id") or "", *_fields(data)])
    else:
        text = " ".join([data.text("custom_id") or "", *(str(v) for v in _values(data))])
    names = (member.text("nick") if member else None, user.text("global_name"))
    guild_id = interaction.opt_id("guild_id")
    common: dict[str, Any] = {
        "platform": "discord",
        "user_id": user.id("id"),
        "user_name": next((name for name in names if name), None) or user.text("username"),
        "scope_id": guild_id,
        "message_id": None,
    }
    channel_id = interaction.id("channel_id")
    if guild_id is None:
        source = SessionSource(chat_id=channel_id, chat_type="dm", **common)
    else:
        channel = interaction.opt_obj("channel")
        source = _guild_source(interaction, context, common, channel.data if channel else None)
    return MessageEvent(source=source, text=text.strip(), reply_to_message_id=reply_to)


def _options(data: Fields, depth: int = 0) -> list[str]:
    """A command's option values in order, a sub-command's (group's) name before its own; Discord
    nests at most a group and a sub-command, deeper nesting is not read."""
    words: list[str] = []
    for option in data.objs("options"):
        if option.integer("type") in (1, 2):
            if depth < 2:
                words += [option.text("name") or "", *_options(option, depth + 1)]
        elif (value := option.data.get("value")) is not None:
            words.append(str(value).lower() if isinstance(value, bool) else str(value))
    return words


def _fields(data: Fields) -> list[str]:
    """A modal's submitted fields as ``custom_id: value`` (a select's values joined by ``, ``),
    through action rows (``components``) and labels (``component``); fields with neither a value
    nor values (text displays) are left out."""
    lines: list[str] = []
    for row in data.objs("components"):
        inner = row.opt_obj("component")
        for field in [inner] if inner is not None else row.objs("components") or [row]:
            value = field.text("value")
            values = _values(field) if value is None else []
            if value is not None or values:
                said = value if value is not None else ", ".join(str(v) for v in values)
                lines.append(f"{field.text('custom_id') or ''}: {said}")
    return lines


def _values(data: Fields) -> list[object]:
    """A select menu's chosen values."""
    values = data.data.get("values")
    if values is None:
        return []
    if not isinstance(values, list):
        raise malformed(f"{data.path}.values", "must be an array")
    return values


def _guild_source(
    message: Fields, context: ReadContext, common: dict[str, Any], given: object = None
) -> SessionSource:
    """The source of a guild message: a thread under its parent, or a channel. ``given`` is the
    channel object an interaction carries, used before the host's cache unless it is a thread
    without its ``parent_id``."""
    channel_id = message.id("channel_id")
    kind = message.integer("channel_type")
    found = given if _complete(given) else None
    if found is None and context.lookup_chat is not None:
        found = context.lookup_chat(channel_id)
    if found is None and (kind is None or kind in _THREAD_TYPES):
        said = "a thread's" if kind is not None else "whose type and"
        raise malformed(
            f"{message.path}.channel_id",
            f"names channel {channel_id}, {said} parent the payload does not give",
            "pass ReadContext(lookup_chat=...) returning the channel object (type, parent_id) "
            "from the host's channel cache, so that a thread is not read as a channel",
        )
    channel = Fields(found or {}, f"channel {channel_id}")
    if kind is None:
        kind = channel.integer("type")
    if kind in _THREAD_TYPES:
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


def _complete(channel: object) -> bool:
    """Whether an interaction's channel object says all the source needs."""
    if not isinstance(channel, Mapping):
        return False
    return channel.get("type") not in _THREAD_TYPES or channel.get("parent_id") is not None


def _content(
    message: Fields, reference: Fields | None
) -> tuple[str, MessageType, tuple[str, ...]] | None:
    """Text, message type and attachment URLs, a forward's from the message it forwards; None
    when the message has none of them."""
    parts = [message]
    if reference is not None and reference.integer("type") == _FORWARD:
        parts += [snapshot.obj("message") for snapshot in message.objs("message_snapshots")]
    text = "\n".join(own for part in parts if (own := part.text("content")))
    attachments = [attachment for part in parts for attachment in part.objs("attachments")]
    urls = tuple(url for attachment in attachments if (url := attachment.text("url")))
    if attachments:
        if any((part.integer("flags") or 0) & _VOICE_MESSAGE_FLAG for part in parts):
            return text, MessageType.VOICE, urls
        return text, media_type(attachments[0].text("content_type")), urls
    if any(part.objs("sticker_items") for part in parts):
        return text, MessageType.STICKER, ()
    return (text, MessageType.TEXT, ()) if text else None
