"""Recovery steps: named, ordered units of start-up (or shutdown) work."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hermes_hookspecs import hookspec

if TYPE_CHECKING:
    from hermes_core.config.schema import GatewayConfig
    from hermes_core.domain.specs import RecoveryStep


@hookspec
def hermes_register_recovery_steps(config: GatewayConfig) -> list[RecoveryStep]:
    """Return the recovery steps this plugin provides, as :class:`hermes_core.RecoveryStep` objects.

    **When:** once per plugin manager, when ``create_plugin_manager`` checks the loaded plugins,
    together with the other registration hooks (the result is cached; registering or
    unregistering a plugin collects them again). The steps themselves run at every gateway start.

    **Mode:** every implementation is called on its own, in pluggy's call order; all steps are
    merged and run once in ascending ``order`` (ties broken by ``name``) before the start-up gate
    is raised, whichever plugin registered them. Steps with ``phase="shutdown"`` run in the same
    order during a graceful stop, before the store closes.

    **Arguments:** ``config``, the gateway configuration.

    **Returns:** a list of ``RecoveryStep``. Each step's ``run`` receives a
    :class:`hermes_core.RecoveryContext`: the store, the configuration, whether the previous stop
    was clean, the host callbacks ``diagnostic_muted`` and ``queue_restore``, and a
    :class:`hermes_core.RecoveryReport` shared by all steps. The built-in steps write typed fields
    of the report that later steps read (``stuck_loop`` counts ``crash_recovery.interrupted``);
    other steps record under their step name in ``report.extra``.

    **Failure policy:** step names are unique (a duplicate is a ``PluginConflictError`` naming both
    plugins); plugins may add steps but cannot remove or reorder the built-in ones. Disabling the
    built-in ``recovery_steps`` plugin is a ``ConfigError`` naming every built-in step no other
    plugin registers under the same name. A non-critical step that raises is logged with its name
    and the next step runs; a critical step that raises aborts start-up (at shutdown it prevents
    writing ``.clean_shutdown``).
    """
