"""Test-only crash points: ``HERMES_CRASH_AT=<point>`` makes the process SIGKILL
itself the first time it reaches that point, so tests and the demo can crash a real process
anywhere along the turn pipeline and inside shutdown.

Each point is one place in the code. The specification also names three places twice (the
second name describes the same commit); those names stay accepted as aliases of the point.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping

logger = logging.getLogger(__name__)

CRASH_POINTS = (
    "enqueued", "marker_written", "reply_stored", "sent", "marker_cleared", "recovery_done",
    "drain_marked", "drain_timed_out", "clean_shutdown_written",
)  # fmt: skip
"""Every point of the gateway, one per place, in pipeline order."""

CONNECTOR_CRASH_POINTS = ("connector_before_ack",)
"""Points in the platform connectors, reached only in a serving process: a connector's
``handle_message`` returned for an event (it is stored) and the platform is not yet told
(no 200 sent, no polling offset moved past it)."""

STREAM_CRASH_POINTS = ("stream_started", "stream_posted", "stream_edited")
"""Points of a streamed reply: the store knows that a streamed reply is under way (before its
first message is posted); a message was posted and its id stored; a message was edited (the
platform answered, nothing stored)."""

ALL_CRASH_POINTS = (*CRASH_POINTS, *CONNECTOR_CRASH_POINTS, *STREAM_CRASH_POINTS)
"""Every point that ``HERMES_CRASH_AT`` may name (besides the aliases)."""

CRASH_ALIASES = {
    "user_stored": "marker_written",  # the turn's user message is stored in the marker's commit
    "obligation_recorded": "reply_stored",  # the reply and its ledger row share one commit
    "delivered": "marker_cleared",  # settling a delivery closes its turn in the same commit
}
"""Other names the specification gives a point's place; arming one arms the point."""


class _Armed:
    point: str | None = None


def arm(environ: Mapping[str, str] | None = None) -> str | None:
    """Read ``HERMES_CRASH_AT`` once (at start-up); returns the armed point, if any.

    Set to a point name (or an alias of one), start-up logs one warning; unset or empty, crash
    points do nothing. An unknown name is ignored with a warning listing the valid ones.
    """
    value = (os.environ if environ is None else environ).get("HERMES_CRASH_AT", "").strip()
    point = CRASH_ALIASES.get(value, value)
    if point and point not in ALL_CRASH_POINTS:
        logger.warning(
            "HERMES_CRASH_AT=%s is not a crash point and is ignored (valid: %s)",
            value, ", ".join((*ALL_CRASH_POINTS, *CRASH_ALIASES)),
        )  # fmt: skip
        point = ""
    _Armed.point = point or None
    if _Armed.point:
        logger.warning(
            "HERMES_CRASH_AT=%s: this process will kill itself (SIGKILL) at that point; "
            "for tests only", value,
        )  # fmt: skip
    return _Armed.point


def crash_point(name: str) -> None:
    """Die by SIGKILL here if ``name`` is the armed point (only the first time it is reached)."""
    if _Armed.point == name:
        _Armed.point = None
        os.kill(os.getpid(), signal.SIGKILL)
