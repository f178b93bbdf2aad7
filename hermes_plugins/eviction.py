"""The built-in eviction plugin: offers the core's LRU planner.

A plugin offering its own policy through ``hermes_eviction_policy`` replaces this one.
"""

from __future__ import annotations

from hermes_core import EvictionPolicy, GatewayConfig, hookimpl
from hermes_core.gateway.eviction import LRU_POLICY


@hookimpl
def hermes_eviction_policy(config: GatewayConfig) -> EvictionPolicy:
    """Offer the LRU planner (active unless exactly one other plugin offers a policy)."""
    return LRU_POLICY
