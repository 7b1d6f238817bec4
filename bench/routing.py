"""Routing benchmark: one Mooncake trace, the same simulated engines, several routers.

    python -m bench.routing [--trace mooncake_synthetic.jsonl] [--engines 4] [--time-scale 0.5] [--load 0.8]
                            [--sample-families 0.25] [--requests N]
                            [--policies sglang dynamo_round_robin dynamo_kv affinity] [--busy-cores N]

Defaults take about 13 minutes on 2 cores (4 policies × 147 wall s of arrivals, plus drains and
start-up); `--sample-families 1` replays the whole trace (about 4× longer). Faster time scales
distort the platform's numbers on 2 cores: at 0.25 the machine saturates and placement replies
miss their budget (see bench/README.md). `make bench-routing` runs a smaller sample of the
synthetic trace and the start of the conversation trace (about 15 minutes for both).
`--busy-cores 1` runs every policy beside a process that takes one core for itself: the slow
control plane of a host with other work or a pod at its CPU limit.

What runs:
1. `--engines` simulated engines (`inferbus sim-engine`, H100 TP2 by default: 418,701 KV tokens
   each), started once and shared by every policy; `POST /flush_cache` between policies.
2. The workload (`bench/routing_workload.py`): `traces/mooncake_synthetic.jsonl`, a
   random quarter of its prefix families by default (whole families, so their reuse is intact; a
   prefix of the trace would not do: its first 1,000 requests have a 17% ceiling, not 65%), prompt
   text from `tools.capacity.traces.mooncake_prompt` (512-token blocks named by `hash_ids`), arrival
   times scaled so that the fleet is `--load` busy at the hit rate a perfect-affinity router could
   get from these engines' KV (the engines' own step-time model prices the work).
3. Per policy, in sequence:
   - `round_robin`, `least_loaded`, `affinity`: the whole platform (NATS, Redis, router, gateway,
     billing, one worker per engine) with `INFERBUS_ROUTER_POLICY` set and placement on
     (`INFERBUS_PLACEMENT_TIMEOUT_MS`); the client calls `POST /v1/completions` (raw prompt, no chat
     template) streaming with `include_usage`;
   - `sglang`: `sglang-router --policy cache_aware` (PyPI `sglang-router`, installed here if
     missing) over the same engines; the client calls its native `POST /generate`;
   - `dynamo_kv`, `dynamo_round_robin`: NVIDIA Dynamo 1.6.1's frontend (`--router-mode kv` or
     `round-robin`) over one Dynamo mocker engine per engine of ours, with the same timing table,
     KV pool, block size, chunked prefill and batch limit (`bench/dynamo_live.py`; Dynamo is
     installed into `.venv-dynamo` on first use); the client calls `POST /v1/completions`.
   An open-loop client (aiohttp, a new connection per request) sends each request at its scaled
   arrival time. Every engine, ours and Dynamo's, is timed by the same profile table of the GPU
   model with SGLang's default scheduling (no decode in a step that prefills).
4. Measured per policy: token-weighted prefix-cache hit rate (sum of cached / sum of prompt tokens
   as the engines reported them in the responses, cross-checked with the engines' own counters),
   TTFT p50/p90, TPOT p90, throughput, load imbalance (max/mean over engines of prompt + generated
   tokens, from each engine's `/metrics` before and after; also of the tokens actually computed),
   errors, CPU use of every process and the router's CPU per request.

Time: engines run `--time-scale` wall seconds per simulated second. Every latency is measured by
the client in wall time and divided by the time scale, so all numbers are in simulated (GPU)
seconds; what the platform itself adds (a few ms of wall time) is magnified by 1/time-scale.
Results: bench/results/routing.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import json
import os
import platform as host
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import dynamo_env, dynamo_live
from bench.common import percentile, write_results
from bench.routing_workload import Workload, build, request_gpu_seconds
from inferbus.local.ports import free_port
from inferbus.local.probes import http_ok
from inferbus.local.process import Process
from inferbus.local.stack import Stack, StackConfig
from inferbus.timing import roofline
from services.sim_engine.profile_table import build_table, save_npz
from tools.capacity import traces

MODEL = "meta-llama/Llama-3.3-70B-Instruct"
CLK_TCK = os.sysconf("SC_CLK_TCK")
INFERBUS_POLICIES = ("round_robin", "least_loaded", "affinity")
DYNAMO_POLICIES = tuple(dynamo_live.ROUTER_MODES)
ALL_POLICIES = ("round_robin", "least_loaded", "sglang", "dynamo_round_robin", "dynamo_kv", "affinity")
DEFAULT_POLICIES = ("sglang", "dynamo_round_robin", "dynamo_kv", "affinity")
LABELS = {"round_robin": "inferbus round-robin", "least_loaded": "inferbus least-loaded",
          "sglang": "sglang-router cache_aware", "affinity": "inferbus affinity",
          "dynamo_kv": "Dynamo KV router", "dynamo_round_robin": "Dynamo round-robin"}
# Processes that are engines or the load generator, not a router's: left out of its CPU per request.
NOT_ROUTER = ("engine-", "mocker-", "load-generator")
BENCH_PACKAGES = {"sglang_router": "sglang-router>=0.3,<0.4", "matplotlib": "matplotlib>=3.8"}


def ensure_packages(names: list[str]) -> None:
    """pip-install into this interpreter what the benchmark needs and the core install lacks."""
    missing = [BENCH_PACKAGES[n] for n in names if importlib.util.find_spec(n) is None]
    if missing:
        print(f"installing {' '.join(missing)} …", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *missing], check=True)


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine has spent busy since boot (from /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


# ---- engines -------------------------------------------------------------------------------------

_METRIC = re.compile(rb"^(sglang:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


@dataclass
class EngineCounters:
    prompt: float
    generated: float
    cached: float
    ttft_buckets: dict[float, float]  # sglang:time_to_first_token_seconds, cumulative, wall seconds

    def minus(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(self.prompt - other.prompt, self.generated - other.generated, self.cached - other.cached,
                              {le: n - other.ttft_buckets.get(le, 0.0) for le, n in self.ttft_buckets.items()})


def histogram(text: bytes, name: str) -> dict[float, float]:
    """Cumulative bucket counts (upper bound → count) of a Prometheus histogram in `text`."""
    pattern = re.compile(re.escape(name).encode() + rb'_bucket\{[^}]*le="([^"]+)"[^}]*\} ([0-9.eE+-]+)$', re.M)
    return {float(m.group(1)): float(m.group(2)) for m in pattern.finditer(text)}


def histogram_quantile(buckets: dict[float, float], q: float) -> float:
    """Prometheus's histogram_quantile: linear inside the bucket; NaN without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return float("nan")
    target = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= target:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * ((target - below) / (count - below) if count > below else 0.0)
        lower, below = bound, count
    return lower


class Fleet:
    """The simulated engines, started once for every policy."""

    def __init__(self, args: argparse.Namespace, state: Path) -> None:
        self.processes: list[Process] = []
        self.urls: list[str] = []
        self.info: dict[str, Any] = {}  # the first engine's /server_info, once started
        # Every engine (ours and Dynamo's mockers) is timed by one profile table of the GPU model,
        # with SGLang's scheduling: no decode in a step that prefills (the mocker's SGLang mode).
        self.table_path = state / "profile.npz"
        save_npz(build_table(roofline(args.gpu, args.tp)), self.table_path)
        # One tokenizer for every router's path (our gateway, our engines, Dynamo's frontend): one
        # token per word of the trace's prompt text, so a prompt is the trace's token count everywhere.
        self.model_dir = dynamo_live.write_model_dir(state / "model", 131_072)
        self.kv_events: list[str] = []  # ZMQ endpoints of the engines' KV-cache events ("" = not supported)
        events = (
            "--kv-events-config"
            in subprocess.run(
                [sys.executable, "-m", "tools.commands.main", "sim-engine", "--help"], capture_output=True, text=True
            ).stdout
        )
        for i in range(1, args.engines + 1):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            argv = [
                sys.executable,
                "-m",
                "tools.commands.main",
                "sim-engine",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--gpu",
                args.gpu,
                "--tp",
                str(args.tp),
                "--model",
                MODEL,
                "--time-scale",
                str(args.time_scale),
                "--log-level",
                "warning",
                "--profile-table",
                str(self.table_path),
                "--no-mixed-chunk",
                "--model-dir",
                str(self.model_dir),
            ]
            endpoint = f"tcp://127.0.0.1:{free_port()}" if events else ""
            if endpoint:  # as `inferbus up` runs them: the engine binds, its worker connects and relays
                argv += ["--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": endpoint, "bind": True})]
            self.kv_events.append(endpoint)
            if args.kv_capacity_tokens:
                argv += ["--kv-capacity-tokens", str(args.kv_capacity_tokens)]
            ready = functools.partial(http_ok, f"{url}/ready")
            self.processes.append(Process(f"engine-{i}", argv, dict(os.environ, PYTHONUNBUFFERED="1"),
                                          state / "logs" / f"engine-{i}.log", ready, url))
            self.urls.append(url)

    def start(self, timeout: float = 60) -> None:
        for p in self.processes:
            p.start()
        deadline = time.monotonic() + timeout
        for p in self.processes:
            while not p.ready():
                if not p.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"{p.name} did not start:\n{p.tail()}")
                time.sleep(0.1)

    def stop(self) -> None:
        for p in self.processes:
            p.signal(signal.SIGTERM)
        for p in self.processes:
            if not p.wait(10):
                p.signal(signal.SIGKILL)
                p.wait(5)

    def server_info(self) -> dict[str, Any]:
        self.info = get_json(self.urls[0] + "/server_info")
        return self.info

    def counters(self) -> list[EngineCounters]:
        out = []
        for url in self.urls:
            with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
                text = response.read()
            values = {m.group(1).decode(): float(m.group(2)) for m in _METRIC.finditer(text)}
            prompt = values.get("sglang:prompt_tokens_total", 0.0)
            # The engine's cumulative hit rate is cached / prompt tokens since start; health-check
            # prompts (a few tokens) count there but not in the prompt counter: negligible.
            hit_rate = get_json(url + "/v1/loads")["loads"][0]["cache_hit_rate"]
            out.append(EngineCounters(prompt, values.get("sglang:generation_tokens_total", 0.0), hit_rate * prompt,
                                      histogram(text, "sglang:time_to_first_token_seconds")))
        return out

    def idle(self) -> bool:
        for url in self.urls:
            load = get_json(url + "/v1/loads")["loads"][0]
            if load["num_running_reqs"] or load["num_waiting_reqs"]:
                return False
        return True

    def flush(self, timeout: float = 120) -> None:
        """Empty every engine's prefix cache (refused while requests run, so wait for idle)."""
        deadline = time.monotonic() + timeout
        pending = list(self.urls)
        while pending:
            for url in list(pending):
                request = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
                try:
                    with urllib.request.urlopen(request, timeout=5) as response:
                        if response.status == 200:
                            pending.remove(url)
                except urllib.error.HTTPError:
                    pass
            if pending:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"engines still busy, cache not flushed: {pending}")
                time.sleep(0.5)


# ---- front ends ------------------------------------------------------------------------------------

class PlatformStack(Stack):
    """The platform without engines of its own: one worker per existing engine."""

    def __init__(self, config: StackConfig, engine_urls: list[str], kv_events: list[str]) -> None:
        super().__init__(config)
        self.engine_urls = engine_urls
        self.kv_events = kv_events

    def plan(self) -> None:
        super().plan()  # config.workers == 0: NATS, Redis, router, billing, gateway (last)
        gateway = self.processes.pop()
        self.router_metrics_port = free_port()
        for process in self.processes:
            if process.name == "router":  # its placement reasons are part of the result
                process.env["INFERBUS_METRICS_PORT"] = str(self.router_metrics_port)
                process.env["INFERBUS_LOG_LEVEL"] = "info"  # the launcher waits for its `router_ready` line
        for i, (url, events) in enumerate(zip(self.engine_urls, self.kv_events), 1):
            self._add(
                f"worker-{i}",
                self._inferbus("worker"),
                lambda: True,
                f"drives {url}",
                INFERBUS_WORKER_ID=f"worker-{i}",
                INFERBUS_ENGINE_URL=url,
                INFERBUS_METRICS_PORT="0",
                **({"INFERBUS_ENGINE_KV_EVENTS": events, "INFERBUS_ENGINE_KV_EVENTS_BIND": "false"} if events else {}),
            )
        self.processes.append(gateway)

    def gateway_serving(self, url: str | None = None) -> bool:
        try:
            with urllib.request.urlopen(f"{url or self.gateway_url}/ready", timeout=0.5) as response:
                return json.load(response).get("workers", 0) >= len(self.engine_urls)
        except Exception:
            return False


def router_policies() -> str:
    """`inferbus router --help` (its environment variables), to see whether INFERBUS_ROUTER_POLICY exists."""
    result = subprocess.run(
        [sys.executable, "-m", "tools.commands.main", "router", "--help"], capture_output=True, text=True
    )
    return result.stdout


_PLACEMENT = re.compile(
    r"^(inferbus_(?:router_)?placements_total|inferbus_placement_seconds_count)\{([^}]*)\} ([0-9.eE+-]+)$", re.M)


def placement_counters(urls: list[str]) -> dict[str, float]:
    """The placement counters (`placed_share` reads them) scraped from each Prometheus endpoint that answers."""
    out: dict[str, float] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            continue
        for m in _PLACEMENT.finditer(text):
            out[f"{m.group(1)}{{{m.group(2)}}}"] = float(m.group(3))
    return out


class Frontend:
    name: str
    url: str
    headers: dict[str, str]
    endpoint: str  # "completions" | "generate"

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def pids(self) -> dict[str, int]: return {}
    def counters(self) -> dict[str, float]: return {}
    def queue_wait(self) -> dict[str, float]: return {}


class InferbusFrontend(Frontend):
    endpoint = "completions"

    def __init__(self, policy: str, fleet: Fleet, state: Path, placement_timeout_ms: float, time_scale: float,
                 placement_patience_ms: float | None = None) -> None:
        self.name = policy
        env = {
            "INFERBUS_ROUTER_POLICY": policy,
            "INFERBUS_PLACEMENT_TIMEOUT_MS": str(placement_timeout_ms),
            **({} if placement_patience_ms is None else {"INFERBUS_PLACEMENT_PATIENCE_MS": str(placement_patience_ms)}),
            # Compare routing, not admission: nothing is refused for queueing (sglang-router refuses nothing).
            "INFERBUS_QUEUE_BUDGET_STANDARD_S": "1000000", "INFERBUS_QUEUE_BUDGET_PREMIUM_S": "1000000",
            "INFERBUS_REQUEST_TIMEOUT_S": "3600", "INFERBUS_ACCESS_LOG": "false",
            # Load reports every 0.25 wall s would be 2.5 simulated s apart at time scale 0.1: scale the
            # interval with the engines' clock (floored, so polling does not eat the CPU).
            "INFERBUS_LOAD_INTERVAL_S": str(max(0.05, min(0.25, 0.25 * time_scale))),
        }
        self.stack = PlatformStack(StackConfig(state_dir=state / policy, workers=0, gateway_port=free_port(),
                                               model_dir=fleet.model_dir,
                                               log_level="warning", extra_env=env), fleet.urls, fleet.kv_events)
        self.url = self.stack.gateway_url + "/v1/completions"
        self.headers = {"content-type": "application/json"}

    def start(self) -> None:
        from tools.commands.local_platform import demo_key

        try:
            self.stack.start(timeout=120)
        except Exception:
            self.stack.stop()
            raise
        self.headers["authorization"] = "Bearer " + asyncio.run(demo_key(self.stack.redis_url))

    def stop(self) -> None:
        self.stack.stop()

    def counters(self) -> dict[str, float]:
        """Where requests were placed: the gateway's and the router's placement counters."""
        return placement_counters(
            [self.stack.gateway_url + "/metrics", f"http://127.0.0.1:{self.stack.router_metrics_port}/metrics"])

    def pids(self) -> dict[str, int]:
        return {p.name: p.pid for p in self.stack.processes}

    def queue_wait(self) -> dict[str, float]:
        """Gateway accept → engine submit (placement, JetStream, worker), from the gateway's histogram."""
        try:
            with urllib.request.urlopen(self.stack.gateway_url + "/metrics", timeout=5) as response:
                buckets = histogram(response.read(), "inferbus_queue_wait_seconds")
        except OSError:
            return {}
        return {"p50": histogram_quantile(buckets, 0.5), "p90": histogram_quantile(buckets, 0.9)}


class SglangFrontend(Frontend):
    endpoint = "generate"

    def __init__(self, fleet: Fleet, state: Path) -> None:
        self.name = "sglang"
        self.fleet = fleet
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/generate"
        self.base = f"http://127.0.0.1:{port}"
        self.headers = {"content-type": "application/json"}
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *fleet.urls,
                "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1", "--log-level", "warn"]
        self.process = Process("sglang-router", argv, dict(os.environ), state / "logs" / "sglang-router.log",
                               self._ready, self.base)

    def _ready(self) -> bool:
        try:
            workers = get_json(self.base + "/workers", timeout=1).get("workers", [])
        except Exception:
            return False
        return sum(1 for w in workers if w.get("is_healthy")) >= len(self.fleet.urls)

    def start(self) -> None:
        self.process.start()
        deadline = time.monotonic() + 60
        while not self.process.ready():
            if not self.process.alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sglang-router did not start:\n{self.process.tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.process.signal(signal.SIGTERM)
        if not self.process.wait(10):
            self.process.signal(signal.SIGKILL)
            self.process.wait(5)

    def pids(self) -> dict[str, int]:
        return {"sglang-router": self.process.pid}


# ---- the load generator -----------------------------------------------------------------------------

@dataclass
class Outcome:
    index: int
    scheduled: float  # wall seconds from the start
    sent: float = 0.0
    headers: float | None = None  # the response's status line and headers read
    first: float | None = None
    end: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    response_id: str | None = None  # the completion's id (Dynamo's is "cmpl-<request id>")


def request_body(endpoint: str, prompt: str, max_tokens: int) -> bytes:
    if endpoint == "generate":
        payload: dict[str, Any] = {"text": prompt, "stream": True,
                                   "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}}
    else:
        payload = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                   "stream_options": {"include_usage": True}}
    return json.dumps(payload).encode()


_RESPONSE_ID = re.compile(rb'"id":"([^"]+)"')


async def one_request(session: Any, frontend: Frontend, body: bytes, outcome: Outcome, t0: float) -> None:
    import aiohttp

    outcome.sent = time.perf_counter() - t0
    last = b""
    try:
        async with session.post(frontend.url, data=body, headers=frontend.headers) as response:
            outcome.headers = time.perf_counter() - t0
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                if b'"error"' in line[:16]:
                    outcome.error = line[6:300].decode(errors="replace")
                    return
                if outcome.first is None and b'"text":""' not in line and b'"text":"' in line:
                    outcome.first = time.perf_counter() - t0
                    found = _RESPONSE_ID.search(line)
                    outcome.response_id = found.group(1).decode() if found else None
                if frontend.endpoint == "generate" or b'"usage":{' in line:
                    last = line
        outcome.end = time.perf_counter() - t0
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        return
    try:
        final = json.loads(last[6:])
        if frontend.endpoint == "generate":
            meta = final["meta_info"]
            outcome.prompt_tokens, outcome.cached_tokens = meta["prompt_tokens"], meta["cached_tokens"]
            outcome.completion_tokens = meta["completion_tokens"]
        else:
            usage = final["usage"]
            outcome.prompt_tokens, outcome.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
            outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (ValueError, KeyError, TypeError):
        outcome.error = f"no usage in the last chunk: {last[:200]!r}"


class Progress:
    """One status line on stderr, rewritten in place (a plain line per update when not a TTY)."""

    def __init__(self, label: str, total: int, span_wall: float) -> None:
        self.label, self.total, self.span_wall = label, total, span_wall
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def update(self, sent: int, done: int, errors: int, elapsed: float, force: bool = False) -> None:
        if not force and elapsed - self.last < (0.5 if self.tty else 15.0):
            return
        self.last = elapsed
        width = 30
        filled = int(width * done / max(1, self.total))
        bar = "█" * filled + "·" * (width - filled)
        line = (f"{self.label:<26} |{bar}| {done}/{self.total} done, {sent - done} in flight, {errors} errors, "
                f"{elapsed:5.0f}/{self.span_wall:.0f} s")
        sys.stderr.write(("\r" + line + "   ") if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


async def replay(frontend: Frontend, workload: Workload, prompts: list[str], time_scale: float,
                 label: str) -> tuple[list[Outcome], float]:
    import aiohttp

    requests = workload.requests
    outcomes = [Outcome(i, r.arrival_s * time_scale) for i, r in enumerate(requests)]
    # A new connection per request: keep-alive aiohttp clients stall ~40 ms per request against
    # Dynamo's frontend (its own TTFT metric does not show it; checked in the results).
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    progress = Progress(label, len(requests), workload.span_s * time_scale)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        tasks: list[asyncio.Task[None]] = []
        state = {"stop": False}

        async def report() -> None:
            while not state["stop"]:
                done = sum(1 for o in outcomes if o.end is not None or o.error)
                progress.update(len(tasks), done, sum(1 for o in outcomes if o.error), time.perf_counter() - t0)
                await asyncio.sleep(0.5)

        reporter = asyncio.create_task(report())
        main = asyncio.current_task()
        loop = asyncio.get_running_loop()
        interrupted = False

        def interrupt() -> None:
            nonlocal interrupted
            interrupted = True
            assert main is not None
            main.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, interrupt)
        try:
            for request, outcome, prompt in zip(requests, outcomes, prompts):
                delay = outcome.scheduled - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                body = request_body(frontend.endpoint, prompt, request.output_tokens)
                tasks.append(asyncio.create_task(one_request(session, frontend, body, outcome, t0)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            if not interrupted:
                raise
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise KeyboardInterrupt from None
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            state["stop"] = True
            await reporter
        wall = time.perf_counter() - t0
        done = sum(1 for o in outcomes if o.end is not None or o.error)
        progress.update(len(tasks), done, sum(1 for o in outcomes if o.error), wall, force=True)
        progress.close()
    return outcomes, wall


# ---- one policy --------------------------------------------------------------------------------------

def summarise(outcomes: list[Outcome], wall: float, time_scale: float, workload: Workload,
              before: list[EngineCounters], after: list[EngineCounters], cpu: dict[str, float],
              gpu: str, tp: int) -> dict[str, Any]:
    ok = [o for o in outcomes if o.error is None and o.end is not None and o.first is not None]
    errors = [o for o in outcomes if o not in ok]
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    # (sent, first token, end) of each answered request
    times = [(o.sent, o.first, o.end) for o in ok if o.first is not None and o.end is not None]
    ttft = [(first - sent) / time_scale for sent, first, _ in times]
    # Where a front end answers with its headers before the first token (inferbus: once admitted and
    # queued), the client's TTFT splits in two: sent → headers and headers → first token.
    headers = [(o.headers - o.sent) / time_scale for o in ok if o.headers is not None]
    tpot = [(o.end - o.first) / time_scale / (o.completion_tokens - 1)
            for o in ok if o.completion_tokens > 1 and o.end is not None and o.first is not None]
    e2e = [(end - sent) / time_scale for sent, _, end in times]
    lateness = [(o.sent - o.scheduled) * 1000 for o in outcomes]
    sim_span = wall / time_scale
    deltas = [a.minus(b) for a, b in zip(after, before)]
    processed = [d.prompt + d.generated for d in deltas]
    computed = [d.prompt - d.cached + d.generated for d in deltas]
    mean_processed = sum(processed) / len(processed)
    mean_computed = sum(computed) / len(computed)
    engine_ttft: dict[float, float] = {}
    for d in deltas:
        for le, n in d.ttft_buckets.items():
            engine_ttft[le] = engine_ttft.get(le, 0.0) + n
    engine_prompt = sum(d.prompt for d in deltas)
    model = roofline(gpu, tp)
    by_index = {o.index: o for o in ok}
    # Engine time the served requests cost at the hits they actually got, over the fleet's time.
    work = sum(request_gpu_seconds(model, r, by_index[i].cached_tokens)
               for i, r in enumerate(workload.requests) if i in by_index)
    return {
        "requests": len(outcomes), "ok": len(ok), "errors": len(errors),
        "error_samples": sorted({(o.error or "no first token")[:160] for o in errors})[:5],
        "hit_rate": cached / prompt if prompt else 0.0,
        "hit_rate_engines": sum(d.cached for d in deltas) / engine_prompt if engine_prompt else 0.0,
        "hit_rate_vs_ceiling": (cached / prompt) / workload.ceiling_hit_rate if prompt else 0.0,
        "hit_rate_vs_bound": (cached / prompt) / workload.bound_hit_rate if prompt and workload.bound_hit_rate else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "ttft_p99_s": percentile(ttft, 99),
        "headers_p50_s": percentile(headers, 50), "headers_p90_s": percentile(headers, 90),
        "tpot_p50_ms": percentile(tpot, 50) * 1000, "tpot_p90_ms": percentile(tpot, 90) * 1000,
        "e2e_p50_s": percentile(e2e, 50), "e2e_p90_s": percentile(e2e, 90),
        # Inside the engines (arrival at the engine to first token), from their histograms: coarse buckets.
        "engine_ttft_p50_s": histogram_quantile(engine_ttft, 0.5) / time_scale,
        "engine_ttft_p90_s": histogram_quantile(engine_ttft, 0.9) / time_scale,
        "output_tok_s": sum(o.completion_tokens for o in ok) / sim_span,
        "req_s": len(ok) / sim_span,
        "sim_seconds": sim_span, "wall_seconds": wall,
        # Simulated seconds from the last arrival to the last completion: long when the fleet fell behind.
        "drain_s": (max((o.end or 0.0) for o in outcomes) - outcomes[-1].scheduled) / time_scale,
        "implied_load": work / (workload.engines * workload.span_s),
        "imbalance": max(processed) / mean_processed if mean_processed else 0.0,
        "imbalance_computed": max(computed) / mean_computed if mean_computed else 0.0,
        "per_engine": [{"prompt": d.prompt, "generated": d.generated, "cached": d.cached} for d in deltas],
        "send_lateness_ms": {"p50": percentile(lateness, 50), "p99": percentile(lateness, 99),
                             "max": max(lateness) if lateness else 0.0},
        "cpu_cores": cpu,
    }


def run_policy(policy: str, fleet: Fleet, workload: Workload, prompts: list[str], args: argparse.Namespace,
               state: Path) -> dict[str, Any]:
    fleet.flush()
    frontend: Any
    if policy == "sglang":
        frontend = SglangFrontend(fleet, state)
    elif policy in DYNAMO_POLICIES:  # its own engines (mockers) with our engines' timing and limits
        frontend = dynamo_live.DynamoFrontend(policy, args.engines, MODEL, fleet.info, fleet.table_path,
                                              fleet.model_dir, args.time_scale, state)
    else:
        frontend = InferbusFrontend(policy, fleet, state, args.placement_timeout_ms, args.time_scale,
                                    args.placement_patience_ms)
    print(f"\n{LABELS[policy]}: starting front end…", flush=True)
    frontend.start()
    try:
        time.sleep(2)  # first load reports reach the router
        before = fleet.counters()
        pids = {**{p.name: p.pid for p in fleet.processes}, **frontend.pids()}
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        own_before = own_cpu_seconds()
        machine_before = machine_busy_seconds()
        outcomes, wall = asyncio.run(replay(frontend, workload, prompts, args.time_scale, LABELS[policy]))
        cpu = {name: (cpu_seconds(pid) - cpu_before[name]) / wall for name, pid in pids.items()}
        cpu["load-generator"] = (own_cpu_seconds() - own_before) / wall
        machine = (machine_busy_seconds() - machine_before) / wall
        deadline = time.monotonic() + 30
        while not fleet.idle() and time.monotonic() < deadline:
            time.sleep(0.2)
        after = fleet.counters()
        if policy in DYNAMO_POLICIES:
            before, after = dynamo_counters(frontend, outcomes, workload, args.time_scale)
        placements = frontend.counters()
        queue_wait = frontend.queue_wait()
    finally:
        frontend.stop()
    cpu_total = sum(cpu.values())
    # Anything else on the machine (other benchmarks, tests) competes for the same cores.
    others = max(0.0, machine - cpu_total)
    result = summarise(outcomes, wall, args.time_scale, workload, before, after,
                       {k: round(v, 3) for k, v in sorted(cpu.items())}, args.gpu, args.tp)
    if queue_wait:  # wall seconds → simulated
        result["platform_queue_wait_s"] = {k: v / args.time_scale for k, v in queue_wait.items()}
    router_cpu_s = sum(v for k, v in cpu.items() if not k.startswith(NOT_ROUTER)) * wall
    result.update(policy=policy, label=LABELS[policy], cpu_total_cores=cpu_total, placements=placements,
                  machine_busy_cores=machine, other_processes_cores=others,
                  router_cpu_ms_per_request=1000 * router_cpu_s / max(1, result["ok"]))
    if policy in DYNAMO_POLICIES:
        result.update(getattr(frontend, "summary", {}))
    print(f"{LABELS[policy]}: hit {result['hit_rate']:.1%} (engines {result['hit_rate_engines']:.1%}), "
          f"TTFT p50/p90 {result['ttft_p50_s']:.2f}/{result['ttft_p90_s']:.2f} s, TPOT p90 {result['tpot_p90_ms']:.0f} "
          f"ms, imbalance {result['imbalance']:.2f}, errors {result['errors']}, CPU {cpu_total:.2f} cores "
          f"(machine {machine:.2f} of {os.cpu_count()}, others {others:.2f})"
          + (f", placements {placements}" if placements else ""), flush=True)
    return result


def dynamo_counters(frontend: Any, outcomes: list[Outcome], workload: Workload,
                    time_scale: float) -> tuple[list[EngineCounters], list[EngineCounters]]:
    """Per-worker counters of a Dynamo run, from its frontend's log, and each outcome's cached tokens.

    The mocker reports no cached tokens in the response's usage. In KV mode the router logs the
    blocks it found cached on the chosen worker (`overlap_blocks`, from the mockers' KV events): that
    is the hit count. Round-robin has no index: its hits are estimated by replaying each worker's
    requests, in the order they were sent, through an LRU cache of the worker's KV size."""
    records = frontend.records()
    block = int(frontend.block_size)
    workers = sorted({r["worker"] for r in records.values() if "worker" in r})
    by_id = {o.response_id.removeprefix("cmpl-"): o for o in outcomes if o.response_id}
    kv_mode = frontend.name == "dynamo_kv"
    caches: dict[str, OrderedDict[int, None]] = {}
    capacity_blocks = workload.kv_capacity_tokens // traces.MOONCAKE_BLOCK_TOKENS
    ordered = sorted(((o, records[rid]) for rid, o in by_id.items() if rid in records and "worker" in records[rid]),
                     key=lambda pair: pair[0].sent)
    for outcome, record in ordered:
        if kv_mode:
            outcome.cached_tokens = min(outcome.prompt_tokens, block * record.get("overlap_blocks", 0))
        else:
            cache = caches.setdefault(record["worker"], OrderedDict())
            outcome.cached_tokens = traces.replay_blocks(workload.requests[outcome.index], cache, capacity_blocks)
    counters = {w: EngineCounters(0.0, 0.0, 0.0, {}) for w in workers}
    for outcome, record in ordered:
        c = counters[record["worker"]]
        c.prompt += record["input_tokens"]
        c.generated += record["output_tokens"]
        c.cached += outcome.cached_tokens
    ttft = [r["ttft_ms"] / 1000 / time_scale for _, r in ordered if r.get("ttft_ms") == r.get("ttft_ms")]
    frontend.summary = {
        "frontend_ttft_p50_s": percentile(ttft, 50), "frontend_ttft_p90_s": percentile(ttft, 90),
        "hit_rate_source": "router's overlap blocks" if kv_mode else "estimated: LRU replay of its placements",
        "requests_in_log": len(ordered),
    }
    before = [EngineCounters(0.0, 0.0, 0.0, {}) for _ in workers]
    return before, [counters[w] for w in workers]


# ---- reporting ----------------------------------------------------------------------------------------

def markdown(results: dict[str, Any]) -> str:
    w = results["workload"]
    cfg = results["config"]
    lines = [
        f"# Routing benchmark ({results['when']}, {results['machine']['cpus']} CPUs)",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Trace `{Path(cfg.get('trace', 'mooncake_synthetic.jsonl')).name}`: {w['requests']} requests "
        f"({w['families_kept']} prefix families"
        f"{'' if w['families_kept'] == w['families_total'] else ' of ' + str(w['families_total'])}, "
        f"{w['dropped_too_long']} longer than the context window left out), mean input {w['mean_input_tokens']:.0f} / "
        f"output {w['mean_output_tokens']:.0f} tokens, arrivals ×{w['arrival_factor']:.3f} → {w['rate_req_s']:.2f} "
        f"req/s over {w['span_s']:.0f} simulated s.",
        f"Fleet: {cfg['engines']} × simulated {cfg['gpu']} TP{cfg['tp']}, {w['kv_capacity_tokens']:,} KV tokens each, "
        f"time scale {cfg['time_scale']} (all latencies in simulated seconds = client wall time / time scale).",
        "",
        f"Hit-rate references: ceiling (infinite cache) **{w['ceiling_hit_rate']:.1%}**; perfect affinity with these "
        f"engines' KV as LRU caches **{w['bound_hit_rate']:.1%}**; round-robin with the same caches "
        f"{w['round_robin_lru_hit_rate']:.1%}. Load: {w['target_load']:.0%} of the fleet at the affinity bound's hits "
        f"({w['load_no_cache']:.0%} with no cache hits).",
        "",
        "| policy | hit rate (engines) | of ceiling | TTFT p50 / p90 / p99 s | TPOT p90 ms | output tok/s | req/s | "
        "imbalance (computed) | implied load | drain s | placed by router | errors | CPU cores | router CPU ms/req |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["policies"]:
        lines.append(
            f"| {r['label']} | {r['hit_rate']:.1%} ({r['hit_rate_engines']:.1%}) | {r['hit_rate_vs_ceiling']:.0%} | "
            f"{r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} / {r.get('ttft_p99_s', float('nan')):.2f} | "
            f"{r['tpot_p90_ms']:.0f} | {r['output_tok_s']:.0f} | "
            f"{r['req_s']:.2f} | {r['imbalance']:.2f} ({r['imbalance_computed']:.2f}) | {r['implied_load']:.0%} | "
            f"{r.get('drain_s', 0):.0f} | {placed_share(r)} | {r['errors']} | {r['cpu_total_cores']:.2f} | "
            f"{r.get('router_cpu_ms_per_request', float('nan')):.1f} |")
    lines += ["", "Columns: hit rate = Σ cached / Σ prompt tokens from the responses (the engines' own counters in "
              "brackets); of ceiling = hit rate / infinite-cache ceiling; TTFT and TPOT in simulated seconds; "
              "imbalance = max/mean over engines of prompt + generated tokens (computed: uncached prompt + generated); "
              "implied load = engine time the requests cost at the hits they got / fleet time over the arrival span; "
              "drain = simulated seconds from the last arrival to the last completion; placed by router = share of "
              "requests queued for the worker the router chose within the placement timeout; router CPU ms/req = "
              "CPU of the router's processes (all but engines, mockers and the load generator: for inferbus "
              "NATS, Redis, router, gateway, billing and workers) over the replay, per completed request.",
              "",
              "Dynamo rows: Dynamo 1.6.1's frontend over one mocker per engine, timed by the same profile table with "
              "the same KV pool, block size, chunked-prefill budget and batch limit as our engines. The mocker puts no "
              "cached tokens in the usage: the KV router's hits are the blocks its index found on the chosen worker "
              "(`overlap_blocks` in the frontend's log); round-robin's are estimated by an LRU replay of its "
              "placements. Its per-worker tokens come from the frontend's log (`decode_worker_id`).",
              "", "Targets: hit rate ≥ 90% of the ceiling and ≥ Dynamo KV's, imbalance ≤ 1.15, TTFT p90 below "
              "sglang-router's and ≤ 0.8 × Dynamo KV's.", ""]
    verdicts = results.get("verdict")
    if verdicts:
        lines += ["| inferbus affinity | value | target | met |", "| --- | ---: | ---: | --- |"]
        for v in verdicts:
            lines.append(f"| {v['what']} | {v['value']} | {v['target']} | {'yes' if v['met'] else 'no'} |")
        lines.append("")
    lines += ["Where TTFT goes, and the client checked against each front end (simulated s; engine = arrival at "
              "the engine → first token, from the engines' histograms, coarse buckets; Dynamo's frontend's own TTFT "
              "per request from its log; platform queue wait = gateway accept → engine submit, from the gateway's; "
              "headers = request sent → response headers read by the client: inferbus answers with them once the "
              "request is admitted and queued):",
              "",
              "| policy | client TTFT p50 / p90 | client headers p50 / p90 | engine TTFT p50 / p90 | "
              "front end's TTFT p50 / p90 | platform queue wait p50 / p90 |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    nan = float("nan")
    for r in results["policies"]:
        wait = r.get("platform_queue_wait_s")
        own = (f"{r['frontend_ttft_p50_s']:.2f} / {r['frontend_ttft_p90_s']:.2f}" if "frontend_ttft_p50_s" in r
               else "n/a")
        lines.append(f"| {r['label']} | {r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} | "
                     f"{r.get('headers_p50_s', nan):.2f} / {r.get('headers_p90_s', nan):.2f} | "
                     f"{r.get('engine_ttft_p50_s', nan):.2f} / {r.get('engine_ttft_p90_s', nan):.2f} | {own} | "
                     + (f"{wait['p50']:.2f} / {wait['p90']:.2f} |" if wait else "n/a |"))
    lines += ["", "CPU use per process (cores, averaged over the replay):", ""]
    for r in results["policies"]:
        top = sorted(r["cpu_cores"].items(), key=lambda kv: -kv[1])
        lines.append(f"- {r['label']}: " + ", ".join(f"{k} {v:.2f}" for k, v in top if v >= 0.01)
                     + f"; whole machine {r.get('machine_busy_cores', 0):.2f} busy (other processes "
                     f"{r.get('other_processes_cores', 0):.2f}); client send lateness p50/p99 "
                     f"{r['send_lateness_ms']['p50']:.1f}/{r['send_lateness_ms']['p99']:.1f} ms wall")
    skipped = results.get("skipped")
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in skipped.items())]
    return "\n".join(lines) + "\n"


def placed_share(result: dict[str, Any]) -> str:
    """Share of requests the gateway queued for the worker the router chose (the rest were too short
    to ask about, or their answer came after they had gone to the shared queue: how many, in brackets)."""
    p = result.get("placements") or {}
    worker = p.get('inferbus_placements_total{target="worker"}', 0.0)
    anywhere = p.get('inferbus_placements_total{target="any"}', 0.0)
    late = p.get('inferbus_placement_seconds_count{outcome="late"}')
    share = f"{worker / (worker + anywhere):.0%}" if worker + anywhere else "n/a"
    return share if late is None else f"{share} ({late:.0f} late)"


def verdict(results: dict[str, Any]) -> list[dict[str, Any]]:
    by = {r["policy"]: r for r in results["policies"]}
    ours = by.get("affinity")
    if ours is None:
        return []
    out = [
        {
            "what": "hit rate / ceiling",
            "value": f"{ours['hit_rate_vs_ceiling']:.0%}",
            "target": "≥ 90%",
            "met": ours["hit_rate_vs_ceiling"] >= 0.9,
        },
        {
            "what": "hit rate / finite-cache bound",
            "value": f"{ours['hit_rate_vs_bound']:.0%}",
            "target": "(reference)",
            "met": ours["hit_rate_vs_bound"] >= 0.9,
        },
        {
            "what": "load imbalance",
            "value": f"{ours['imbalance']:.2f}",
            "target": "≤ 1.15",
            "met": ours["imbalance"] <= 1.15,
        },
    ]
    if "dynamo_kv" in by:
        theirs = by["dynamo_kv"]
        out.append({"what": "hit rate vs Dynamo KV", "value": f"{ours['hit_rate']:.1%}",
                    "target": f"≥ {theirs['hit_rate']:.1%}", "met": ours["hit_rate"] >= theirs["hit_rate"]})
        out.append({"what": "TTFT p90 vs Dynamo KV", "value": f"{ours['ttft_p90_s']:.2f} s",
                    "target": f"≤ {0.8 * theirs['ttft_p90_s']:.2f} s (0.8×)",
                    "met": ours["ttft_p90_s"] <= 0.8 * theirs["ttft_p90_s"]})
    if "sglang" in by:
        out.append(
            {
                "what": "TTFT p90 vs sglang-router",
                "value": f"{ours['ttft_p90_s']:.2f} s",
                "target": f"< {by['sglang']['ttft_p90_s']:.2f} s",
                "met": ours["ttft_p90_s"] < by["sglang"]["ttft_p90_s"],
            }
        )
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["policies"]
    labels = [r["label"].replace(" ", "\n", 1) for r in rows]
    colours = ["#8da0cb" if r["policy"] != "affinity" else "#fc8d62" for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    w = results["workload"]
    panels = [
        (
            axes[0][0],
            [r["hit_rate"] * 100 for r in rows],
            "prefix-cache hit rate (%)",
            [
                (w["ceiling_hit_rate"] * 100, "ceiling (infinite cache)"),
                (w["bound_hit_rate"] * 100, "perfect affinity, this KV"),
            ],
        ),
        (axes[0][1], [r["ttft_p90_s"] for r in rows], "TTFT p90 (s, p50 hatched)", []),
        (axes[1][0], [r["tpot_p90_ms"] for r in rows], "TPOT p90 (ms)", []),
        (axes[1][1], [r["imbalance"] for r in rows], "load imbalance (max/mean tokens)", [(1.15, "target 1.15")]),
    ]
    for ax, values, title, refs in panels:
        ax.bar(labels, values, color=colours)
        for x, v in enumerate(values):
            ax.text(x, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
        for y, text in refs:
            ax.axhline(y, ls="--", lw=1, color="grey")
            ax.text(len(values) - 0.5, y, text, ha="right", va="bottom", fontsize=7, color="grey")
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=7)
    axes[0][1].bar(labels, [r["ttft_p50_s"] for r in rows], color="none", edgecolor="black", hatch="//")
    cfg = results["config"]
    fig.suptitle(f"Mooncake synthetic, {w['requests']} requests at {w['target_load']:.0%} load, "
                 f"{cfg['engines']}× sim {cfg['gpu']} TP{cfg['tp']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main ---------------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    policies = list(args.policies)
    ensure_packages(["matplotlib"] + (["sglang_router"] if "sglang" in policies else []))
    skipped: dict[str, str] = {}
    if any(p in DYNAMO_POLICIES for p in policies):
        dynamo_env.ensure()
    if any(p in INFERBUS_POLICIES for p in policies) and "INFERBUS_ROUTER_POLICY" not in router_policies():
        for p in [p for p in policies if p in INFERBUS_POLICIES and p != "least_loaded"]:
            if not args.force:
                skipped[p] = "the router has no INFERBUS_ROUTER_POLICY yet (least-loaded only)"
                policies.remove(p)
    workload = build(str(args.trace), engines=args.engines, gpu=args.gpu, tp=args.tp,
                     kv_capacity_tokens=args.kv_capacity_tokens, load=args.load,
                     sample_families=args.sample_families, limit=args.requests, seed=args.seed)
    summary = workload.summary()
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}), flush=True)
    print(
        f"each policy replays {workload.span_s:.0f} simulated s = {workload.span_s * args.time_scale:.0f} wall s",
        flush=True,
    )
    print("building prompts…", flush=True)
    prompts = [traces.mooncake_prompt(r) for r in workload.requests]
    state = Path(tempfile.mkdtemp(prefix="inferbus-bench-routing-"))
    fleet = Fleet(args, state)
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": host.platform()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python -m bench.routing " + " ".join(sys.argv[1:]),
        "config": {"engines": args.engines, "gpu": args.gpu, "tp": args.tp, "time_scale": args.time_scale,
                   "load": args.load, "placement_timeout_ms": args.placement_timeout_ms,
                   "placement_patience_ms": args.placement_patience_ms,
                   "sample_families": args.sample_families, "requests": args.requests, "seed": args.seed,
                   "busy_cores": args.busy_cores,
                   "trace": str(args.trace)},
        "workload": summary, "policies": [], "skipped": skipped,
    }
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy_cores)]
    try:
        fleet.start()
        info = fleet.server_info()
        results["config"]["engine_info"] = {k: info.get(k) for k in (
            "max_total_num_tokens", "page_size", "chunked_prefill_size", "max_running_requests", "version", "gpu",
            "tp_size", "time_scale")}
        for policy in policies:
            results["policies"].append(run_policy(policy, fleet, workload, prompts, args, state))
    finally:
        for process in busy:
            process.kill()
        fleet.stop()
        if not args.keep_logs:
            import shutil

            shutil.rmtree(state, ignore_errors=True)
        else:
            print(f"logs in {state}/", flush=True)
    results["verdict"] = verdict(results)
    return results


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGTERM, _terminate)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="Mooncake JSONL trace (default: mooncake_synthetic.jsonl, found as tools.capacity.traces.find "
        "does, e.g. in INFERBUS_TRACES_DIR)",
    )
    parser.add_argument("--engines", type=int, default=4, help="simulated engines (one worker each)")
    parser.add_argument("--gpu", default="H100", choices=["H100", "H200"], help="simulated GPU")
    parser.add_argument("--tp", type=int, default=2, choices=[1, 2, 4, 8], help="GPUs per engine")
    parser.add_argument("--kv-capacity-tokens", type=int, default=None, help="KV pool per engine (default: the GPU's)")
    parser.add_argument("--time-scale", type=float, default=0.5,
                        help="engine wall seconds per simulated second (0.5: twice as fast as real time)")
    parser.add_argument("--load", type=float, default=0.8,
                        help="fleet utilisation to scale arrivals to, at the perfect-affinity hit rate")
    parser.add_argument("--requests", type=int, default=None, help="replay only the first N selected requests")
    parser.add_argument("--sample-families", type=float, default=0.25,
                        help="keep this random share of prefix families (whole families, so reuse stays intact; "
                             "1 = the whole trace, about 4x longer)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the family sample")
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), choices=ALL_POLICIES,
                        help="policies to run, in order (dynamo_*: Dynamo 1.6.1's frontend over mocker engines, "
                             "installed into .venv-dynamo on first use)")
    parser.add_argument("--placement-timeout-ms", type=float, default=200.0,
                        help="INFERBUS_PLACEMENT_TIMEOUT_MS of the gateway for the inferbus policies")
    parser.add_argument("--placement-patience-ms", type=float, default=None,
                        help="INFERBUS_PLACEMENT_PATIENCE_MS of the gateway (default: the gateway's; 0 waits only the "
                             "timeout, as gateways did before they waited for a slow router)")
    parser.add_argument("--busy-cores", type=int, default=0,
                        help="run this many processes that only spin, for the whole run: the platforms compete with "
                             "them for the CPU, as with a host's other work or a pod's CPU limit (1 on a 2-core "
                             "machine takes about one core)")
    parser.add_argument("--force", action="store_true",
                        help="run inferbus policies even if the router does not list INFERBUS_ROUTER_POLICY")
    parser.add_argument("--keep-logs", action="store_true", help="keep every process's log (path printed at the end)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="where routing.{json,md,png} go")
    parser.add_argument("--name", default="routing", help="result file name (without extension)")
    args = parser.parse_args()
    args.trace = traces.find(args.trace or "mooncake_synthetic.jsonl")
    results = run(args)
    write_results(args.out, args.name, results, markdown)
    if results["policies"]:
        plot(results, args.out / f"{args.name}.png")
        print(f"plot: {args.out / (args.name + '.png')}")


if __name__ == "__main__":
    main()
