"""Platform connectors: how a platform's events arrive and how replies reach it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hermes_hookspecs import hookspec

if TYPE_CHECKING:
    from hermes_core.config.schema import GatewayConfig
    from hermes_core.domain.specs import ConnectorSpec


@hookspec
def hermes_register_connectors(config: GatewayConfig) -> list[ConnectorSpec]:
    """Return the connectors this plugin provides, as :class:`hermes_core.ConnectorSpec` objects.

    **When:** once per plugin manager, when ``create_plugin_manager`` checks the loaded plugins,
    together with the other registration hooks (the result is cached; registering or
    unregistering a plugin collects them again).

    **Mode:** every implementation is called on its own, in pluggy's call order; results are
    collected per plugin. Return an empty list when the plugin provides no connector.

    **Arguments:** ``config``, the gateway configuration.

    **Returns:** a list of ``ConnectorSpec``. A spec names the platform it connects and a
    ``build`` function that makes the connector (``hermes_core.domain.connectors.Connector``)
    from a ``ConnectorContext``: the platform's ``platforms.<name>`` section, the configuration,
    the environment (secrets are read from variables the section names) and the platform's event
    reader. ``build`` does no I/O; ``Connector.start`` connects. A connector receives events
    through a poller it runs or through the HTTP routes it declares (``WebhookRoute``; the app
    that ``hermes-sessions serve`` runs, or a host's own, serves them), hands each to
    ``Inbox.handle_message`` and acknowledges it to the platform only after that returned (a 5xx,
    or a polling offset kept, on ``MessageNotStoredError``). Its ``adapter`` sends replies
    (``hermes_core.Adapter``), split at the platform's limit, and reports failures as the ledger's
    kinds: ``rate_limited`` (with ``retry_after``), ``disconnected``, ``rejected`` (worth trying
    again) and ``permanent`` (never: a blocked bot, a chat that is gone).

    **Failure policy:** a platform served by connectors of two plugins is a
    ``PluginConflictError`` naming both and which to disable. An implementation that raises, or
    returns something other than a list of ``ConnectorSpec``, is logged with the plugin's name,
    its connectors are unavailable and it is listed as ``failed``; with ``strict=True`` it is an
    error. A ``build`` that raises is the connector's error, reported by ``serve`` with the
    platform's name: it is never swallowed.
    """
