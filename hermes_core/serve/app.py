"""The HTTP app of a serving gateway: the connectors' webhook routes, ``/healthz``, ``/readyz``
and ``/metrics``, as a Starlette application that a host may mount in its own ASGI server.

A webhook body longer than ``server.max_body_bytes`` is refused with 413 before it is read (by
its ``Content-Length``) or as soon as it grows past the limit (a body without one). A route that
raises answers 500 with a fixed text: no answer carries a stack trace or a secret.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.connectors import Connector, WebhookRoute, WebRequest
from hermes_core.domain.errors import HermesError
from hermes_core.gateway.runtime import Gateway
from hermes_core.serve.metrics import CONTENT_TYPE, Metrics

__all__ = ["ServeStatus", "build_app", "readiness"]

logger = logging.getLogger(__name__)


class _TooLarge(Exception):
    """A request body grew past the limit while it was read."""


@dataclass
class ServeStatus:
    """What ``/readyz`` reads beside the gateway: whether the server is draining."""

    draining: bool = False


def readiness(
    gateway: Gateway, connectors: Sequence[Connector], status: ServeStatus
) -> dict[str, str]:
    """What keeps the gateway from being ready, by check (``store``, a platform's name,
    ``draining``); empty when it is ready. Blocking (the store's health): call it in a thread."""
    problems: dict[str, str] = {}
    if status.draining:
        problems["draining"] = "the gateway is stopping"
    try:
        health = gateway.store.health()
    except HermesError:
        problems["store"] = "the gateway is not started"
    else:
        if not health["available"] or health["read_only"]:
            problems["store"] = "the store cannot be written"
        elif health["degraded"]:
            problems["store"] = "the store runs on its JSONL fallback"
    for connector in connectors:
        if not connector.adapter.is_connected():
            problems[connector.platform] = "not connected"
    return problems


def build_app(
    gateway: Gateway,
    connectors: Sequence[Connector],
    config: GatewayConfig,
    *,
    metrics: Metrics | None = None,
    status: ServeStatus | None = None,
) -> Starlette:
    """The app serving ``connectors``' routes for ``gateway``; ``metrics`` (registered as a
    plugin of the gateway's plugin manager) adds ``/metrics``."""
    status = status or ServeStatus()
    limit = config.server.max_body_bytes

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def readyz(request: Request) -> Response:
        problems = await asyncio.to_thread(readiness, gateway, connectors, status)
        return JSONResponse(
            {"ready": not problems, "problems": problems}, status_code=503 if problems else 200
        )

    routes = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
    ]
    if metrics is not None:
        scrape = metrics

        async def metrics_endpoint(request: Request) -> Response:
            text = await asyncio.to_thread(scrape.render, _snapshot(gateway))
            return Response(text, media_type=CONTENT_TYPE)

        routes.append(Route("/metrics", metrics_endpoint, methods=["GET"]))
    for connector in connectors:
        for route in connector.routes:
            endpoint = _endpoint(route, limit, metrics)
            routes.append(Route(route.path, endpoint, methods=list(route.methods)))
    return Starlette(routes=routes)


def _endpoint(
    route: WebhookRoute, limit: int, metrics: Metrics | None
) -> Callable[[Request], Awaitable[Response]]:
    """The Starlette endpoint of a connector's route: the body read within ``limit``, the
    route's answer, any exception a fixed 500."""

    async def endpoint(request: Request) -> Response:
        response = await _answer(route, request, limit)
        if metrics is not None:
            metrics.answered(route.path, response.status_code)
        return response

    return endpoint


async def _answer(route: WebhookRoute, request: Request, limit: int) -> Response:
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        return PlainTextResponse("the body is too large", status_code=413)
    try:
        body = await _read(request, limit)
    except _TooLarge:
        return PlainTextResponse("the body is too large", status_code=413)
    headers = {name: ", ".join(request.headers.getlist(name)) for name in request.headers}
    web = WebRequest(request.method, request.url.path, headers, dict(request.query_params), body)
    try:
        answer = await route.handle(web)
    except Exception:
        logger.exception("the route %s failed", route.path)
        return PlainTextResponse("internal error", status_code=500)
    return Response(
        answer.body, status_code=answer.status, media_type=answer.content_type,
        headers=dict(answer.headers),
    )  # fmt: skip


async def _read(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it grows past ``limit`` bytes."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _snapshot(gateway: Gateway) -> Callable[[], tuple[int, int, dict[str, int]]] | None:
    """What the gauges read, or None while the gateway is not started."""
    queue = gateway.queue
    try:
        store = gateway.store
    except HermesError:
        return None

    def read() -> tuple[int, int, dict[str, int]]:
        ledger = store._obligations.ledger
        rows: dict[str, int] = {}
        if ledger is not None:
            for row in ledger.rows.obligations(("pending", "attempting", "failed", "abandoned")):
                rows[row.state] = rows.get(row.state, 0) + 1
        return (queue.total() if queue else 0), len(store.dead_letters()), rows

    return read
