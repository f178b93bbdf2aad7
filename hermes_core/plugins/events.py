"""Raw platform payloads into events: the core side of ``PlatformSpec.read_event``.

A host passes the payload it received (a Telegram ``Update``, a Discord ``MESSAGE_CREATE``, a
Slack ``event_callback``, a WhatsApp webhook, ...) to :func:`read_event` and gets the
:class:`~hermes_core.domain.models.MessageEvent` whose source the platform's plugin filled in, so
that keys are built from what the platform said rather than from a hand translation.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from hermes_core.domain.errors import InvalidValueError, MalformedEventError, shown
from hermes_core.domain.keys import source_key_problem
from hermes_core.domain.models import MessageEvent
from hermes_core.domain.specs import ReadContext
from hermes_core.plugins.manager import HermesPluginManager, platform_registry

__all__ = ["read_event"]

logger = logging.getLogger(__name__)


def read_event(
    platform: str,
    payload: object,
    *,
    context: ReadContext | None = None,
    plugins: HermesPluginManager | None = None,
) -> MessageEvent | None:
    """The event in ``payload``, one raw payload of ``platform`` as the platform delivers it;
    None when it is not a user message (an edit, a reaction, a bot's message, a service
    message). ``plugins`` None: the default plugin manager.

    Raises :class:`~hermes_core.domain.errors.UnknownPlatformError` for an unregistered platform,
    :class:`~hermes_core.domain.errors.InvalidValueError` when the platform's plugin reads no
    payloads, and :class:`~hermes_core.domain.errors.MalformedEventError` for a payload that cannot
    be read (any invalid value met while reading is reported as one, and so is any other exception a
    plugin's reader raises, naming the plugin) and for ids the key builder refuses (control
    characters, over 1024 characters in the key under the longest profile name), checked here
    for every reader.
    """
    registry = platform_registry(plugins)
    spec = registry.require(platform)
    if spec.read_event is None:
        raise InvalidValueError(
            "platform",
            f"platform {shown(platform)} has no event reader (its plugin does not set "
            "PlatformSpec.read_event); build the MessageEvent in the host instead.",
        )
    if not isinstance(payload, Mapping):
        raise MalformedEventError(
            "payload",
            f"a {platform} payload must be a JSON object, not {type(payload).__name__}; pass the "
            "decoded body the platform delivered.",
        )
    try:
        event = spec.read_event(payload, context or ReadContext())
    except MalformedEventError:
        raise
    except InvalidValueError as exc:
        raise MalformedEventError(
            exc.field, f"the {platform} payload cannot be read: {exc}"
        ) from exc
    except Exception as exc:  # a reader's bug (or a payload too deep for it): named, one error
        owner = registry.owners.get(platform, "?")
        logger.debug("plugin %r failed reading a %s payload", owner, platform, exc_info=True)
        raise MalformedEventError(
            "payload",
            f"plugin {owner!r} failed reading this {platform} payload ({shown(exc)}); it is a bug "
            f"in that plugin's read_event: report it to its authors with the payload, or "
            f"disable the plugin (plugins.disable: [{owner}]).",
        ) from exc
    problem = None if event is None else source_key_problem(event.source, spec)
    if problem is not None:
        raise MalformedEventError(
            "source",
            f"the ids of this {platform} payload (chat, thread, user) make no valid session key: "
            f"{problem}; pass the payload exactly as the platform delivered it.",
        )
    return event
