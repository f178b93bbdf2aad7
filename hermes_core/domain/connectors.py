"""The connector seam: how a platform plugin connects a real platform to the gateway.

A *connector* is built from its platform's ``platforms.<name>`` configuration section. Events
arrive through a poller it runs (``start``) or through the HTTP routes it declares (``routes``);
replies leave through its ``adapter``. The types here name no web framework: a route handles a
:class:`WebRequest` (the body already read, within the app's size limit) and returns a
:class:`WebResponse`, so that a connector runs under any ASGI server the host mounts it in.

The acknowledgement rule every connector keeps: a platform is told that an event arrived (an HTTP
200, a polling offset moved past it) only after :meth:`Inbox.handle_message` returned for it, that
is once the event is stored. :class:`~hermes_core.domain.errors.MessageNotStoredError` means it
was not: answer so that the platform delivers it again (a 5xx, the offset kept).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ValidationError

from hermes_core.domain.errors import ConfigError
from hermes_core.domain.models import MessageEvent

if TYPE_CHECKING:
    from hermes_core.config.schema import GatewayConfig
    from hermes_core.domain.specs import ReadContext
    from hermes_core.gateway.agents import Adapter

Settings = TypeVar("Settings", bound=BaseModel)

__all__ = [
    "Connector", "ConnectorContext", "Inbox", "WebRequest", "WebResponse", "WebhookRoute",
]  # fmt: skip


@dataclass(frozen=True)
class WebRequest:
    """One HTTP request to a connector's route, its body read whole (the app refuses bodies
    over ``server.max_body_bytes`` before reading them)."""

    method: str
    path: str
    headers: Mapping[str, str]
    """Header names in lower case; a repeated header's values joined with ``", "``."""
    query: Mapping[str, str]
    body: bytes

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (any case), None when absent."""
        return self.headers.get(name.lower())


@dataclass(frozen=True)
class WebResponse:
    """What a route answers. Bodies never carry a secret or a stack trace."""

    status: int = 200
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def text(cls, status: int, text: str) -> WebResponse:
        """A plain-text answer."""
        return cls(status, text.encode("utf-8"))

    @classmethod
    def json(cls, status: int, value: Any) -> WebResponse:
        """A JSON answer."""
        return cls(status, json.dumps(value).encode("utf-8"), "application/json")


@dataclass(frozen=True)
class WebhookRoute:
    """One HTTP route a connector serves, relative to the app's root (e.g. ``/telegram``)."""

    path: str
    handle: Callable[[WebRequest], Awaitable[WebResponse]]
    methods: tuple[str, ...] = ("POST",)


@runtime_checkable
class Inbox(Protocol):
    """Where a connector hands what arrives: the gateway (:class:`~hermes_core.Gateway` is one)."""

    async def handle_message(self, event: MessageEvent) -> None:
        """Store ``event`` and run or queue its turn; returns once it is stored. Raises
        ``MessageNotStoredError`` when it is not: leave the event unacknowledged."""
        ...

    async def platform_connected(self, platform: str) -> None:
        """Say that ``platform`` (re)connected: its owed replies are sent, its lanes resumed."""
        ...


@runtime_checkable
class Connector(Protocol):
    """A platform connection: events in (a poller or routes), replies out (``adapter``)."""

    @property
    def platform(self) -> str:
        """The platform's name."""
        ...

    @property
    def adapter(self) -> Adapter:
        """Sends the gateway's replies to the platform."""
        ...

    @property
    def routes(self) -> Sequence[WebhookRoute]:
        """The HTTP routes the app serves for this connector (empty for a poller)."""
        ...

    async def start(self, inbox: Inbox) -> None:
        """Connect and begin handing events to ``inbox`` (a poller starts its task here); returns
        once connected. Raises ``ConfigError`` for what the user must fix (a refused token)."""
        ...

    async def stop(self) -> None:
        """Stop taking events (a poller finishes its current batch) and close connections."""
        ...

    def status(self) -> str:
        """One line for the operator: how events arrive and where (never a secret)."""
        ...


@dataclass(frozen=True)
class ConnectorContext:
    """What a connector is built from."""

    platform: str
    settings: Mapping[str, Any]
    """The ``platforms.<name>`` section as the file wrote it, host keys included."""
    config: GatewayConfig
    environ: Mapping[str, str]
    """Where secrets are read: the configuration names variables, never holds their values."""
    read_event: Callable[[Mapping[str, Any]], MessageEvent | None]
    """The platform's reader (``hermes_core.read_event`` for this platform and plugins)."""
    read_in_context: Callable[[Mapping[str, Any], ReadContext], MessageEvent | None] | None = None
    """The same reader given a :class:`~hermes_core.domain.specs.ReadContext` (a connector's
    cache of the platform's chats); None when the host gives none."""

    def settings_as(self, model: type[Settings]) -> Settings:
        """The section validated by ``model`` (which should ignore unknown keys: the host's);
        a ``ConfigError`` names the ``platforms.<name>`` key, the file and what is accepted."""
        from hermes_core.config.messages import config_error  # the configuration's wording

        try:
            return model.model_validate(dict(self.settings))
        except ValidationError as exc:
            source = self.config.source or "the configuration"
            raise config_error(exc, source, model, ("platforms", self.platform)) from None

    def secret(self, variable: str | None, key: str) -> str:
        """The value of the environment variable ``variable`` that the setting ``key`` names;
        a ``ConfigError`` saying what to set when it is unset or blank."""
        value = self.environ.get(variable, "").strip() if variable else ""
        if not value:
            where = f"platforms.{self.platform}.{key}"
            named = f"the environment variable {variable}" if variable else "no variable"
            raise ConfigError(
                where, f"{where} names {named}, which is not set; export it with the "
                f"{self.platform} credential, or name the variable that holds it in {where}.",
                source=self.config.source,
            )  # fmt: skip
        return value
