"""A TCP proxy in front of a real nats-server that can cut one client's connection.

Every service of a test platform connects through it; `cut("gateway", hold_s)` closes the
connections whose NATS `CONNECT` names start with "gateway" and refuses that client's new ones for
`hold_s`, as when the NATS node a gateway uses dies and its clients take a while to reconnect.
Messages published to the client's subscriptions meanwhile are lost, as core NATS loses them.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import suppress


class NatsProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._connections: dict[str, list[asyncio.StreamWriter]] = {}  # CONNECT name → its client sockets
        self._refused_until: dict[str, float] = {}  # name prefix → monotonic time new connections are refused until
        self._thread = threading.Thread(target=self._loop.run_forever, name="nats-proxy", daemon=True)
        self.cuts = 0

    def start(self) -> None:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result(5)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for writers in self._connections.values():
                for writer in writers:
                    writer.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def cut(self, prefix: str, hold_s: float) -> int:
        """Close the connections of clients named `prefix`…, refusing their new ones for `hold_s`;
        how many were closed."""
        async def cut() -> int:
            self._refused_until[prefix] = time.monotonic() + hold_s
            closed = 0
            for name, writers in self._connections.items():
                if name.startswith(prefix):
                    for writer in writers:
                        writer.transport.abort()
                        closed += 1
                    writers.clear()
            self.cuts += closed
            return closed

        return asyncio.run_coroutine_threadsafe(cut(), self._loop).result(5)

    def _refused(self, name: str) -> bool:
        now = time.monotonic()
        return any(name.startswith(prefix) and now < until for prefix, until in self._refused_until.items())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        server_to_client = asyncio.ensure_future(_pipe(up_reader, writer))
        name = ""
        try:
            # The client's first line is CONNECT {json}, after the server's INFO reached it.
            line = await reader.readline()
            if line.startswith(b"CONNECT "):
                with suppress(ValueError):
                    name = str(json.loads(line[8:]).get("name", ""))
            if self._refused(name):
                return
            self._connections.setdefault(name, []).append(writer)
            up_writer.write(line)
            await _pipe(reader, up_writer)
        finally:
            server_to_client.cancel()
            up_writer.close()
            writer.close()
            writers = self._connections.get(name, [])
            if writer in writers:
                writers.remove(writer)


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    with suppress(ConnectionError, asyncio.CancelledError):
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
