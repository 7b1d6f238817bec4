"""Placement benchmark: how long the router takes to decide, alone and over NATS.

    python -m bench.placement [--workers 200] [--blocks-per-worker 4000] [--requests 5000] [--prompt-blocks 250,32]

1. decision: `Placer.place` with the affinity policy on a fleet of `--workers` workers whose prefix index holds
   `--blocks-per-worker` blocks each, for prompts of each `--prompt-blocks` size in 64-token blocks
   (250: Mooncake's 16k tokens; 32: a 2k-token chat), half of them a prefix shared with some
   workers; microseconds per decision (including recording it), and the index's memory.
2. round trip: a real nats-server and the router service as a process, fed heartbeats and load
   reports for the same number of workers; a client asks for placements one at a time, as a
   gateway does, and times each request/reply. Also the router's CPU per placement.

Writes `placement.json` and `placement.md` to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform as host
import random
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgspec
import nats

from bench.common import percentile, write_results
from inferbus.bus import connection as bus
from inferbus.local.ports import free_port
from inferbus.local.probes import http_ok
from inferbus.local.servers import nats_server_binary
from proto import messages as m
from proto import subjects
from services.router.config import RoutingConfig
from services.router.placement import make_placer

MODEL = "bench-model"
SHARED_BLOCKS = 125  # the longest shared prefix a family has


def family_hashes(family: int) -> list[int]:
    return [hash((family, i)) & 0xFFFFFFFFFFFFFFFF for i in range(SHARED_BLOCKS)]


def make_request(rng: random.Random, families: int, blocks: int = 250) -> m.PlacementRequest:
    shared = family_hashes(rng.randrange(families))[: blocks // 2]
    tail = [rng.getrandbits(64) for _ in range(blocks - len(shared))]
    return m.PlacementRequest(request_id="r", model=MODEL, prompt_tokens=64 * blocks + 30,
                              block_hashes=shared + tail, block_size=64)


def heartbeat(worker_id: str) -> m.Heartbeat:
    return m.Heartbeat(worker_id=worker_id, model=MODEL, engine_url="", started=0, ts=time.time(), max_running=64,
                       block_size=64, max_adapters=8)


def load(worker_id: str, rng: random.Random) -> m.WorkerLoad:
    running = rng.randrange(0, 64)
    return m.WorkerLoad(worker_id=worker_id, model=MODEL, ts=time.time(), seq=1, running=running, waiting=0,
                        in_flight=running, max_running=64, kv_used_tokens=100_000, kv_capacity_tokens=400_000,
                        queued_prefill_tokens=rng.randrange(0, 20_000))


def measure_decisions(workers: int, blocks_per_worker: int, requests: int, blocks: int) -> dict[str, Any]:
    rng = random.Random(1)
    # A frozen clock: heartbeats set up minutes earlier must still count as fresh.
    placer = make_placer("affinity", lambda: 1000.0, RoutingConfig(), rng)
    families = max(1, workers * blocks_per_worker // (SHARED_BLOCKS * 4))
    tracemalloc.start()
    for i in range(workers):
        worker_id = f"w{i}"
        placer.registry.on_heartbeat(heartbeat(worker_id))
        placer.registry.on_load(load(worker_id, rng))
        held: list[int] = []
        while len(held) < blocks_per_worker:
            held += family_hashes(rng.randrange(families))
        placer.registry.on_cache(m.CacheEvent(worker_id=worker_id, seq=1, ts=0, cleared=True,
                                              stored=[m.BlockStored(block_hashes=held[:blocks_per_worker])]))
    index_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    asks = [make_request(rng, families, blocks) for _ in range(requests)]
    timings = []
    for n, ask in enumerate(asks):
        if n % 200 == 0:  # workers report every 250 ms: pulled what was placed on them
            for view in placer.registry.workers.values():
                placer.registry.on_load(
                    msgspec.structs.replace(load(view.worker_id, rng), pulled_own=view.placed_total)
                )
        started = time.perf_counter()
        reply = placer.place(ask)
        timings.append(time.perf_counter() - started)
        assert reply.worker_id is not None, reply.reason
    return {
        "workers": workers, "blocks_per_worker": blocks_per_worker, "prompt_blocks": blocks,
        "indexed_blocks": len(placer.registry.index),
        "index_mb": round(index_bytes / 2**20, 1), "requests": requests,
        "decision_us_p50": round(percentile(timings, 50) * 1e6, 1),
        "decision_us_p99": round(percentile(timings, 99) * 1e6, 1),
    }


async def measure_round_trip(workers: int, requests: int, blocks: int) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="bench-placement-"))
    port, monitor = free_port(), free_port()
    server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor), "-js",
                               "-sd", str(state / "nats")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    router = None
    try:
        while not http_ok(f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true"):
            await asyncio.sleep(0.05)
        url = f"nats://127.0.0.1:{port}"
        env = dict(os.environ, NATS_URL=url, INFERBUS_METRICS_PORT="0", INFERBUS_HEARTBEAT_TTL_S="600",
                   INFERBUS_LOG_LEVEL="warning")
        router = subprocess.Popen([sys.executable, "-m", "tools.commands.main", "router"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        nc = await nats.connect(url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        kv = await bus.workers_bucket(js, 600)
        rng = random.Random(2)
        for i in range(workers):
            await kv.put(subjects.worker_key(f"w{i}"), m.encode(heartbeat(f"w{i}")))
        for i in range(workers):
            await nc.publish(subjects.metrics_subject(f"w{i}"), m.encode(load(f"w{i}", rng)))
        families = max(1, workers * 10)
        asks = [m.encode(make_request(rng, families, blocks)) for _ in range(requests)]
        subject = subjects.placement_subject(MODEL)
        deadline = time.monotonic() + 30
        while True:  # until the router answers with a worker
            try:
                reply = await nc.request(subject, asks[0], timeout=1)
                if m.decoder(m.PlacementReply).decode(reply.data).worker_id:
                    break
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the router did not start placing")
            await asyncio.sleep(0.2)
        cpu_before = _cpu_seconds(router.pid)
        timings = []
        for ask in asks:
            started = time.perf_counter()
            await nc.request(subject, ask, timeout=2)
            timings.append(time.perf_counter() - started)
        cpu = _cpu_seconds(router.pid) - cpu_before
        await nc.close()
        return {
            "requests": requests, "prompt_blocks": blocks, "round_trip_ms_p50": round(percentile(timings, 50) * 1e3, 3),
            "round_trip_ms_p99": round(percentile(timings, 99) * 1e3, 3),
            "router_cpu_ms_per_placement": round(cpu / requests * 1e3, 3),
        }
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        server.terminate()
        server.wait(10)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def markdown(results: dict[str, Any]) -> str:
    lines = ["# Placement", "", f"`python -m bench.placement` on {results['host']}.", "",
             "| prompt | decision p50 / p99 µs | round trip p50 / p99 ms | router CPU ms per placement |",
             "| --- | ---: | ---: | ---: |"]
    for d, r in zip(results["decision"], results["round_trip"]):
        lines.append(f"| {d['prompt_blocks']} blocks ({d['prompt_blocks'] * 64:,} tokens) | {d['decision_us_p50']} / "
                     f"{d['decision_us_p99']} | {r['round_trip_ms_p50']} / {r['round_trip_ms_p99']} | "
                     f"{r['router_cpu_ms_per_placement']} |")
    d = results["decision"][0]
    lines += ["", f"{d['workers']} workers, {d['indexed_blocks']:,} indexed blocks ({d['index_mb']} MB). The decision "
              "includes recording it in the index; the round trip is a gateway-side NATS request/reply to the "
              "router process, one at a time.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=200)
    parser.add_argument("--blocks-per-worker", type=int, default=4000)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--prompt-blocks", default="250,32", help="prompt sizes in 64-token blocks, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    results = {
        "host": f"{host.machine()}, {os.cpu_count()} CPUs, Python {host.python_version()}",
        "decision": [measure_decisions(args.workers, args.blocks_per_worker, args.requests, int(blocks))
                     for blocks in args.prompt_blocks.split(",")],
        "round_trip": [asyncio.run(measure_round_trip(args.workers, args.requests, int(blocks)))
                       for blocks in args.prompt_blocks.split(",")],
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    write_results(args.out, "placement", results, markdown)
    print(markdown(results))


if __name__ == "__main__":
    main()
