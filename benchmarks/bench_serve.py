"""Webhook requests through the HTTP app that ``hermes-sessions serve`` runs, beside the same turns
handed to ``Gateway.handle_message`` in process: the HTTP layer's cost as a ratio, in one run.

The platform is WhatsApp (the built-in Cloud API connector: each POST's ``X-Hub-Signature-256``
is checked, its body read by the WhatsApp reader, its message stored before the 200), the agent
the echo agent, the store SQLite in a temporary directory (or ``--url``, a PostgreSQL database
whose tables are dropped first). One gateway serves both modes; replies go to a fake Cloud API in
a process of its own, which counts them: a turn counts once its reply reached it.

- **app**: a load process of its own keeps ``--in-flight`` (default 200) signed POSTs open
  against the app (``hermes_core.serve.app.build_app`` under uvicorn, as ``serve`` runs it) over
  loopback, on as many kept-alive connections, and times each from its send to its 200: p50 and
  p99 of the time to acknowledgement. The rate: messages from the first POST until the fake API has
  every reply.
- **in process**: the same kind of bodies read with ``hermes_core.read_event`` and handed to
  ``Gateway.handle_message``, ``--in-flight`` at a time, by the serving process itself.

Last, the app alone at a steady ``--paced`` rate (default 100 requests/s, for 10 s; request
``k`` is due ``k / rate`` seconds after the start, on up to ``--in-flight`` connections): the
time to acknowledgement a platform sees below saturation, measured from when each request was
due.

Every message comes from a user of its own (a new lane each: no message waits behind another of
its lane). Each mode sends ``--requests`` messages (default 3,000) in 3 rounds that alternate the
two modes, so that the ratio comes from the same minutes. The machine's cores are shared by the
serving process, the load process and the fake API: the load process's work is part of what the
app's figure pays.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from benchmarks.bench_runtime import empty_postgres
from hermes_core import GatewayConfig, HermesPluginManager, create_plugin_manager, read_event
from hermes_core.gateway.agent_loading import load_agent
from hermes_core.gateway.runtime import Gateway
from hermes_core.serve.app import build_app
from hermes_core.serve.metrics import Metrics
from hermes_core.serve.runner import AppServer, build_connectors

NUMBER_ID = "106540352242922"
SECRET = "bench-app-secret"
ENVIRON = {
    "WHATSAPP_ACCESS_TOKEN": "bench-token", "WHATSAPP_APP_SECRET": SECRET,
    "WHATSAPP_VERIFY_TOKEN": "bench-verify",
}  # fmt: skip
ROUNDS = 3
PACED_SECS = 10.0


def _uvicorn(app: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", access_log=False, lifespan="off"
    )


async def _listening(server: uvicorn.Server, task: asyncio.Task[None]) -> int:
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    port: int = server.servers[0].sockets[0].getsockname()[1]
    return port


# -- the fake Cloud API (a process of its own) ----------------------------------------------------


def _fake_api(port_out: Connection) -> None:
    sent = 0

    async def number(request: Request) -> Response:
        return JSONResponse({"display_phone_number": "15550000000", "id": NUMBER_ID})

    async def messages(request: Request) -> Response:
        nonlocal sent
        await request.body()
        sent += 1
        return JSONResponse({"messages": [{"id": f"wamid.out.{sent}"}]})

    async def count(request: Request) -> Response:
        return PlainTextResponse(str(sent))

    app = Starlette(
        routes=[
            Route(f"/{NUMBER_ID}", number),
            Route(f"/{NUMBER_ID}/messages", messages, methods=["POST"]),
            Route("/count", count),
        ]
    )

    async def run() -> None:
        server = uvicorn.Server(_uvicorn(app))
        task = asyncio.create_task(server.serve())
        port_out.send(await _listening(server, task))
        await task

    asyncio.run(run())


async def _replies(client: httpx.AsyncClient, api: str) -> int:
    return int((await client.get(f"{api}/count")).text)


async def _until_replies(api: str, expected: int) -> None:
    async with httpx.AsyncClient() as client:
        while await _replies(client, api) < expected:
            await asyncio.sleep(0.005)


# -- Meta's side: bodies and signatures -----------------------------------------------------------


def _body(wa_id: str, message_id: str) -> bytes:
    message = {"from": wa_id, "id": message_id, "timestamp": "1764900000", "type": "text",
               "text": {"body": f"hello from {wa_id}"}}  # fmt: skip
    value = {
        "messaging_product": "whatsapp",
        "metadata": {"display_phone_number": "15550000000", "phone_number_id": NUMBER_ID},
        "contacts": [{"profile": {"name": "Bench"}, "wa_id": wa_id}], "messages": [message],
    }  # fmt: skip
    entry = {"id": "1", "changes": [{"field": "messages", "value": value}]}
    return json.dumps({"object": "whatsapp_business_account", "entry": [entry]}).encode()


def _bodies(tag: int, count: int) -> list[bytes]:
    return [_body(f"1555{tag:02d}{n:06d}", f"wamid.{tag}.{n}") for n in range(count)]


async def _post(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, body: bytes
) -> int:
    """One signed POST on a kept-alive connection; the answer's status (its body is read)."""
    digest = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    head = (
        f"POST /whatsapp HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"X-Hub-Signature-256: sha256={digest}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    status = int((await reader.readline()).split(b" ", 2)[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


def _load(
    url: str, bodies: list[bytes], in_flight: int, out: Connection, pace: float | None = None
) -> None:
    """The load process: POST every body signed on ``in_flight`` kept-alive connections
    (HTTP/1.1 written by hand: a client library's own cost would dwarf the app's); sends back
    each request's time to its answer. Without ``pace`` every connection sends its next request
    as soon as the last is answered; with it, request ``k`` is due ``k / pace`` seconds after
    the start and its time runs from then (waiting for a free connection included)."""
    host = url.removeprefix("http://")
    address, port = host.rsplit(":", 1)

    async def run() -> list[float]:
        latencies: list[float] = []
        connections: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
        connections = asyncio.Queue()
        for _ in range(in_flight):
            connections.put_nowait(await asyncio.open_connection(address, int(port)))

        free = asyncio.Semaphore(in_flight)

        async def send(body: bytes, due: float) -> None:
            reader, writer = await connections.get()
            status = await _post(reader, writer, host, body)
            latencies.append(time.perf_counter() - due)
            connections.put_nowait((reader, writer))
            free.release()
            if status != 200:
                raise RuntimeError(f"the app answered {status}")

        began = time.perf_counter()
        sends = []
        for k, body in enumerate(bodies):
            if pace is None:
                await free.acquire()  # the next request once one is answered
                due = time.perf_counter()
            else:
                due = began + k / pace
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
            sends.append(asyncio.create_task(send(body, due)))
        await asyncio.gather(*sends)
        while not connections.empty():
            connections.get_nowait()[1].close()
        return latencies

    out.send(asyncio.run(run()))


# -- the two modes --------------------------------------------------------------------------------


def _config(home: Path, api: str, url: str | None) -> GatewayConfig:
    data: dict[str, Any] = {
        "platforms": {"whatsapp": {"enabled": True, "phone_number_id": NUMBER_ID,
                                   "api_base": api}},
        "server": {"port": 0},
        "gateway": {"busy_ack_enabled": False, "write_sessions_json": False,
                    "housekeeping": {"initial_delay_secs": 1e6}},
        "agent": {"agent_cache": {"max_size": 512}},
        "plugins": {"autoload": False},
    }  # fmt: skip
    if url:
        data["storage"] = {"url": url}
    return GatewayConfig.from_dict(data, environ={"HERMES_HOME": str(home)})


async def _app_round(
    url: str, api: str, bodies: list[bytes], in_flight: int, pace: float | None = None
) -> tuple[float, list[float]]:
    async with httpx.AsyncClient() as client:
        base = await _replies(client, api)
    receive, send = multiprocessing.Pipe(duplex=False)
    load = multiprocessing.Process(target=_load, args=(url, bodies, in_flight, send, pace))
    load.start()  # the process starts before the clock: its start-up is not the app's
    began = time.perf_counter()
    latencies: list[float] = await asyncio.to_thread(receive.recv)
    await _until_replies(api, base + len(bodies))
    elapsed = time.perf_counter() - began
    load.join()
    return len(bodies) / elapsed, latencies


async def _own_round(
    gateway: Gateway, plugins: HermesPluginManager, api: str, bodies: list[bytes], in_flight: int
) -> float:
    async with httpx.AsyncClient() as client:
        base = await _replies(client, api)
    waiting = list(reversed(bodies))
    began = time.perf_counter()

    async def worker() -> None:
        while waiting:
            event = read_event("whatsapp", json.loads(waiting.pop()), plugins=plugins)
            if event is None:
                raise RuntimeError("the WhatsApp reader read no message")
            await gateway.handle_message(event)

    await asyncio.gather(*(worker() for _ in range(in_flight)))
    await _until_replies(api, base + len(bodies))
    return len(bodies) / (time.perf_counter() - began)


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def _bench(args: argparse.Namespace, api: str) -> None:
    os.environ.update(ENVIRON)
    if args.url:
        empty_postgres(args.url)
    with tempfile.TemporaryDirectory() as home:
        config = _config(Path(home), api, args.url)
        plugins = create_plugin_manager(config)
        metrics = Metrics()
        plugins.register(metrics, name="serve_metrics")
        connectors = build_connectors(config, plugins, os.environ)
        agent = load_agent(config)
        gateway = Gateway(config, plugins, agent.factory, [c.adapter for c in connectors])
        app = build_app(gateway, connectors, config, metrics=metrics)
        await gateway.start()
        for connector in connectors:
            await connector.start(gateway)
        server = AppServer(_uvicorn(app))
        serving = asyncio.create_task(server.serve())
        url = f"http://127.0.0.1:{await _listening(server, serving)}"
        app_rates, own_rates, latencies = [], [], []
        per_round = args.requests // ROUNDS
        for round_ in range(ROUNDS):
            bodies = _bodies(2 * round_, per_round)
            rate, acks = await _app_round(url, api, bodies, args.in_flight)
            app_rates.append(rate)
            latencies += acks
            bodies = _bodies(2 * round_ + 1, per_round)
            own_rates.append(await _own_round(gateway, plugins, api, bodies, args.in_flight))
        bodies = _bodies(2 * ROUNDS, int(args.paced * PACED_SECS))
        _, paced = await _app_round(url, api, bodies, args.in_flight, args.paced)
        server.should_exit = True
        await serving
        for connector in connectors:
            await connector.stop()
        await gateway.stop()
        await agent.aclose()
    app_rate, own_rate = statistics.fmean(app_rates), statistics.fmean(own_rates)
    ratios = [a / o for a, o in zip(app_rates, own_rates, strict=True)]
    store = "PostgreSQL" if args.url else "SQLite"
    print(f"{per_round * ROUNDS} messages per mode in {ROUNDS} rounds, {args.in_flight} in "
          f"flight, {store} store, echo agent, WhatsApp connector")  # fmt: skip
    print(f"  app (signed POSTs over loopback): {app_rate:8.0f} turns/s")
    print(f"  in process (handle_message):      {own_rate:8.0f} turns/s")
    print(f"  app / in process: {app_rate / own_rate:.2f} (rounds {min(ratios):.2f} to "
          f"{max(ratios):.2f}); target at least 0.5")  # fmt: skip
    print(f"  time to acknowledgement, {args.in_flight} in flight: "
          f"p50 {_percentile(latencies, 0.5) * 1000:.1f} ms, "
          f"p99 {_percentile(latencies, 0.99) * 1000:.1f} ms; target p99 under 50 ms")  # fmt: skip
    print(f"  time to acknowledgement, {args.paced:.0f} requests/s offered for {PACED_SECS:.0f} s: "
          f"p50 {_percentile(paced, 0.5) * 1000:.1f} ms, "
          f"p99 {_percentile(paced, 0.99) * 1000:.1f} ms")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=3000, help="messages per mode")
    parser.add_argument("--in-flight", type=int, default=200, help="requests at once")
    parser.add_argument(
        "--paced", type=float, default=100.0, help="requests/s of the paced measurement"
    )
    parser.add_argument("--url", help="a PostgreSQL URL (default: SQLite in a temporary directory)")
    args = parser.parse_args(argv)
    receive, send = multiprocessing.Pipe(duplex=False)
    fake = multiprocessing.Process(target=_fake_api, args=(send,), daemon=True)
    fake.start()
    try:
        asyncio.run(_bench(args, f"http://127.0.0.1:{receive.recv()}"))
    finally:
        fake.terminate()


if __name__ == "__main__":
    main()
