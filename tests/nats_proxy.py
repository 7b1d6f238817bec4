"""A TCP proxy in front of a real nats-server that can cut one client's connection.

Every service of a test platform connects through it; `cut("gateway", hold_s)` closes the
connections whose NATS `CONNECT` names start with "gateway" and refuses that client's new ones for
`hold_s`, as when the NATS node a gateway uses dies and its clients take a while to reconnect.
Messages published to the client's subscriptions meanwhile are lost, as core NATS loses them.
`arm(prefix, hold_s, trigger)` makes the same cut happen inside the proxy, right after the client
was sent the first message `trigger(subject, payload)` picks: a test that must cut at a point of a
stream does not depend on how fast its own client reads.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from contextlib import suppress

Trigger = Callable[[str, bytes], bool]


class NatsProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._connections: dict[str, list[asyncio.StreamWriter]] = {}  # CONNECT name → its client sockets
        self._refused_until: dict[str, float] = {}  # name prefix → monotonic time new connections are refused until
        self._thread = threading.Thread(target=self._loop.run_forever, name="nats-proxy", daemon=True)
        self._armed: dict[str, tuple[float, Trigger]] = {}  # name prefix → (hold_s, trigger) of a cut to come
        self.cuts = 0
        self.cut_at: float | None = None  # monotonic time of the last cut

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
            return self._cut(prefix, hold_s)

        return asyncio.run_coroutine_threadsafe(cut(), self._loop).result(5)

    def arm(self, prefix: str, hold_s: float, trigger: Trigger) -> None:
        """Cut clients named `prefix`… (as `cut`) once one of them was sent a message that
        `trigger(subject, payload)` picks; that message still reaches it."""
        async def arm() -> None:
            self._armed[prefix] = (hold_s, trigger)

        asyncio.run_coroutine_threadsafe(arm(), self._loop).result(5)

    def _cut(self, prefix: str, hold_s: float) -> int:
        self._refused_until[prefix] = time.monotonic() + hold_s
        closed = 0
        for name, writers in self._connections.items():
            if name.startswith(prefix):
                for writer in writers:
                    writer.transport.abort()
                    closed += 1
                writers.clear()
        self.cuts += closed
        self.cut_at = time.monotonic()
        return closed

    async def _relay(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, name: list[str]) -> None:
        """Server to client, a whole protocol unit at a time, looking for an armed cut's message."""
        buffer = b""
        with suppress(ConnectionError, asyncio.CancelledError):
            while data := await source.read(65536):
                buffer += data
                units, buffer = _units(buffer)
                for subject, payload, unit in units:
                    sink.write(unit)
                    armed = next(((prefix, cut) for prefix, cut in self._armed.items()
                                  if name[0].startswith(prefix)), None)
                    if armed is not None and subject and armed[1][1](subject, payload):
                        del self._armed[armed[0]]
                        await sink.drain()
                        self._cut(armed[0], armed[1][0])
                        return
                await sink.drain()

    def _refused(self, name: str) -> bool:
        now = time.monotonic()
        return any(name.startswith(prefix) and now < until for prefix, until in self._refused_until.items())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        named = [""]  # set once the client's CONNECT is read
        server_to_client = asyncio.ensure_future(self._relay(up_reader, writer, named))
        name = ""
        try:
            # The client's first line is CONNECT {json}, after the server's INFO reached it.
            line = await reader.readline()
            if line.startswith(b"CONNECT "):
                with suppress(ValueError):
                    name = str(json.loads(line[8:]).get("name", ""))
            if self._refused(name):
                return
            named[0] = name
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


def _units(buffer: bytes) -> tuple[list[tuple[str, bytes, bytes]], bytes]:
    """The whole protocol units at the start of `buffer` (server to client), each as (subject,
    payload without headers, its bytes), subject "" for all but MSG and HMSG; and the rest."""
    units: list[tuple[str, bytes, bytes]] = []
    while (end := buffer.find(b"\r\n")) >= 0:
        line = buffer[:end]
        if line.startswith((b"MSG ", b"HMSG ")):
            fields = line.split()
            size = int(fields[-1])
            if len(buffer) < end + 2 + size + 2:
                break
            body = buffer[end + 2:end + 2 + size]
            headers = int(fields[-2]) if line.startswith(b"HMSG ") else 0
            units.append((fields[1].decode(), body[headers:], buffer[:end + 2 + size + 2]))
            buffer = buffer[end + 2 + size + 2:]
        else:
            units.append(("", b"", buffer[:end + 2]))
            buffer = buffer[end + 2:]
    return units, buffer
