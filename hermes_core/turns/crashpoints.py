"""Test-only crash points: ``HERMES_CRASH_AT=<point>`` makes the process SIGKILL
itself the first time it reaches that point, so tests and the demo can crash a real process
anywhere along the turn pipeline and inside shutdown.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping

logger = logging.getLogger(__name__)

CRASH_POINTS = (
    "enqueued", "marker_written", "user_stored", "reply_stored", "obligation_recorded", "sent",
    "delivered", "marker_cleared", "recovery_done", "drain_marked", "drain_timed_out",
    "clean_shutdown_written",
)  # fmt: skip
"""Every named point, in pipeline order."""


class _Armed:
    point: str | None = None


def arm(environ: Mapping[str, str] | None = None) -> str | None:
    """Read ``HERMES_CRASH_AT`` once (at start-up); returns the armed point, if any.

    Set to a point name, start-up logs one warning; unset or empty, crash points do nothing. An
    unknown name is ignored with a warning listing the valid ones.
    """
    value = (os.environ if environ is None else environ).get("HERMES_CRASH_AT", "").strip()
    if value and value not in CRASH_POINTS:
        logger.warning(
            "HERMES_CRASH_AT=%s is not a crash point and is ignored (valid: %s)",
            value, ", ".join(CRASH_POINTS),
        )  # fmt: skip
        value = ""
    _Armed.point = value or None
    if _Armed.point:
        logger.warning(
            "HERMES_CRASH_AT=%s: this process will kill itself (SIGKILL) at that point; "
            "for tests only", _Armed.point,
        )  # fmt: skip
    return _Armed.point


def crash_point(name: str) -> None:
    """Die by SIGKILL here if ``name`` is the armed point (only the first time it is reached)."""
    if _Armed.point == name:
        _Armed.point = None
        os.kill(os.getpid(), signal.SIGKILL)
