"""Running an eviction policy under the cache's invariants.

The policy (a plugin's, or the built-in LRU planner :data:`LRU_POLICY` that the ``eviction``
plugin offers) only plans: whatever it returns, the cache releases offered candidates only, each
once, at most ``limit`` of them. A policy that raises costs one pass its plan, not the pass: the
built-in planner runs instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hermes_core.domain.specs import EvictionCandidate, EvictionPolicy, EvictionReason

__all__ = ["LRU_POLICY", "lru_plan", "plan_evictions"]

logger = logging.getLogger(__name__)


def lru_plan(
    candidates: Sequence[EvictionCandidate], reason: EvictionReason, limit: int
) -> list[str]:
    """The candidates' keys in the order given (least recently used first), cut to ``limit``."""
    return [candidate.session_key for candidate in candidates[: max(limit, 0)]]


LRU_POLICY = EvictionPolicy(name="lru", plan=lru_plan)
"""The built-in policy: the agent cache uses it when no other is configured, and for a pass in
which a replacement policy raised."""


def plan_evictions(
    policy: EvictionPolicy,
    candidates: Sequence[EvictionCandidate],
    reason: EvictionReason,
    limit: int,
) -> list[str]:
    """The keys to release, in order: ``policy``'s plan restricted to ``candidates`` and ``limit``.

    Keys that were not offered (protected entries, unknown keys), repeats and non-strings are
    ignored with a warning naming the policy; a longer plan is cut with a warning. If the policy
    raises, the error is logged with its name and the built-in planner plans this pass.
    """
    try:
        planned = list(policy.plan(candidates, reason, limit))
    except Exception:
        logger.exception(
            "eviction policy %r failed on a %s pass; the built-in planner plans this pass",
            policy.name, reason,
        )  # fmt: skip
        planned = lru_plan(candidates, reason, limit)
    offered = {candidate.session_key for candidate in candidates}
    plan: list[str] = []
    for key in planned:
        if isinstance(key, str) and key in offered:
            offered.discard(key)
            plan.append(key)
    if len(plan) < len(planned):
        logger.warning(
            "eviction policy %r planned %d protected, unknown or repeated entries; ignored",
            policy.name, len(planned) - len(plan),
        )  # fmt: skip
    if len(plan) > limit:
        logger.warning(
            "eviction policy %r planned %d entries for a limit of %d; the plan was cut",
            policy.name, len(plan), limit,
        )  # fmt: skip
    return plan[:limit]
