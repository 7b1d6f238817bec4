"""A small HTTP/1.1 keep-alive client for the engine's API, on asyncio protocols and httptools.

The worker makes one streaming POST per request to an engine on the same host or pod. aiohttp
spent more CPU per request than the rest of the worker together; this client writes a request
in one `transport.write`, parses responses (chunked or sized) with httptools' C parser, and
hands body bytes to the reader as they arrive.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools


class HTTPError(ConnectionError):
    """The connection failed or the response could not be parsed."""


class Response:
    def __init__(self) -> None:
        # Looked up once per response, not per read: on Python 3.11 every lookup is a getpid() call.
        self._loop = asyncio.get_running_loop()
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: list[bytes] = []
        self._waiter: asyncio.Future[None] | None = None
        self.complete = False
        self.error: Exception | None = None
        self.received_any = False

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive: everything buffered since the last read, in one piece."""
        while True:
            if self._chunks:
                data = b"".join(self._chunks)
                self._chunks.clear()
                yield data
                continue
            if self.error is not None:
                raise self.error
            if self.complete:
                return
            await self._wait()

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_chunks()])


class _Connection(asyncio.Protocol):
    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.closed = False
        self._header_name = b""

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.ready.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.response is not None:
            self.response.received_any = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(HTTPError(f"bad response from engine: {error}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        self._fail(HTTPError(f"engine closed the connection{': ' + str(exc) if exc else ''}"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.response is not None:
            self.response.status = self.parser.get_status_code()
            self.response._wake()

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._chunks.append(body)
            self.response._wake()

    def on_message_complete(self) -> None:
        response, self.response = self.response, None
        keep_alive = self.parser.should_keep_alive()
        if response is not None:
            response.complete = True
            response._wake()
        if keep_alive and not self.closed:
            self.pool._release(self)
        else:
            self.close()

    def _fail(self, error: Exception) -> None:
        response, self.response = self.response, None
        if response is not None and not response.complete:
            response.error = error
            response._wake()

    def send(self, request: bytes, response: Response) -> None:
        assert self.transport is not None
        self.response = response
        self.transport.write(request)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            self.pool._forget(self)


class ConnectionPool:
    """Keep-alive connections to one origin; any number open, idle ones reused most-recent first."""

    def __init__(self, base_url: str, connect_timeout: float = 5.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError(f"only http:// engine URLs are supported, got {base_url!r}")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.connect_timeout = connect_timeout
        self._host_header = f"{self.host}:{self.port}".encode()
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()

    async def _acquire(self) -> tuple[_Connection, bool]:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection, True
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self), self.host, self.port), self.connect_timeout
            )
        except (OSError, asyncio.TimeoutError) as error:
            raise HTTPError(f"cannot connect to engine at {self.host}:{self.port}: {error}") from error
        self._all.add(connection)
        return connection, False

    def _release(self, connection: _Connection) -> None:
        self._idle.append(connection)

    def _forget(self, connection: _Connection) -> None:
        self._all.discard(connection)
        if connection in self._idle:
            self._idle.remove(connection)

    def _encode(self, method: str, path: str, body: bytes, headers: dict[str, str] | None) -> bytes:
        lines = [f"{method} {self.prefix}{path} HTTP/1.1".encode(), b"Host: " + self._host_header]
        if body or method == "POST":
            lines.append(b"Content-Type: application/json")
            lines.append(b"Content-Length: " + str(len(body)).encode())
        for name, value in (headers or {}).items():
            lines.append(f"{name}: {value}".encode("latin-1"))
        return b"\r\n".join(lines) + b"\r\n\r\n" + body

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None) -> Response:
        """Send a request and return once the response headers arrived; read the body from the response."""
        raw = self._encode(method, path, body, headers)
        for attempt in (1, 2):
            connection, reused = await self._acquire()
            response = Response()
            connection.send(raw, response)
            while not response.status and response.error is None:
                await response._wait()
            if response.error is None:
                return response
            # An idle connection the engine had already closed: nothing was processed, send again.
            if not (reused and not response.received_any and attempt == 1):
                raise response.error
        raise HTTPError("unreachable")

    async def close(self) -> None:
        for connection in list(self._all):
            connection.close()
