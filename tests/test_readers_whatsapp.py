"""The WhatsApp reader on Cloud API webhooks and WhatsApp Web (Baileys) messages.

Cloud API samples follow Meta's messages webhook reference,
https://developers.facebook.com/documentation/business-messaging/whatsapp/webhooks/reference/messages
(``object``, ``entry[].changes[].value`` with ``metadata``, ``contacts[].profile.name`` and
``wa_id``, ``messages[]`` with ``from``, ``id``, ``timestamp``, ``type``, ``text.body``,
``image``/``audio`` with ``id`` and ``voice``, ``context.id``, ``reaction``; ``statuses[]``), and
its group messages page (``group_id`` on a message), .../webhooks/reference/messages/group/.
WhatsApp Web samples follow Baileys' ``WAMessage``: the key fields ``remoteJid``, ``fromMe``,
``id``, ``participant``, ``remoteJidAlt`` and ``participantAlt`` at
https://baileys.wiki/api-reference/type-aliases/WAMessageKey, PN and LID JIDs at
https://baileys.wiki/migration/v7, and the ``proto.IMessage`` content fields (``conversation``,
``extendedTextMessage.contextInfo.stanzaId``, ``imageMessage.caption``, ``audioMessage.ptt``,
``ephemeralMessage``, ``reactionMessage``, ``protocolMessage``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.readers import keyed, read

from hermes_core import MalformedEventError, MessageType, read_event
from hermes_core.testing import fresh_plugin_manager
from hermes_plugins.readers.whatsapp import split_cloud_webhook

PHONE = "60123456789"
LID = "999999999999999"
GROUP = "120363025246125244@g.us"


def cloud(*messages: dict[str, Any], **value: Any) -> dict[str, Any]:
    """A Cloud API webhook body whose one ``messages`` change holds ``messages``."""
    change = {
        "messaging_product": "whatsapp",
        "metadata": {"display_phone_number": "15550783881", "phone_number_id": "106540352242922"},
        "contacts": [{"profile": {"name": "Sheena"}, "wa_id": PHONE}],
        "messages": list(messages),
        **value,
    }
    entry = {"id": "102290129340398", "changes": [{"value": change, "field": "messages"}]}
    return {"object": "whatsapp_business_account", "entry": [entry]}


def text(body: str = "hi", **extra: Any) -> dict[str, Any]:
    return {
        "from": PHONE, "id": "wamid.HBgLMTY1MDM4Nzk0MzkVAgASGBQzQTRB", "timestamp": "1749416383",
        "type": "text", "text": {"body": body}, **extra,
    }  # fmt: skip


def web(remote: str, message: dict[str, Any] | None = None, **key: Any) -> dict[str, Any]:
    """A Baileys ``WAMessage`` received in chat ``remote``."""
    return {
        "key": {"remoteJid": remote, "fromMe": False, "id": "3EB0C767D097B7A3C1", **key},
        "message": {"conversation": "hello"} if message is None else message,
        "messageTimestamp": 1749416383,
        "pushName": "Sheena",
    }


def map_lid(hermes_home: Path) -> None:
    """The bridge's mapping file saying LID -> phone number."""
    directory = hermes_home / "platforms" / "whatsapp" / "session"
    directory.mkdir(parents=True)
    reverse = directory / f"lid-mapping-{LID}_reverse.json"
    reverse.write_text(json.dumps(f"{PHONE}@s.whatsapp.net"), encoding="utf-8")


KEYS = [
    ("cloud DM", cloud(text()), f"agent:main:whatsapp:dm:c={PHONE}", False),
    ("cloud group", cloud(text(group_id="Y2FwaV9ncm91cDoxNTU1")),
     f"agent:main:whatsapp:group:c=Y2FwaV9ncm91cDoxNTU1:u={PHONE}", False),
    ("web DM by phone JID", web(f"{PHONE}@s.whatsapp.net"), f"agent:main:whatsapp:dm:c={PHONE}",
     False),
    ("web DM from a device", web(f"{PHONE}:12@s.whatsapp.net"),
     f"agent:main:whatsapp:dm:c={PHONE}", False),
    ("web DM by LID with its phone JID", web(f"{LID}@lid", remoteJidAlt=f"{PHONE}@s.whatsapp.net"),
     f"agent:main:whatsapp:dm:c={PHONE}", False),
    ("web DM by LID alone, no mapping", web(f"{LID}@lid"),
     f"agent:main:whatsapp:dm:c={LID}", False),
    ("web group, phone participant with device",
     web(GROUP, participant=f"{PHONE}:3@s.whatsapp.net"),
     f"agent:main:whatsapp:group:c={GROUP}:u={PHONE}", False),
    ("web group, LID participant with its phone JID",
     web(GROUP, participant=f"{LID}@lid", participantAlt=f"{PHONE}@s.whatsapp.net"),
     f"agent:main:whatsapp:group:c={GROUP}:u={PHONE}", False),
]  # fmt: skip


@pytest.mark.parametrize(("case", "payload", "key", "shared"), KEYS, ids=[k[0] for k in KEYS])
def test_keys(case: str, payload: Any, key: str, shared: bool, hermes_home: Path) -> None:
    assert keyed("whatsapp", payload, hermes_home) == (key, shared)


def test_a_phone_sender_and_its_lid_share_a_key_when_the_mapping_file_exists(
    hermes_home: Path,
) -> None:
    dm_by_phone = web(f"{PHONE}@s.whatsapp.net")
    dm_by_lid = web(f"{LID}@lid")
    in_group_by_phone = web(GROUP, participant=f"{PHONE}@s.whatsapp.net")
    in_group_by_lid = web(GROUP, participant=f"{LID}@lid")
    assert keyed("whatsapp", dm_by_lid, hermes_home) != keyed("whatsapp", dm_by_phone, hermes_home)
    map_lid(hermes_home)
    assert keyed("whatsapp", dm_by_lid, hermes_home) == keyed("whatsapp", dm_by_phone, hermes_home)
    assert keyed("whatsapp", in_group_by_lid, hermes_home) == keyed(
        "whatsapp", in_group_by_phone, hermes_home
    )
    assert keyed("whatsapp", cloud(text()), hermes_home) == keyed(
        "whatsapp", dm_by_lid, hermes_home
    )


def test_web_source_fields(hermes_home: Path) -> None:
    event = read("whatsapp", web(f"{LID}@lid", remoteJidAlt=f"{PHONE}@s.whatsapp.net"), hermes_home)
    assert event is not None
    source = event.source
    assert (source.chat_id, source.chat_id_alt) == (f"{PHONE}@s.whatsapp.net", f"{LID}@lid")
    assert (source.user_id, source.user_name, event.message_id) == (
        f"{PHONE}@s.whatsapp.net", "Sheena", "3EB0C767D097B7A3C1"
    )  # fmt: skip


WEB_CONTENT = [
    ({"extendedTextMessage": {"text": "re", "contextInfo": {"stanzaId": "ABC"}}},
     "re", MessageType.TEXT, "ABC"),
    ({"imageMessage": {"caption": "pic", "mimetype": "image/jpeg"}},
     "pic", MessageType.PHOTO, None),
    ({"audioMessage": {"ptt": True, "seconds": 3}}, "", MessageType.VOICE, None),
    ({"ephemeralMessage": {"message": {"conversation": "gone soon"}}},
     "gone soon", MessageType.TEXT, None),
]  # fmt: skip


@pytest.mark.parametrize(("message", "body", "kind", "reply"), WEB_CONTENT)
def test_web_content(
    message: dict[str, Any], body: str, kind: MessageType, reply: str | None, hermes_home: Path
) -> None:
    event = read("whatsapp", web(f"{PHONE}@s.whatsapp.net", message), hermes_home)
    assert event is not None
    assert (event.text, event.message_type, event.reply_to_message_id) == (body, kind, reply)


def test_cloud_content(hermes_home: Path) -> None:
    picture = {"id": "1479537139650973", "caption": "look", "mime_type": "image/jpeg"}
    image = {**text(), "type": "image", "image": picture, "context": {"id": "wamid.Q"}}
    event = read("whatsapp", cloud(image), hermes_home)
    assert event is not None
    assert (event.text, event.message_type, event.reply_to_message_id) == (
        "look", MessageType.PHOTO, "wamid.Q"
    )  # fmt: skip
    assert event.metadata == {"media_ids": ["1479537139650973"]}
    assert event.source.user_name == "Sheena"
    voice = {**text(), "type": "audio", "audio": {"id": "7", "voice": True}}
    voiced = read("whatsapp", cloud(voice), hermes_home)
    assert voiced is not None
    assert voiced.message_type == MessageType.VOICE


def test_a_batched_webhook_is_split_then_read(hermes_home: Path) -> None:
    batched = cloud(text("one"), {**text("two"), "id": "wamid.2"})
    with pytest.raises(MalformedEventError, match="split_cloud_webhook"):
        read("whatsapp", batched, hermes_home)
    parts = split_cloud_webhook(batched)
    events = [read("whatsapp", part, hermes_home) for part in parts]
    assert [event.text for event in events if event is not None] == ["one", "two"]


class _CountedContact(dict[str, Any]):
    """A ``contacts`` entry that counts how often its fields are read."""

    reads = 0

    def get(self, key: str, default: Any = None) -> Any:
        _CountedContact.reads += 1
        return super().get(key, default)


def test_splitting_and_reading_a_batch_is_linear(hermes_home: Path) -> None:
    """A webhook of n messages from n senders (n contacts): splitting it and reading every part
    reads each contact a bounded number of times, not once per message (n * n reads)."""
    count = 1000
    senders = [str(60_100_000_000 + n) for n in range(count)]
    messages = [{**text(f"m{n}"), "from": sender, "id": f"wamid.{n}"}
                for n, sender in enumerate(senders)]  # fmt: skip
    contacts = [_CountedContact(profile={"name": f"P{n}"}, wa_id=sender)
                for n, sender in enumerate(senders)]  # fmt: skip
    _CountedContact.reads = 0
    manager = fresh_plugin_manager(hermes_home)
    events = [
        read_event("whatsapp", part, plugins=manager)
        for part in split_cloud_webhook(cloud(*messages, contacts=contacts))
    ]
    assert [(e.text, e.source.user_name) for e in events if e is not None] == [
        (f"m{n}", f"P{n}") for n in range(count)
    ]
    assert _CountedContact.reads <= 10 * count


NOT_MESSAGES = [
    ("cloud status update", cloud(statuses=[{"id": "wamid.1", "status": "read"}])),
    ("cloud reaction", cloud({**text(), "type": "reaction",
                              "reaction": {"message_id": "wamid.1", "emoji": "👍"}})),
    ("cloud unsupported", cloud({**text(), "type": "unsupported"})),
    ("web own message", web(f"{PHONE}@s.whatsapp.net", fromMe=True)),
    ("web status broadcast", web("status@broadcast", participant=f"{PHONE}@s.whatsapp.net")),
    ("web reaction", web(f"{PHONE}@s.whatsapp.net",
                         {"reactionMessage": {"key": {"id": "X"}, "text": "👍"}})),
    ("web poll vote (encrypted)", web(f"{PHONE}@s.whatsapp.net", {"pollUpdateMessage": {
        "pollCreationMessageKey": {"id": "X"}, "vote": {"encPayload": "AAAA", "encIv": "BBBB"}}})),
    ("web deletion", web(f"{PHONE}@s.whatsapp.net", {"protocolMessage": {"type": 0}})),
    ("web stub without content", {**web(GROUP, participant="1@lid"), "message": None,
                                  "messageStubType": 27}),
]  # fmt: skip


@pytest.mark.parametrize(("case", "payload"), NOT_MESSAGES, ids=[n[0] for n in NOT_MESSAGES])
def test_not_user_messages(case: str, payload: Any, hermes_home: Path) -> None:
    assert read("whatsapp", payload, hermes_home) is None


def wrapped(depth: int) -> dict[str, Any]:
    """A text message inside ``depth`` disappearing-message wrappers."""
    message: dict[str, Any] = {"conversation": "deep"}
    for _ in range(depth):
        message = {"ephemeralMessage": {"message": message}}
    return message


def test_wrapping_up_to_four_deep_is_read(hermes_home: Path) -> None:
    event = read("whatsapp", web(f"{PHONE}@s.whatsapp.net", wrapped(4)), hermes_home)
    assert event is not None
    assert event.text == "deep"


MALFORMED = [
    ("payload", {"hello": "world"}),
    ("payload.entry[0].changes[0].value.messages[0].from", cloud({**text(), "from": None})),
    ("payload.key.remoteJid", web("someone@example.com")),
    ("payload.key.participant", web(GROUP)),
    ("payload.message", web(f"{PHONE}@s.whatsapp.net", wrapped(5))),
]  # fmt: skip


@pytest.mark.parametrize(("field", "payload"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_payloads_name_the_field(field: str, payload: Any, hermes_home: Path) -> None:
    with pytest.raises(MalformedEventError) as caught:
        read("whatsapp", payload, hermes_home)
    assert caught.value.field == field


def read_as(payload: Any, hermes_home: Path) -> tuple[str, str, str | None, str | None]:
    """(key, text, reply-to id, thread id) of the event in ``payload``."""
    event = read("whatsapp", payload, hermes_home)
    assert event is not None, "the payload should read to an event"
    key, _ = keyed("whatsapp", payload, hermes_home)
    return key, event.text, event.reply_to_message_id, event.source.thread_id


# Baileys 6.7 and the 7.0 alphas name the phone-number JID of a LID-addressed sender
# ``senderPn`` (DMs) and ``participantPn`` (groups), next to ``senderLid`` / ``participantLid``
# (their ``WAMessageKey`` extension of ``proto.IMessageKey``); later 7.0 releases renamed them
# ``remoteJidAlt`` / ``participantAlt`` (https://baileys.wiki/api-reference/type-aliases/WAMessageKey).
OLDER_SPELLING = [
    ("DM", web(f"{LID}@lid", senderPn=f"{PHONE}@s.whatsapp.net", senderLid=f"{LID}@lid"),
     web(f"{LID}@lid", remoteJidAlt=f"{PHONE}@s.whatsapp.net"),
     f"agent:main:whatsapp:dm:c={PHONE}"),
    ("group", web(GROUP, participant=f"{LID}@lid", participantPn=f"{PHONE}@s.whatsapp.net",
                  participantLid=f"{LID}@lid"),
     web(GROUP, participant=f"{LID}@lid", participantAlt=f"{PHONE}@s.whatsapp.net"),
     f"agent:main:whatsapp:group:c={GROUP}:u={PHONE}"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "older", "newer", "key"), OLDER_SPELLING,
                         ids=[o[0] for o in OLDER_SPELLING])  # fmt: skip
def test_the_older_phone_jid_spelling_reaches_the_same_lane(
    case: str, older: Any, newer: Any, key: str, hermes_home: Path
) -> None:
    """Without mapping files, a LID sender whose phone JID comes as ``senderPn`` /
    ``participantPn`` is keyed by the phone number, like the newer spelling."""
    assert read_as(older, hermes_home) == (key, "hello", None, None)
    assert read_as(newer, hermes_home) == (key, "hello", None, None)
    old_event, new_event = (
        read("whatsapp", older, hermes_home),
        read("whatsapp", newer, hermes_home),
    )
    assert old_event is not None
    assert new_event is not None
    assert old_event.source == new_event.source


def test_the_newer_phone_jid_spelling_comes_first(hermes_home: Path) -> None:
    other = "60111111111@s.whatsapp.net"
    dm = web(f"{LID}@lid", remoteJidAlt=f"{PHONE}@s.whatsapp.net", senderPn=other)
    group = web(GROUP, participant=f"{LID}@lid", participantAlt=f"{PHONE}@s.whatsapp.net",
                participantPn=other)  # fmt: skip
    assert read_as(dm, hermes_home)[0] == f"agent:main:whatsapp:dm:c={PHONE}"
    assert read_as(group, hermes_home)[0] == f"agent:main:whatsapp:group:c={GROUP}:u={PHONE}"


def flow_reply(**nfm_reply: str) -> dict[str, Any]:
    """A Flow submission as Meta's Flows webhook reference shows it: ``interactive`` of type
    ``nfm_reply`` with ``name``, ``body`` and ``response_json``, in reply (``context``) to the
    message that opened the Flow."""
    return {
        "context": {"from": "15550783881", "id": "wamid.FLOW_MESSAGE"},
        "from": PHONE, "id": "wamid.FLOW_REPLY", "timestamp": "1749416383", "type": "interactive",
        "interactive": {"type": "nfm_reply", "nfm_reply": {"name": "flow", **nfm_reply}},
    }  # fmt: skip


def test_a_flow_submission_carries_its_form(hermes_home: Path) -> None:
    form = '{"flow_token": "AQAAAAACS5FpgQ_cAAAAAD0QI3s.", "department": "sales"}'
    submitted = cloud(flow_reply(body="Sent", response_json=form))
    assert read_as(submitted, hermes_home) == (
        f"agent:main:whatsapp:dm:c={PHONE}", form, "wamid.FLOW_MESSAGE", None
    )  # fmt: skip
    body_only = cloud(flow_reply(body="Sent"))
    assert read_as(body_only, hermes_home)[1:3] == ("Sent", "wamid.FLOW_MESSAGE")


# Meta's unsupported messages webhook reference
# (.../webhooks/reference/messages/unsupported): ``type`` ``unsupported`` with ``errors`` (131051:
# type not supported; 131060: currently unavailable) and ``unsupported.type``; the older reference
# sent ``type`` ``unknown`` with ``errors`` carrying ``details``.
_UNSUPPORTED_ERROR = {
    "code": 131051, "title": "Message type unknown", "message": "Message type unknown",
    "error_data": {"details": "Message type is currently not supported."},
}  # fmt: skip
_BASE = {"from": PHONE, "id": "wamid.UNSUPPORTED", "timestamp": "1739321024"}
UNDELIVERED = [
    ("unsupported", {**_BASE, "errors": [_UNSUPPORTED_ERROR], "type": "unsupported",
                     "unsupported": {"type": "poll_update"}}),
    ("unavailable", {**_BASE, "errors": [{**_UNSUPPORTED_ERROR, "code": 131060,
                                          "title": "This message is currently unavailable."}],
                     "type": "unsupported", "unsupported": {"type": "image"}}),
    ("legacy unknown", {**_BASE, "errors": [{"code": 131051, "title": "Unsupported message type",
                                             "details": "Message type is not currently supported"}],
                        "type": "unknown"}),
    ("errors on a media type without its object",
     {**_BASE, "errors": [_UNSUPPORTED_ERROR], "type": "image"}),
]  # fmt: skip


@pytest.mark.parametrize(("case", "message"), UNDELIVERED, ids=[u[0] for u in UNDELIVERED])
def test_messages_the_platform_could_not_deliver_are_ignored(
    case: str, message: dict[str, Any], hermes_home: Path
) -> None:
    assert read("whatsapp", cloud(message), hermes_home) is None


# Media objects as Meta's messages webhook reference shows them in newer webhook versions:
# ``id``, ``mime_type``, ``sha256`` and a ``url`` to download it with the access token.
CLOUD_MEDIA = ["image", "audio", "video", "document", "sticker"]


@pytest.mark.parametrize("kind", CLOUD_MEDIA)
def test_cloud_media_urls(kind: str, hermes_home: Path) -> None:
    url = f"https://lookaside.fbsbx.com/whatsapp_business/attachments/?mid=1234&ext=1749416383&hash={kind}"
    media = {
        "mime_type": "application/octet-stream",
        "sha256": "Z2l2ZW4=",
        "id": "1234",
        "url": url,
    }
    message = {**text(), "type": kind, kind: media, "context": {"id": "wamid.Q"}}
    del message["text"]
    payload = cloud(message)
    assert read_as(payload, hermes_home) == (
        f"agent:main:whatsapp:dm:c={PHONE}", "", "wamid.Q", None
    )  # fmt: skip
    event = read("whatsapp", payload, hermes_home)
    assert event is not None
    assert (event.media_urls, event.metadata) == ((url,), {"media_ids": ["1234"]})


# Replies to buttons and lists, as Meta's messages webhook reference shows them: a template's
# quick-reply button comes as ``type`` ``button`` with ``button.text`` and ``button.payload``
# (.../webhooks/reference/messages/button); an interactive message's reply as ``type``
# ``interactive`` with ``interactive.button_reply`` or ``interactive.list_reply`` holding ``id``,
# ``title`` (and a list row's ``description``) (.../webhooks/reference/messages/interactive).
_REPLY = {"from": PHONE, "id": "wamid.CHOICE", "timestamp": "1749416383",
          "context": {"from": "15550783881", "id": "wamid.ASKED"}}  # fmt: skip
CHOICES = [
    ("template quick reply", {**_REPLY, "type": "button",
                              "button": {"payload": "TALK_TO_AGENT", "text": "Talk to agent"}},
     "Talk to agent", "TALK_TO_AGENT"),
    ("interactive button", {**_REPLY, "type": "interactive", "interactive": {
        "type": "button_reply", "button_reply": {"id": "yes-7", "title": "Yes"}}},
     "Yes", "yes-7"),
    ("interactive list row", {**_REPLY, "type": "interactive", "interactive": {
        "type": "list_reply", "list_reply": {"id": "row-2", "title": "Tuesday",
                                             "description": "2-4 pm"}}},
     "Tuesday", "row-2"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "message", "body", "choice"), CHOICES, ids=[c[0] for c in CHOICES]
)
def test_button_and_list_replies_carry_their_title_and_id(
    case: str, message: dict[str, Any], body: str, choice: str, hermes_home: Path
) -> None:
    payload = cloud(message)
    assert read_as(payload, hermes_home) == (
        f"agent:main:whatsapp:dm:c={PHONE}", body, "wamid.ASKED", None
    )  # fmt: skip
    event = read("whatsapp", payload, hermes_home)
    assert event is not None
    assert (event.message_type, event.metadata) == (MessageType.TEXT, {"choice_id": choice})


# Shared contacts and locations as Meta's messages webhook reference shows them
# (.../webhooks/reference/messages/contacts: ``contacts[]`` with ``name.formatted_name`` and
# ``phones[].phone``; .../messages/location: ``location`` with ``latitude``, ``longitude``,
# ``name``, ``address``). The Cloud API delivers no polls (a poll arrives as ``unsupported``).
CLOUD_SHARED = [
    ("contacts", {**_REPLY, "type": "contacts", "contacts": [
        {"name": {"formatted_name": "Barbara Johnson", "first_name": "Barbara"},
         "phones": [{"phone": "+1 (940) 555-1234", "wa_id": "19405551234", "type": "HOME"},
                    {"phone": "+1 (650) 555-1234", "type": "WORK"}]},
        {"name": {"formatted_name": "Ali"}, "phones": []}]},
     "Barbara Johnson: +1 (940) 555-1234, +1 (650) 555-1234; Ali", MessageType.TEXT),
    ("location", {**_REPLY, "type": "location", "location": {
        "latitude": 37.483307, "longitude": -122.148981, "name": "Philz Coffee",
        "address": "101 Forest Ave, Palo Alto, CA 94301"}},
     "Philz Coffee, 101 Forest Ave, Palo Alto, CA 94301 (37.483307, -122.148981)",
     MessageType.LOCATION),
    ("location without a name", {**_REPLY, "type": "location",
                                 "location": {"latitude": 3, "longitude": 101.5}},
     "(3, 101.5)", MessageType.LOCATION),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "message", "body", "kind"), CLOUD_SHARED, ids=[c[0] for c in CLOUD_SHARED]
)
def test_cloud_contacts_and_locations_read_as_text(
    case: str, message: dict[str, Any], body: str, kind: MessageType, hermes_home: Path
) -> None:
    payload = cloud(message)
    assert read_as(payload, hermes_home) == (
        f"agent:main:whatsapp:dm:c={PHONE}", body, "wamid.ASKED", None
    )  # fmt: skip
    event = read("whatsapp", payload, hermes_home)
    assert event is not None
    assert event.message_type == kind


# The same in Baileys' ``proto.IMessage``: ``contactMessage`` (``displayName``, ``vcard`` whose
# ``TEL`` lines carry the numbers), ``contactsArrayMessage.contacts[]``, ``locationMessage``
# (``degreesLatitude``, ``degreesLongitude``, ``name``, ``address``) and
# ``pollCreationMessage`` / ``pollCreationMessageV3`` (``name``, ``options[].optionName``).
_VCARD = ("BEGIN:VCARD\nVERSION:3.0\nFN:Barbara Johnson\n"
          "TEL;type=CELL;type=VOICE;waid=19405551234:+1 940 555 1234\nEND:VCARD")  # fmt: skip
_QUOTE = {"stanzaId": "3EB0ASKED", "participant": f"{PHONE}@s.whatsapp.net"}
WEB_SHARED = [
    ("contact", {"contactMessage": {"displayName": "Barbara Johnson", "vcard": _VCARD,
                                    "contextInfo": _QUOTE}},
     "Barbara Johnson: +1 940 555 1234", MessageType.TEXT, "3EB0ASKED"),
    ("contacts array", {"contactsArrayMessage": {"displayName": "2 contacts", "contacts": [
        {"displayName": "Barbara Johnson", "vcard": _VCARD},
        {"displayName": "Ali", "vcard": "BEGIN:VCARD\nFN:Ali\nEND:VCARD"}]}},
     "Barbara Johnson: +1 940 555 1234; Ali", MessageType.TEXT, None),
    ("location", {"locationMessage": {"degreesLatitude": 37.483307,
                                      "degreesLongitude": -122.148981, "name": "Philz Coffee",
                                      "address": "101 Forest Ave", "contextInfo": _QUOTE}},
     "Philz Coffee, 101 Forest Ave (37.483307, -122.148981)", MessageType.LOCATION, "3EB0ASKED"),
    ("poll", {"pollCreationMessage": {"name": "Lunch?", "options": [
        {"optionName": "Pizza"}, {"optionName": "Sushi"}], "selectableOptionsCount": 1}},
     "Poll: Lunch? (Pizza / Sushi)", MessageType.TEXT, None),
    ("poll v3", {"pollCreationMessageV3": {"name": "Lunch?", "options": [
        {"optionName": "Pizza"}], "contextInfo": _QUOTE}},
     "Poll: Lunch? (Pizza)", MessageType.TEXT, "3EB0ASKED"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "message", "body", "kind", "reply"), WEB_SHARED, ids=[w[0] for w in WEB_SHARED]
)
def test_web_contacts_locations_and_polls_read_as_text(
    case: str,
    message: dict[str, Any],
    body: str,
    kind: MessageType,
    reply: str | None,
    hermes_home: Path,
) -> None:
    payload = web(GROUP, message, participant=f"{PHONE}@s.whatsapp.net")
    assert read_as(payload, hermes_home) == (
        f"agent:main:whatsapp:group:c={GROUP}:u={PHONE}", body, reply, None
    )  # fmt: skip
    event = read("whatsapp", payload, hermes_home)
    assert event is not None
    assert event.message_type == kind


# Baileys' ``proto.IContextInfo`` on a message's content: ``stanzaId`` and ``participant`` of
# the replied-to message, its content as ``quotedMessage`` (a ``proto.IMessage``), and
# ``mentionedJid`` (the JIDs @-mentioned in the text).
MENTIONED = [f"{PHONE}@s.whatsapp.net", f"{LID}@lid"]
QUOTES = [
    ("text quoting text", {"extendedTextMessage": {"text": "@60123456789 at noon", "contextInfo": {
        "stanzaId": "3EB0ASKED", "participant": f"{PHONE}@s.whatsapp.net",
        "quotedMessage": {"conversation": "what time?"}, "mentionedJid": MENTIONED}}},
     "@60123456789 at noon", "3EB0ASKED", {"reply_to_text": "what time?", "mentions": MENTIONED}),
    ("image quoting a captioned image", {"imageMessage": {"caption": "this one", "contextInfo": {
        "stanzaId": "3EB0PIC", "quotedMessage": {"imageMessage": {"caption": "which?"}}}}},
     "this one", "3EB0PIC", {"reply_to_text": "which?"}),
    ("quote of a quote reads one level", {"extendedTextMessage": {"text": "yes", "contextInfo": {
        "stanzaId": "3EB0B", "quotedMessage": {"extendedTextMessage": {
            "text": "sure?", "contextInfo": {"stanzaId": "3EB0A",
                                             "quotedMessage": {"conversation": "deep"}}}}}}},
     "yes", "3EB0B", {"reply_to_text": "sure?"}),
    ("mentions without a quote", {"extendedTextMessage": {"text": "hi all", "contextInfo": {
        "mentionedJid": MENTIONED}}},
     "hi all", None, {"mentions": MENTIONED}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "message", "body", "reply", "metadata"), QUOTES, ids=[q[0] for q in QUOTES]
)
def test_web_quoted_text_and_mentions_go_to_metadata(
    case: str,
    message: dict[str, Any],
    body: str,
    reply: str | None,
    metadata: dict[str, Any],
    hermes_home: Path,
) -> None:
    payload = web(GROUP, message, participant=f"{PHONE}@s.whatsapp.net")
    assert read_as(payload, hermes_home) == (
        f"agent:main:whatsapp:group:c={GROUP}:u={PHONE}", body, reply, None
    )  # fmt: skip
    event = read("whatsapp", payload, hermes_home)
    assert event is not None
    assert event.metadata == metadata


# A click-to-WhatsApp ad's first message as Meta's messages webhook reference shows it
# (.../webhooks/reference/messages/text, "referral"): a text message with a ``referral`` object
# (``source_url``, ``source_id``, ``source_type``, ``headline``, ``body``, ``media_type``,
# ``image_url``, ``ctwa_clid``, ``welcome_message``).
REFERRAL = {
    "source_url": "https://fb.me/3cr4Wqqkv", "source_id": "120226305854810726",
    "source_type": "ad", "headline": "Chat with us", "body": "Free delivery this week",
    "media_type": "image", "image_url": "https://scontent.xx.fbcdn.net/v/t45.1600-4/ad.png",
    "ctwa_clid": "ARAkLkA8rmlFeiCktEJQ-QTwRiyYHAFDLMNDBH0CD3qpjd0HR4irJ6LEkR7JwFF4XvnO2E4Nx0-eM",
    "welcome_message": {"text": "Hi! How can we help?"},
}  # fmt: skip


def test_a_click_to_whatsapp_referral_goes_to_metadata(hermes_home: Path) -> None:
    payload = cloud(text("Can I get more info?", referral=REFERRAL))
    assert read_as(payload, hermes_home) == (
        f"agent:main:whatsapp:dm:c={PHONE}", "Can I get more info?", None, None
    )  # fmt: skip
    event = read("whatsapp", payload, hermes_home)
    assert event is not None
    assert event.metadata == {"referral": REFERRAL}
    plain = read("whatsapp", cloud(text()), hermes_home)
    assert plain is not None
    assert plain.metadata == {}


# Senders with a username (Meta's "Business-scoped user IDs" page, .../whatsapp/business-scoped-
# user-ids/): every messages webhook carries the sender's business-scoped user id (BSUID) as
# ``contacts[].user_id`` (and the message's ``from_user_id``), with ``profile.username``; the
# phone number (``from``, ``wa_id``) is left out when the user hides it. The spelling
# ``messages[].from_user_id`` is also that of webhooks captured from the Cloud API (beside
# ``from`` and ``contacts[].user_id``) and of providers relaying them (YCloud's ``fromUserId``).
BSUID = "US.13491208655302741918"
_BY_USERNAME = {"profile": {"name": "Maria", "username": "maria.lopez"}, "user_id": BSUID}


def hidden(body: str = "hi", **extra: Any) -> dict[str, Any]:
    """A text message from a user whose phone number is withheld."""
    message = {**text(body), "from_user_id": BSUID, **extra}
    del message["from"]
    return message


USERNAME_KEYS = [
    ("DM keyed by from_user_id", cloud(hidden(), contacts=[_BY_USERNAME]),
     f"agent:main:whatsapp:dm:c={BSUID}"),
    ("DM keyed by the one contact's user_id", cloud(
        {k: v for k, v in hidden().items() if k != "from_user_id"}, contacts=[_BY_USERNAME]),
     f"agent:main:whatsapp:dm:c={BSUID}"),
    ("group member keyed by user_id", cloud(hidden(group_id="Y2FwaV9ncm91cDoxNTU1"),
                                            contacts=[_BY_USERNAME]),
     f"agent:main:whatsapp:group:c=Y2FwaV9ncm91cDoxNTU1:u={BSUID}"),
    ("a phone number still wins", cloud(text(from_user_id=BSUID),
                                        contacts=[{**_BY_USERNAME, "wa_id": PHONE}]),
     f"agent:main:whatsapp:dm:c={PHONE}"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "payload", "key"), USERNAME_KEYS,
                         ids=[u[0] for u in USERNAME_KEYS])  # fmt: skip
def test_senders_without_a_phone_number_are_keyed_by_their_user_id(
    case: str, payload: Any, key: str, hermes_home: Path
) -> None:
    assert read_as(payload, hermes_home) == (key, "hi", None, None)
    event = read("whatsapp", payload, hermes_home)
    assert event is not None
    assert event.source.user_name == "Maria"


def test_a_batch_of_username_senders_splits_by_user_id(hermes_home: Path) -> None:
    other = {"profile": {"name": "Ali", "username": "ali"}, "user_id": "MY.8812345"}
    batched = cloud(hidden("one"), {**hidden("two"), "id": "wamid.2", "from_user_id": "MY.8812345"},
                    contacts=[_BY_USERNAME, other])  # fmt: skip
    events = [read("whatsapp", part, hermes_home) for part in split_cloud_webhook(batched)]
    assert [(e.text, e.source.user_id, e.source.user_name) for e in events if e is not None] == [
        ("one", BSUID, "Maria"), ("two", "MY.8812345", "Ali")
    ]  # fmt: skip


# Replies to a bridge's buttons, lists, template buttons and native flows, as Baileys'
# ``proto.IMessage`` carries them (WAProto.proto: ``ButtonsResponseMessage`` with
# ``selectedButtonId`` and ``selectedDisplayText``; ``ListResponseMessage`` with ``title`` and
# ``singleSelectReply.selectedRowId``; ``TemplateButtonReplyMessage`` with ``selectedId``,
# ``selectedDisplayText`` and ``selectedIndex``; ``InteractiveResponseMessage`` with ``body.text``
# and ``nativeFlowResponseMessage`` ``name`` / ``paramsJson``), each quoting the bot's message
# through ``contextInfo`` (``stanzaId``, ``quotedMessage``).
_ASKED = {"stanzaId": "3EB0MENU", "participant": f"{PHONE}@s.whatsapp.net",
          "quotedMessage": {"conversation": "Pick a plan"}}  # fmt: skip
WEB_CHOICES = [
    ("buttons", {"buttonsResponseMessage": {
        "selectedButtonId": "plan-basic", "selectedDisplayText": "Basic", "type": 1,
        "contextInfo": _ASKED}}, "Basic", "plan-basic"),
    ("list", {"listResponseMessage": {
        "title": "Pro (annual)", "listType": 1, "description": "best value",
        "singleSelectReply": {"selectedRowId": "plan-pro-y"}, "contextInfo": _ASKED}},
     "Pro (annual)", "plan-pro-y"),
    ("template button", {"templateButtonReplyMessage": {
        "selectedId": "plan-team", "selectedDisplayText": "Team", "selectedIndex": 2,
        "contextInfo": _ASKED}}, "Team", "plan-team"),
    ("native flow", {"interactiveResponseMessage": {
        "body": {"text": "Sent", "format": 1},
        "nativeFlowResponseMessage": {"name": "quick_reply", "paramsJson": '{"id":"plan-x"}',
                                      "version": 3},
        "contextInfo": _ASKED}}, '{"id":"plan-x"}', "quick_reply"),
    ("inside messageContextInfo and ephemeral", {"ephemeralMessage": {"message": {
        "messageContextInfo": {"deviceListMetadataVersion": 2},
        "buttonsResponseMessage": {"selectedButtonId": "b1", "selectedDisplayText": "Yes",
                                   "contextInfo": _ASKED}}}}, "Yes", "b1"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "message", "body", "choice"), WEB_CHOICES, ids=[c[0] for c in WEB_CHOICES]
)
def test_web_button_list_and_template_replies_read_as_what_was_chosen(
    case: str, message: dict[str, Any], body: str, choice: str, hermes_home: Path
) -> None:
    payload = web(GROUP, message, participant=f"{PHONE}@s.whatsapp.net")
    assert read_as(payload, hermes_home) == (
        f"agent:main:whatsapp:group:c={GROUP}:u={PHONE}", body, "3EB0MENU", None
    )  # fmt: skip
    event = read("whatsapp", payload, hermes_home)
    assert event is not None
    assert event.message_type == MessageType.TEXT
    assert event.metadata == {"choice_id": choice, "reply_to_text": "Pick a plan"}


def test_a_web_button_reply_without_an_id_has_no_choice(hermes_home: Path) -> None:
    payload = web(
        f"{PHONE}@s.whatsapp.net", {"buttonsResponseMessage": {"selectedDisplayText": "Ok"}}
    )
    assert read_as(payload, hermes_home) == (f"agent:main:whatsapp:dm:c={PHONE}", "Ok", None, None)
    event = read("whatsapp", payload, hermes_home)
    assert event is not None
    assert event.metadata == {}


# A click-to-WhatsApp ad's first message through a Baileys bridge: the text carries
# ``contextInfo.externalAdReply`` (WAProto.proto ``ContextInfo.ExternalAdReplyInfo``: ``title``,
# ``body``, ``mediaType``, ``thumbnailUrl``, ``sourceType``, ``sourceId``, ``sourceUrl``,
# ``ctwaClid``), the Web counterpart of the Cloud API's ``referral``.
AD = {"title": "Chat with us", "body": "Free delivery this week", "mediaType": 1,
      "thumbnailUrl": "https://scontent.xx.fbcdn.net/v/t45.1600-4/ad.png", "sourceType": "ad",
      "sourceId": "120226305854810726", "sourceUrl": "https://fb.me/3cr4Wqqkv",
      "ctwaClid": "ARAkLkA8rmlFeiCktEJQ"}  # fmt: skip


def test_a_web_click_to_whatsapp_ad_context_goes_to_metadata(hermes_home: Path) -> None:
    message = {"extendedTextMessage": {"text": "Can I get more info?",
                                       "contextInfo": {"externalAdReply": AD}}}  # fmt: skip
    payload = web(f"{PHONE}@s.whatsapp.net", message)
    assert read_as(payload, hermes_home) == (
        f"agent:main:whatsapp:dm:c={PHONE}", "Can I get more info?", None, None
    )  # fmt: skip
    event = read("whatsapp", payload, hermes_home)
    assert event is not None
    assert event.metadata == {"referral": AD}
    bad = web(f"{PHONE}@s.whatsapp.net", {"extendedTextMessage": {
        "text": "x", "contextInfo": {"externalAdReply": "ad"}}})  # fmt: skip
    with pytest.raises(MalformedEventError) as caught:
        read("whatsapp", bad, hermes_home)
    assert caught.value.field == "payload.message.extendedTextMessage.contextInfo.externalAdReply"
