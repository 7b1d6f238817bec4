"""Serving-spine benchmark: inferbus and sglang-router side by side in front of one simulated engine.

    python -m bench.spine [--quick] [--seconds S] [--reps N] [--concurrency 1 16 64 256] [--out bench/results]

About 8 minutes with the defaults, 2 with --quick (sglang-router is pip-installed on first use).

Three systems take the same streaming chat requests (`POST /v1/chat/completions`, 16 output
tokens, `stream_options.include_usage`) from one closed-loop client on this machine:

- **engine**: the simulated SGLang engine alone, the floor;
- **sglang-router**: `sglang-router` from PyPI (installed on first use, as `make bench-routing`
  does) with its defaults, in front of that engine;
- **inferbus**: the whole platform (`inferbus.local.stack.Stack`: NATS, Redis, router, billing, batch,
  gateway, one worker) in front of that same engine process;
- **the floors** (`bench/floor.py`, skipped with `--no-floors`): *python-over-nats*, two bare
  Python relays with core NATS between them, the platform's shape with nothing else;
  *python-over-jetstream*, the same through a durable JetStream work queue; *python-relay*, one
  bare Python relay: what any Python spine of this shape costs at least.

Scenarios: closed loop at concurrency 1, 16, 64 and 256 with zero step time, and "paced" (the engine
takes 10 ms per step, so tokens arrive 10 ms apart) at concurrency 64. Each scenario runs every
system `--reps` times, alternating the order (engine, sglang-router, inferbus; then reversed), so a
slow patch of the shared machine does not land on one system only.

Per phase: requests/s, time to the first token's bytes (TTFB) p50/p99 and what each router adds over
the engine alone in the same rep, and CPU-ms per request of every process **with its whole tree**
(utime + stime + reaped children's, read from /proc before and after the measured window); for
inferbus also NATS messages per request by connection (nats-server's /connz and /varz) and Redis
commands per request by command (`INFO commandstats`), counts that do not depend on how busy the
machine is; and after each start, the platform's idle cost (`--idle-seconds` without requests).

The client sets TCP_NODELAY and re-arms TCP_QUICKACK after every read, for every system: a server
that writes the response head and the first event in two small segments without TCP_NODELAY (Nagle
on) otherwise waits for the client's delayed ACK (~40 ms on Linux) before the first token. A short
"client check" at concurrency 1 shows what an ordinary client (no quick ACK) sees.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform as host
import re
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httptools

from bench.common import percentile, write_results
from bench.routing import ensure_packages
from inferbus.local.ports import free_port
from inferbus.local.probes import tcp_open
from inferbus.local.process import Process
from inferbus.local.servers import nats_server_binary
from inferbus.local.stack import Stack, StackConfig
from tools.commands.local_platform import demo_key

MODEL = "meta-llama/Llama-3.3-70B-Instruct"
OUTPUT_TOKENS = 16
PACED_STEP_MS = 10.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
SYSTEMS = ("engine", "sglang-router", "inferbus")
# Bare relays of inferbus's shape and nothing else (bench/floor.py): what any Python spine costs.
FLOORS = ("python-over-jetstream", "python-over-nats", "python-relay")
ROUTERS = ("sglang-router", "inferbus", *FLOORS)
# The stack's process names → the names reported (one worker, one engine).
STACK_PROCESSES = {"gateway": "gateway", "worker-1": "worker", "router": "router", "billing": "billing",
                   "batch": "batch", "nats": "nats-server", "redis": "redis", "engine-1": "engine"}
# What each system's CPU per request adds up (the engine is everyone's, shown apart).
OWN_PROCESSES = {"engine": (), "sglang-router": ("sglang-router",),
                 "inferbus": ("gateway", "worker", "router", "billing", "batch", "nats-server", "redis"),
                 "python-over-jetstream": ("front-js", "back-js", "floor-nats"),
                 "python-over-nats": ("front", "back", "floor-nats"), "python-relay": ("relay",)}
TCP_QUICKACK = getattr(socket, "TCP_QUICKACK", 12)  # Linux


# ---- pure helpers (tests/test_bench_spine.py) ---------------------------------------------------

@dataclass(frozen=True)
class ProcStat:
    """One process from /proc/<pid>/stat: its parent and the CPU ticks it and its reaped children used."""

    ppid: int
    ticks: int  # utime + stime + cutime + cstime


def parse_proc_stat(text: str) -> ProcStat:
    # The command name (field 2) is in parentheses and may hold spaces or ")": split after the last ")".
    fields = text.rsplit(")", 1)[1].split()
    return ProcStat(ppid=int(fields[1]), ticks=sum(int(fields[i]) for i in (11, 12, 13, 14)))


def tree_ticks(procs: Mapping[int, ProcStat], root: int) -> int:
    """CPU ticks of `root` and every live descendant. A child that exited and was reaped is already in
    its parent's cutime/cstime, so the whole tree's CPU is counted once."""
    children: dict[int, list[int]] = {}
    for pid, stat in procs.items():
        children.setdefault(stat.ppid, []).append(pid)
    total, pending, seen = 0, [root], set()
    while pending:
        pid = pending.pop()
        if pid in seen or pid not in procs:
            continue
        seen.add(pid)
        total += procs[pid].ticks
        pending.extend(children.get(pid, ()))
    return total


def cpu_ms_per_request(before: Mapping[str, int], after: Mapping[str, int], requests: int,
                       clk_tck: int = CLK_TCK) -> dict[str, float]:
    """CPU-ms per request of each named tree between two readings of tick counts."""
    n = max(1, requests)
    return {name: (after[name] - before[name]) * 1000 / clk_tck / n for name in before if name in after}


# ---- deterministic counts: NATS messages, Redis commands (tests/test_bench_spine.py) -----------

def connection_role(name: str) -> str:
    """The service behind a NATS connection's name (`gateway-<id>`, `worker-1-liveness`, `billing-rollup`…)."""
    if name.startswith("worker-"):
        return "worker heartbeat" if name.endswith("-liveness") else "worker"
    if name == "billing-rollup":
        return "billing rollup"
    for role in ("gateway", "router", "batch", "billing"):
        if name == role or name.startswith(role + "-"):
            return role
    return name or "unnamed"


NATS_FIELDS = ("in_msgs", "out_msgs", "in_bytes", "out_bytes")


def nats_counts(connz: Mapping[str, Any], varz: Mapping[str, Any]) -> dict[str, int]:
    """Counters from nats-server's /connz and /varz: per connection (`nats.<role>#<cid>.<field>`, the
    server's view: `in` is what the client published, `out` what it was sent) and the server's
    totals (`nats.server.<field>`, JetStream's internal traffic included)."""
    out = {f"nats.server.{f}": int(varz.get(f, 0)) for f in NATS_FIELDS}
    for conn in connz.get("connections") or []:
        key = f"nats.{connection_role(str(conn.get('name', '')))}#{conn.get('cid')}"
        for f in NATS_FIELDS:
            out[f"{key}.{f}"] = int(conn.get(f, 0))
    return out


def redis_counts(commandstats: Mapping[str, Any]) -> dict[str, int]:
    """Calls per command from Redis's `INFO commandstats` (as redis-py parses it), `redis.<command>`."""
    return {"redis." + name.removeprefix("cmdstat_"): int(stat["calls"]) for name, stat in commandstats.items()
            if isinstance(stat, Mapping) and "calls" in stat}


def count_deltas(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """What each counter grew by; a connection that closed in between is left out, one that opened
    counts from zero. Per-connection counters are then summed by role (`nats.<role>.<field>`)."""
    out: dict[str, int] = {}
    for key, value in after.items():
        name = key.split("#", 1)[0] + "." + key.rsplit(".", 1)[1] if "#" in key else key
        out[name] = out.get(name, 0) + value - before.get(key, 0)
    return out


def per_unit(counts: Mapping[str, float], units: float) -> dict[str, float]:
    """Counts divided by requests (or seconds)."""
    return {key: value / units for key, value in counts.items()} if units else {}


_FIRST_TOKEN = re.compile(rb'"content": ?"[^"]')  # a delta with non-empty content ("" is the role-only chunk)
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens": ?(\d+)')


def first_token_at(body: bytes | bytearray, start: int = 0) -> bool:
    """Whether the SSE body, scanned from `start`, holds a chunk with non-empty content."""
    return _FIRST_TOKEN.search(body, start) is not None


def completed_tokens(body: bytes | bytearray) -> int | None:
    """Completion tokens in the stream's final usage chunk, if the stream ended with `[DONE]`."""
    if not body.rstrip().endswith(b"data: [DONE]"):
        return None
    found = list(_COMPLETION_TOKENS.finditer(body))
    return int(found[-1].group(1)) if found else None


@dataclass
class Slice:
    """What one measured window of a closed loop saw: raw samples and counter differences."""

    ttfb_ms: list[float]
    e2e_ms: list[float]
    requests: int  # streams completed in the window
    errors: int
    first_error: str
    wall: float  # seconds
    ticks: dict[str, int]  # CPU ticks of each named process tree
    client_seconds: float  # the load client's CPU
    machine_seconds: float  # busy CPU seconds of the whole machine
    counts: dict[str, int] = field(default_factory=dict)  # growth of the platform's counters (count_deltas)


def phase_metrics(system: str, slices: list[Slice], clk_tck: int = CLK_TCK) -> dict[str, Any]:
    """One system's numbers from its slices of a rep, pooled: samples together, counters summed."""
    wall = sum(s.wall for s in slices)
    done = sum(s.requests for s in slices)
    ttfb = [x for s in slices for x in s.ttfb_ms]
    e2e = [x for s in slices for x in s.e2e_ms]
    names = dict.fromkeys(n for s in slices for n in s.ticks)
    ticks = {n: sum(s.ticks.get(n, 0) for s in slices) for n in names}
    cpu = cpu_ms_per_request(dict.fromkeys(ticks, 0), ticks, done, clk_tck)
    own = OWN_PROCESSES[system]
    others = [n for n in ticks if n not in own and n != "engine"]
    client = sum(s.client_seconds for s in slices)
    machine = sum(s.machine_seconds for s in slices)
    measured = sum(ticks.values()) / clk_tck
    counts: dict[str, int] = {}
    for piece in slices:
        for key, value in piece.counts.items():
            counts[key] = counts.get(key, 0) + value
    return {
        "system": system,
        "seconds": wall,
        "slices": len(slices),
        "requests": done,
        "errors": sum(s.errors for s in slices),
        "first_error": next((s.first_error for s in slices if s.first_error), ""),
        "req_per_s": done / wall if wall else float("nan"),
        "ttfb_p50_ms": percentile(ttfb, 50),
        "ttfb_p99_ms": percentile(ttfb, 99),
        "e2e_p50_ms": percentile(e2e, 50),
        "e2e_p99_ms": percentile(e2e, 99),
        "cpu_ms_per_request": cpu,
        "own_cpu_ms_per_request": sum(cpu.get(n, 0.0) for n in own),
        "counts_per_request": per_unit(counts, done),
        "client_cpu_ms_per_request": client * 1000 / max(1, done),
        # The other systems' processes, idle meanwhile (timers, heartbeats, polling).
        "others_idle_cores": sum(ticks[n] for n in others) / clk_tck / wall if wall else float("nan"),
        "machine_busy_cores": machine / wall if wall else float("nan"),
        # Busy cores of the machine not explained by the processes measured here and the client:
        # other users of a shared machine.
        "other_load_cores": max(0.0, (machine - measured - client) / wall) if wall else float("nan"),
    }


def mean(values: Iterable[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


@dataclass(frozen=True)
class Target:
    what: str
    scenario: str
    metric: str  # key of a router's summary in that scenario
    bound: float
    higher_is_better: bool = False
    unit: str = "ms"
    engine_metric: str = ""  # the engine alone's number that bounds or puts this one in scale


TARGETS = (
    Target("added TTFB p50, C=1", "c1", "added_ttfb_p50_ms", 1.5, engine_metric="ttfb_p50_ms"),
    Target("whole-platform CPU-ms per request, C=64", "c64", "own_cpu_ms_per_request", 0.6, unit="CPU-ms",
           engine_metric="engine_cpu_ms_per_request"),
    Target("req/s, C=64", "c64", "req_per_s", 2500.0, higher_is_better=True, unit="req/s", engine_metric="req_per_s"),
    Target("paced added TTFB p50, C=64", "paced64", "added_ttfb_p50_ms", 3.0, engine_metric="ttfb_p50_ms"),
    Target("paced added TTFB p99, C=64", "paced64", "added_ttfb_p99_ms", 10.0, engine_metric="ttfb_p99_ms"),
)


def summarise(phases: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per scenario and system: means over reps (with each rep's value), TTFB added over the engine
    alone in the same rep, CPU per request by process."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    by_key = {(p["scenario"], p["rep"], p["system"]): p for p in phases}
    for scenario in dict.fromkeys(p["scenario"] for p in phases):
        out[scenario] = {}
        for system in (*SYSTEMS, *FLOORS):
            runs = [p for p in phases if p["scenario"] == scenario and p["system"] == system]
            if not runs:
                continue
            s: dict[str, Any] = {"reps": len(runs), "concurrency": runs[0]["concurrency"]}
            for key in ("req_per_s", "ttfb_p50_ms", "ttfb_p99_ms", "e2e_p50_ms", "own_cpu_ms_per_request",
                        "client_cpu_ms_per_request", "other_load_cores"):
                s[key] = mean(r[key] for r in runs)
                s[key + "_reps"] = [r[key] for r in runs]
            s["errors"] = sum(r["errors"] for r in runs)
            s["requests"] = sum(r["requests"] for r in runs)
            names = dict.fromkeys(n for r in runs for n in r["cpu_ms_per_request"])
            s["cpu_ms_per_request"] = {
                n: mean(r["cpu_ms_per_request"].get(n, float("nan")) for r in runs) for n in names
            }
            s["engine_cpu_ms_per_request"] = s["cpu_ms_per_request"].get("engine", float("nan"))
            s["others_idle_cores"] = mean(r.get("others_idle_cores", float("nan")) for r in runs)
            keys = dict.fromkeys(k for r in runs for k in r.get("counts_per_request", {}))
            s["counts_per_request"] = {k: mean(r.get("counts_per_request", {}).get(k, 0.0) for r in runs) for k in keys}
            if system != "engine":
                for q in ("p50", "p99"):
                    added = [r[f"ttfb_{q}_ms"] - by_key[(scenario, r["rep"], "engine")][f"ttfb_{q}_ms"]
                             for r in runs if (scenario, r["rep"], "engine") in by_key]
                    s[f"added_ttfb_{q}_ms"] = mean(added)
                    s[f"added_ttfb_{q}_ms_reps"] = added
            out[scenario][system] = s
    return out


def verdict(summary: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """The issue's targets for inferbus, met or missed, with sglang-router's value and the ratio."""
    rows = []
    for t in TARGETS:
        systems = summary.get(t.scenario, {})
        ours = systems.get("inferbus", {}).get(t.metric, float("nan"))
        theirs = systems.get("sglang-router", {}).get(t.metric, float("nan"))
        reps = systems.get("inferbus", {}).get(t.metric + "_reps", [])
        # Met only when every rep meets it: on a noisy machine one lucky rep (or a negative
        # "added" latency) says nothing.
        met = all((v >= t.bound if t.higher_is_better else v <= t.bound) for v in reps or [ours])
        # A ratio over a value within measuring noise of zero (or below it) says nothing.
        ratio = ours / theirs if theirs >= 0.05 else float("nan")
        engine = systems.get("engine", {}).get(t.engine_metric, float("nan"))
        rows.append({"what": t.what, "target": f"{'≥' if t.higher_is_better else '≤'} {t.bound:g} {t.unit}",
                     "inferbus": ours, "sglang_router": theirs, "ratio_to_sglang_router": ratio,
                     "engine_alone": engine, "engine_metric": t.engine_metric,
                     "met": bool(met) and not math.isnan(ours), "reps": reps})
    return rows


# ---- /proc --------------------------------------------------------------------------------------

def read_procs() -> dict[int, ProcStat]:
    procs = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    procs[int(entry.name)] = parse_proc_stat(f.read())
            except (OSError, ValueError, IndexError):
                continue  # exited while we read
    return procs


def machine_busy_seconds() -> float:
    """CPU seconds every core has spent busy since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLK_TCK  # minus idle and iowait


@dataclass
class Reading:
    ticks: dict[str, int]
    client: float  # this process's CPU seconds
    machine: float  # busy seconds of the whole machine
    wall: float


def reading(roots: Mapping[str, int]) -> Reading:
    procs = read_procs()
    t = os.times()
    return Reading({name: tree_ticks(procs, pid) for name, pid in roots.items()}, t.user + t.system,
                   machine_busy_seconds(), time.perf_counter())


# ---- the client ---------------------------------------------------------------------------------

class StreamConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection reading SSE responses with httptools: notes when the first
    token's bytes arrive and checks the stream's usage. TCP_NODELAY always; TCP_QUICKACK re-armed
    after every read when `quickack` (Linux resets it on its own)."""

    def __init__(self, quickack: bool) -> None:
        self.quickack = quickack
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.sock: Any = None
        self.waiter: asyncio.Future[None] | None = None
        self.body = bytearray()
        self.scanned = 0
        self.sent = self.first = self.end = 0.0
        self.status = 0
        self.keep_alive = True
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.sock = transport.get_extra_info("socket")
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.quickack:
            self.sock.setsockopt(socket.IPPROTO_TCP, TCP_QUICKACK, 1)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(exc or ConnectionError("connection closed"))

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.body.clear()
        self.scanned = 0

    def on_body(self, chunk: bytes) -> None:
        self.body += chunk
        if not self.first:
            if first_token_at(self.body, max(0, self.scanned - 16)):  # the marker may straddle two reads
                self.first = time.perf_counter()
            self.scanned = len(self.body)

    def on_message_complete(self) -> None:
        self.end = time.perf_counter()
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def exchange(self, request: bytes) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        self.first = 0.0
        self.sent = time.perf_counter()
        assert self.transport is not None
        self.transport.write(request)
        await self.waiter


@dataclass
class Endpoint:
    """Where one system takes chat completions, and the raw requests for it."""

    system: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)

    def request(self, i: int, max_tokens: int = OUTPUT_TOKENS) -> bytes:
        prompt = f"Benchmark request {i}: summarise the serving spine in one line."
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                           "temperature": 0, "stream": True, "stream_options": {"include_usage": True}},
                          separators=(",", ":")).encode()
        parts = urlsplit(self.url)
        head = [f"POST {parts.path} HTTP/1.1", f"Host: {parts.netloc}", "Content-Type: application/json",
                f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in self.headers.items())]
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body  # one write

    @property
    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 80


async def closed_loop(endpoint: Endpoint, concurrency: int, seconds: float, warmup: float, roots: Mapping[str, int],
                      quickack: bool = True, counters: Counters | None = None) -> Slice:
    """`concurrency` connections each sending the next request when the last one ended; measured over
    `seconds` after `warmup`. Requests sent in the window count for TTFB and end-to-end time however
    late they end (the loop drains them: counting only those that also ended in the window would
    drop the slow ones); requests that ended in the window count for throughput and CPU; `counters`
    (the platform's NATS and Redis counters) are read at both ends of the window."""
    loop = asyncio.get_running_loop()
    ttfb: list[float] = []
    e2e: list[float] = []
    state: dict[str, Any] = {"errors": 0, "done": 0, "measuring": False, "stopping": False, "bad": ""}
    counter = iter(range(10**9))
    host_, port = endpoint.address

    async def one_connection() -> None:
        conn: StreamConnection | None = None
        while not state["stopping"]:
            try:
                if conn is None or conn.lost or not conn.keep_alive:
                    if conn is not None and conn.transport is not None:
                        conn.transport.close()
                    _, conn = await loop.create_connection(lambda: StreamConnection(quickack), host_, port)
                await conn.exchange(endpoint.request(next(counter)))
            except (OSError, httptools.HttpParserError) as exc:
                if not state["stopping"]:  # warm-up's errors count too: a failing system is not hidden
                    state["errors"] += 1
                    state["bad"] = state["bad"] or f"{type(exc).__name__}: {exc}"
                    await asyncio.sleep(0.01)
                conn = None
                continue
            in_window = window[0] <= conn.sent < window[1]
            tokens = completed_tokens(conn.body) if conn.status == 200 else None
            if tokens != OUTPUT_TOKENS or not conn.first:
                if not state["stopping"] or in_window:
                    state["errors"] += 1
                    state["bad"] = state["bad"] or f"HTTP {conn.status}: {bytes(conn.body[:300])!r}"
                continue
            if state["measuring"]:
                state["done"] += 1
            if in_window:
                ttfb.append((conn.first - conn.sent) * 1000)
                e2e.append((conn.end - conn.sent) * 1000)
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    window = [float("inf"), float("inf")]  # perf_counter at its start and end
    tasks = [asyncio.create_task(one_connection()) for _ in range(concurrency)]
    await asyncio.sleep(warmup)
    before = reading(roots)
    window[0] = before.wall
    counted_before = counters() if counters else {}
    state["measuring"] = True
    await asyncio.sleep(seconds)
    # No await from here to `stopping`: no request is sent after the window's end.
    state["measuring"] = False
    after = reading(roots)
    window[1] = after.wall
    counted_after = counters() if counters else {}
    state["stopping"] = True
    await asyncio.wait(tasks, timeout=60)
    for task in tasks:
        task.cancel()

    return Slice(ttfb_ms=ttfb, e2e_ms=e2e, requests=int(state["done"]), errors=int(state["errors"]),
                 first_error=str(state["bad"]), wall=after.wall - before.wall,
                 ticks={name: after.ticks[name] - before.ticks[name] for name in before.ticks if name in after.ticks},
                 client_seconds=after.client - before.client, machine_seconds=after.machine - before.machine,
                 counts=count_deltas(counted_before, counted_after))


# ---- the systems --------------------------------------------------------------------------------

Counters = Callable[[], dict[str, int]]


def platform_counters(stack: Stack) -> Counters:
    """Reads the stack's NATS (/connz, /varz on its monitoring port) and Redis (`INFO commandstats`)
    counters. The reading's own `INFO` shows up as `redis.info` (one per reading)."""
    import redis

    client = redis.Redis.from_url(stack.redis_url)

    def get(path: str) -> dict[str, Any]:
        with urllib.request.urlopen(stack.nats_monitor_url + path, timeout=5) as response:
            return dict(json.load(response))

    def read() -> dict[str, int]:
        counts = nats_counts(get("/connz?limit=4096"), get("/varz"))
        counts.update(redis_counts(client.info("commandstats")))
        return counts

    return read


def measure_idle(roots: Mapping[str, int], counters: Counters, seconds: float) -> dict[str, Any]:
    """The platform with no requests for `seconds`: cores each process burns (heartbeats, pull
    loops, timers) and NATS messages and Redis commands per second."""
    before, counted = reading(roots), counters()
    time.sleep(seconds)
    after, counted_after = reading(roots), counters()
    wall = after.wall - before.wall
    return {"seconds": wall,
            "cores": {name: (after.ticks[name] - before.ticks[name]) / CLK_TCK / wall for name in before.ticks},
            "counts_per_second": per_unit(count_deltas(counted, counted_after), wall)}


def start_stack(paced: bool, quiet_logs: bool = False) -> tuple[Stack, str]:
    """The platform as `inferbus up` runs it (log level info: the gateway's access log on), one worker."""
    config = StackConfig(state_dir=Path(tempfile.mkdtemp(prefix="inferbus-bench-")), gateway_port=free_port(),
                         workers=1, log_level="warning" if quiet_logs else "info", time_scale=1.0 if paced else 0.0,
                         fixed_step_ms=PACED_STEP_MS if paced else None)
    stack = Stack(config)
    try:
        stack.start(timeout=90)
        return stack, asyncio.run(demo_key(stack.redis_url))
    except BaseException:
        stack.stop()
        stack.rmtree()
        raise


def start_sglang_router(engine_url: str, state: Path, quiet_logs: bool = False) -> tuple[Process, str]:
    """sglang-router with its defaults (cache_aware policy, its log level) in front of the one engine."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            with urllib.request.urlopen(base + "/workers", timeout=1) as response:
                workers = json.load(response).get("workers", [])
        except Exception:
            return False
        return any(w.get("is_healthy") for w in workers)

    argv = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", engine_url,
            "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
            "--prometheus-host", "127.0.0.1", *(["--log-level", "warn"] if quiet_logs else [])]
    process = Process("sglang-router", argv, dict(os.environ), state / "logs" / "sglang-router.log", ready, base)
    process.start()
    deadline = time.monotonic() + 60
    while not process.ready():
        if not process.alive() or time.monotonic() > deadline:
            stop_process(process)
            raise RuntimeError(f"sglang-router did not start:\n{process.tail()}")
        time.sleep(0.2)
    return process, base


def start_floors(engine_url: str, state: Path) -> tuple[list[Process], dict[str, str]]:
    """The bare relays of bench/floor.py in front of the engine: processes and each floor's URL."""
    nats_port, relay_port, front_port, front_js_port = free_port(), free_port(), free_port(), free_port()
    nats_url = f"nats://127.0.0.1:{nats_port}"
    logs = state / "logs"

    def listening(port: int) -> Callable[[], bool]:
        return lambda: tcp_open(port)

    def said_ready(path: Path) -> Callable[[], bool]:
        return lambda: path.exists() and b"ready" in path.read_bytes()

    floor = [sys.executable, "-m", "bench.floor"]
    processes = [
        Process("floor-nats", [nats_server_binary(), "-a", "127.0.0.1", "-p", str(nats_port), "-js",
                               "-sd", str(state / "floor-nats")], dict(os.environ),
                logs / "floor-nats.log", listening(nats_port)),
        Process("relay", [*floor, "relay", "--port", str(relay_port), "--engine", engine_url], dict(os.environ),
                logs / "relay.log", listening(relay_port)),
        Process("back", [*floor, "back", "--nats", nats_url, "--engine", engine_url], dict(os.environ),
                logs / "back.log", said_ready(logs / "back.log")),
        Process("front", [*floor, "front", "--port", str(front_port), "--nats", nats_url], dict(os.environ),
                logs / "front.log", listening(front_port)),
        Process("back-js", [*floor, "back", "--jetstream", "--nats", nats_url, "--engine", engine_url],
                dict(os.environ), logs / "back-js.log", said_ready(logs / "back-js.log")),
        Process("front-js", [*floor, "front", "--jetstream", "--port", str(front_js_port), "--nats", nats_url],
                dict(os.environ), logs / "front-js.log", listening(front_js_port)),
    ]
    try:
        for process in processes:
            process.start()
            deadline = time.monotonic() + 30
            while not process.ready():
                if not process.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"{process.name} did not start:\n{process.tail()}")
                time.sleep(0.1)
    except BaseException:
        for process in processes:
            stop_process(process)
        raise
    urls = {"python-relay": f"http://127.0.0.1:{relay_port}", "python-over-nats": f"http://127.0.0.1:{front_port}",
            "python-over-jetstream": f"http://127.0.0.1:{front_js_port}"}
    return processes, urls


def stop_process(process: Process) -> None:
    process.signal(signal.SIGTERM)
    if not process.wait(10):
        process.signal(signal.SIGKILL)
        process.wait(5)


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    paced: bool

    @property
    def label(self) -> str:
        return f"paced {PACED_STEP_MS:g} ms/token, C={self.concurrency}" if self.paced else f"C={self.concurrency}"


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    out = [Scenario(f"c{c}", c, False) for c in args.concurrency]
    if args.paced_concurrency:
        out.append(Scenario(f"paced{args.paced_concurrency}", args.paced_concurrency, True))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    ensure_packages(["sglang_router"] + (["matplotlib"] if args.plot else []))
    from importlib.metadata import version

    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": host.platform()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python -m bench.spine", *sys.argv[1:]]),
        "sglang_router": version("sglang-router"),
        "config": {"seconds": args.seconds, "warmup": args.warmup, "reps": args.reps, "slices": args.slices,
                   "floors": args.floors,
                   "idle_seconds": args.idle_seconds,
                   "quiet_logs": args.quiet_logs,
                   "output_tokens": OUTPUT_TOKENS,
                   "paced_step_ms": PACED_STEP_MS},
        "phases": [], "client_check": [], "idle": {}, "load_average_before": os.getloadavg()[0],
    }
    plan = scenarios(args)
    for paced in (False, True):
        todo = [s for s in plan if s.paced == paced]
        if not todo and (paced or not args.client_check):
            continue
        print(f"{'paced' if paced else 'zero step time'}: starting inferbus and sglang-router…", flush=True)
        stack, key = start_stack(paced, args.quiet_logs)
        router: Process | None = None
        floors: list[Process] = []
        try:
            engine = stack.get("engine-1")
            router, router_url = start_sglang_router(engine.detail, stack.config.state_dir, args.quiet_logs)
            roots = {STACK_PROCESSES[p.name]: p.pid for p in stack.processes if p.name in STACK_PROCESSES}
            roots["sglang-router"] = router.pid
            floor_urls: dict[str, str] = {}
            if args.floors:
                floors, floor_urls = start_floors(engine.detail, stack.config.state_dir)
                roots.update({p.name: p.pid for p in floors})
            counters = platform_counters(stack)
            if args.idle_seconds:
                time.sleep(1.0)  # start-up work done
                own = {name: roots[name] for name in OWN_PROCESSES["inferbus"] if name in roots}
                idle = measure_idle(own, counters, args.idle_seconds)
                results["idle"]["paced" if paced else "zero step time"] = idle
                redis_per_s = sum(
                    v for k, v in idle["counts_per_second"].items() if k.startswith("redis.") and k != "redis.info"
                )
                print(
                    f"  idle {idle['seconds']:.1f} s: inferbus {sum(idle['cores'].values()):.3f} cores, "
                    f"{idle['counts_per_second'].get('nats.server.in_msgs', 0):.1f} NATS msgs/s in, "
                    f"{redis_per_s:.1f} Redis commands/s",
                    flush=True,
                )
            endpoints = {
                "engine": Endpoint("engine", engine.detail + "/v1/chat/completions"),
                "sglang-router": Endpoint("sglang-router", router_url + "/v1/chat/completions"),
                "inferbus": Endpoint("inferbus", stack.gateway_url + "/v1/chat/completions",
                                     {"Authorization": f"Bearer {key}"}),
                **{name: Endpoint(name, url + "/v1/chat/completions") for name, url in floor_urls.items()},
            }
            systems = (*SYSTEMS, *(FLOORS if args.floors else ()))
            if not paced and args.client_check:
                for system in SYSTEMS:
                    for quickack in (False, True):
                        window = asyncio.run(closed_loop(endpoints[system], 1, args.client_check, 0.5, roots, quickack))
                        phase = {**phase_metrics(system, [window]), "concurrency": 1, "quickack": quickack}
                        results["client_check"].append(phase)
                        print(f"  client check  {system:14} quickack={quickack!s:5} "
                              f"TTFB p50 {phase['ttfb_p50_ms']:.2f} ms  p99 {phase['ttfb_p99_ms']:.2f} ms", flush=True)
            for scenario in todo:
                for rep in range(args.reps):
                    order = systems if rep % 2 == 0 else tuple(reversed(systems))
                    windows: dict[str, list[Slice]] = {system: [] for system in order}
                    # With --slices > 1 the systems take turns slice by slice within the rep, so
                    # a burst of other work on the machine falls on all of them alike.
                    for _ in range(args.slices):
                        for system in order:
                            windows[system].append(asyncio.run(closed_loop(
                                endpoints[system], scenario.concurrency, args.seconds / args.slices, args.warmup, roots,
                            counters=counters if system == "inferbus" else None)))
                    for system in order:
                        phase = phase_metrics(system, windows[system])
                        phase.update(scenario=scenario.name, label=scenario.label, rep=rep, paced=scenario.paced,
                                     concurrency=scenario.concurrency, quickack=True)
                        results["phases"].append(phase)
                        print(f"  {scenario.label:24} rep {rep} {system:14} {phase['req_per_s']:7.0f} req/s  "
                              f"TTFB p50 {phase['ttfb_p50_ms']:6.2f} p99 {phase['ttfb_p99_ms']:6.2f} ms  "
                              f"{phase['own_cpu_ms_per_request']:.3f} CPU-ms/req  errors {phase['errors']}"
                              + (f" ({phase['first_error'][:120]})" if phase["errors"] else ""), flush=True)
        finally:
            if router is not None:
                stop_process(router)
            for process in reversed(floors):
                stop_process(process)
            stack.stop()
            stack.rmtree()
    results["load_average_after"] = os.getloadavg()[0]
    results["summary"] = summarise(results["phases"])
    results["targets"] = verdict(results["summary"])
    if args.plot:
        plot(results, args.out / "spine.png")
    return results


# ---- output -------------------------------------------------------------------------------------

NOISY_CORES = 0.25  # average other load above which the report says the run was disturbed
PROCESS_ORDER = ("gateway", "worker", "router", "billing", "batch", "nats-server", "redis", "sglang-router",
                 "front-js", "back-js", "front", "back", "floor-nats", "relay")


def _f(value: float, digits: int = 2) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def noise_note(results: dict[str, Any]) -> list[str]:
    """A warning when other work kept the machine's cores busy during the phases."""
    other = [p["other_load_cores"] for p in results["phases"]]
    if not other or mean(other) < NOISY_CORES:
        return []
    return [f"**The machine was busy with other work**: {mean(other):.2f} cores on average (up to {max(other):.2f}) "
            f"outside the measured processes and the client, on {results['machine']['cpus']} CPUs; load average "
            f"{results.get('load_average_before', float('nan')):.1f} before, "
            f"{results.get('load_average_after', float('nan')):.1f} after. "
            "Latency and req/s swing with it from phase to phase; CPU-ms per request is the steadiest number here.", ""]


def ratio_cell(ratio: float) -> str:
    return "–" if math.isnan(ratio) else f"{ratio:.2f}×"


def markdown(results: dict[str, Any]) -> str:
    summary = results["summary"]
    labels = {p["scenario"]: p["label"] for p in results["phases"]}
    cfg = results["config"]
    lines = [
        f"# Serving spine: inferbus and sglang-router side by side ({results['when']}, {results['machine']['cpus']} "
        "CPUs)",
        "",
        f"Command: `{results['command']}`. One simulated SGLang engine (the stack's `engine-1`) behind "
        f"sglang-router {results['sglang_router']} (defaults) and behind inferbus (one worker, "
        f"{'log level warning' if cfg.get('quiet_logs') else 'defaults: log level info, access log on'}); "
        "streaming chat with usage, "
        f"{cfg['output_tokens']} output tokens, closed loop, {cfg['reps']} reps of {cfg['seconds']:g} s"
        + (f" in {cfg['slices']} slices taken in turn" if cfg.get("slices", 1) > 1 else "")
        + f" (after {cfg['warmup']:g} s warm-up{' each' if cfg.get('slices', 1) > 1 else ''}) alternating the "
        "systems' order; client with TCP_NODELAY and quick ACK. "
        "Everything, the client included, shares this machine; TTFB is added over the engine alone in the same rep.",
        "",
        *noise_note(results),
        "## Targets (inferbus; met = met in every rep; ratio = inferbus / sglang-router)",
        "",
        "| target | bound | inferbus | per rep | sglang-router | ratio | | engine alone |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    engine_what = {"ttfb_p50_ms": "TTFB p50 {} ms", "ttfb_p99_ms": "TTFB p99 {} ms",
                   "engine_cpu_ms_per_request": "its own {} CPU-ms/req", "req_per_s": "{} req/s"}
    for row in results["targets"]:
        digits = 0 if "req/s" in row["target"] else 2
        reps = " / ".join(_f(v, digits) for v in row["reps"])
        engine = engine_what.get(row.get("engine_metric", ""), "{}").format(
            _f(row.get("engine_alone", float("nan")), digits)
        )
        lines.append(f"| {row['what']} | {row['target']} | {_f(row['inferbus'], digits)} | {reps} | "
                     f"{_f(row['sglang_router'], digits)} | {ratio_cell(row['ratio_to_sglang_router'])} | "
                     f"{'met' if row['met'] else '**missed**'} | {engine} |")
    lines += floor_table(results)
    lines += ["", "## Every scenario (means over reps)", "",
              "| scenario | system | req/s | TTFB p50 / p99 ms | added TTFB p50 / p99 ms | own CPU-ms/req | engine "
              "CPU-ms/req | client CPU-ms/req | other load (cores) | errors |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for scenario, systems in summary.items():
        for system, s in systems.items():
            added = (f"{_f(s['added_ttfb_p50_ms'])} / {_f(s['added_ttfb_p99_ms'])}" if system != "engine" else "floor")
            lines.append(f"| {labels[scenario]} | {system} | {_f(s['req_per_s'], 0)} | {_f(s['ttfb_p50_ms'])} / "
                         f"{_f(s['ttfb_p99_ms'])} | {added} | {_f(s['own_cpu_ms_per_request'], 3)} | "
                         f"{_f(s['cpu_ms_per_request'].get('engine', float('nan')), 3)} | "
                         f"{_f(s['client_cpu_ms_per_request'], 3)} | {_f(s['other_load_cores'])} | {s['errors']} |")
    lines += ["", "## CPU-ms per request by process (whole process trees, means over reps)", "",
              "| scenario | system | " + " | ".join(PROCESS_ORDER) + " | total | engine |",
              "| --- | --- | " + " | ".join("---:" for _ in PROCESS_ORDER) + " | ---: | ---: |"]
    for scenario, systems in summary.items():
        for system in ROUTERS:
            if system not in systems:
                continue
            s = systems[system]
            own = OWN_PROCESSES[system]
            cells = [_f(s["cpu_ms_per_request"].get(p, float("nan")), 3) if p in own else "" for p in PROCESS_ORDER]
            lines.append(f"| {labels[scenario]} | {system} | " + " | ".join(cells) +
                         f" | **{_f(s['own_cpu_ms_per_request'], 3)}** | "
                         f"{_f(s['cpu_ms_per_request'].get('engine', float('nan')), 3)} |")
    lines += count_tables(results)
    if results["client_check"]:
        lines += ["", "## Client check: concurrency 1, with and without quick ACK", "",
                  "| system | ordinary client (TCP_NODELAY only) TTFB p50 / p99 ms | quick-ACK client TTFB p50 / p99 "
                  "ms |",
                  "| --- | ---: | ---: |"]
        for system in SYSTEMS:
            rows = {p["quickack"]: p for p in results["client_check"] if p["system"] == system}
            if len(rows) == 2:
                lines.append(f"| {system} | {_f(rows[False]['ttfb_p50_ms'])} / {_f(rows[False]['ttfb_p99_ms'])} | "
                             f"{_f(rows[True]['ttfb_p50_ms'])} / {_f(rows[True]['ttfb_p99_ms'])} |")
    if results.get("plot"):
        lines += ["", f"![CPU-ms per request by process]({Path(results['plot']).name})"]
    return "\n".join(lines) + "\n"


def floor_table(results: dict[str, Any]) -> list[str]:
    """The targets beside what the bare relays of inferbus's shape reach (bench/floor.py)."""
    summary = results["summary"]
    present = [f for f in FLOORS if any(f in systems for systems in summary.values())]
    if not present:
        return []
    lines = ["", "## The floor: inferbus's shape with nothing else (`bench/floor.py`, means over reps)", "",
             "*python-over-nats* is two bare Python relays with core NATS between them (HTTP in, the request to "
             "the other over NATS, the engine's SSE bytes back one message per read); *python-over-jetstream* the "
             "same with the request through a durable JetStream work queue (file storage, acknowledged on both "
             "sides, pulled by the worker's own puller); *python-relay* one bare "
             "relay: the same libraries as the platform (uvicorn + httptools + uvloop, nats-py, the worker's HTTP "
             "client), no tenancy, admission, durable queue, placement, billing, parsing or rendering. What these "
             "cost is the least a Python spine of this shape can.", "",
             "| target | bound | inferbus | " + " | ".join(present) + " | sglang-router |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in present) + " | ---: |"]
    for t in TARGETS:
        systems = summary.get(t.scenario, {})
        digits = 0 if t.unit == "req/s" else 2
        cells = [_f(systems.get(name, {}).get(t.metric, float("nan")), digits)
                 for name in ("inferbus", *present, "sglang-router")]
        lines.append(
            f"| {t.what} | {'≥' if t.higher_is_better else '≤'} {t.bound:g} {t.unit} | " + " | ".join(cells) + " |"
        )
    return lines


def _roles(keys: Iterable[str]) -> list[str]:
    """Connection roles in `nats.<role>.<field>` keys, the server's totals left out."""
    return sorted(
        {
            k[len("nats.") :].rsplit(".", 1)[0]
            for k in keys
            if k.startswith("nats.") and not k.startswith("nats.server.")
        }
    )


def count_tables(results: dict[str, Any]) -> list[str]:
    """inferbus's NATS messages and Redis commands per request, its idle cost, and CPU per request
    split into idle background and work: counts do not depend on how busy the machine is."""
    summary = results["summary"]
    labels = {p["scenario"]: p["label"] for p in results["phases"]}
    ours = {sc: systems["inferbus"] for sc, systems in summary.items() if "inferbus" in systems
            and systems["inferbus"].get("counts_per_request")}
    idle = results.get("idle", {})
    if not ours and not idle:
        return []
    lines: list[str] = []
    if ours:
        cols = list(ours)
        head = "| | " + " | ".join(labels[c] for c in cols) + " |"
        rule = "| --- | " + " | ".join("---:" for _ in cols) + " |"
        counts = {c: ours[c]["counts_per_request"] for c in cols}
        keys = {k for c in cols for k in counts[c]}
        lines += [
            "",
            "## NATS messages per request (inferbus, from nats-server's /connz and /varz; means over reps)",
            "",
            "Per connection, the server's view: *published* is what the service sent to nats-server "
            "(requests, JetStream publishes, acks, pull requests, replies), *received* what nats-server "
            "delivered to it. The server's totals include JetStream's internal messages.",
            "",
            head,
            rule,
        ]
        for role in _roles(keys):
            for field_, what in (("in_msgs", "published"), ("out_msgs", "received")):
                lines.append(f"| {role}: {what} | " + " | ".join(_f(counts[c].get(f"nats.{role}.{field_}", 0.0))
                                                                 for c in cols) + " |")
        lines.append("| **nats-server total in / out** | " + " | ".join(
            f"{_f(counts[c].get('nats.server.in_msgs', 0.0))} / {_f(counts[c].get('nats.server.out_msgs', 0.0))}"
            for c in cols) + " |")
        lines.append("| nats-server bytes in + out | " + " | ".join(
            _f(counts[c].get("nats.server.in_bytes", 0.0) + counts[c].get("nats.server.out_bytes", 0.0), 0)
            for c in cols) + " |")
        commands = sorted({k for k in keys if k.startswith("redis.") and k != "redis.info"})
        lines += ["", "## Redis commands per request (inferbus, `INFO commandstats`; means over reps)", "",
                  "A pipeline or a Lua script is one round trip for several commands; `evalsha` is one script call.",
                  "", head, rule]
        for command in commands:
            lines.append(
                f"| {command[len('redis.') :]} | " + " | ".join(_f(counts[c].get(command, 0.0)) for c in cols) + " |"
            )
        lines.append(
            "| **total** | " + " | ".join(_f(sum(counts[c].get(k, 0.0) for k in commands)) for c in cols) + " |"
        )
    for name, run_ in idle.items():
        cores = run_["cores"]
        per_s = run_["counts_per_second"]
        lines += [
            "",
            f"## inferbus idle ({name} stack, {run_['seconds']:.1f} s without requests)",
            "",
            "| process | cores | | connection | NATS msgs/s published / received |",
            "| --- | ---: | --- | --- | ---: |",
        ]
        roles = _roles(per_s)
        procs = [p for p in PROCESS_ORDER if p in cores]
        for i in range(max(len(procs), len(roles))):
            left = f"{procs[i]} | {_f(cores[procs[i]], 3)}" if i < len(procs) else " | "
            right = (f"{roles[i]} | {_f(per_s.get(f'nats.{roles[i]}.in_msgs', 0.0), 1)} / "
                     f"{_f(per_s.get(f'nats.{roles[i]}.out_msgs', 0.0), 1)}") if i < len(roles) else " | "
            lines.append(f"| {left} | | {right} |")
        redis_per_s = sum(v for k, v in per_s.items() if k.startswith("redis.") and k != "redis.info")
        lines.append(f"| **total** | **{_f(sum(cores.values()), 3)}** | | nats-server in / out | "
                     f"{_f(per_s.get('nats.server.in_msgs', 0.0), 1)} / "
                     f"{_f(per_s.get('nats.server.out_msgs', 0.0), 1)} |")
        lines.append(f"| | | | Redis commands/s | {_f(redis_per_s, 1)} |")
    zero = idle.get("zero step time")
    if zero and ours:
        background = sum(zero["cores"].values())
        lines += ["", "## CPU per request: idle background and work (inferbus)", "",
                  f"Background = the idle cores measured above ({_f(background, 3)}) × 1000 / req/s: what the "
                  "platform would burn anyway, spread over the requests; work = the rest.", "",
                  "| scenario | req/s | CPU-ms/req | background | work |", "| --- | ---: | ---: | ---: | ---: |"]
        for c, s in ours.items():
            if c.startswith("paced"):
                continue
            share = background * 1000 / s["req_per_s"] if s["req_per_s"] else float("nan")
            lines.append(f"| {labels[c]} | {_f(s['req_per_s'], 0)} | {_f(s['own_cpu_ms_per_request'], 3)} | "
                         f"{_f(share, 3)} | {_f(s['own_cpu_ms_per_request'] - share, 3)} |")
    return lines


def plot(results: dict[str, Any], path: Path) -> None:
    """Stacked bars: CPU-ms per request by process, per system, per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    labels = {p["scenario"]: ("paced " if p["paced"] else "") + f"C={p['concurrency']}" for p in results["phases"]}
    short = {"sglang-router": "sglang", "python-over-jetstream": "py+js", "python-over-nats": "py+nats",
             "python-relay": "py relay"}
    bars = [(f"{labels[sc]}\n{short.get(sy, sy)}", sy, summary[sc][sy])
            for sc in summary for sy in ROUTERS if sy in summary[sc]]
    if not bars:
        return
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(bars)), 4.2))
    bottoms = [0.0] * len(bars)
    for process in PROCESS_ORDER:
        heights = [s["cpu_ms_per_request"].get(process, 0.0) if process in OWN_PROCESSES[system] else 0.0
                   for _, system, s in bars]
        if any(h > 0 for h in heights):
            ax.bar(range(len(bars)), heights, bottom=bottoms, label=process)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    for x, total in enumerate(bottoms):
        ax.annotate(f"{total:.2f}", (x, total), ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, max(bottoms) * 1.12)
    ax.set_xticks(range(len(bars)), [name for name, _, _ in bars], fontsize=7)
    ax.set_ylabel("CPU-ms per request")
    ax.set_title("CPU-ms per request by process, whole process trees (engine and client not included)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    results["plot"] = str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds of each phase (default 4)")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each phase (default 1)")
    parser.add_argument("--reps", type=int, default=2, help="reps of each scenario, alternating the order (default 2)")
    parser.add_argument("--slices", type=int, default=1,
                        help="split each phase into this many slices, the systems taking turns slice by slice "
                             "(each slice after its own warm-up); more evens out a noisy machine (default 1)")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 64, 256],
                        help="closed-loop levels at zero step time (default 1 16 64 256)")
    parser.add_argument("--paced-concurrency", type=int, default=64,
                        help=f"concurrency of the paced case ({PACED_STEP_MS:g} ms per token; 0 skips it; default 64)")
    parser.add_argument("--client-check", type=float, default=2.0,
                        help="seconds of each C=1 run with and without quick ACK (0 skips it; default 2)")
    parser.add_argument("--quiet-logs", action="store_true",
                        help="inferbus at log level warning (no access log) and sglang-router at warn, instead of "
                             "each one's default (info)")
    parser.add_argument(
        "--no-floors",
        dest="floors",
        action="store_false",
        help="skip the bare relays (bench/floor.py: one Python process, two over core NATS, two over JetStream) "
        "that show what any Python spine of inferbus's shape costs",
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=5.0,
        help="seconds the platform is measured with no requests after each start (0 skips it; default 5)",
    )
    parser.add_argument("--quick", action="store_true",
                        help="one rep of 1.5 s per phase, 0.5 s warm-up, 1 s client check, 3 s idle")
    parser.add_argument("--no-plot", dest="plot", action="store_false", help="skip spine.png (needs matplotlib)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="where spine.json, .md and .png go")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.warmup, args.reps, args.client_check = 1.5, 0.5, 1, min(args.client_check, 1.0)
        args.idle_seconds = min(args.idle_seconds, 3.0)
    results = run(args)
    write_results(args.out, "spine", results, markdown)


if __name__ == "__main__":
    main()
