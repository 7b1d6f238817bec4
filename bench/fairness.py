"""Fair share under contention: share of tokens served per tenant against its weight.

    python -m bench.fairness [--seconds S] [--out bench/results]

One worker with four slots (simulated H100 TP2 at 10x speed) and three tenants in closed loops:
`big` (weight 3, 4 streams), `small` (weight 1, 4 streams) and `noisy` (weight 1, 40 streams,
ten times the others' traffic). With the fair queue each tenant's share of tokens should follow
its weight (3 : 1 : 1 → 60% / 20% / 20%) however much it sends. The same run with the fair queue
effectively off (a dispatch window so large that everything queues first come, first served in
JetStream) shows what it prevents.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import write_results
from inferbus.local.ports import free_port
from inferbus.local.stack import Stack, StackConfig
from tools.commands.main import new_admin_key

MODEL = "meta-llama/Llama-3.3-70B-Instruct"
TENANTS = {"big": (3.0, 4), "small": (1.0, 4), "noisy": (1.0, 40)}  # weight, concurrent streams
MAX_TOKENS = 40


async def closed_loop(base_url: str, key: str, streams: int, seconds: float) -> int:
    """Completion tokens served to `streams` clients that each send again as soon as answered."""
    tokens = 0
    stop_at = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=120, headers={"authorization": f"Bearer {key}"}) as http:
        async def loop() -> None:
            nonlocal tokens
            while time.monotonic() < stop_at:
                response = await http.post(f"{base_url}/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "share"}], "max_tokens": MAX_TOKENS})
                if response.status_code == 200 and time.monotonic() < stop_at:
                    tokens += response.json()["usage"]["completion_tokens"]

        await asyncio.gather(*(loop() for _ in range(streams)))
    return tokens


def run(window_per_worker: int, seconds: float) -> dict[str, dict[str, float]]:
    admin_key = new_admin_key()
    stack = Stack(StackConfig(
        state_dir=Path(tempfile.mkdtemp(prefix="inferbus-fair-")), gateway_port=free_port(), workers=1,
        time_scale=0.1, log_level="warning", admin_key=admin_key,
        extra_env={"INFERBUS_WORKER_MAX_RUNNING": "4", "INFERBUS_DISPATCH_WINDOW_PER_WORKER": str(window_per_worker)},
    ))
    stack.start(timeout=90)
    try:
        keys = {}
        with httpx.Client(
            base_url=stack.gateway_url + "/admin/v1", headers={"authorization": f"Bearer {admin_key}"}
        ) as admin:
            for tenant, (weight, _) in TENANTS.items():
                admin.post("/tenants", json={"id": tenant, "weight": weight}).raise_for_status()
                keys[tenant] = admin.post(f"/tenants/{tenant}/keys", json={"name": "bench"}).json()["secret"]

        async def everyone() -> list[int]:
            return await asyncio.gather(*(closed_loop(stack.gateway_url, keys[t], streams, seconds)
                                          for t, (_, streams) in TENANTS.items()))

        served = dict(zip(TENANTS, asyncio.run(everyone())))
    finally:
        stack.stop()
        stack.rmtree()
    total = sum(served.values()) or 1
    weights = sum(w for w, _ in TENANTS.values())
    return {t: {"tokens": served[t], "share": served[t] / total, "weight_share": TENANTS[t][0] / weights,
                "traffic_share": TENANTS[t][1] / sum(s for _, s in TENANTS.values())} for t in TENANTS}


def markdown(results: dict) -> str:
    lines = [f"# Fair share under contention ({results['when']})", "",
             "Command: `python -m bench.fairness` (part of `make bench`). One worker, 4 slots, simulated H100 TP2 "
             f"at 10x speed, {results['seconds']:.0f} s closed loops of {MAX_TOKENS}-token requests.", "",
             "| tenant | weight share | share of traffic sent | tokens served, fair queue | share | tokens, first come "
             "first served | share |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for tenant in TENANTS:
        fair, fifo = results["fair"][tenant], results["fifo"][tenant]
        lines.append(f"| {tenant} | {fair['weight_share']:.0%} | {fair['traffic_share']:.0%} | {fair['tokens']:.0f} | "
                     f"**{fair['share']:.1%}** | {fifo['tokens']:.0f} | {fifo['share']:.1%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15.0, help="duration of each run")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="where fairness.json and .md go")
    args = parser.parse_args()
    results = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": args.seconds,
               "fair": run(2, args.seconds), "fifo": run(100_000, args.seconds)}
    write_results(args.out, "fairness", results, markdown)


if __name__ == "__main__":
    main()
