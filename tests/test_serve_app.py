"""The HTTP app over real HTTP on the loopback interface: a connector's webhook route stores
before it answers, bodies past the limit are refused unread, no answer leaks an error's detail,
``/healthz``, ``/readyz`` and ``/metrics`` (parsed as Prometheus text, moving with turns)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.hook_connector import HookConnector
from support.loopback import served_here

from hermes_core import (
    Gateway,
    GatewayConfig,
    create_plugin_manager,
)
from hermes_core.gateway.agents import EchoAgent
from hermes_core.serve.app import ServeStatus, build_app
from hermes_core.serve.metrics import Metrics

LIMIT = 4096


class Served:
    def __init__(self, url: str, gateway: Gateway, connector: HookConnector, status: ServeStatus):
        self.url, self.gateway, self.connector, self.status = url, gateway, connector, status


@pytest.fixture
async def served(hermes_home: Path) -> AsyncIterator[Served]:
    config = GatewayConfig.from_dict(
        {"server": {"max_body_bytes": LIMIT}}, environ={"HERMES_HOME": str(hermes_home)}
    )
    plugins = create_plugin_manager(config)
    metrics = Metrics()
    plugins.register(metrics, name="serve_metrics")
    connector = HookConnector()
    gateway = Gateway(config, plugins, lambda entry: EchoAgent(), [connector.adapter])
    status = ServeStatus()
    app = build_app(gateway, [connector], config, metrics=metrics, status=status)
    await gateway.start()
    await connector.start(gateway)
    try:
        async with served_here(app) as url:
            yield Served(url, gateway, connector, status)
    finally:
        await gateway.stop()


async def test_a_webhook_event_is_stored_answered_200_and_replied_to(served: Served) -> None:
    async with httpx.AsyncClient() as client:
        body = {"chat": "42", "text": "hello", "id": "m1"}
        answer = await client.post(f"{served.url}/matrix", json=body)
        assert (answer.status_code, answer.text) == (200, "stored")
        again = await client.post(f"{served.url}/matrix", json=body)  # a redelivery
        assert again.status_code == 200
        ignored = await client.post(f"{served.url}/matrix", json={"ignore": True})
        assert (ignored.status_code, ignored.text) == (200, "ignored")
        not_json = await client.post(f"{served.url}/matrix", content=b"{nope")
        assert not_json.status_code == 400
    await served.gateway.idle()
    assert served.connector.adapter.texts("42") == ["echo: hello"]


async def test_a_stopped_connector_answers_503_so_the_platform_delivers_again(
    served: Served,
) -> None:
    await served.connector.stop()
    async with httpx.AsyncClient() as client:
        answer = await client.post(f"{served.url}/matrix", json={"chat": 1, "text": "x", "id": 1})
    assert answer.status_code == 503
    await served.gateway.idle()
    assert served.connector.adapter.sent == []


async def _raw(url: str, request: bytes) -> tuple[int, bytes]:
    """Send ``request`` on a new connection; the status and what was answered."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    return int(answer.split(b" ", 2)[1]), answer


async def test_a_body_over_the_limit_is_refused_before_it_is_read(served: Served) -> None:
    head = (
        b"POST /matrix HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 10485760\r\n\r\n"
    )
    # 10 MB announced, 1 KB sent: the answer comes without waiting for the rest.
    status, _ = await _raw(served.url, head + b"x" * 1024)
    assert status == 413


async def test_a_chunked_body_growing_past_the_limit_is_refused(served: Served) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(64):
            yield b"x" * 1024

    async with httpx.AsyncClient() as client:
        answer = await client.post(f"{served.url}/matrix", content=chunks())
    assert answer.status_code == 413
    await served.gateway.idle()
    assert served.connector.adapter.sent == []


async def test_a_failing_route_answers_500_without_the_error(served: Served) -> None:
    async with httpx.AsyncClient() as client:
        answer = await client.post(f"{served.url}/matrix/boom", content=b"{}")
        missing = await client.get(f"{served.url}/nothing-here")
    assert (answer.status_code, answer.text) == (500, "internal error")
    assert "secret-token" not in answer.text
    assert missing.status_code == 404


async def test_health_and_readiness(served: Served) -> None:
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{served.url}/healthz")).text == "ok"
        ready = await client.get(f"{served.url}/readyz")
        assert (ready.status_code, ready.json()) == (200, {"ready": True, "problems": {}})
        served.connector.adapter.connected = False
        served.status.draining = True
        unready = await client.get(f"{served.url}/readyz")
    assert unready.status_code == 503
    assert set(unready.json()["problems"]) == {"matrix", "draining"}


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_parse_as_prometheus_text_and_move_with_turns(served: Served) -> None:
    async with httpx.AsyncClient() as client:
        before = _samples((await client.get(f"{served.url}/metrics")).text)
        for n in range(3):
            body = json.dumps({"chat": f"c{n}", "text": "hi", "id": f"m{n}"})
            assert (await client.post(f"{served.url}/matrix", content=body)).status_code == 200
        await served.gateway.idle()
        answer = await client.get(f"{served.url}/metrics")
    assert answer.headers["content-type"].startswith("text/plain")
    after = _samples(answer.text)
    assert (
        after[("hermes_turns_started_total", ())] == before[("hermes_turns_started_total", ())] + 3
    )
    assert after[("hermes_turns_ended_total", ())] >= 3
    assert after[("hermes_turn_seconds_count", ())] >= 3
    assert after[("hermes_store_commit_seconds_count", ())] > 0
    assert after[("hermes_http_requests_total", (("route", "/matrix"), ("status", "200")))] == 3
    assert after[("hermes_queue_depth", ())] == 0
    assert after[("hermes_ledger_rows", (("state", "pending"),))] == 0
