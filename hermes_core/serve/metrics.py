"""Prometheus metrics of a serving gateway (``GET /metrics``), fed by the lifecycle hooks.

Counters and histograms move as lifecycle events arrive (turns, store commits, ledger
transitions, lane takeovers); the gauges (queue depth, dead letters, ledger rows by state) are
read from the gateway when the metrics are scraped. Each :class:`Metrics` has a registry of its
own, so that several gateways in one process (tests) never share a series.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from hermes_core.domain.specs import LifecycleEvent
from hermes_core.plugins.manager import hookimpl

__all__ = ["CONTENT_TYPE", "Metrics", "Snapshot"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The media type of the Prometheus text format."""

LEDGER_STATES = ("pending", "attempting", "failed", "abandoned")

_TURN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800)
_COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_OPEN_TURNS = 100_000
"""Turn starts remembered for their latency (a turn whose end is never seen is dropped)."""

Snapshot = Callable[[], tuple[int, int, dict[str, int]]]
"""Reads (queue depth, dead letters, ledger rows by state) from the gateway; blocking."""


class Metrics:
    """The series of one serving gateway; register it as a plugin (it observes lifecycle
    events) and call :meth:`render` for the scrape."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.turns_started = Counter("hermes_turns_started", "Turns started.", registry=registry)
        self.turns_ended = Counter("hermes_turns_ended", "Turns ended.", registry=registry)
        self.turn_seconds = Histogram(
            "hermes_turn_seconds", "Time from a turn's start to its end.",
            buckets=_TURN_BUCKETS, registry=registry,
        )  # fmt: skip
        self.commit_seconds = Histogram(
            "hermes_store_commit_seconds", "Time a store commit took.",
            buckets=_COMMIT_BUCKETS, registry=registry,
        )  # fmt: skip
        self.commit_steps = Histogram(
            "hermes_store_commit_steps", "Writer steps committed together (the batch size).",
            buckets=_STEP_BUCKETS, registry=registry,
        )  # fmt: skip
        self.takeovers = Counter(
            "hermes_lane_takeovers", "Lanes taken over from a gateway whose lease expired.",
            registry=registry,
        )  # fmt: skip
        self.send_failures = Counter(
            "hermes_send_failures", "Replies the platform did not accept, by failure kind.",
            ["platform", "kind"], registry=registry,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "hermes_queue_depth", "Events waiting in the lanes' queues.", registry=registry
        )
        self.dead_letters = Gauge(
            "hermes_dead_letters", "Queued events given up on (dead letters).", registry=registry
        )
        self.ledger_rows = Gauge(
            "hermes_ledger_rows", "Delivery-ledger rows by state.", ["state"], registry=registry
        )
        self.requests = Counter(
            "hermes_http_requests", "Webhook requests answered, by route and status.",
            ["route", "status"], registry=registry,
        )  # fmt: skip
        self._open: dict[str, float] = {}
        self._lock = threading.Lock()

    @hookimpl
    def hermes_on_lifecycle_event(self, event: LifecycleEvent) -> None:
        """Move the series an event concerns (called on the loop or the writer thread)."""
        kind, detail = event.kind, event.detail
        if kind == "turn_started":
            self.turns_started.inc()
            with self._lock:
                if len(self._open) < _OPEN_TURNS:
                    self._open[str(detail.get("token"))] = time.monotonic()
        elif kind == "turn_ended":
            self.turns_ended.inc()
            with self._lock:
                began = self._open.pop(str(detail.get("token")), None)
            if began is not None:
                self.turn_seconds.observe(time.monotonic() - began)
        elif kind == "store_committed":
            self.commit_seconds.observe(float(detail.get("seconds", 0.0)))
            self.commit_steps.observe(int(detail.get("steps", 0)))
        elif kind == "lane_taken_over":
            self.takeovers.inc()
        elif kind == "ledger_transition" and detail.get("failure_kind"):
            platform = str(detail.get("platform", ""))
            self.send_failures.labels(platform, str(detail["failure_kind"])).inc()

    def answered(self, route: str, status: int) -> None:
        """Count a webhook request answered with ``status``."""
        self.requests.labels(route, str(status)).inc()

    def render(self, snapshot: Snapshot | None) -> bytes:
        """The metrics in the Prometheus text format, the gauges read now through ``snapshot``
        (blocking: call it in a worker thread); None leaves the gauges as they were."""
        if snapshot is not None:
            depth, dead, ledger = snapshot()
            self.queue_depth.set(depth)
            self.dead_letters.set(dead)
            for state in LEDGER_STATES:
                self.ledger_rows.labels(state).set(ledger.get(state, 0))
        return generate_latest(self.registry)
