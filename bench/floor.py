"""The least a Python serving spine can cost: two bare relays that `bench.spine` measures next to inferbus.

inferbus is two Python hops with NATS between them: the gateway serves the client's HTTP stream,
the worker streams from the engine. These relays keep that shape and drop everything else
(tenancy, admission, durable queue, placement, billing, token parsing and rendering): they pass
the engine's SSE bytes through unchanged, on the same libraries the platform uses (uvicorn with
httptools and uvloop, nats-py, the worker's own HTTP client).

- `relay`: one process, HTTP in, HTTP out to the engine (what any Python router costs at least);
- `front` + `back`: the same split over core NATS: `front` publishes the request body to
  `floor.request` with a reply subject of its own, `back` streams the engine's response to that
  subject one message per body read and ends it with an empty message;
- `front --jetstream` + `back --jetstream`: the request goes through a durable JetStream
  work queue on `floor.durable` instead (file storage; `front` waits for the stream's acknowledgement, `back` pulls
  with the worker's own puller and acknowledges when the response is done), the platform's way
  of losing nothing on a crash.

Run by `bench.spine` (`--floors`); by hand: `python -m bench.floor relay --port P --engine URL`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import uvicorn
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from services.worker.http import ConnectionPool
from services.worker.puller import Puller
from services.worker.slots import SlotBudget

REQUEST_SUBJECT = "floor.request"
# Apart from the core subject: a stream captures core publishes too, and core subscribers hear
# what is published into a stream.
DURABLE_SUBJECT = "floor.durable"
STREAM = "FLOOR"
REPLY_HEADER = "Floor-Reply"


async def ensure_stream(js: Any) -> None:
    config = StreamConfig(name=STREAM, subjects=[DURABLE_SUBJECT], retention=RetentionPolicy.WORK_QUEUE,
                          storage=StorageType.FILE)
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError:
        pass  # the other side made it first
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def lifespan(receive: Receive, send: Send, start: Callable[[], Awaitable[None]]) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await start()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class Relay:
    """HTTP in, the engine's response out, in one process."""

    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url
        self.pool: ConnectionPool | None = None

    async def start(self) -> None:
        self.pool = ConnectionPool(self.engine_url)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send, self.start)
            return
        assert self.pool is not None
        body = await read_body(receive)
        response = await self.pool.request("POST", scope["path"], body)
        await send({"type": "http.response.start", "status": response.status, "headers": SSE_HEADERS})
        async for chunk in response.iter_chunks():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


class Front:
    """HTTP in; the request over NATS to a `back`, its response streamed back on a reply subject."""

    def __init__(self, nats_url: str, jetstream: bool = False) -> None:
        self.nats_url = nats_url
        self.jetstream = jetstream
        self.nc: Any = None
        self.js: Any = None
        self.streams: dict[str, asyncio.Queue[bytes]] = {}
        self.ids = itertools.count()
        self.prefix = ""

    async def start(self) -> None:
        self.nc = await nats.connect(self.nats_url, name="floor-front")
        if self.jetstream:
            self.js = self.nc.jetstream()
            await ensure_stream(self.js)
        self.prefix = self.nc.new_inbox()
        await self.nc.subscribe(self.prefix + ".*", cb=self.on_reply)

    async def on_reply(self, msg: Any) -> None:
        queue = self.streams.get(msg.subject)
        if queue is not None:
            queue.put_nowait(msg.data)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send, self.start)
            return
        body = await read_body(receive)
        reply = f"{self.prefix}.{next(self.ids)}"
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.streams[reply] = queue
        try:
            if self.js is not None:
                await self.js.publish(DURABLE_SUBJECT, body, headers={REPLY_HEADER: reply})
            else:
                await self.nc.publish(REQUEST_SUBJECT, body, reply=reply)
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            while chunk := await queue.get():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            del self.streams[reply]


async def back(nats_url: str, engine_url: str, jetstream: bool = False) -> None:
    """Take requests from `floor.request`, stream the engine's response to each one's reply subject."""
    nc = await nats.connect(nats_url, name="floor-back")
    pool = ConnectionPool(engine_url)
    tasks: set[asyncio.Task[None]] = set()
    if jetstream:
        await back_durable(nc, pool, tasks)
        return

    async def serve(body: bytes, reply: str) -> None:
        try:
            response = await pool.request("POST", "/v1/chat/completions", body)
            async for chunk in response.iter_chunks():
                await nc.publish(reply, chunk)
        finally:
            await nc.publish(reply, b"")

    async def on_request(msg: Any) -> None:
        task = asyncio.create_task(serve(msg.data, msg.reply))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    await nc.subscribe(REQUEST_SUBJECT, queue="back", cb=on_request)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def back_durable(nc: Any, pool: ConnectionPool, tasks: set[asyncio.Task[None]]) -> None:
    """`back` on a JetStream work queue: pulled as the worker pulls, acknowledged when served."""
    js = nc.jetstream()
    await ensure_stream(js)
    await js.add_consumer(STREAM, durable_name="back", ack_policy="explicit", max_ack_pending=-1)
    budget, wake = SlotBudget(256, 1), asyncio.Event()

    async def serve(msg: Any) -> None:
        reply = msg.headers[REPLY_HEADER]
        try:
            response = await pool.request("POST", "/v1/chat/completions", msg.data)
            async for chunk in response.iter_chunks():
                await nc.publish(reply, chunk)
        finally:
            await nc.publish(reply, b"")
            await msg.ack()
            budget.release()
            wake.set()

    def on_message(msg: Any) -> None:
        task = asyncio.create_task(serve(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    puller = Puller(nc, STREAM, "back", budget, on_message, wake=wake)
    await puller.start()
    print("ready", flush=True)
    while True:
        await puller.pull()
        await wake.wait()
        wake.clear()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=("relay", "front", "back"))
    parser.add_argument("--port", type=int, default=0, help="HTTP port (relay, front)")
    parser.add_argument("--engine", default="", help="the engine's base URL (relay, back)")
    parser.add_argument("--nats", default="", help="nats-server URL (front, back)")
    parser.add_argument("--jetstream", action="store_true",
                        help="front, back: requests through a durable JetStream work queue instead of core NATS")
    args = parser.parse_args()
    if args.role == "back":
        import uvloop

        uvloop.run(back(args.nats, args.engine, args.jetstream))
        return
    app = Relay(args.engine) if args.role == "relay" else Front(args.nats, args.jetstream)
    uvicorn.run(app, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools", lifespan="on",
                access_log=False, log_level="warning")


if __name__ == "__main__":
    main()
