"""What JetStream replication (R3 on a 3-node cluster) costs the serving spine.

The spine benchmark's requests and client (bench/spine.py: streaming chat with usage, simulated
engine at zero step time, one worker, 16 output tokens, every request admitted through Redis and
billed from the usage ledger) on a single
nats-server with R1 streams, then on `inferbus up --zones 3`'s platform: a 3-node NATS cluster with
REQUESTS, USAGE and every bucket at R3, Redis behind Sentinel. Reported: TTFT at concurrency 1
(what R3 adds to a request's latency: the request publish and its ack wait for a quorum), and at a
closed-loop concurrency, requests per second and CPU-ms per request of NATS (all nodes) and of the
spine's services.

    python -m bench.replication            # results in bench/results/replication.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import write_results
from bench.spine import CLK_TCK, Endpoint, closed_loop, phase_metrics
from inferbus.local.ports import free_port
from inferbus.local.stack import Stack, StackConfig
from tools.commands.local_platform import demo_key

GROUPS = ("nats", "gateway", "router", "worker", "billing", "redis", "sentinel")


def measure(zones: int, single_seconds: float, concurrency: int, seconds: float) -> dict:
    stack = Stack(StackConfig(state_dir=Path(tempfile.mkdtemp(prefix="inferbus-bench-r3-")), gateway_port=free_port(),
                              workers=1, log_level="warning", time_scale=0.0, batch=False, zones=zones))
    stack.start(timeout=120)
    try:
        key = asyncio.run(demo_key(stack.redis_url))
        gateway = Endpoint("inferbus", stack.gateway_url + "/v1/chat/completions", {"Authorization": f"Bearer {key}"})
        # The spine benchmark's client (quick ACK, one keep-alive connection per stream), 1 s warm-up each.
        single = phase_metrics("inferbus", [asyncio.run(closed_loop(gateway, 1, single_seconds, 1.0, {}))])
        roots = {p.name: p.pid for p in stack.processes if p.name.split("-")[0] in GROUPS}
        window = asyncio.run(closed_loop(gateway, concurrency, seconds, 1.0, roots))
        loop = {**phase_metrics("inferbus", [window]), "concurrency": concurrency}
        n = max(1, window.requests)
        cpu = {group: sum(ticks for name, ticks in window.ticks.items() if name.split("-")[0] == group)
               * 1000 / CLK_TCK / n for group in GROUPS}
        return {"zones": zones, "sequential": single, "closed_loop": loop, "cpu_ms_per_request": cpu}
    finally:
        stack.stop()
        stack.rmtree()


def markdown(results: dict) -> str:
    one, three = results["single"], results["cluster"]
    lines = [f"# Cost of JetStream R3 on the spine ({results['when']}, {results['cpus']} CPUs)", "",
             "Command: `python -m bench.replication` (" + results["args"] + "). Single: one nats-server, R1. "
             "Cluster: `inferbus up --zones 3` (3 NATS nodes, R3 streams and buckets, Redis with Sentinel), "
             "one worker. Zero step time, 16 output tokens; the load client shares the machine. The cluster's "
             "numbers include more than R3: its gateways have a zone, so every request asks a router for a "
             "placement (a single-node gateway skips the round trip for prompts shorter than a prefix block), "
             "three routers count every placement, and admission goes through Sentinel-managed Redis.", "",
             "| | single node, R1 | 3-node cluster, R3 | added by R3 |", "| --- | ---: | ---: | ---: |"]
    for key, label in (("ttfb_p50_ms", "TTFT p50 ms (concurrency 1)"), ("ttfb_p99_ms", "TTFT p99 ms (concurrency 1)"),
                       ("e2e_p50_ms", "e2e p50 ms (concurrency 1)")):
        a, b = one["sequential"][key], three["sequential"][key]
        lines.append(f"| {label} | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
    a, b = one["closed_loop"]["req_per_s"], three["closed_loop"]["req_per_s"]
    lines.append(f"| req/s at concurrency {one['closed_loop']['concurrency']} | {a:.0f} | {b:.0f} | {b - a:+.0f} |")
    for group in GROUPS:
        a, b = one["cpu_ms_per_request"][group], three["cpu_ms_per_request"][group]
        if a or b:
            lines.append(f"| {group} CPU-ms per request (all its processes) | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
    total_a, total_b = (sum(r["cpu_ms_per_request"].values()) for r in (one, three))
    lines.append(
        f"| **all measured CPU-ms per request** | {total_a:.2f} | {total_b:.2f} | **{total_b - total_a:+.2f}** |"
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--single-seconds", type=float, default=5.0, help="seconds at concurrency 1, per platform")
    parser.add_argument("--concurrency", type=int, default=16, help="closed-loop concurrency")
    parser.add_argument("--seconds", type=float, default=10.0, help="closed-loop duration")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    results: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "args": f"--single-seconds {args.single_seconds:g} --concurrency {args.concurrency} --seconds {args.seconds:g}",
    }
    results["single"] = measure(1, args.single_seconds, args.concurrency, args.seconds)
    results["cluster"] = measure(3, args.single_seconds, args.concurrency, args.seconds)
    write_results(args.out, "replication", results, markdown)


if __name__ == "__main__":
    main()
