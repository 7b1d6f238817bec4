"""Ledger ingest benchmark: how fast the billing rollup drains the usage ledger.

    python -m bench.billing [--events N] [--tenants T] [--batch B] [--out bench/results]

A fresh nats-server (file storage) and Redis are started here. N usage events (T tenants, three
API keys each, a few adapters and batches, every status, accept times spread over two days so
minute, hour and day buckets all fill) are published to the `USAGE` stream first; then the clock
starts and the billing service's own `RollupConsumer` (`usage-rollup`, in this process) drains the
stream until it is caught up: raw pulls, msgspec decode, pricing, one Lua call per tenant per
batch in one pipeline, explicit acks. The same run then replays the ledger from scratch
(`rebuild`, what `inferbus usage rebuild` does) and checks both give the published totals to the
token and the micro-dollar. CPU seconds of this process, nats-server and redis-server are read from
/proc before and after each phase. Writes billing.json and billing.md to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform as host
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import nats
import redis.asyncio as aioredis

from bench.common import percentile, write_results
from inferbus.bus import connection as bus
from inferbus.local.ports import free_port
from inferbus.local.probes import http_ok, redis_reachable
from inferbus.local.servers import nats_server_binary, redis_server_binary
from inferbus.stores import usage as u
from inferbus.stores.billing import PriceStore, UsageStore
from inferbus.stores.pricing import Prices
from proto import messages as m
from proto import subjects
from services.billing.rollup import RollupConsumer, rebuild

MODEL = "meta-llama/Llama-3.3-70B-Instruct"
STATUSES: list[Literal["completed", "cancelled", "failed"]] = ["completed", "cancelled", "failed"]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def make_events(n: int, tenants: int, now: float, rate: float | None, seed: int = 7) -> list[m.UsageEvent]:
    """`rate` requests/s in the order they were accepted (the ledger's order), or None: accept
    times scattered at random over two days (every event in its own minute bucket: the worst case)."""
    rng = random.Random(seed)
    events = []
    for i in range(n):
        t = rng.randrange(tenants)
        prompt = rng.randint(20, 4000)
        status = rng.choices(STATUSES, [0.9, 0.08, 0.02])[0]
        started = now - rng.uniform(0, 2 * 86400) if rate is None else now - (n - i) / rate
        events.append(m.UsageEvent(
            request_id=f"{i:08x}{rng.getrandbits(96):024x}", tenant=f"tenant-{t:03d}", model=MODEL,
            status=status, usage=m.Usage(prompt_tokens=prompt, completion_tokens=rng.randint(0, 800),
                                         cached_tokens=rng.randint(0, prompt)),
            started=started, finished=started + rng.uniform(0.2, 30), band=rng.choice(["premium", "standard"]),
            adapter=rng.choice([None, None, None, f"lora-{t % 5}"]), api_key_id=f"key_{t:03d}_{rng.randrange(3)}",
            batch_id=f"batch_{t % 7}" if rng.random() < 0.1 else None, worker_id="worker-1",
        ))
    return events


async def publish(nats_url: str, events: list[m.UsageEvent]) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.ensure_streams(js)
    for i, event in enumerate(events):
        # Core publishes into the stream (no ack round trip each): only the setup, not measured.
        await nc.publish(
            subjects.usage_subject(event.tenant, subjects.USAGE_FROM_OWNER, "gw"),
            m.encode(event),
            headers={"Nats-Msg-Id": event.request_id},
        )
        if i % 5000 == 4999:
            await nc.flush()
    await nc.flush()
    deadline = time.monotonic() + 120
    while (await js.stream_info(subjects.USAGE_STREAM)).state.messages < len(events):
        if time.monotonic() > deadline:
            raise SystemExit("the stream did not receive every published event")
        await asyncio.sleep(0.2)
    await nc.close()


PROBE = """
import json, sys, time, redis
client = redis.Redis.from_url(sys.argv[1])
latencies = []
stop = time.monotonic() + float(sys.argv[2])
while time.monotonic() < stop:
    start = time.perf_counter()
    client.ping()
    latencies.append(time.perf_counter() - start)
    time.sleep(0.005)
print(json.dumps(latencies))
"""


def start_probe(redis_url: str, seconds: float) -> subprocess.Popen[str]:
    """PING Redis every 5 ms from another process: what a gateway's admission call waits while
    the rollup's scripts run (a script blocks every other client until it ends)."""
    return subprocess.Popen([sys.executable, "-c", PROBE, redis_url, str(seconds)], stdout=subprocess.PIPE, text=True)


def probe_result(probe: subprocess.Popen[str]) -> dict[str, float]:
    out, _ = probe.communicate(timeout=600)
    ms = [x * 1000 for x in json.loads(out)]
    return {"pings": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "max_ms": max(ms)}


def expected_totals(events: list[m.UsageEvent], book_prices: Prices) -> dict[str, int]:
    totals = {"requests": len(events), "input_tokens": 0, "cached_tokens": 0, "output_tokens": 0, "cost_micro": 0}
    for e in events:
        totals["input_tokens"] += e.usage.prompt_tokens
        totals["cached_tokens"] += e.usage.cached_tokens
        totals["output_tokens"] += e.usage.completion_tokens
        totals["cost_micro"] += book_prices.cost_micro(e.usage.prompt_tokens, e.usage.completion_tokens,
                                                       e.usage.cached_tokens, batch=bool(e.batch_id))
    return totals


async def rolled_up_totals(store: UsageStore, start: int, end: int) -> dict[str, int]:
    tenants = await store.tenants()
    query = u.UsageQuery(start=u.floor_to(start, 86400), end=u.ceil_to(end, 86400), width="1d", limit=31)
    buckets, _ = await store.query(query, tenants)
    total = u.Totals()
    for _, groups in buckets:
        for t in groups.values():
            total.add(t)
    return {"requests": total.requests, "input_tokens": total.input_tokens, "cached_tokens": total.cached_tokens,
            "output_tokens": total.output_tokens, "cost_micro": total.cost}


async def drain(nats_url: str, store: UsageStore, prices: PriceStore, batch: int, n: int) -> float:
    nc = await nats.connect(nats_url, pending_size=256 * 1024 * 1024)
    consumer = RollupConsumer(nc, nats_url, store, prices, batch=batch, count_metrics=True)
    await consumer.open()
    started = time.perf_counter()

    async def drained() -> bool:
        return consumer.counted + consumer.duplicates >= n

    await consumer.run(done=drained)
    elapsed = time.perf_counter() - started
    await consumer.stop()
    await nc.close()
    return elapsed


async def measure(nats_url: str, redis_url: str, pids: dict[str, int], n: int, tenants: int, batch: int,
                  rate: float | None) -> dict[str, Any]:
    now = time.time()
    events = make_events(n, tenants, now, rate)
    t0 = time.perf_counter()
    await publish(nats_url, events)
    publish_s = time.perf_counter() - t0
    redis = aioredis.from_url(redis_url)
    defaults = Prices(0.60, 0.90, 0.15, 0.5)
    prices = PriceStore(redis, default=defaults)
    await prices.seed(defaults)
    store = UsageStore(redis)
    expected = expected_totals(events, defaults)
    # The service holds no ledger in memory; 200,000 live events here would make every garbage
    # collection pass slower and bill the consumer for the benchmark's own bookkeeping.
    del events
    gc.collect()

    def cpu() -> dict[str, float]:
        return {name: cpu_seconds(pid) for name, pid in pids.items()}

    idle_probe = start_probe(redis_url, 2.0)
    idle = await asyncio.to_thread(probe_result, idle_probe)
    probe = start_probe(redis_url, 4.0)
    before = cpu()
    elapsed = await drain(nats_url, store, prices, batch, n)
    after = cpu()
    busy = await asyncio.to_thread(probe_result, probe)
    first = await rolled_up_totals(store, int(now - 3 * 86400), int(now + 86400))
    first_cpu = {k: after[k] - before[k] for k in after}

    nc = await nats.connect(nats_url, pending_size=256 * 1024 * 1024)
    before = cpu()
    t0 = time.perf_counter()
    await rebuild(nc, nats_url, store, prices, batch=batch)
    rebuild_s = time.perf_counter() - t0
    after = cpu()
    await nc.close()
    replay = await rolled_up_totals(store, int(now - 3 * 86400), int(now + 86400))
    stats = await redis.info("commandstats")
    memory = await redis.info("memory")
    await redis.aclose()
    assert first == expected, (first, expected)
    assert replay == expected, (replay, expected)
    return {
        "arrival_rate_per_s": rate, "publish_s": publish_s,
        "ingest": {"seconds": elapsed, "events_per_s": n / elapsed, "cpu_s": first_cpu},
        "rebuild": {"seconds": rebuild_s, "events_per_s": n / rebuild_s,
                    "cpu_s": {k: after[k] - before[k] for k in after}},
        "totals": expected, "totals_match": True,
        "redis_ping_idle": idle, "redis_ping_during_ingest": busy,
        "redis_usec_per_evalsha": stats.get("cmdstat_evalsha", {}).get("usec_per_call"),
        "redis_used_memory_mb": memory["used_memory"] / 2**20,
    }


WORKLOADS = {
    "peak": (833.0, "accepted at the design's peak, 833 requests/s, in ledger order"),
    "scattered": (None, "accept times scattered at random over two days (a fresh bucket per event: worst case)"),
}


def markdown(r: dict[str, Any]) -> str:
    def row(workload: str, name: str, phase: dict[str, Any]) -> str:
        c = phase["cpu_s"]
        per = 1e6 / r["events"]
        return (f"| {workload} | {name} | {phase['seconds']:.2f} | **{phase['events_per_s']:,.0f}** | "
                f"{c['bench'] * per:.1f} | {c['nats'] * per:.1f} | {c['redis'] * per:.1f} |")

    lines = [
        f"# Billing ledger ingest ({r['when']}, {r['machine']['cpus']} CPUs)",
        "",
        f"Command: `python -m bench.billing --events {r['events']} --tenants {r['tenants']} --batch {r['batch']}` "
        f"(nats-server {r['nats_version']}, Redis {r['redis_version']}, both started by the benchmark for each "
        "workload; the rollup consumer runs in the benchmark's process). 1-minute load average "
        f"{r['load_average_1m']['before']:.1f} before the run, {r['load_average_1m']['after']:.1f} after.",
        "",
        "| workload | phase | seconds | events/s | consumer CPU-µs/event | nats-server CPU-µs/event | redis "
        "CPU-µs/event |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, w in r["workloads"].items():
        lines.append(row(name, "drain a pre-filled ledger (`usage-rollup`)", w["ingest"]))
        lines.append(row(name, "replay from scratch (`rebuild`)", w["rebuild"]))
    lines += ["", "Workloads: " + "; ".join(f"**{name}**: {WORKLOADS[name][1]}" for name in r["workloads"]) + ".", ""]
    for name, w in r["workloads"].items():
        t = w["totals"]
        lines.append(
            f"- {name}: both phases reproduce the published totals exactly ({t['requests']:,} requests, "
            f"{t['input_tokens']:,} input tokens of which {t['cached_tokens']:,} cached, {t['output_tokens']:,} "
            f"output, {u.usd_text(t['cost_micro'])} USD); Redis spent {w['redis_usec_per_evalsha']:.0f} µs per "
            f"ingest call (one per tenant and up to 256 events) and held {w['redis_used_memory_mb']:.0f} MB after "
            f"both phases. A PING from another process took {w['redis_ping_during_ingest']['p50_ms']:.2f} ms p50, "
            f"{w['redis_ping_during_ingest']['p99_ms']:.2f} ms p99, {w['redis_ping_during_ingest']['max_ms']:.1f} ms "
            f"max during the drain (idle: {w['redis_ping_idle']['p50_ms']:.2f} / {w['redis_ping_idle']['p99_ms']:.2f} "
            "ms).")
    lines += ["", "Target: ≥ 20,000 events/s.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--tenants", type=int, default=50)
    parser.add_argument("--batch", type=int, default=2000, help="events per pull request (two in flight)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    args = parser.parse_args()
    workloads = {}
    load_before = os.getloadavg()
    for name in args.workloads.split(","):
        workloads[name] = run_workload(args, WORKLOADS[name][0])
    load_after = os.getloadavg()
    nats_version = subprocess.run([nats_server_binary(), "--version"], capture_output=True, text=True).stdout.split()
    redis_version = subprocess.run([redis_server_binary(), "--version"], capture_output=True, text=True).stdout.split()
    results = {
        "machine": {"cpus": os.cpu_count(), "python": host.python_version(), "platform": host.platform()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "nats_version": nats_version[-1] if nats_version else "unknown",
        "redis_version": next((w.removeprefix("v=") for w in redis_version if w.startswith("v=")), "unknown"),
        "events": args.events, "tenants": args.tenants, "batch": args.batch,
        # Other work on the machine skews every number here: the 1-minute load average around the run.
        "load_average_1m": {"before": load_before[0], "after": load_after[0]},
        "workloads": workloads,
    }
    write_results(args.out, "billing", results, markdown)


def run_workload(args: argparse.Namespace, rate: float | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as state:
        nats_port, monitor, redis_port = free_port(), free_port(), free_port()
        nats_server = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(nats_port), "-m", str(monitor), "-js", "-sd", state],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        redis_server = subprocess.Popen([redis_server_binary(), "--port", str(redis_port), "--bind", "127.0.0.1",
                                         "--save", "", "--appendonly", "no", "--dir", state], stdout=subprocess.DEVNULL)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        try:
            deadline = time.monotonic() + 20
            while not (
                http_ok(f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true") and redis_reachable(redis_url)
            ):
                if time.monotonic() > deadline:
                    raise SystemExit("nats-server or redis-server did not start")
                time.sleep(0.05)
            pids = {"bench": os.getpid(), "nats": nats_server.pid, "redis": redis_server.pid}
            return asyncio.run(measure(f"nats://127.0.0.1:{nats_port}", redis_url, pids, args.events,
                                       args.tenants, args.batch, rate))
        finally:
            nats_server.terminate()
            redis_server.terminate()
            nats_server.wait()
            redis_server.wait()


if __name__ == "__main__":
    main()
