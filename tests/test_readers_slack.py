"""The Slack reader on Events API samples.

Samples follow Slack's documentation: the ``event_callback`` envelope (``team_id``,
``api_app_id``, ``event``, ``event_id``, ``event_time``) and ``url_verification`` at
https://api.slack.com/apis/events-api; the ``message`` event with ``channel_type`` ``channel``,
``group``, ``im`` and ``mpim``, ``thread_ts``, ``bot_id``, ``hidden`` and its subtypes
(``message_changed``, ``bot_message``, ``channel_join``, ``thread_broadcast``, ``file_share``) at
https://api.slack.com/events/message; ``app_mention`` (no ``channel_type``) at
https://api.slack.com/events/app_mention; the Socket Mode ``events_api`` envelope at
https://api.slack.com/apis/socket-mode; and the conversation object (``is_im``) at
https://api.slack.com/types/conversation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.readers import keyed, read

from hermes_core import MalformedEventError, MessageType, ReadContext

TEAM = "T0123ABCD"


def callback(**event: Any) -> dict[str, Any]:
    """An ``event_callback`` holding a ``message`` from user U1 in channel C1 (overridable)."""
    inner = {
        "type": "message", "channel": "C1", "user": "U1", "text": "hello",
        "ts": "1712345678.000200", "event_ts": "1712345678.000200", "channel_type": "channel",
        **event,
    }  # fmt: skip
    return {
        "token": "x", "team_id": TEAM, "api_app_id": "A1", "type": "event_callback",
        "event": inner, "event_id": "Ev1", "event_time": 1712345678,
    }  # fmt: skip


KEYS = [
    ("public channel, per user", callback(), f"agent:main:slack:group:s={TEAM}:c=C1:u=U1", False),
    ("private channel", callback(channel="G7", channel_type="group"),
     f"agent:main:slack:group:s={TEAM}:c=G7:u=U1", False),
    ("DM", callback(channel="D5", channel_type="im"), f"agent:main:slack:dm:s={TEAM}:c=D5", False),
    ("group DM", callback(channel="G9", channel_type="mpim"),
     f"agent:main:slack:group:s={TEAM}:c=G9:u=U1", False),
    ("thread reply, shared", callback(thread_ts="1712345000.000100"),
     f"agent:main:slack:group:s={TEAM}:c=C1:t=1712345000.000100", True),
    ("thread reply also sent to the channel",
     callback(subtype="thread_broadcast", thread_ts="1712345000.000100"),
     f"agent:main:slack:group:s={TEAM}:c=C1:t=1712345000.000100", True),
    ("a thread's parent is not in the thread", callback(thread_ts="1712345678.000200"),
     f"agent:main:slack:group:s={TEAM}:c=C1:u=U1", False),
    ("socket mode envelope",
     {"envelope_id": "e1", "type": "events_api", "accepts_response_payload": False,
      "payload": callback()},
     f"agent:main:slack:group:s={TEAM}:c=C1:u=U1", False),
]  # fmt: skip


@pytest.mark.parametrize(("case", "payload", "key", "shared"), KEYS, ids=[k[0] for k in KEYS])
def test_keys(case: str, payload: Any, key: str, shared: bool, hermes_home: Path) -> None:
    assert keyed("slack", payload, hermes_home) == (key, shared)


def test_the_workspace_keeps_equal_channel_ids_apart(hermes_home: Path) -> None:
    other = {**callback(), "team_id": "T999"}
    assert keyed("slack", other, hermes_home)[0] != keyed("slack", callback(), hermes_home)[0]


def test_org_wide_installs_scope_by_their_authorization(hermes_home: Path) -> None:
    # An org-wide install's ``authorizations[0]`` has ``is_enterprise_install`` true,
    # ``enterprise_id`` set and ``team_id`` null; a payload without ``team_id`` (and no
    # ``event.team``) is scoped by the authorization's team, else its enterprise
    # (https://api.slack.com/enterprise/org-ready-apps, https://api.slack.com/apis/events-api).
    grant = {"enterprise_id": "E0ORG", "team_id": None, "user_id": "UBOT", "is_bot": True,
             "is_enterprise_install": True}  # fmt: skip
    org = {**callback(thread_ts="1712345000.000100"), "enterprise_id": "E0ORG",
           "authorizations": [grant], "is_ext_shared_channel": False}  # fmt: skip
    del org["team_id"]
    event = read("slack", org, hermes_home)
    assert event is not None
    assert (event.text, event.reply_to_message_id, event.source.thread_id) == (
        "hello", "1712345000.000100", "1712345000.000100",
    )  # fmt: skip
    assert keyed("slack", org, hermes_home)[0] == (
        "agent:main:slack:group:s=E0ORG:c=C1:t=1712345000.000100"
    )
    workspace = {**org, "authorizations": [{**grant, "team_id": "T0WS"}]}
    assert keyed("slack", workspace, hermes_home)[0].startswith("agent:main:slack:group:s=T0WS:")
    # A payload that names its team keeps the key it always had.
    named = {**org, "team_id": TEAM}
    assert keyed("slack", named, hermes_home)[0] == (
        f"agent:main:slack:group:s={TEAM}:c=C1:t=1712345000.000100"
    )


def test_a_mention_and_its_message_event_read_to_one_lane_and_message(hermes_home: Path) -> None:
    mention = callback(type="app_mention", text="<@UBOT> help", thread_ts="1712345000.000100")
    del mention["event"]["channel_type"]
    message = callback(text="<@UBOT> help", thread_ts="1712345000.000100")
    first, second = read("slack", mention, hermes_home), read("slack", message, hermes_home)
    assert first is not None
    assert second is not None
    assert keyed("slack", mention, hermes_home) == keyed("slack", message, hermes_home)
    assert first.message_id == second.message_id == "1712345678.000200"
    assert first.reply_to_message_id == "1712345000.000100"


def test_a_mention_without_channel_type_asks_the_host_then_the_id(hermes_home: Path) -> None:
    mention = callback(type="app_mention", channel="C77")
    del mention["event"]["channel_type"]
    assert keyed("slack", mention, hermes_home)[0].startswith("agent:main:slack:group:")
    conversations = {"C77": {"id": "C77", "is_im": True}}
    looked_up = ReadContext(lookup_chat=conversations.get)
    assert keyed("slack", mention, hermes_home, looked_up)[0].startswith("agent:main:slack:dm:")
    direct = callback(type="app_mention", channel="D42")
    del direct["event"]["channel_type"]
    assert keyed("slack", direct, hermes_home)[0] == f"agent:main:slack:dm:s={TEAM}:c=D42"


def test_profile_name_and_files(hermes_home: Path) -> None:
    payload = callback(
        subtype="file_share", text="see",
        user_profile={"display_name": "ana", "real_name": "Ana Lima"},
        files=[{"id": "F1", "name": "r.pdf", "mimetype": "application/pdf",
                "url_private": "https://files.slack.com/files-pri/T-F1/r.pdf"}],
    )  # fmt: skip
    event = read("slack", payload, hermes_home)
    assert event is not None
    assert (event.text, event.message_type) == ("see", MessageType.DOCUMENT)
    assert event.media_urls == ("https://files.slack.com/files-pri/T-F1/r.pdf",)
    assert (event.source.user_name, event.source.scope_id) == ("ana", TEAM)


def test_slack_connect_file_stubs_keep_their_id(hermes_home: Path) -> None:
    # A file shared from another organisation over Slack Connect arrives as a stub with
    # ``file_access: "check_file_info"`` and no URL; files.info with its id gives the file
    # (https://api.slack.com/apis/channels-between-orgs#check_file_info).
    stub = {"id": "F2", "mode": "file_access", "file_access": "check_file_info",
            "created": 0, "timestamp": 0, "user": ""}  # fmt: skip
    payload = callback(subtype="file_share", text="", thread_ts="1712345000.000100", files=[stub])
    event = read("slack", payload, hermes_home)
    assert event is not None
    assert (event.text, event.reply_to_message_id, event.source.thread_id) == (
        "", "1712345000.000100", "1712345000.000100",
    )  # fmt: skip
    assert event.media_urls == ()
    assert event.metadata["media_ids"] == ["F2"]
    assert keyed("slack", payload, hermes_home)[0] == (
        f"agent:main:slack:group:s={TEAM}:c=C1:t=1712345000.000100"
    )
    plain = read("slack", callback(), hermes_home)
    assert plain is not None
    assert "media_ids" not in plain.metadata


def test_shared_and_forwarded_messages_keep_their_attachment_text(hermes_home: Path) -> None:
    # A shared (forwarded) message is a plain ``message`` whose ``attachments`` hold the original
    # with ``is_share`` / ``is_msg_unfurl``, its ``text`` and a ``fallback``
    # (https://api.slack.com/reference/messaging/attachments, as "Share message" posts it).
    shared = {"is_share": True, "is_msg_unfurl": True, "ts": "1712340000.000100",
              "channel_id": "C2", "author_id": "U2", "author_name": "ben",
              "text": "deploy at 5", "fallback": "[April 5th] ben: deploy at 5",
              "footer": "Posted in #ops"}  # fmt: skip
    event = read("slack", callback(text="fyi", attachments=[shared]), hermes_home)
    assert event is not None
    assert (event.text, event.reply_to_message_id, event.source.thread_id) == (
        "fyi\ndeploy at 5", None, None,
    )  # fmt: skip
    assert keyed("slack", callback(text="", attachments=[shared]), hermes_home)[0] == (
        f"agent:main:slack:group:s={TEAM}:c=C1:u=U1"
    )
    bare = {**shared, "text": None}
    forwarded = read("slack", callback(text="", attachments=[bare]), hermes_home)
    assert forwarded is not None
    assert forwarded.text == "[April 5th] ben: deploy at 5"
    unfurl = {"from_url": "https://example.com", "title": "Example", "text": "a page"}
    linked = read("slack", callback(text="https://example.com", attachments=[unfurl]), hermes_home)
    assert linked is not None
    assert linked.text == "https://example.com"


def slash_command(**fields: str) -> dict[str, str]:
    """A slash command as Slack POSTs it (form fields, decoded by the host), after
    https://api.slack.com/interactivity/slash-commands#app_command_handling."""
    return {
        "token": "x", "team_id": TEAM, "team_domain": "acme", "channel_id": "C1",
        "channel_name": "general", "user_id": "U1", "user_name": "ana", "command": "/ask",
        "text": "what is due", "api_app_id": "A1", "response_url": "https://hooks.slack.com/c/1",
        "trigger_id": "13345224609.738474920.8088930838d88f008e0", **fields,
    }  # fmt: skip


def test_slash_commands_read_as_the_command_line(hermes_home: Path) -> None:
    event = read("slack", slash_command(), hermes_home)
    assert event is not None
    assert (event.text, event.reply_to_message_id, event.source.thread_id) == (
        "/ask what is due", None, None,
    )  # fmt: skip
    assert (event.source.user_name, event.message_id) == ("ana", None)
    assert keyed("slack", slash_command(), hermes_home)[0] == (
        f"agent:main:slack:group:s={TEAM}:c=C1:u=U1"
    )
    # A DM's channel_name is "directmessage"; Socket Mode wraps the same fields in a
    # ``slash_commands`` envelope (https://api.slack.com/apis/socket-mode).
    dm = slash_command(channel_id="D5", channel_name="directmessage", text="")
    envelope = {"envelope_id": "e2", "type": "slash_commands", "payload": dm,
                "accepts_response_payload": True}  # fmt: skip
    wrapped = read("slack", envelope, hermes_home)
    assert wrapped is not None
    assert wrapped.text == "/ask"
    assert keyed("slack", envelope, hermes_home)[0] == f"agent:main:slack:dm:s={TEAM}:c=D5"


NOT_MESSAGES = [
    ("url verification", {"token": "x", "challenge": "abc", "type": "url_verification"}),
    ("edit", callback(subtype="message_changed", hidden=True, message={"text": "new"})),
    ("bot message", callback(subtype="bot_message", bot_id="B1")),
    ("app's own reply", callback(bot_id="B1")),
    ("join", callback(subtype="channel_join")),
    ("reaction", callback(type="reaction_added", reaction="tada")),
    # Slackbot's notices: a plain ``message`` event whose ``user`` is Slackbot's fixed id
    # USLACKBOT, with no ``bot_id`` and no subtype (a reminder in the DM with Slackbot, a notice
    # in a channel), as the message event at https://api.slack.com/events/message carries them.
    ("Slackbot reminder in its DM",
     callback(channel="D0SLACKBOT", channel_type="im", user="USLACKBOT",
              text="Reminder: stand-up.")),
    ("Slackbot notice in a channel",
     callback(user="USLACKBOT", text="Only visible to you: this channel is archived soon.")),
    # The AI assistant pane's events (https://api.slack.com/events/assistant_thread_started and
    # .../assistant_thread_context_changed): the user opened the pane or moved to another
    # channel; what they write there arrives as ``message`` events.
    ("assistant thread started",
     {**callback(), "event": {"type": "assistant_thread_started", "event_ts": "1715873754.429808",
      "assistant_thread": {"user_id": "U1", "channel_id": "D5",
                           "thread_ts": "1729999327.187299",
                           "context": {"channel_id": "C1", "team_id": TEAM}}}}),
    ("assistant thread context changed",
     {**callback(), "event": {"type": "assistant_thread_context_changed",
      "event_ts": "1715873754.429808",
      "assistant_thread": {"user_id": "U1", "channel_id": "D5",
                           "thread_ts": "1729999327.187299",
                           "context": {"channel_id": "C2", "team_id": TEAM}}}}),
    # Shortcuts (https://api.slack.com/interactivity/shortcuts/using): a global one has no
    # conversation; a message shortcut names an action on a message, for the host's handler.
    ("global shortcut",
     {"type": "shortcut", "token": "x", "action_ts": "1581106241.371594",
      "team": {"id": TEAM, "domain": "acme"}, "user": {"id": "U1", "username": "ana",
      "team_id": TEAM}, "callback_id": "open_notes", "trigger_id": "944799105734.773906753841"}),
    ("message shortcut",
     {"type": "message_action", "token": "x", "action_ts": "1581106241.371594",
      "team": {"id": TEAM, "domain": "acme"}, "user": {"id": "U1", "name": "ana"},
      "channel": {"id": "C1", "name": "general"}, "callback_id": "summarise",
      "trigger_id": "944799105734.773906753841", "message_ts": "1712345678.000200",
      "message": {"type": "message", "user": "U2", "ts": "1712345678.000200", "text": "hi"},
      "response_url": "https://hooks.slack.com/app/1"}),
    ("socket mode interactive envelope",
     {"envelope_id": "e3", "type": "interactive", "payload": {"type": "shortcut",
      "callback_id": "open_notes", "team": {"id": TEAM}, "user": {"id": "U1"}}}),
]  # fmt: skip


@pytest.mark.parametrize(("case", "payload"), NOT_MESSAGES, ids=[n[0] for n in NOT_MESSAGES])
def test_not_user_messages(case: str, payload: Any, hermes_home: Path) -> None:
    assert read("slack", payload, hermes_home) is None


MALFORMED = [
    ("body.event", {"type": "event_callback", "team_id": TEAM}),
    ("body.event.channel", callback(channel=None)),
    ("body.event.user", callback(user=None)),
    ("body.event.channel_type", callback(channel_type="huddle")),
    ("body.payload", {"type": "events_api", "payload": "x"}),
]


@pytest.mark.parametrize(("field", "payload"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_payloads_name_the_field(field: str, payload: Any, hermes_home: Path) -> None:
    with pytest.raises(MalformedEventError) as caught:
        read("slack", payload, hermes_home)
    assert caught.value.field == field
