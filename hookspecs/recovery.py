"""Recovery steps: named, ordered units of start-up (or shutdown) work."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hermes_hookspecs import hookspec

if TYPE_CHECKING:
    from hermes_core.config import GatewayConfig
    from hermes_core.specs import RecoveryStep


@hookspec
def hermes_register_recovery_steps(config: GatewayConfig) -> list[RecoveryStep]:
    """Return the recovery steps this plugin provides, as :class:`hermes_core.RecoveryStep` objects.

    **When:** once per gateway start, before the store is used for traffic.

    **Mode:** every implementation is called; all steps are merged and run once in ascending
    ``order`` (ties broken by ``name``) before the start-up gate is raised. Steps with
    ``phase="shutdown"`` run in the same order during a graceful stop, before the store closes.

    **Arguments:** ``config``, the gateway configuration.

    **Returns:** a list of ``RecoveryStep``. Each step's ``run`` receives a
    :class:`hermes_core.RecoveryContext`: the store, the configuration, whether the previous stop
    was clean, and a report shared by all steps, into which a step writes what it did.

    **Failure policy:** step names are unique (a duplicate is a ``PluginError`` naming both
    plugins); plugins may add steps but cannot remove or reorder the built-in ones. A non-critical
    step that raises is logged with its name and the next step runs; a critical step that raises
    aborts start-up (at shutdown it prevents writing ``.clean_shutdown``).
    """
