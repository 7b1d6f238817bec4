"""Serving-spine benchmark: what the platform adds on top of the engine, measured in one run.

    python -m bench.spine [--requests N] [--seconds S] [--out bench/results]

1. Concurrency 1, zero step time, 16 output tokens, an ordinary HTTP client (httpx, defaults):
   TTFT and end-to-end p50/p99 through the gateway and straight to the engine.
2. Closed loop at concurrency 16/64/256, zero step time: requests/s, and CPU-ms per request of
   gateway + router + worker together (read from /proc before and after).
3. Paced: engine at a fixed 10 ms per step, 64 concurrent streams: TTFT through the gateway vs
   straight to the engine.

Everything runs on this machine: the client shares the cores with the platform, as in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform as host
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx

from bench.common import percentile, write_results
from inferbus.commands.main import _demo_key
from inferbus.local import Stack, StackConfig, free_port

MODEL = "meta-llama/Llama-3.3-70B-Instruct"
OUTPUT_TOKENS = 16
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


@dataclass
class Target:
    """How to ask one endpoint for a 16-token stream and recognise its first token."""

    name: str
    url: str
    headers: dict[str, str]

    def body(self, i: int, max_tokens: int = OUTPUT_TOKENS) -> bytes:
        prompt = f"Benchmark request {i}: summarise the serving spine in one line."
        if self.name == "engine":
            payload = {"text": prompt, "stream": True,
                       "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}}
        else:
            payload = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}
        return json.dumps(payload).encode()


def is_first_token(name: str, data: bytes) -> bool:
    # The engine's first chunk with text, or the gateway's first chunk with content.
    return (b'"text":"' in data and b'"text":""' not in data) if name == "engine" else b'"content":"' in data


def engine_target(stack: Stack) -> Target:
    return Target("engine", stack.get("engine-1").detail + "/generate", {"content-type": "application/json"})


def gateway_target(stack: Stack, key: str) -> Target:
    return Target("inferbus", stack.gateway_url + "/v1/chat/completions",
                  {"content-type": "application/json", "authorization": f"Bearer {key}"})


# ---- 1. concurrency 1, ordinary client ----------------------------------------------------------

def sequential(target: Target, n: int) -> dict[str, float]:
    ttft, e2e = [], []
    with httpx.Client(timeout=30) as client:
        for i in range(n + 20):
            start = time.perf_counter()
            first = None
            with client.stream("POST", target.url, content=target.body(i), headers=target.headers) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if first is None and line.startswith("data: ") and is_first_token(target.name, line.encode()):
                        first = time.perf_counter()
            end = time.perf_counter()
            if i >= 20 and first is not None:  # the first 20 warm connections and caches
                ttft.append((first - start) * 1000)
                e2e.append((end - start) * 1000)
    return {"requests": len(ttft), "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "e2e_p50_ms": percentile(e2e, 50), "e2e_p99_ms": percentile(e2e, 99)}


# ---- 2 and 3. closed loops -----------------------------------------------------------------------

async def closed_loop(target: Target, concurrency: int, seconds: float, max_tokens: int = OUTPUT_TOKENS,
                      warmup: float = 1.0) -> dict[str, float]:
    ttft: list[float] = []
    errors = 0
    done = 0
    stop_at = time.perf_counter() + warmup + seconds
    measure_from = time.perf_counter() + warmup
    counter = iter(range(10**9))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def loop() -> None:
            nonlocal errors, done
            while time.perf_counter() < stop_at:
                start = time.perf_counter()
                first = None
                try:
                    async with session.post(target.url, data=target.body(next(counter), max_tokens),
                                            headers=target.headers) as response:
                        if response.status != 200:
                            errors += 1
                            await response.read()
                            continue
                        async for line in response.content:
                            if first is None and is_first_token(target.name, line):
                                first = time.perf_counter()
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    errors += 1
                    continue
                if start >= measure_from and first is not None:
                    ttft.append((first - start) * 1000)
                    done += 1

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return {"concurrency": concurrency, "requests": done, "errors": errors, "req_per_s": done / seconds,
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99)}


SPINE = ("gateway", "router", "worker-1")


async def measured_loop(stack: Stack, target: Target, concurrency: int, seconds: float) -> dict[str, float]:
    pids = {name: stack.get(name).pid for name in (*SPINE, "billing", "engine-1", "nats")}
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    wall = time.perf_counter()
    result = await closed_loop(target, concurrency, seconds, warmup=0.0)
    wall = time.perf_counter() - wall
    n = max(1, result["requests"])
    cpu_ms = {name: (cpu_seconds(pid) - before[name]) * 1000 / n for name, pid in pids.items()}
    result.update(
        spine_cpu_ms_per_request=sum(cpu_ms[name] for name in SPINE),
        cpu_ms_per_request=cpu_ms,
        engine_cpu_ms_per_request=cpu_ms["engine-1"],
        nats_cpu_ms_per_request=cpu_ms["nats"],
        billing_cpu_ms_per_request=cpu_ms["billing"],
        req_per_s=n / wall,
    )
    return result


def start_stack(**config: object) -> tuple[Stack, str]:
    stack = Stack(StackConfig(state_dir=Path(tempfile.mkdtemp(prefix="inferbus-bench-")), gateway_port=free_port(),
                              workers=1, log_level="warning", **config))  # type: ignore[arg-type]
    stack.start(timeout=90)
    return stack, asyncio.run(_demo_key(stack.redis_url))


def run(args: argparse.Namespace) -> dict:
    results: dict = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": host.platform()},
                     "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print("zero step time: starting stack…", flush=True)
    stack, key = start_stack(time_scale=0.0)
    try:
        engine, gateway = engine_target(stack), gateway_target(stack, key)
        print(f"1. concurrency 1, {args.requests} requests each", flush=True)
        direct = sequential(engine, args.requests)
        through = sequential(gateway, args.requests)
        results["sequential"] = {"engine": direct, "inferbus": through,
                                 "added_ttft_p50_ms": through["ttft_p50_ms"] - direct["ttft_p50_ms"],
                                 "added_ttft_p99_ms": through["ttft_p99_ms"] - direct["ttft_p99_ms"]}
        print(json.dumps(results["sequential"], indent=1), flush=True)
        results["closed_loop"] = []
        for concurrency in args.concurrency:
            print(f"2. closed loop, concurrency {concurrency}, {args.seconds:.0f} s each", flush=True)
            direct_loop = asyncio.run(closed_loop(engine, concurrency, args.seconds))
            through_loop = asyncio.run(measured_loop(stack, gateway, concurrency, args.seconds))
            results["closed_loop"].append({"concurrency": concurrency, "engine": direct_loop, "inferbus": through_loop})
            print(json.dumps(results["closed_loop"][-1], indent=1), flush=True)
    finally:
        stack.stop()
        stack.rmtree()

    print("3. paced: engine 10 ms per step, 64 streams: starting stack…", flush=True)
    stack, key = start_stack(time_scale=1.0, fixed_step_ms=10.0)
    try:
        engine, gateway = engine_target(stack), gateway_target(stack, key)
        # Twice as long as the other runs: the p99 of a 10 s window rests on a handful of samples.
        direct_paced = asyncio.run(closed_loop(engine, 64, 2 * args.seconds, max_tokens=32))
        through_paced = asyncio.run(closed_loop(gateway, 64, 2 * args.seconds, max_tokens=32))
        results["paced"] = {"step_ms": 10, "streams": 64, "output_tokens": 32, "engine": direct_paced,
                            "inferbus": through_paced,
                            "added_ttft_p50_ms": through_paced["ttft_p50_ms"] - direct_paced["ttft_p50_ms"],
                            "added_ttft_p99_ms": through_paced["ttft_p99_ms"] - direct_paced["ttft_p99_ms"]}
        print(json.dumps(results["paced"], indent=1), flush=True)
    finally:
        stack.stop()
        stack.rmtree()
    return results


def markdown(results: dict) -> str:
    seq = results["sequential"]
    lines = [
        f"# Serving spine benchmark ({results['when']}, {results['machine']['cpus']} CPUs)",
        "",
        "Command: `make bench` (`python -m bench.spine`). Simulated engine, one worker; the load client shares the machine. "
        "Every request passes tenant admission (one atomic Redis call); billing reconciles it from the usage ledger.",
        "",
        "## Concurrency 1, zero step time, 16 output tokens, httpx client",
        "",
        "| path | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in ("engine", "inferbus"):
        r = seq[name]
        lines.append(f"| {name} | {r['ttft_p50_ms']:.2f} | {r['ttft_p99_ms']:.2f} | {r['e2e_p50_ms']:.2f} | {r['e2e_p99_ms']:.2f} |")
    lines += [f"| **added by inferbus** | **{seq['added_ttft_p50_ms']:.2f}** | {seq['added_ttft_p99_ms']:.2f} | | |", "",
              "## Closed loop, zero step time, 16 output tokens (streaming)", "",
              "| concurrency | engine req/s | inferbus req/s | inferbus TTFT p50 / p99 ms | gateway+router+worker CPU-ms/req | billing CPU-ms/req | engine CPU-ms/req | NATS CPU-ms/req | errors |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in results["closed_loop"]:
        e, i = row["engine"], row["inferbus"]
        lines.append(f"| {row['concurrency']} | {e['req_per_s']:.0f} | {i['req_per_s']:.0f} | {i['ttft_p50_ms']:.1f} / {i['ttft_p99_ms']:.1f} | "
                     f"{i['spine_cpu_ms_per_request']:.2f} | {i['billing_cpu_ms_per_request']:.2f} | {i['engine_cpu_ms_per_request']:.2f} | "
                     f"{i['nats_cpu_ms_per_request']:.2f} | {i['errors']} |")
    paced = results["paced"]
    lines += ["", "## Paced: engine 10 ms per step, 64 concurrent streams, 32 output tokens", "",
              "| path | req/s | TTFT p50 ms | TTFT p99 ms |", "| --- | ---: | ---: | ---: |"]
    for name in ("engine", "inferbus"):
        r = paced[name]
        lines.append(f"| {name} | {r['req_per_s']:.1f} | {r['ttft_p50_ms']:.2f} | {r['ttft_p99_ms']:.2f} |")
    lines.append(f"| **added by inferbus** | | **{paced['added_ttft_p50_ms']:.2f}** | **{paced['added_ttft_p99_ms']:.2f}** |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300, help="requests per path at concurrency 1")
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of each closed-loop run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256], help="closed-loop levels")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="where spine.json and spine.md go")
    args = parser.parse_args()
    results = run(args)
    write_results(args.out, "spine", results, markdown)


if __name__ == "__main__":
    main()
