"""Agent-cache eviction policy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hermes_hookspecs import hookspec

if TYPE_CHECKING:
    from hermes_core.config.schema import GatewayConfig
    from hermes_core.domain.specs import EvictionPolicy


@hookspec
def hermes_eviction_policy(config: GatewayConfig) -> EvictionPolicy | None:
    """Offer an eviction policy for the agent cache, as a :class:`hermes_core.EvictionPolicy`.

    **When:** once per plugin manager, when ``create_plugin_manager`` checks the loaded plugins,
    together with the registration hooks (the result is cached; registering or unregistering a
    plugin collects them again). The gateway reads the active policy when it builds its cache.

    **Mode:** every implementation is called on its own, in pluggy's call order. Exactly one
    policy is active: the built-in LRU planner, unless exactly one other plugin offers a policy,
    which then replaces it. Return ``None`` to offer nothing.

    **Arguments:** ``config``, the gateway configuration.

    **Returns:** an ``EvictionPolicy`` whose ``plan(candidates, reason, limit)`` receives the cached
    agents in least-recently-used order (each with last activity, whether a turn is in flight and
    whether its transcript is persisted), the reason (``capacity``, ``idle`` or ``pressure``) and
    the most entries it may release, and returns the session keys to release, in order.

    **Failure policy:** two non-built-in policies are a ``PluginConflictError`` naming both plugins;
    disabling the built-in ``eviction`` plugin while no other plugin offers a policy is a
    ``ConfigError``. An implementation of this hook that raises is logged and listed as
    ``failed``. The cache enforces its invariants on any plan: protected entries (turn in flight,
    unpersisted transcript, protected most-recent entries under pressure) and unknown keys are
    ignored with a warning, and a plan longer than ``limit`` is cut. A ``plan`` that raises is
    logged with the plugin's name and that pass falls back to the built-in planner.
    """
