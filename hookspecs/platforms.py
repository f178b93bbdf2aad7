"""Platform registration: key rules, identifier canonicalisation and the PII-redaction contract."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hermes_hookspecs import hookspec

if TYPE_CHECKING:
    from hermes_core.config.schema import GatewayConfig
    from hermes_core.domain.specs import PlatformSpec


@hookspec
def hermes_register_platforms(config: GatewayConfig) -> list[PlatformSpec]:
    """Return the platforms this plugin provides, as :class:`hermes_core.PlatformSpec` objects.

    **When:** once per plugin manager, when ``create_plugin_manager`` checks the loaded plugins,
    together with the other registration hooks (the result is cached; registering or
    unregistering a plugin collects them again).

    **Mode:** every implementation is called on its own, in pluggy's call order; results are
    collected per plugin. Return an empty list when the plugin provides no platform.

    **Arguments:** ``config``, the gateway configuration (for instance to locate files under
    ``config.hermes_home``).

    **Returns:** a list of ``PlatformSpec``. A spec names the platform (``^[a-z0-9_]+$``) and MAY
    supply a display label, a scope key component, a DM chat-id canonicaliser, a participant
    canonicaliser, a description override, prompt notes, an identifier validator, an event
    reader (``read_event``: one raw platform payload into a ``MessageEvent``, None for what is not
    a user message, ``MalformedEventError`` for what cannot be read) and ``local_machine`` (the
    platform is the machine running the agent). Anything not supplied
    follows the generic key rule of the core. Canonicalisers are pure, deterministic and do no
    network I/O; they run on every inbound message.

    **PII-redaction safety contract:** ``PlatformSpec.pii_safe`` says whether the platform's
    user and chat ids may be replaced by pseudonyms in the system prompt (default false: ids stay
    raw, e.g. because mentions need them). When redaction is on, the participant canonicaliser
    also normalises the ids that are pseudonymised, so aliases of one person get one pseudonym.
    Redaction fails closed: if a canonicaliser or any other hook consulted for redaction raises,
    no prompt is produced and the error names the plugin.

    **Failure policy:** a name claimed by two plugins is a conflict: ``PlatformConflictError``
    naming both plugins, their distributions and the fix (``plugins.disable:
    [<plugin>.<platform>]`` drops one platform of one plugin, a plain plugin name drops the whole
    plugin), raised by ``create_plugin_manager`` and by ``platforms()``; ``list_plugins()`` shows
    both plugins with the status ``conflict``. A ``<plugin>.<platform>`` entry naming a platform
    the loaded plugin does not register is a ``ConfigError``. An implementation that raises, or
    returns something other than a list of ``PlatformSpec``, is logged with the plugin's name, its
    platforms are not registered and it is listed as ``failed``; with ``strict=True`` it is a
    ``PluginError``.
    """
