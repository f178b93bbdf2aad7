"""WhatsApp payloads into events: Cloud API webhooks and WhatsApp Web messages.

**Cloud API**: the webhook body (``{"object": "whatsapp_business_account", "entry": [...]}``).
Changes other than ``messages``, status updates, reactions, message types the event model cannot
carry (``unsupported``, ``system``, ``order``, ...) and messages the platform could not deliver
(with ``errors``, e.g. code 131051) are not user messages. Shared contacts and locations read as
short text (``name: phone, phone``; ``name, address (latitude, longitude)``). A Flow submission
(``interactive.nfm_reply``) reads as its form's ``response_json`` (else its ``body``); a
template quick reply (``button``) or interactive button or list reply as its title, the id of
what it chose in ``metadata["choice_id"]``. The first message from a click-to-WhatsApp ad
keeps its ``referral`` object in ``metadata["referral"]``. A
message with ``group_id`` belongs to that group, else it is a DM with its sender: ``from``, a
phone number, or for a user whose number is withheld (usernames) the business-scoped user id,
``from_user_id`` else the one ``contacts[].user_id``. One payload must hold one message: a
webhook batching several is split first with :func:`split_cloud_webhook`.

**WhatsApp Web** (a bridge built on the multi-device protocol, e.g. Baileys): one ``WAMessage``
(``{"key": {"remoteJid": ..., "fromMe": ..., "id": ...}, "message": {...}, "pushName": ...}``).
Own messages (``fromMe``), status and newsletter broadcasts, edits, deletions, reactions and
stubs are not user messages. Shared contacts, locations and polls read as text (a poll as
``Poll: question (option / option)``), and so do button, list, template-button and native-flow
replies (what was chosen, its id in ``metadata["choice_id"]``). The replied-to message's text
(``contextInfo.quotedMessage``) goes to ``metadata["reply_to_text"]``, the mentioned JIDs
(``contextInfo.mentionedJid``) to ``metadata["mentions"]``, a click-to-WhatsApp ad's
``contextInfo.externalAdReply`` to ``metadata["referral"]``. ``<id>@g.us`` is a group whose
sender is ``key.participant``; ``<digits>@s.whatsapp.net`` (with or without a ``:<device>``
suffix) and ``<digits>@lid`` are DMs.
When a LID-addressed chat or sender also comes with its phone-number JID, the phone-number JID is
used, so the key does not depend on which form the bridge saw; otherwise the plugin's
canonicaliser maps a LID to the phone number through the bridge's mapping files. Baileys spells
that JID two ways: 7.0 release candidates and later ``remoteJidAlt`` / ``participantAlt``, 6.7 and
the 7.0 alphas ``senderPn`` / ``participantPn``; both are read, the newer spelling first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from hermes_core.domain.errors import shown
from hermes_core.domain.models import MessageEvent, MessageType, SessionSource
from hermes_core.domain.specs import ReadContext
from hermes_plugins.readers.fields import Fields, malformed
from hermes_plugins.readers.whatsapp_text import card_text, place_text, vcard_phones, web_choice

_CLOUD_MEDIA = {
    "image": MessageType.PHOTO,
    "video": MessageType.VIDEO,
    "audio": MessageType.AUDIO,
    "document": MessageType.DOCUMENT,
    "sticker": MessageType.STICKER,
}
_WEB_WRAPPERS = (
    "ephemeralMessage", "viewOnceMessage", "viewOnceMessageV2", "viewOnceMessageV2Extension",
    "documentWithCaptionMessage",
)  # fmt: skip
_WEB_MEDIA = {
    "imageMessage": MessageType.PHOTO,
    "videoMessage": MessageType.VIDEO,
    "documentMessage": MessageType.DOCUMENT,
    "stickerMessage": MessageType.STICKER,
}
_WEB_POLLS = ("pollCreationMessage", "pollCreationMessageV2", "pollCreationMessageV3")
_DM_PHONE_FIELDS = ("remoteJidAlt", "senderPn")
_SENDER_PHONE_FIELDS = ("participantAlt", "participantPn")
_MAX_WRAPPING = 4
_DM_SERVERS = frozenset({"s.whatsapp.net", "lid"})
_SKIPPED_SERVERS = frozenset({"broadcast", "newsletter"})


class Content(NamedTuple):
    """What a message says, apart from who sent it where."""

    text: str
    kind: MessageType
    media_id: str | None
    reply_id: str | None
    media_url: str | None = None
    metadata: Mapping[str, Any] | None = None


def read_whatsapp_payload(payload: Mapping[str, Any], context: ReadContext) -> MessageEvent | None:
    """The event of a Cloud API webhook or a WhatsApp Web message (see the module docstring)."""
    body = Fields(payload, "payload")
    if body.text("object") == "whatsapp_business_account":
        return _read_cloud(body)
    if body.has("key"):
        return _read_web(body)
    raise malformed(
        "payload",
        "is neither a Cloud API webhook (object: whatsapp_business_account) nor a WhatsApp Web "
        "message (key.remoteJid)",
    )


def _cloud_changes(body: Fields) -> list[tuple[Fields, Fields, Fields, list[Fields]]]:
    """Every (entry, change, value, messages) of the ``messages`` changes of a webhook."""
    found = []
    for entry in body.objs("entry"):
        for change in entry.objs("changes"):
            if change.text("field") == "messages":
                value = change.obj("value")
                found.append((entry, change, value, value.objs("messages")))
    return found


def split_cloud_webhook(payload: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One webhook body per message of a Cloud API webhook, each with the envelope and
    ``metadata`` it came with and only its sender's ``contacts``; raises ``MalformedEventError``
    like the reader. Linear in the webhook's size (the contacts are indexed once per change), so
    splitting and reading every part cost about what reading the whole body once does."""
    parts = []
    for entry, change, value, messages in _cloud_changes(Fields(payload, "payload")):
        contacts: dict[str, list[Mapping[str, Any]]] = {}
        for contact in value.objs("contacts") if messages else ():
            for name in {contact.opt_id("wa_id"), contact.opt_id("user_id")} - {None}:
                contacts.setdefault(str(name), []).append(contact.data)
        for message in messages:
            sender = message.opt_id("from") or message.opt_id("from_user_id")
            if sender is not None:
                mine = contacts.get(sender, [])
            else:  # one message: its contacts are the sender's
                mine = (value.data.get("contacts") or []) if len(messages) == 1 else []
            part = {**value.data, "contacts": mine, "messages": [message.data]}
            changes = [{**change.data, "value": part}]
            parts.append({**payload, "entry": [{**entry.data, "changes": changes}]})
    return parts


def _read_cloud(body: Fields) -> MessageEvent | None:
    messages = [(value, message) for *_, value, found in _cloud_changes(body) for message in found]
    if len(messages) > 1:
        raise malformed(
            "payload.entry",
            f"holds {len(messages)} messages, and one payload reads to one event",
            "split it with hermes_plugins.readers.whatsapp.split_cloud_webhook and read each part",
        )
    if not messages:
        return None
    value, message = messages[0]
    content = _cloud_content(message)
    if content is None:
        return None
    referral = message.opt_obj("referral")
    if referral is not None:
        extra = {**(content.metadata or {}), "referral": dict(referral.data)}
        content = content._replace(metadata=extra)
    contacts = value.objs("contacts")
    sender = message.opt_id("from") or message.opt_id("from_user_id")
    if sender is None and len(contacts) == 1:
        sender = contacts[0].opt_id("user_id")
    sender = sender or message.id("from")
    group = message.opt_id("group_id")
    names = [
        contact.obj("profile").text("name")
        for contact in contacts
        if sender in (contact.opt_id("wa_id"), contact.opt_id("user_id")) and contact.has("profile")
    ]
    source = SessionSource(
        platform="whatsapp",
        chat_id=group or sender,
        chat_type="group" if group else "dm",
        user_id=sender,
        user_name=names[0] if names else None,
        message_id=message.id("id"),
    )
    return _event(source, content=content)


def _cloud_content(message: Fields) -> Content | None:
    """What a Cloud API message says; None for types the event model cannot carry and for messages
    whose ``errors`` say the platform could not deliver their content."""
    kind = message.text("type")
    if message.has("errors"):
        return None
    context = message.opt_obj("context")
    reply_id = context.opt_id("id") if context is not None else None
    if kind == "text":
        return Content(message.obj("text").text("body") or "", MessageType.TEXT, None, reply_id)
    if kind in _CLOUD_MEDIA:
        media = message.obj(kind)
        media_type = _CLOUD_MEDIA[kind]
        if kind == "audio" and media.flag("voice"):
            media_type = MessageType.VOICE
        return Content(
            media.text("caption") or "", media_type, media.opt_id("id"), reply_id, media.text("url")
        )
    if kind == "location":
        text = place_text(message.obj("location"), "latitude", "longitude")
        return Content(text, MessageType.LOCATION, None, reply_id)
    if kind == "contacts":
        cards = [
            card_text(card.obj("name").text("formatted_name") if card.has("name") else None,
                  [phone.text("phone") for phone in card.objs("phones")])
            for card in message.objs("contacts")
        ]  # fmt: skip
        return Content("; ".join(card for card in cards if card), MessageType.TEXT, None, reply_id)
    if kind == "button":
        button = message.obj("button")
        choice = _choice(button.opt_id("payload"))
        return Content(button.text("text") or "", MessageType.TEXT, None, reply_id, None, choice)
    if kind == "interactive":
        interactive = message.obj("interactive")
        flow = interactive.opt_obj("nfm_reply")
        if flow is not None:
            form = flow.text("response_json") or flow.text("body") or ""
            return Content(form, MessageType.TEXT, None, reply_id)
        chosen = interactive.opt_obj("button_reply") or interactive.opt_obj("list_reply")
        if chosen is None:
            return Content("", MessageType.TEXT, None, reply_id)
        title = chosen.text("title") or ""
        return Content(title, MessageType.TEXT, None, reply_id, None, _choice(chosen.opt_id("id")))
    return None


def _choice(choice_id: str | None) -> dict[str, str] | None:
    """The metadata naming the button or list row a reply chose (its id or payload)."""
    return {"choice_id": choice_id} if choice_id else None


def _phone_first(key: Fields, jid: str, fields: tuple[str, ...]) -> tuple[str, str | None]:
    """(the JID to key by, the other form): the phone-number JID when a LID comes with one in the
    first of ``fields`` the key has."""
    alt = next((found for name in fields if (found := key.opt_id(name))), None)
    if alt and jid.endswith("@lid") and not alt.endswith("@lid"):
        return alt, jid
    return jid, alt


def _read_web(message: Fields) -> MessageEvent | None:
    key = message.obj("key")
    if key.flag("fromMe"):
        return None
    remote = key.id("remoteJid")
    server = remote.rpartition("@")[2]
    if server in _SKIPPED_SERVERS:
        return None
    if server != "g.us" and server not in _DM_SERVERS:
        raise malformed(
            "payload.key.remoteJid",
            f"has the server {shown(server)}; expected g.us, s.whatsapp.net, lid, broadcast or "
            "newsletter",
        )
    content = _web_content(message.opt_obj("message"))
    if content is None:
        return None
    common: dict[str, Any] = {
        "platform": "whatsapp",
        "user_name": message.text("pushName"),
        "message_id": key.id("id"),
    }
    if server == "g.us":
        sender, _ = _phone_first(key, key.id("participant"), _SENDER_PHONE_FIELDS)
        source = SessionSource(chat_id=remote, chat_type="group", user_id=sender, **common)
    else:
        chat, other = _phone_first(key, remote, _DM_PHONE_FIELDS)
        source = SessionSource(
            chat_id=chat, chat_id_alt=other, chat_type="dm", user_id=chat, **common
        )
    return _event(source, content=content)


def _web_content(message: Fields | None, *, quoting: bool = True) -> Content | None:
    """What a WhatsApp Web message says, through its wrappers; None for what is not read. With
    ``quoting``, the quoted message's text and the mentions go to the metadata (a quoted message's
    own quote is not read)."""
    path = message.path if message is not None else ""
    for _ in range(_MAX_WRAPPING + 1):
        if message is None:
            return None
        wrapper = next((name for name in _WEB_WRAPPERS if message.has(name)), None)
        if wrapper is None:
            break
        message = message.obj(wrapper).opt_obj("message")
    else:
        raise malformed(path, f"wraps its content more than {_MAX_WRAPPING} deep")
    if message is None:
        return None
    content = _web_body(message)
    if content is None or not quoting:
        return content
    metadata = {**(content.metadata or {}), **_context_metadata(message)}
    return content._replace(metadata=metadata or None)


def _web_body(message: Fields) -> Content | None:
    """What an unwrapped WhatsApp Web message says; None for what is not read."""
    conversation = message.text("conversation")
    if conversation is not None:
        return Content(conversation, MessageType.TEXT, None, None)
    extended = message.opt_obj("extendedTextMessage")
    if extended is not None:
        return Content(extended.text("text") or "", MessageType.TEXT, None, _quoted(extended))
    audio = message.opt_obj("audioMessage")
    if audio is not None:
        kind = MessageType.VOICE if audio.flag("ptt") else MessageType.AUDIO
        return Content("", kind, None, _quoted(audio))
    for name, kind in _WEB_MEDIA.items():
        media = message.opt_obj(name)
        if media is not None:
            return Content(media.text("caption") or "", kind, None, _quoted(media))
    return _web_shared(message)


def _web_shared(message: Fields) -> Content | None:
    """A shared location, contact card(s), poll or a reply to buttons or a list as text; None
    for what is not read."""
    choice = web_choice(message)
    if choice is not None:
        part, text, chosen = choice
        return Content(text, MessageType.TEXT, None, _quoted(part), None, _choice(chosen))
    place = message.opt_obj("locationMessage")
    if place is not None:
        text = place_text(place, "degreesLatitude", "degreesLongitude")
        return Content(text, MessageType.LOCATION, None, _quoted(place))
    contact = message.opt_obj("contactMessage")
    cards = [contact] if contact is not None else []
    listed = message.opt_obj("contactsArrayMessage")
    cards += listed.objs("contacts") if listed is not None else []
    if cards:
        named = (card_text(card.text("displayName"), vcard_phones(card)) for card in cards)
        text = "; ".join(filter(None, named))
        return Content(text, MessageType.TEXT, None, _quoted(contact or listed or cards[0]))
    poll = next((message.obj(name) for name in _WEB_POLLS if message.has(name)), None)
    if poll is not None:
        options = " / ".join(filter(None, (o.text("optionName") for o in poll.objs("options"))))
        text = f"Poll: {poll.text('name') or ''}" + (f" ({options})" if options else "")
        return Content(text, MessageType.TEXT, None, _quoted(poll))
    return None


def _context_metadata(message: Fields) -> dict[str, Any]:
    """``reply_to_text`` (the replied-to message's text), ``mentions`` (the mentioned JIDs) and
    ``referral`` (a click-to-WhatsApp ad's ``externalAdReply``, as sent) from the
    ``contextInfo`` of the message's content."""
    found = (name for name, part in message.data.items()
             if isinstance(part, Mapping) and part.get("contextInfo") is not None)  # fmt: skip
    name = next(found, None)
    if name is None:
        return {}
    info = message.obj(name).obj("contextInfo")
    metadata: dict[str, Any] = {}
    quoted = info.opt_obj("quotedMessage")
    said = _web_content(quoted, quoting=False) if quoted is not None else None
    if said is not None and said.text:
        metadata["reply_to_text"] = said.text
    mentions = info.data.get("mentionedJid")
    if mentions is not None and not isinstance(mentions, list):
        raise malformed(f"{info.path}.mentionedJid", "must be a list")
    jids = [jid for jid in mentions or () if isinstance(jid, str) and jid]
    if jids:
        metadata["mentions"] = jids
    ad = info.opt_obj("externalAdReply")
    if ad is not None:
        metadata["referral"] = dict(ad.data)
    return metadata


def _quoted(content: Fields) -> str | None:
    """The id of the message this content replies to (``contextInfo.stanzaId``)."""
    info = content.opt_obj("contextInfo")
    return info.opt_id("stanzaId") if info is not None else None


def _event(source: SessionSource, *, content: Content) -> MessageEvent:
    metadata: dict[str, Any] = dict(content.metadata or {})
    if content.media_id:
        metadata["media_ids"] = [content.media_id]
    return MessageEvent(
        source=source,
        text=content.text,
        message_type=content.kind,
        message_id=source.message_id,
        reply_to_message_id=content.reply_id,
        media_urls=(content.media_url,) if content.media_url else (),
        metadata=metadata,
    )
