"""The built-in eviction policy: release the least recently used candidates first.

A plugin offering its own policy through ``hermes_eviction_policy`` replaces this one; the agent
cache also falls back to :func:`lru_plan` for a pass in which a replacement policy raised.
"""

from __future__ import annotations

from collections.abc import Sequence

from hermes_core import EvictionCandidate, EvictionPolicy, GatewayConfig, hookimpl
from hermes_core.specs import EvictionReason


def lru_plan(
    candidates: Sequence[EvictionCandidate], reason: EvictionReason, limit: int
) -> list[str]:
    """The candidates' keys in the order given (least recently used first), cut to ``limit``."""
    return [candidate.session_key for candidate in candidates[: max(limit, 0)]]


LRU_POLICY = EvictionPolicy(name="lru", plan=lru_plan)
"""The built-in policy, as the agent cache uses it when no other is configured."""


@hookimpl
def hermes_eviction_policy(config: GatewayConfig) -> EvictionPolicy:
    """Offer the LRU planner (active unless exactly one other plugin offers a policy)."""
    return LRU_POLICY
