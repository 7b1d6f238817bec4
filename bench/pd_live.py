"""Aggregated against disaggregated, live: one trace, the same number of simulated GPUs.

    python -m bench.pd_live [--trace mooncake_synthetic.jsonl] [--engines 4] [--prefill 1] [--decode 3]
                            [--time-scale 0.5] [--load 0.8] [--sample-families 0.15] [--requests 240]
                            [--busy-cores N]

What runs, once per topology, on the whole platform (`inferbus.local.stack.Stack`, as `inferbus up`):
- **aggregated**: `--engines` simulated engines (H100 TP2 by default), one worker each;
- **disaggregated**: `--prefill` prefill and `--decode` decode engines and workers
  (`inferbus up --prefill P --decode D`), P + D = `--engines`: the same GPUs.

The workload is the routing benchmark's (`bench/routing_workload.py`): a sample of the trace's
prefix families (whole families), arrivals scaled so that the aggregated fleet is `--load` busy at
the perfect-affinity hit rate, prompt text from `tools.capacity.traces.mooncake_prompt` and a
word-level tokenizer (one token per word of the trace, so a prompt is the trace's token count).
The same requests at the same times go to both topologies: an open-loop client
(`bench.routing.replay`) streams `POST /v1/completions`.

Measured per topology, in simulated (GPU) seconds (wall time divided by `--time-scale`): TTFT and
TPOT p50/p90 as the client saw them, the prefix-cache hit rate the usage reported, the share of
requests the gateway queued where the router chose (a disaggregated fleet: a decode worker with
its prefill worker; the rest went to the shared queue, too short to ask about or not answered in
time), and goodput per
GPU: requests per second that met both SLOs (`--ttft-slo`, `--tpot-slo`: the seed's 800 ms and
40 ms) over the GPUs (engines × TP). `make bench-pd` runs it after the fleet-simulator part
(`bench/pd.py`). Results: bench/results/pd_live.{json,md}.

On a 2-core machine shared with other work the platform's own processes (gateway, router, one
worker per engine, NATS) compete with the engines and the client: compare the two topologies of
one run, not runs of different days. `--busy-cores 1` makes that competition deliberate (a
spinning process takes one of the cores for the whole run): placement must hold when the control
plane is slow, for both topologies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform as host
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import dynamo_live
from bench.common import percentile, write_results
from bench.routing import Outcome, placed_share, placement_counters, replay
from bench.routing_workload import Workload, build
from inferbus.local.ports import free_port
from inferbus.local.stack import Stack, StackConfig
from tools.capacity import traces

MODEL = "meta-llama/Llama-3.3-70B-Instruct"


@dataclass
class Frontend:
    """What `bench.routing.replay` sends to: the platform's OpenAI completions endpoint."""

    url: str
    headers: dict[str, str]
    endpoint: str = "completions"


@dataclass(frozen=True)
class Topology:
    name: str
    workers: int = 0
    prefill: int = 0
    decode: int = 0

    @property
    def engines(self) -> int:
        return self.workers or self.prefill + self.decode

    def label(self) -> str:
        return (f"aggregated, {self.workers} engines" if self.workers
                else f"disaggregated, {self.prefill} prefill + {self.decode} decode")


def summarise(outcomes: list[Outcome], wall: float, time_scale: float, gpus: int, ttft_slo: float,
              tpot_slo: float) -> dict[str, Any]:
    """The client's view of one run, in simulated seconds. Pure (for the tests)."""
    ok = [o for o in outcomes if o.error is None and o.end is not None and o.first is not None]
    ttft = {o.index: (o.first - o.sent) / time_scale for o in ok}  # type: ignore[operator]
    tpot = {o.index: (o.end - o.first) / time_scale / (o.completion_tokens - 1)  # type: ignore[operator]
            for o in ok if o.completion_tokens > 1}
    good = [o for o in ok if ttft[o.index] <= ttft_slo and tpot.get(o.index, 0.0) <= tpot_slo]
    span = wall / time_scale
    prompt = sum(o.prompt_tokens for o in ok)
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "errors": len(outcomes) - len(ok),
        "error_samples": sorted({(o.error or "no first token")[:160] for o in outcomes if o not in ok})[:5],
        "ttft_p50_s": percentile(list(ttft.values()), 50),
        "ttft_p90_s": percentile(list(ttft.values()), 90),
        "tpot_p50_ms": percentile(list(tpot.values()), 50) * 1000,
        "tpot_p90_ms": percentile(list(tpot.values()), 90) * 1000,
        "hit_rate": sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
        "within_slo": len(good),
        "within_slo_share": len(good) / len(outcomes) if outcomes else 0.0,
        # Each SLO alone: a long prompt's own prefill may take longer than the TTFT SLO on any fleet.
        "within_ttft_share": sum(1 for o in ok if ttft[o.index] <= ttft_slo) / len(outcomes) if outcomes else 0.0,
        "within_tpot_share": sum(1 for o in ok if tpot.get(o.index, 0.0) <= tpot_slo) / len(outcomes)
        if outcomes
        else 0.0,
        "goodput_req_s": len(good) / span if span else 0.0,
        "goodput_req_s_per_gpu": len(good) / span / gpus if span and gpus else 0.0,
        "output_tok_s_per_gpu": sum(o.completion_tokens for o in ok) / span / gpus if span and gpus else 0.0,
        "sim_seconds": span,
        "wall_seconds": wall,
        "gpus": gpus,
    }


def run_topology(topology: Topology, workload: Workload, prompts: list[str], args: argparse.Namespace,
                 model_dir: Path, state: Path) -> dict[str, Any]:
    from tools.commands.local_platform import demo_key

    env = {
        # Compare topologies, not admission: nothing is refused for queueing.
        "INFERBUS_QUEUE_BUDGET_STANDARD_S": "1000000", "INFERBUS_QUEUE_BUDGET_PREMIUM_S": "1000000",
        "INFERBUS_REQUEST_TIMEOUT_S": "3600", "INFERBUS_ACCESS_LOG": "false",
        "INFERBUS_PLACEMENT_TIMEOUT_MS": str(args.placement_timeout_ms),
        "INFERBUS_LOAD_INTERVAL_S": str(max(0.05, min(0.25, 0.25 * args.time_scale))),
    }
    stack = Stack(StackConfig(state_dir=state / topology.name, workers=topology.workers, prefill=topology.prefill,
                              decode=topology.decode, gpu=args.gpu, tp=args.tp, gateway_port=free_port(),
                              time_scale=args.time_scale, model_dir=model_dir, log_level="warning", batch=False,
                              engine_args=["--log-level", "warning"], extra_env=env))
    print(f"\n{topology.label()}: starting…", flush=True)
    try:
        stack.start(timeout=180)
        key = asyncio.run(demo_key(stack.redis_url))
        frontend = Frontend(stack.gateway_url + "/v1/completions",
                            {"content-type": "application/json", "authorization": f"Bearer {key}"})
        time.sleep(2)  # first load reports reach the router
        outcomes, wall = asyncio.run(replay(frontend, workload, prompts, args.time_scale, topology.label()))  # type: ignore[arg-type]
        placements = placement_counters([stack.gateway_url + "/metrics"])
    finally:
        stack.stop()
    result = summarise(outcomes, wall, args.time_scale, topology.engines * args.tp, args.ttft_slo, args.tpot_slo)
    result.update(topology=topology.name, label=topology.label(), engines=topology.engines,
                  prefill=topology.prefill, decode=topology.decode, placements=placements)
    print(f"{topology.label()}: TTFT p50/p90 {result['ttft_p50_s']:.2f}/{result['ttft_p90_s']:.2f} s, "
          f"TPOT p50/p90 {result['tpot_p50_ms']:.0f}/{result['tpot_p90_ms']:.0f} ms, within SLO "
          f"{result['within_slo_share']:.0%}, goodput {result['goodput_req_s_per_gpu']:.3f} req/s/GPU, "
          f"hit rate {result['hit_rate']:.1%}, placed by the router {placed_share(result)}, errors {result['errors']}",
          flush=True)
    return result


def markdown(results: dict[str, Any]) -> str:
    config = results["config"]
    lines = [
        "# Aggregated against disaggregated, live (`python -m bench.pd_live`)", "",
        f"{results['when']}, `{results['command']}`; {results['machine']['cpus']} cores (shared with other work).",
        f"Trace {Path(config['trace']).name}: {results['workload']['requests']} requests, mean prompt "
        f"{results['workload']['mean_input_tokens']:.0f} tokens, mean output "
        f"{results['workload']['mean_output_tokens']:.0f}; "
        f"{config['engines']} simulated {config['gpu']} TP{config['tp']} engines ({config['engines'] * config['tp']} "
        f"GPUs) either way, time scale {config['time_scale']}, load {config['load']} for the aggregated fleet. "
        f"SLO: TTFT {config['ttft_slo_s'] * 1000:.0f} ms, TPOT {config['tpot_slo_s'] * 1000:.0f} ms."
        + (f" {config['busy_cores']} spinning process(es) took a core each for the whole run."
           if config.get("busy_cores") else ""), "",
        "| topology | TTFT p50 / p90 s | TPOT p50 / p90 ms | hit rate | within TTFT / TPOT / both SLOs | goodput "
        "req/s/GPU | placed by the router | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["topologies"]:
        lines.append(f"| {r['label']} | {r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} | {r['tpot_p50_ms']:.0f} / "
                     f"{r['tpot_p90_ms']:.0f} | {r['hit_rate']:.1%} | {r['within_ttft_share']:.0%} / "
                     f"{r['within_tpot_share']:.0%} / {r['within_slo_share']:.0%} | "
                     f"{r['goodput_req_s_per_gpu']:.3f} | {placed_share(r)} | {r['errors']} |")
    if len(results["topologies"]) == 2:
        agg, dis = results["topologies"]
        if agg["goodput_req_s_per_gpu"]:
            lines += ["", f"Goodput per GPU, disaggregated ÷ aggregated: "
                          f"{dis['goodput_req_s_per_gpu'] / agg['goodput_req_s_per_gpu']:.2f}×."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--trace", type=Path, default=None, help="Mooncake JSONL trace (default mooncake_synthetic.jsonl)"
    )
    parser.add_argument("--engines", type=int, default=4, help="simulated engines of the aggregated fleet")
    parser.add_argument("--prefill", type=int, default=1, help="prefill engines of the disaggregated fleet")
    parser.add_argument("--decode", type=int, default=None, help="decode engines (default: --engines less --prefill)")
    parser.add_argument("--gpu", default="H100", choices=["H100", "H200"])
    parser.add_argument("--tp", type=int, default=2, choices=[1, 2, 4, 8])
    parser.add_argument("--time-scale", type=float, default=0.5, help="engine wall seconds per simulated second")
    parser.add_argument(
        "--load", type=float, default=0.8, help="the aggregated fleet's utilisation at the bound's hits"
    )
    parser.add_argument("--sample-families", type=float, default=0.15, help="share of the trace's prefix families")
    parser.add_argument("--requests", type=int, default=240, help="replay the first N selected requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-slo", type=float, default=0.8, help="seconds")
    parser.add_argument("--tpot-slo", type=float, default=0.04, help="seconds")
    parser.add_argument("--placement-timeout-ms", type=float, default=200.0)
    parser.add_argument("--topologies", nargs="+", default=["aggregated", "disaggregated"],
                        choices=["aggregated", "disaggregated"])
    parser.add_argument("--busy-cores", type=int, default=0,
                        help="spinning processes beside the platform, one core each: a slow control plane")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="pd_live")
    args = parser.parse_args()
    decode = args.decode if args.decode is not None else args.engines - args.prefill
    if args.prefill < 1 or decode < 1:
        raise SystemExit("the disaggregated fleet needs at least one prefill and one decode engine")
    if args.prefill + decode != args.engines:
        print(
            f"note: {args.prefill} + {decode} engines disaggregated against {args.engines} aggregated", file=sys.stderr
        )
    args.trace = traces.find(args.trace or "mooncake_synthetic.jsonl")
    workload = build(str(args.trace), engines=args.engines, gpu=args.gpu, tp=args.tp, load=args.load,
                     sample_families=args.sample_families, limit=args.requests, seed=args.seed)
    summary = workload.summary()
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}), flush=True)
    print(f"each topology replays {workload.span_s:.0f} simulated s = {workload.span_s * args.time_scale:.0f} wall s",
          flush=True)
    prompts = [traces.mooncake_prompt(r) for r in workload.requests]
    state = Path(tempfile.mkdtemp(prefix="inferbus-bench-pd-"))
    model_dir = dynamo_live.write_model_dir(state / "model", 131_072)
    chosen = {"aggregated": Topology("aggregated", workers=args.engines),
              "disaggregated": Topology("disaggregated", prefill=args.prefill, decode=decode)}
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": host.platform()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python -m bench.pd_live " + " ".join(sys.argv[1:]),
        "config": {"engines": args.engines, "prefill": args.prefill, "decode": decode, "gpu": args.gpu, "tp": args.tp,
                   "time_scale": args.time_scale, "load": args.load, "sample_families": args.sample_families,
                   "requests": args.requests, "seed": args.seed, "trace": str(args.trace),
                   "ttft_slo_s": args.ttft_slo, "tpot_slo_s": args.tpot_slo, "busy_cores": args.busy_cores},
        "workload": summary, "topologies": [],
    }
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy_cores)]
    try:
        for name in args.topologies:
            results["topologies"].append(run_topology(chosen[name], workload, prompts, args, model_dir, state))
    finally:
        for process in busy:
            process.kill()
        if args.keep_logs:
            print(f"logs in {state}/", flush=True)
        else:
            shutil.rmtree(state, ignore_errors=True)
    write_results(args.out, args.name, results, markdown)


if __name__ == "__main__":
    main()
