"""SGLang's prefill bootstrap protocol on the simulated engine: the prefill's bootstrap server
(served from its own thread, as SGLang's) and the decode side's lookup of the prefill's layout and
rank endpoint through it. The prefill/decode shell (`disagg_server.py`) runs both."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx

# The prefill/decode shell's logger: the protocol's log lines keep one name wherever their code is.
logger = logging.getLogger("inferbus.sim_engine.disagg")

# The bootstrap server's route queries: the whole layout, and the one rank this simulator runs.
LAYOUT_QUERY = {"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1}
RANK_QUERY = {"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": 0}


def local_ip(host: str) -> str:
    """The address peers reach this engine at (SGLang's rank_ip)."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


class BootstrapServer:
    """SGLang's prefill bootstrap server (its CommonKVBootstrapServer's routes): `/health`, `/route`
    (GET: the layout, or one rank's endpoint; PUT: a rank registers), `/register_dp_rank`,
    `/query_dp_ranks`. Static data, served from a daemon thread like SGLang's."""

    def __init__(self, host: str, port: int, layout: dict[str, Any]) -> None:
        self.layout = layout
        self.ranks: dict[tuple[int, int, int, int], dict[str, Any]] = {}
        self.room_to_dp_rank: dict[int, int] = {}
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()  # open keep-alive connections, cut on close
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with server._lock:
                    server._connections.add(self.connection)

            def finish(self) -> None:
                with server._lock:
                    server._connections.discard(self.connection)
                super().finish()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
                logger.debug("bootstrap %s", format % args)

            def _reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self) -> Any:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length) or b"{}")

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                url = urlparse(self.path)
                if url.path == "/health":
                    self._reply(200, b"OK", "text/plain")
                elif url.path == "/route":
                    status, body = server.route(parse_qs(url.query))
                    self._reply(status, body)
                else:
                    self._reply(404, b"Not Found", "text/plain")

            def do_PUT(self) -> None:  # noqa: N802
                if urlparse(self.path).path != "/route":
                    self._reply(405, b"Method not allowed")
                    return
                try:
                    server.register(self._body())
                except (KeyError, ValueError, TypeError) as exc:
                    self._reply(400, str(exc).encode(), "text/plain")
                    return
                self._reply(200, b"OK", "text/plain")

            def do_POST(self) -> None:  # noqa: N802
                path = urlparse(self.path).path
                try:
                    data = self._body()
                    if path == "/register_dp_rank":
                        with server._lock:
                            server.room_to_dp_rank[int(data["bootstrap_room"])] = int(data["dp_rank"])
                        self._reply(200, b"OK", "text/plain")
                    elif path == "/query_dp_ranks":
                        with server._lock:
                            found = {str(r): server.room_to_dp_rank[int(r)] for r in data["bootstrap_rooms"]
                                     if int(r) in server.room_to_dp_rank}
                        self._reply(200, json.dumps(found).encode())
                    else:
                        self._reply(404, b"Not Found", "text/plain")
                except (KeyError, ValueError, TypeError) as exc:
                    self._reply(400, str(exc).encode(), "text/plain")

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="bootstrap-server", daemon=True)
        self._thread.start()

    def register(self, data: dict[str, Any]) -> None:
        key = (int(data["attn_dp_rank"]), int(data["attn_cp_rank"]), int(data["attn_tp_rank"]), int(data["pp_rank"]))
        with self._lock:
            self.ranks[key] = {"rank_ip": str(data["rank_ip"]), "rank_port": int(data["rank_port"])}

    def route(self, query: dict[str, list[str]]) -> tuple[int, bytes]:
        try:
            key = tuple(int(query[name][0]) for name in
                        ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"))
        except (KeyError, ValueError):
            return 400, b"Missing inputs for bootstrap server."
        with self._lock:
            registered = len(self.ranks)
            rank = self.ranks.get(key)  # type: ignore[arg-type]
        if registered == 0:
            return 503, f"Prefill server not fully registered yet ({registered} workers registered).".encode()
        if key == (-1, -1, -1, -1):
            return 200, json.dumps(self.layout).encode()
        if rank is None:
            return 404, (f"Bootstrap info not found for dp_rank={key[0]} cp_rank={key[1]} tp_rank={key[2]} "
                         f"pp_rank={key[3]}").encode()
        return 200, json.dumps(rank).encode()

    def close(self) -> None:
        """Stop serving and cut open connections, so peers see it gone (not a keep-alive that still answers)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


async def fetch_prefill_endpoint(http: httpx.AsyncClient, addr: str, page_size: int) -> str | None:
    """The prefill rank's ZMQ endpoint from the bootstrap server at `addr`, or None (not there yet,
    or a layout this decode engine cannot take), logged as SGLang logs it."""
    try:
        layout = await http.get(f"http://{addr}/route", params=LAYOUT_QUERY)
        if layout.status_code != 200:
            logger.error("Failed to get prefill server info: %s, %s", layout.status_code, layout.text)
            return None
        info = layout.json()
        if info.get("page_size") not in (None, page_size):
            logger.error("Page size mismatch: prefill server has page_size=%s, but decode server has page_size=%s",
                         info.get("page_size"), page_size)
            return None
        rank = await http.get(f"http://{addr}/route", params=RANK_QUERY)
        if rank.status_code != 200:
            return None
        found = rank.json()
        return f"tcp://{found['rank_ip']}:{found['rank_port']}"
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        logger.error("Error fetching prefill server info from bootstrap: %s", exc)
        return None
