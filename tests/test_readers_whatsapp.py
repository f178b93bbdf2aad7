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
