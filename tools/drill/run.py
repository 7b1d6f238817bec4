"""Run a drill against a running local platform: bounded load, one fault, the report.

The platform is the one `inferbus up` runs from a state dir (its `platform.json`: gateways,
process ids, the operator's NATS credentials, Redis). The load is streamed chat completions through
the official OpenAI SDK from a few concurrent clients spread over the zones' gateways; a client
retries a request that failed with a connection error, a 429 or a 5xx (as the SDK's own retries
would, waiting what the server's retry-after asks, but on the next gateway), up to `max_attempts`
in all. The fault is made the way the failure happens: a process killed (SIGKILL), stopped
(SIGSTOP, a hang), or a GPU told to hang;
the launcher's supervisor brings killed processes back, as a deployment's would.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import openai

from inferbus.bus import connection as bus
from proto import messages as m
from proto import subjects

from .report import Attempt, Call, DrillReport, LedgerEvent, summarize

MODEL = "meta-llama/Llama-3.3-70B-Instruct"
TENANT = "demo"


@dataclass
class Platform:
    """What `platform.json` says about a running platform (re-read: restarted processes get new pids)."""

    state_dir: Path
    _cached: dict | None = None
    _read_at: float = 0.0

    def data(self) -> dict:
        """The file's content, re-read at most every 0.2 s."""
        now = time.monotonic()
        if self._cached is None or now - self._read_at > 0.2:
            try:
                self._cached = json.loads((self.state_dir / "platform.json").read_text())
                self._read_at = now
            except (OSError, ValueError):
                if self._cached is None:
                    raise
        return self._cached

    @property
    def zones(self) -> list[str]:
        return list(self.data().get("zones") or [])

    def gateways(self) -> list[str]:
        data = self.data()
        return list((data.get("gateway_urls") or {}).values()) or [str(data["gateway_url"])]

    def pids(self) -> dict[str, int]:
        return dict(self.data()["processes"])

    def detail(self, name: str) -> str:
        return str((self.data().get("details") or {}).get(name, ""))

    def nats_servers(self) -> list[str]:
        data = self.data()
        user, password = data.get("nats_user") or "", data.get("nats_password") or ""
        servers = bus.server_list(str(data["nats_url"]))
        if user:  # nats:// or, on a platform started with --tls, tls://
            servers = [s.replace("://", f"://{user}:{password}@", 1) for s in servers]
        return servers

    def nats_tls(self) -> ssl.SSLContext | None:
        """On a platform started with --tls: a context verifying its servers against its CA."""
        ca = self.data().get("nats_tls_ca")
        return ssl.create_default_context(cafile=str(ca)) if ca else None

    def workers(self) -> list[str]:
        return sorted(name for name in self.pids() if name.startswith("worker-"))

    def workers_of(self, role: str) -> list[str]:
        """The workers of a prefill/decode role (`inferbus up --prefill N --decode M`), by their detail."""
        return [name for name in self.workers() if f"({role})" in self.detail(name)]

    def zone_of(self, name: str) -> str:
        """The zone of a process of a multi-zone platform ("" for a platform-wide one)."""
        if name.startswith(("worker-", "engine-")):
            detail = self.detail("worker-" + name.split("-", 1)[1])
            return detail.rsplit("zone ", 1)[1] if "zone " in detail else ""
        suffix = name.rsplit("-", 1)[-1]
        return suffix if suffix in self.zones else ""


@dataclass
class Fault:
    """What a drill broke: processes to see replaced (new pid) before it counts as recovered, and
    what to do after `hold_s` (a stopped process is continued)."""

    description: str
    replaced: list[str] = field(default_factory=list)
    old_pids: dict[str, int] = field(default_factory=dict)
    undo: Callable[[], None] | None = None
    hold_s: float = 0.0
    in_flight: int | None = None  # requests the broken workers' engines held at the fault (None: not measured)
    at: float = field(default_factory=time.monotonic)  # when it broke (after any wait for live work)


def _kill(platform: Platform, names: list[str], description: str) -> Fault:
    pids = platform.pids()
    for name in names:
        os.kill(pids[name], signal.SIGKILL)
    return Fault(description, replaced=names, old_pids={n: pids[n] for n in names})


def _needs_zones(platform: Platform, kind: str) -> None:
    if len(platform.zones) < 2:
        raise SystemExit(f"drill {kind} needs a multi-zone platform: inferbus up --zones 3")


def _redis_primary(platform: Platform) -> str:
    """The process that is the Redis primary now (Sentinel's answer)."""
    from redis.sentinel import Sentinel

    from inferbus.runtime.redis_conn import parse_sentinel_url

    parsed = parse_sentinel_url(str(platform.data()["redis_url"]))
    if parsed is None:
        raise SystemExit("drill redis-failover needs Redis with sentinels: inferbus up --zones 3")
    sentinel = Sentinel(list(parsed.sentinels), sentinel_kwargs={"password": parsed.password, "socket_timeout": 1})
    _, port = sentinel.discover_master(parsed.service)
    for name in platform.pids():
        if name.startswith("redis-") and f":{port}/" in platform.detail(name):
            return name
    raise SystemExit(f"no redis process of this platform listens on the primary's port {port}")


def _engine_requests(url: str) -> int:
    """The requests a simulated engine holds now (running, waiting, or in a PD queue); 0 when it
    does not answer."""
    loads = (_http_json(url + "/v1/loads?include=all") or {}).get("loads") or []
    return sum(entry.get("num_running_reqs", 0) + entry.get("num_waiting_reqs", 0) for entry in loads)


def _engine_of(platform: Platform, worker: str) -> str:
    return platform.detail("engine-" + worker.split("-", 1)[1])


def freeze_while_busy(platform: Platform, workers: list[str], timeout_s: float = 15.0) -> int:
    """SIGSTOP `workers` at a moment their engines hold requests, so the fault that follows hits
    live streams (a stopped worker finishes none; its engine's requests wait for it). Returns the
    requests held then; 0 (workers running again) when their engines stayed idle for `timeout_s`."""
    pids = platform.pids()
    deadline = time.monotonic() + timeout_s
    while True:
        for name in workers:
            os.kill(pids[name], signal.SIGSTOP)
        held = sum(_engine_requests(_engine_of(platform, name)) for name in workers)
        if held or time.monotonic() > deadline:
            break
        for name in workers:
            os.kill(pids[name], signal.SIGCONT)
        time.sleep(0.02)
    if not held:
        for name in workers:
            os.kill(pids[name], signal.SIGCONT)
    return held


def wait_busy(url: str, timeout_s: float = 15.0) -> int:
    """The requests a simulated engine holds, once it holds any (0 after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not (held := _engine_requests(url)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return held


def _kill_role(platform: Platform, kind: str, role: str, wait_busy_s: float = 15.0, freeze_s: float = 0.5) -> Fault:
    """Kill the first worker of `role` with its engine (a pod lost) while its engine holds work:
    a prefill worker mid-prefill or mid-transfer, a decode worker mid-stream. The engine is
    frozen (SIGSTOP) the moment it is seen holding requests and killed `freeze_s` later, so what
    it held cannot finish in between (a prefill half lasts a fraction of a second) and what its
    worker hands it meanwhile dies with it, as on a GPU that stalls before its pod is lost."""
    workers = platform.workers_of(role)
    if len(workers) < 2:
        raise SystemExit(f"drill {kind} needs a disaggregated platform with at least 2 {role} workers: "
                         "inferbus up --prefill 2 --decode 2")
    victim = workers[0]
    engine = "engine-" + victim.split("-", 1)[1]
    held = wait_busy(platform.detail(engine), wait_busy_s)
    os.kill(platform.pids()[engine], signal.SIGSTOP)
    time.sleep(freeze_s)
    what = "mid-transfer" if role == "prefill" else "mid-stream"
    fault = _kill(platform, [victim, engine], f"SIGKILL {victim} and {engine} ({role}, {what}; "
                                              f"its engine frozen {freeze_s:g} s before)")
    fault.in_flight = held
    return fault


def make_fault(kind: str, platform: Platform, *, hang_s: float) -> Fault:
    if kind in ("prefill-kill", "decode-kill"):
        return _kill_role(platform, kind, kind.split("-", 1)[0])
    workers = platform.workers()
    first = workers[0]
    index = first.split("-", 1)[1]
    if kind == "worker-kill":
        held = freeze_while_busy(platform, [first])
        fault = _kill(platform, [first], f"SIGKILL {first}")
        fault.in_flight = held
        return fault
    if kind == "worker-hang":
        pid = platform.pids()[first]
        held = freeze_while_busy(platform, [first])
        os.kill(pid, signal.SIGSTOP)  # (again, when its engine stayed idle)
        return Fault(f"SIGSTOP {first} for {hang_s:g} s", undo=lambda: os.kill(pid, signal.SIGCONT), hold_s=hang_s,
                     in_flight=held)
    if kind == "gpu-death":
        engine = f"engine-{index}"
        held = wait_busy(platform.detail(engine))
        pids = platform.pids()
        request = urllib.request.Request(platform.detail(engine) + "/fault", data=b'{"mode": "hang"}', method="POST",
                                         headers={"content-type": "application/json"})
        urllib.request.urlopen(request, timeout=5).close()
        return Fault(f"{engine}'s GPU hangs (POST /fault)", replaced=[first, engine],
                     old_pids={first: pids[first], engine: pids[engine]}, in_flight=held)
    if kind == "router-kill":
        routers = sorted(n for n in platform.pids() if n == "router" or n.startswith("router-"))
        return _kill(platform, routers[:1], f"SIGKILL {routers[0]}")
    if kind == "billing-kill":
        return _kill(platform, ["billing"], "SIGKILL billing")
    _needs_zones(platform, kind)
    zone = platform.zones[0]
    if kind == "nats-node-kill":
        return _kill(platform, [f"nats-{zone}"], f"SIGKILL nats-{zone}")
    if kind == "redis-failover":
        primary = _redis_primary(platform)
        return _kill(platform, [primary], f"SIGKILL {primary} (the Redis primary)")
    if kind == "zone-loss":
        names = [n for n in platform.pids() if platform.zone_of(n) == zone]
        held = freeze_while_busy(platform, [n for n in names if n.startswith("worker-")])
        fault = _kill(platform, names, f"zone {zone} lost: SIGKILL " + ", ".join(sorted(names)))
        fault.in_flight = held
        return fault
    raise SystemExit(f"unknown drill kind {kind!r}")


KINDS = ("worker-kill", "worker-hang", "gpu-death", "nats-node-kill", "zone-loss", "redis-failover", "router-kill",
         "billing-kill", "prefill-kill", "decode-kill")


# ---- load ----------------------------------------------------------------------------------------


async def _attempt(client: openai.AsyncOpenAI, rng: random.Random, max_tokens: int,
                   prompt_words: tuple[int, int] = (8, 40)) -> Attempt:
    started = time.monotonic()
    attempt = Attempt("", 0, started, started)
    words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "zone", "drill"))
                     for _ in range(rng.randint(*prompt_words)))
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": words}], max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True})
        attempt.request_id = stream.response.headers.get("x-request-id", "")
        async for chunk in stream:
            if chunk.usage is not None:
                attempt.completion_tokens = chunk.usage.completion_tokens
                attempt.prompt_tokens = chunk.usage.prompt_tokens
        attempt.status = 200 if attempt.completion_tokens is not None else 0
    except openai.APIStatusError as error:
        attempt.status = error.status_code
        attempt.request_id = error.response.headers.get("x-request-id", "") or attempt.request_id
        try:
            attempt.retry_after = float(error.response.headers.get("retry-after", "0"))
        except ValueError:
            pass
    except openai.APIError as error:  # an error event in the stream, or a broken connection
        code = getattr(error, "code", None)
        attempt.status = int(code) if isinstance(code, int) or (isinstance(code, str) and code.isdigit()) else \
            (0 if isinstance(error, openai.APIConnectionError) else 500)
    attempt.finished = time.monotonic()
    return attempt


MAX_RETRY_AFTER_S = 120.0  # the OpenAI SDK honours a server's retry-after up to two minutes


def retry_wait(retry: int, retry_after: float) -> float:
    """Seconds before retry number `retry` (0 first): the server's retry-after when it sent one, as
    the OpenAI SDK waits; otherwise exponential backoff from 0.25 s, at most 2 s."""
    if 0 < retry_after <= MAX_RETRY_AFTER_S:
        return retry_after
    return min(2.0, 0.25 * 2 ** retry)


async def _client_loop(gateways: Callable[[], list[str]], key: str, until: float, calls: list[Call], seed: int,
                       max_attempts: int, max_tokens: int, origin: float,
                       prompt_words: tuple[int, int] = (8, 40)) -> None:
    rng = random.Random(seed)
    clients: dict[str, openai.AsyncOpenAI] = {}
    while time.monotonic() < until:
        call = Call()
        calls.append(call)
        urls = gateways()
        first = rng.randrange(len(urls))
        for n in range(max_attempts):
            url = urls[(first + n) % len(urls)]
            client = clients.get(url)
            if client is None:
                client = clients[url] = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
            attempt = await _attempt(client, rng, max_tokens, prompt_words)
            attempt.started -= origin
            attempt.finished -= origin
            call.attempts.append(attempt)
            if attempt.status == 200 or not (attempt.status == 0 or attempt.status == 429 or attempt.status >= 500):
                break
            await asyncio.sleep(retry_wait(n, attempt.retry_after))
    for client in clients.values():
        await client.close()


# ---- what the platform says ------------------------------------------------------------------


def _http_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return json.load(response)
    except urllib.error.HTTPError as error:
        try:
            return json.load(error)
        except ValueError:
            return None
    except (OSError, ValueError):  # not answering (yet), or not JSON
        return None


def _migrations(gateway: str) -> float:
    try:
        with urllib.request.urlopen(gateway + "/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:  # a gateway that is down has no counter to read
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("inferbus_migrations_total"))


def platform_ready(platform: Platform, fault: Fault, workers: int) -> bool:
    """Every broken process is back (a new pid that runs), every gateway answers ready and sees
    every worker."""
    pids = platform.pids()
    for name, old in fault.old_pids.items():
        pid = pids.get(name)
        if pid is None or pid == old:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
    for gateway in platform.gateways():
        ready = _http_json(gateway + "/ready")
        if not ready or ready.get("workers", 0) < workers or ready.get("problems"):
            return False
    return True


async def read_ledger(platform: Platform, request_ids: set[str], wanted: set[str], since: float,
                      settle_s: float = 20.0) -> list[LedgerEvent]:
    """Tenant usage events of `request_ids` on the USAGE stream, waiting up to `settle_s` for
    those of `wanted` (usage waits in outboxes while NATS is away)."""
    import nats
    from nats.js.api import ConsumerConfig, DeliverPolicy

    tls = platform.nats_tls()
    nc = await nats.connect(platform.nats_servers(), connect_timeout=5, max_reconnect_attempts=3,
                            **({"tls": tls} if tls else {}))
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + settle_s
        while True:
            events: list[LedgerEvent] = []
            start = datetime.fromtimestamp(since - 5, tz=UTC)
            sub = await js.subscribe(
                subjects.usage_filter(TENANT),
                ordered_consumer=True,
                config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start),
            )
            try:
                while True:
                    msg = await sub.next_msg(timeout=1.0)
                    event = msgspec.msgpack.decode(msg.data, type=m.UsageEvent)
                    if event.billed_to == "tenant" and event.request_id in request_ids:
                        sender = subjects.usage_sender(msg.subject)
                        events.append(LedgerEvent(event.request_id, event.usage.completion_tokens,
                                                  event.usage.prompt_tokens, event.status,
                                                  ".".join(sender) if sender else ""))
            except (TimeoutError, nats.errors.TimeoutError):
                pass
            finally:
                await sub.unsubscribe()
            if wanted <= {e.request_id for e in events} or time.monotonic() > deadline:
                return events
            await asyncio.sleep(1.0)
    finally:
        await nc.close()


# ---- the drill ---------------------------------------------------------------------------------


async def run_drill(kind: str, state_dir: Path, *, api_key: str, duration_s: float = 30.0, fault_at_s: float = 5.0,
                    clients: int = 6, max_tokens: int = 24, max_attempts: int = 4, hang_s: float = 8.0,
                    recover_timeout_s: float = 60.0, say: Callable[[str], None] = lambda line: None) -> DrillReport:
    if kind not in KINDS:
        raise SystemExit(f"unknown drill kind {kind!r}: one of {', '.join(KINDS)}")
    platform = Platform(state_dir)
    workers = len(platform.workers())
    migrations_before = {g: _migrations(g) for g in platform.gateways()}
    wall_start = time.time()
    origin = time.monotonic()
    until = origin + duration_s
    calls: list[Call] = []
    say(f"drill {kind}: {clients} clients for {duration_s:g} s, fault at {fault_at_s:g} s")
    # A prefill worker is killed mid-transfer: long prompts keep the prefill engines busy for longer.
    prompt_words = (400, 1600) if kind == "prefill-kill" else (8, 40)
    loops = [asyncio.create_task(_client_loop(platform.gateways, api_key, until, calls, seed, max_attempts, max_tokens,
                                              origin, prompt_words)) for seed in range(clients)]
    await asyncio.sleep(fault_at_s)
    fault = await asyncio.to_thread(make_fault, kind, platform, hang_s=hang_s)
    fault_time = fault.at - origin
    say(f"  {fault_time:5.1f} s  fault: {fault.description}")
    if fault.undo is not None:
        await asyncio.sleep(fault.hold_s)
        fault.undo()
        say(f"  {time.monotonic() - origin:5.1f} s  fault undone")
    ready_at: float | None = None
    deadline = time.monotonic() + recover_timeout_s
    while time.monotonic() < deadline:
        if await asyncio.to_thread(platform_ready, platform, fault, workers):
            ready_at = time.monotonic() - origin
            say(f"  {ready_at:5.1f} s  every part back and ready")
            break
        await asyncio.sleep(0.25)
    await asyncio.gather(*loops)
    migrated = 0
    for gateway, before in migrations_before.items():
        after = _migrations(gateway)
        migrated += int(after - before if after >= before else after)  # a restarted gateway counts from 0
    ids = {a.request_id for call in calls if call.ok for a in call.attempts[-1:] if a.request_id}
    every = {a.request_id for call in calls for a in call.attempts if a.request_id}
    ledger = await read_ledger(platform, every, ids, wall_start, settle_s=20.0)
    notes = []
    if kind == "prefill-kill":
        retried = prefill_retries(state_dir, platform.workers_of("decode"))
        notes.append(f"prefill halves retried on another prefill worker: {retried}")
    return summarize(kind, calls, ledger, fault_at=fault_time, ready_at=ready_at, migrated=migrated,
                     in_flight_at_fault=fault.in_flight,
                     recovery="broken processes replaced, every gateway ready with every worker, "
                              "and every request since succeeding on its first attempt", notes=notes)


def prefill_retries(state_dir: Path, decode_workers: list[str]) -> int:
    """Prefill halves the decode workers tried again elsewhere, from their logs (`prefill_retried`)."""
    count = 0
    for name in decode_workers:
        try:
            text = (state_dir / "logs" / f"{name}.log").read_text(errors="replace")
        except OSError:
            continue
        count += text.count('"prefill_retried"')
    return count


def run(kind: str, state_dir: Path, **options: object) -> DrillReport:
    return asyncio.run(run_drill(kind, state_dir, **options))  # type: ignore[arg-type]

