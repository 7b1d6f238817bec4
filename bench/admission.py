"""Admission benchmark: latency of the per-request Redis calls, against a Redis started here.

    python -m bench.admission [--requests N] [--concurrency C] [--tenants T] [--out bench/results]

Each request is one `Admission.admit` (EVALSHA) and one `Admission.reconcile`, timed separately
as the gateway sees them (redis-py asyncio, a BlockingConnectionPool like the gateway's):

1. sequential: one request at a time;
2. concurrent: C requests in flight on one event loop and pool, as a busy gateway would run them.

A PING round trip on the same client is the floor of any Redis call; `INFO commandstats` gives the
time Redis itself spends per script call. Every tenant has every limit set (none ever refuses), so
each call runs the whole script. Writes `admission.json` and `admission.md` to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform as host
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from bench.common import percentile, write_results
from inferbus.local.ports import free_port
from inferbus.local.probes import redis_reachable
from inferbus.local.servers import redis_server_binary
from inferbus.stores.admission import Admission, TenantLimits

LIMITS = TenantLimits(requests_per_minute=10**9, input_tokens_per_minute=10**12, output_tokens_per_minute=10**12,
                      max_concurrent=10**6, monthly_budget_usd=10.0**9)


def summary(latencies_s: list[float], elapsed_s: float | None = None) -> dict[str, float]:
    ms = [x * 1000 for x in latencies_s]
    result = {"calls": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
              "mean_ms": statistics.fmean(ms), "max_ms": max(ms)}
    if elapsed_s is not None:
        result["requests_per_s"] = len(ms) / elapsed_s
    return result


async def one_request(admission: Admission, tenant: str, admits: list[float], reconciles: list[float]) -> None:
    request_id = uuid.uuid4().hex
    start = time.perf_counter()
    decision = await admission.admit(tenant, LIMITS, request_id, 500, 256, 0.0012)
    admitted = time.perf_counter()
    assert decision.admitted, decision
    assert await admission.reconcile(tenant, request_id, 500, 120, 0.0009)
    admits.append(admitted - start)
    reconciles.append(time.perf_counter() - admitted)


async def measure(url: str, requests: int, concurrency: int, tenants: int) -> dict[str, Any]:
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=64, timeout=2, socket_timeout=2)
    redis = aioredis.Redis(connection_pool=pool)
    admission = Admission(redis)
    names = [f"bench-{i}" for i in range(tenants)]
    for name in names:  # warm up: scripts loaded, connections open, tenant state created
        await one_request(admission, name, [], [])

    pings = []
    for _ in range(requests):
        start = time.perf_counter()
        await redis.ping()
        pings.append(time.perf_counter() - start)

    await redis.config_resetstat()
    admits: list[float] = []
    reconciles: list[float] = []
    started = time.perf_counter()
    for i in range(requests):
        await one_request(admission, names[i % tenants], admits, reconciles)
    sequential_s = time.perf_counter() - started
    stats = await redis.info("commandstats")

    concurrent_admits: list[float] = []
    concurrent_reconciles: list[float] = []
    counter = iter(range(requests))

    async def client() -> None:
        for i in counter:
            await one_request(admission, names[i % tenants], concurrent_admits, concurrent_reconciles)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    concurrent_s = time.perf_counter() - started
    await redis.aclose()
    await pool.disconnect()

    evalsha = stats.get("cmdstat_evalsha", {})
    return {
        "ping": summary(pings),
        "sequential": {"admit": summary(admits, sequential_s), "reconcile": summary(reconciles, sequential_s)},
        "concurrent": {"in_flight": concurrency,
                       "admit": summary(concurrent_admits, concurrent_s),
                       "reconcile": summary(concurrent_reconciles, concurrent_s)},
        "redis_usec_per_script_call": evalsha.get("usec_per_call"),
    }


def markdown(results: dict[str, Any]) -> str:
    def row(name: str, s: dict[str, float]) -> str:
        rate = f"{s['requests_per_s']:.0f}" if "requests_per_s" in s else ""
        return f"| {name} | {s['calls']} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | {s['mean_ms']:.3f} | {rate} |"

    seq, conc = results["sequential"], results["concurrent"]
    lines = [
        f"# Admission benchmark ({results['when']}, {results['machine']['cpus']} CPUs)",
        "",
        f"Command: `python -m bench.admission` ({results['tenants']} tenants, every limit set; "
        f"Redis {results['redis_version']} on this machine, started by the benchmark).",
        "",
        "| call | calls | p50 ms | p99 ms | mean ms | requests/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        row("PING (floor of any Redis call)", results["ping"]),
        row("admit, sequential", seq["admit"]),
        row("reconcile, sequential", seq["reconcile"]),
        row(f"admit, {conc['in_flight']} in flight", conc["admit"]),
        row(f"reconcile, {conc['in_flight']} in flight", conc["reconcile"]),
        "",
        f"Redis spends {results['redis_usec_per_script_call']} µs per script call (`INFO commandstats`, "
        "sequential run, admit and reconcile together). requests/s counts admit + reconcile pairs.",
        "",
        f"With {conc['in_flight']} in flight on one event loop, a call's latency is mostly its wait for the "
        f"client's CPU: {conc['in_flight']} in flight / {2 * conc['admit']['requests_per_s']:.0f} calls/s = "
        f"{conc['in_flight'] / (2 * conc['admit']['requests_per_s']) * 1000:.2f} ms (Little's law).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000, help="admit + reconcile pairs per run")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight in the concurrent run")
    parser.add_argument("--tenants", type=int, default=100, help="tenants the requests rotate over")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="where admission.json and .md go")
    args = parser.parse_args()

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with tempfile.TemporaryDirectory() as state:
        server = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", state], stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while not redis_reachable(url):
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("redis-server did not start")
                time.sleep(0.05)
            version = subprocess.run(
                [redis_server_binary(), "--version"], capture_output=True, text=True
            ).stdout.split()
            results = asyncio.run(measure(url, args.requests, args.concurrency, args.tenants))
        finally:
            server.terminate()
            server.wait()
    results = {
        "machine": {"cpus": os.cpu_count(), "python": host.python_version(), "platform": host.platform()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "redis_version": next((w.removeprefix("v=") for w in version if w.startswith("v=")), "unknown"),
        "tenants": args.tenants,
        **results,
    }
    write_results(args.out, "admission", results, markdown)


if __name__ == "__main__":
    main()
