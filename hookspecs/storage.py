"""Storage backends, chosen by the scheme of ``storage.url``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hermes_hookspecs import hookspec

if TYPE_CHECKING:
    from hermes_core.config.schema import GatewayConfig
    from hermes_core.domain.specs import StoreSpec


@hookspec
def hermes_register_stores(config: GatewayConfig) -> list[StoreSpec]:
    """Return the storage backends this plugin provides, as :class:`hermes_core.StoreSpec` objects.

    **When:** once per plugin manager, when ``create_plugin_manager`` checks the loaded plugins,
    together with the other registration hooks (the result is cached; registering or
    unregistering a plugin collects them again).

    **Mode:** every implementation is called on its own, in pluggy's call order; results are
    collected per plugin.

    **Arguments:** ``config``, the gateway configuration.

    **Returns:** a list of ``StoreSpec``. A spec names the backend, the URL schemes it serves
    (``sqlite``, ``postgresql+psycopg``, ...), a factory that opens the backend for a URL, and
    what the backend declares in its ``capabilities`` (search, transcript edits, pruning, ledger,
    durable queue, restart counts, maintenance, atomic batches, turn leases, parallel writers,
    lane wake-ups, local state, the operator interface) and, for a store kept in files on this
    machine, those ``files``. Every backend implements ``hermes_core.store.StoreBackend``; each
    declared capability with a protocol implements it too (``hermes_core.store.backend``,
    ``hermes_core.store.operator``). A backend with one writer per database takes its writer lock in
    ``open`` (raising ``GatewayLockedError`` naming the holder when another process has it) and
    may offer ``open_read_only``, which takes none and refuses every write, for stores opened
    with ``read_only=True``.

    **Failure policy:** a scheme claimed by two plugins is a ``PluginConflictError`` naming both and
    which to disable. Disabling the built-in ``sql_store`` while no other plugin serves the scheme
    of ``storage.url`` is a ``ConfigError`` naming the scheme. Another unknown scheme in
    ``storage.url`` is a startup error naming it. An implementation that raises is logged with the
    plugin's name, its backends are unavailable and it is listed as ``failed``; with
    ``strict=True`` it is an error. A factory that raises when opening is the store's error: it is
    never swallowed. An opened backend lacking a method of ``StoreBackend`` or of a declared
    capability is a ``StoreContractError`` naming the plugin; an undeclared capability turns its
    feature off with one warning.
    """
