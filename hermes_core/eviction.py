"""Running an eviction policy under the cache's invariants.

The policy (a plugin's, or the built-in LRU planner of ``hermes_plugins.eviction``) only plans:
whatever it returns, the cache releases offered candidates only, each once, at most ``limit`` of
them. A policy that raises costs one pass its plan, not the pass: the built-in planner runs instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hermes_core.specs import EvictionCandidate, EvictionPolicy, EvictionReason

__all__ = ["builtin_policy", "plan_evictions"]

logger = logging.getLogger(__name__)


def builtin_policy() -> EvictionPolicy:
    """The built-in LRU planner (imported late: the built-in plugin imports ``hermes_core``)."""
    from hermes_plugins.eviction import LRU_POLICY

    return LRU_POLICY


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
        planned = list(builtin_policy().plan(candidates, reason, limit))
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
