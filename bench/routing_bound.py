"""How much better could any router do? Our policies against a clairvoyant one, in the fleet simulator.

    python -m bench.routing_bound [--trace mooncake_conversation.jsonl] [--requests 250]
                                  [--sample-families 1] [--replicas 4] [--load 0.8]

The same workload as `bench.routing` (`bench/routing_workload.py`: Mooncake requests, arrivals
scaled so the fleet is `--load` busy at perfect-affinity hits) replayed through
`tools.capacity.fleetsim.FleetSim` (the simulated engine per replica, SGLang's default
unmixed steps, the profile table of the GPU's roofline, as in `bench.simulate_vs_dynamo`) with:

- the router's own policies (`round_robin`, `least_loaded`, `affinity`), placing from heartbeats,
  load reports and cache events as the router service does;
- **clairvoyant**: each request goes where its first token would come soonest, found by copying
  every replica's engine as it truly is at that instant (queues, running batch, prefix cache,
  step in progress), adding the request and running the copy until that token. This is the ideal
  that TTFT-greedy routers (our `affinity`, Dynamo's KV router) estimate from reports: what no
  greedy router can beat without knowing the future;
- **alone**: every request on its own idle engine, its prompt less what an infinite cache would
  hold: the time to first token with no queue at all, a floor for any router.

Reported: TTFT p50/p90/p99, TPOT p90, hit rate, CPU seconds. Results:
bench/results/routing_bound.{json,md}. The clairvoyant run costs a few engine copies per request
(about 1 CPU-second per request on 4 replicas with the conversation trace's 14k-token prompts).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform as host
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from bench.common import write_results
from bench.routing_workload import build
from inferbus.timing import roofline
from services.sim_engine.config import EngineConfig
from services.sim_engine.profile_table import TableStepModel, build_table, save_npz
from services.sim_engine.request import Request
from services.sim_engine.sampling import SamplingParams
from services.sim_engine.scheduler import Engine
from tools.capacity import traces
from tools.capacity.fleetsim import FleetConfig, FleetSim
from tools.capacity.traces import TraceRequest

POLICIES = ("round_robin", "least_loaded", "affinity")


def first_token_at(engine: Engine, now: float, stepping: bool, prompt: list[int], output_tokens: int) -> float:
    """When a request added to `engine` at `now` would see its first token, if nothing else arrived.

    Runs a copy: the engine itself is not touched. `stepping`: a step is in progress (the engine's
    clock is at its end), so the request waits for the next one, as a real arrival would."""
    twin = copy.deepcopy(engine)
    if not stepping and twin.now < now:
        twin.advance(now - twin.now)
    probe = Request(rid="probe", input_ids=prompt,
                    sampling=SamplingParams(max_new_tokens=output_tokens, temperature=0.0, ignore_eos=True))
    twin.add(probe)
    while True:
        result = twin.step()
        if any(update.request is probe and update.num_output_tokens > 0 for update in result.updates):
            return twin.now
        if result.idle:
            return float("inf")


class ClairvoyantFleet(FleetSim):
    """FleetSim whose placement looks at the engines' true state instead of asking the router."""

    def _place(self, job: Any) -> None:
        started = time.process_time()
        now = self.loop.now
        soonest = min(self.replicas, key=lambda replica: first_token_at(
            replica.engine, now, replica.stepping, job.prompt, job.output_tokens))
        self.placement_s += time.process_time() - started
        job.expected_cached = 0
        self._dispatch(soonest, job, own=True)


def alone(requests: list[TraceRequest]) -> list[TraceRequest]:
    """Each request with its prompt less what an infinite prefix cache would hold (the engine
    always computes the last token), and no blocks to share: for one engine per request."""
    cache: OrderedDict[int, None] = OrderedDict()
    out = []
    for request in requests:
        hit = min(traces.replay_blocks(request, cache), request.input_tokens - 1)
        out.append(TraceRequest(request.arrival_s, request.input_tokens - hit, request.output_tokens, ()))
    return out


def row(name: str, sim: FleetSim) -> dict[str, Any]:
    started = time.process_time()
    report = sim.run()
    return {"placement": name, "requests": report.requests, "completed": report.completed,
            "hit_rate": report.hit_rate, "ttft_p50_s": report.ttft_p50_s, "ttft_p90_s": report.ttft_p90_s,
            "ttft_p99_s": report.ttft_p99_s, "tpot_p90_s": report.tpot_p90_s,
            "cpu_s": time.process_time() - started}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = roofline(args.gpu, args.tp)
    kv_tokens = model.kv_capacity_tokens() // EngineConfig().block_size * EngineConfig().block_size
    workload = build(str(args.trace), engines=args.replicas, gpu=args.gpu, tp=args.tp, kv_capacity_tokens=kv_tokens,
                     load=args.load, sample_families=args.sample_families, limit=args.requests, seed=args.seed)
    results: dict[str, Any] = {
        "command": "python -m bench.routing_bound " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": host.platform()},
        "trace": args.trace.name, "replicas": args.replicas, "gpu": args.gpu, "tp": args.tp,
        "workload": workload.summary(), "rows": [],
    }
    print(f"{len(workload.requests)} requests at {workload.rate:.2f} req/s on {args.replicas} × {args.gpu} TP{args.tp}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="routing-bound-") as tmp:
        table = build_table(model)
        save_npz(table, Path(tmp) / "profile.npz")
        step = TableStepModel(table)
        engine = EngineConfig(gpu=args.gpu, tp=args.tp, kv_capacity_tokens=kv_tokens,
                              profile_table=str(Path(tmp) / "profile.npz"), mixed_chunk=False)
        fleets: list[tuple[str, FleetSim]] = [
            (policy, FleetSim(FleetConfig(replicas=args.replicas, policy=policy, engine=engine), workload.requests,
                              step_model=step)) for policy in POLICIES]
        fleets.append(("clairvoyant", ClairvoyantFleet(FleetConfig(replicas=args.replicas, engine=engine),
                                                       workload.requests, step_model=step)))
        lone = alone(workload.requests)
        fleets.append(("alone (no queue, infinite cache)",
                       FleetSim(FleetConfig(replicas=len(lone), policy="round_robin", engine=engine), lone,
                                step_model=step)))
        for name, sim in fleets:
            result = row(name, sim)
            results["rows"].append(result)
            print(f"  {name:34} hit {result['hit_rate']:6.1%}  TTFT p50/p90/p99 {result['ttft_p50_s']:6.2f} / "
                  f"{result['ttft_p90_s']:6.2f} / {result['ttft_p99_s']:6.2f} s  TPOT p90 "
                  f"{result['tpot_p90_s'] * 1e3:6.1f} ms  CPU {result['cpu_s']:6.1f} s", flush=True)
    return results


def markdown(results: dict[str, Any]) -> str:
    w = results["workload"]
    rows = {r["placement"]: r for r in results["rows"]}
    affinity = rows.get("affinity", {}).get("ttft_p90_s", float("nan"))
    lines = [
        f"# How much better could any router do? ({results['date']})", "",
        f"Command: `{results['command']}`. Fleet simulator (`FleetSim`), {results['replicas']} × simulated "
        f"{results['gpu']} TP{results['tp']} engines from the roofline's profile table, SGLang's default unmixed "
        f"steps. Trace `{results['trace']}`: {w.get('requests', '?')} requests, load "
        f"{w.get('target_load', float('nan')):.0%} "
        f"at perfect-affinity hits; infinite-cache ceiling {w.get('ceiling_hit_rate', float('nan')):.1%}. Times in "
        "simulated seconds. See bench/routing_bound.py.", "",
        "| placement | hit rate | TTFT p50 / p90 / p99 s | TTFT p90 / affinity's | TPOT p90 ms | CPU s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["rows"]:
        lines.append(f"| {r['placement']} | {r['hit_rate']:.1%} | {r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} / "
                     f"{r['ttft_p99_s']:.2f} | {r['ttft_p90_s'] / affinity:.2f} | {r['tpot_p90_s'] * 1e3:.1f} | "
                     f"{r['cpu_s']:.1f} |")
    lines += ["", "*clairvoyant*: each request placed where its first token would come soonest on the engines' "
              "true state (copies run forward), the ideal of a TTFT-greedy router; *alone*: each request on its own "
              "idle engine, its prompt less an infinite cache's hits, no queue at all."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.routing_bound", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=Path("mooncake_conversation.jsonl"),
                   help="Mooncake trace, a path or a name looked up in $INFERBUS_TRACES_DIR and traces/ "
                        "(default mooncake_conversation.jsonl)")
    p.add_argument("--requests", type=int, default=250, help="the first this many requests (default 250)")
    p.add_argument("--sample-families", type=float, default=1.0, help="share of the prefix families kept (default 1)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--gpu", default="H100", choices=["H100", "H200"])
    p.add_argument("--tp", type=int, default=2, choices=[1, 2, 4, 8])
    p.add_argument("--load", type=float, default=0.8, help="fleet utilisation at perfect-affinity hits (default 0.8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--name", default="routing_bound", help="result file name (without extension)")
    args = p.parse_args(argv)
    args.trace = traces.find(args.trace)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_results(args.out, args.name, run(args), markdown)


if __name__ == "__main__":
    main()
