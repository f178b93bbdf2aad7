"""Slack Events API ``event_callback`` payloads and slash commands into events.

The payload is the HTTP request body (``{"type": "event_callback", "team_id": ..., "event":
{...}}``) or the Socket Mode envelope around it (``{"type": "events_api", "payload": {...}}``).
A slash command (the form fields Slack POSTs, decoded by the host, or Socket Mode's
``slash_commands`` envelope) reads as its command line (``/ask what is due``) in its channel.
Other payload types (``url_verification``, rate-limit notices, shortcuts and other interactive
payloads, which the host's own handlers answer) and inner events other than ``message`` and
``app_mention`` (``assistant_thread_started`` and ``assistant_thread_context_changed`` among
them: the assistant pane opened or moved; what the user writes there comes as ``message``
events) are not user messages, nor are messages from bots (``bot_id``) or
from Slackbot (user ``USLACKBOT``, which has no ``bot_id``: its reminders and notices), hidden
ones and subtypes other than a thread reply also sent to the channel (``thread_broadcast``), a
file share (``file_share``) and ``/me`` (``me_message``): edits, deletions, joins, topic
changes, ... are not read.

The workspace (``team_id``, else ``event.team``) is the scope; a payload naming neither (an
org-wide install's) is scoped by ``authorizations[0]``'s team, else its enterprise.
``channel_type`` ``im`` is a DM; ``mpim`` (group DM), ``channel`` and ``group`` (private
channel) are groups. ``app_mention`` events carry no
``channel_type``: the host's ``ReadContext.lookup_chat`` may return the conversation object
(``is_im``), else a channel id starting with ``D`` is a DM. A reply in a thread has the parent's
``ts`` as ``thread_ts``, which becomes ``thread_id``; a mention also delivered as a ``message``
event reads to the same lane and message id, so the gateway stores it once.

A shared or forwarded message carries the original as an attachment (``is_share`` or
``is_msg_unfurl``): its ``text`` (else ``fallback``) follows the message's own. A file shared
over Slack Connect is a stub (``file_access: check_file_info``) without URL: its id is kept in
``metadata["media_ids"]`` for the host's ``files.info``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hermes_core.domain.models import MessageEvent, MessageType, SessionSource
from hermes_core.domain.specs import ReadContext
from hermes_plugins.readers.fields import Fields, malformed, media_type

_USER_SUBTYPES = frozenset({"thread_broadcast", "file_share", "me_message"})
_SLACKBOT = "USLACKBOT"
"""Slackbot's user id: its notices carry it as ``user`` and no ``bot_id``."""
_CHANNEL_TYPES = {"im": "dm", "mpim": "group", "channel": "group", "group": "group"}


def read_slack_event(payload: Mapping[str, Any], context: ReadContext) -> MessageEvent | None:
    """The event of an ``event_callback`` (see the module docstring)."""
    body = Fields(payload, "body")
    if body.text("type") in ("events_api", "slash_commands"):
        body = body.obj("payload")
    if body.has("command") and not body.has("type"):
        return _slash_command(body)
    if body.text("type") != "event_callback":
        return None
    event = body.obj("event")
    kind = event.text("type")
    if kind not in ("message", "app_mention"):
        return None
    subtype = event.text("subtype")
    if (
        event.has("bot_id") or event.opt_id("user") == _SLACKBOT or event.flag("hidden")
        or (subtype and subtype not in _USER_SUBTYPES)
    ):  # fmt: skip
        return None
    channel = event.id("channel")
    ts = event.id("ts")
    thread_ts = event.opt_id("thread_ts")
    thread = thread_ts if thread_ts != ts else None
    profile = event.opt_obj("user_profile")
    files = event.objs("files")
    urls = tuple(url for item in files if (url := item.text("url_private")))
    stubs = [item.id("id") for item in files if item.text("file_access") == "check_file_info"]
    source = SessionSource(
        platform="slack",
        chat_id=channel,
        chat_type=_chat_type(event, channel, context),
        user_id=event.id("user"),
        user_name=(profile.text("display_name") or profile.text("real_name")) if profile else None,
        thread_id=thread,
        scope_id=_workspace(body, event),
        message_id=ts,
    )
    return MessageEvent(
        source=source,
        text=_text(event),
        message_type=media_type(files[0].text("mimetype")) if files else MessageType.TEXT,
        message_id=ts,
        reply_to_message_id=thread,
        media_urls=urls,
        metadata={"media_ids": stubs} if stubs else {},
    )


def _text(event: Fields) -> str:
    """The message's text, then the text (else fallback) of each message it shares."""
    shared = [
        attachment.text("text") or attachment.text("fallback")
        for attachment in event.objs("attachments")
        if attachment.flag("is_share") or attachment.flag("is_msg_unfurl")
    ]
    return "\n".join(part for part in (event.text("text"), *shared) if part)


def _slash_command(body: Fields) -> MessageEvent:
    """A slash command as its command line; it has no message id and no thread."""
    channel = body.id("channel_id")
    direct = body.text("channel_name") == "directmessage" or channel.startswith("D")
    line = " ".join(part for part in (body.text("command"), body.text("text")) if part)
    source = SessionSource(
        platform="slack",
        chat_id=channel,
        chat_type="dm" if direct else "group",
        user_id=body.id("user_id"),
        user_name=body.text("user_name"),
        scope_id=_workspace(body, Fields({}, body.path)),
    )
    return MessageEvent(source=source, text=line)


def _workspace(body: Fields, event: Fields) -> str | None:
    """``team_id``, else ``event.team``, else (an org-wide install) ``authorizations[0]``'s team,
    else its enterprise, else the body's ``enterprise_id``."""
    grants = body.objs("authorizations")
    grant = grants[0] if grants else None
    found = (
        body.opt_id("team_id"), event.opt_id("team"),
        grant.opt_id("team_id") if grant else None,
        grant.opt_id("enterprise_id") if grant else None,
        body.opt_id("enterprise_id"),
    )  # fmt: skip
    return next((workspace for workspace in found if workspace), None)


def _chat_type(event: Fields, channel: str, context: ReadContext) -> str:
    """``dm`` or ``group``, from ``channel_type``, else the conversation, else the id."""
    given = event.text("channel_type")
    if given is not None:
        if given not in _CHANNEL_TYPES:
            raise malformed(
                f"{event.path}.channel_type", f"must be one of {', '.join(_CHANNEL_TYPES)}"
            )
        return _CHANNEL_TYPES[given]
    found = context.lookup_chat(channel) if context.lookup_chat is not None else None
    if found is not None:
        return "dm" if Fields(found, f"conversation {channel}").flag("is_im") else "group"
    return "dm" if channel.startswith("D") else "group"
