"""Our fleet simulator against NVIDIA Dynamo's offline replay: same trace, same engine timing.

    python -m bench.simulate_vs_dynamo [--replicas 1,4] [--load 0.8] [--sample-families 0.25]
                                       [--requests N] [--large-replicas 200 --large-rate 833]

Both sides replay the same Mooncake requests (`bench/routing_workload.py`: a random quarter of the
prefix families by default, arrivals scaled so the fleet is `--load` busy at perfect-affinity hits)
on virtual clocks:

- **inferbus**: `tools.capacity.fleetsim.FleetSim`, the simulated engine (`services/sim_engine`) per
  replica behind the router's own placement code (`round_robin`, and `affinity` as our prefix
  router), timed by the profile table below (`TableStepModel`).
- **inferbus, fast**: `tools.capacity.fleetsim.fast.FastFleet` (analytic replicas, a few events per
  request, compiled by `tools.capacity.accel` when built) with SGLang's unmixed steps and a prefix
  cache per replica fed the trace's block ids, behind `round_robin` and behind `affinity`, whose
  router sees those caches (the trace's blocks as prefix hashes, the caches' changes as KV events).
- **inferbus + the mocker's quirks** (round-robin, small fleets): `FleetSim` whose engines add the two
  things Dynamo's mocker does that SGLang does not (`MockerQuirks`), to measure how much of the
  difference they are.
- **Dynamo 1.6.1**: `dynamo.replay.api.run_trace_replay` (its mocker engine, SGLang scheduling
  mode, behind `round_robin` and its `kv_router`), timed by the same table through its
  `dynamo_profile` timing provider (`--planner-profile-data`). Run in `.venv-dynamo`
  (`bench/dynamo_env.py` installs it on first use) by `bench/dynamo_replay.py`.

One engine for both: the table is `services/sim_engine/profile_table.build_table` of the H100 TP2
roofline; the same KV pool (our capacity rounded down to whole blocks), block size, chunked-prefill
budget (512), batch limit (256 running requests) and SGLang's default scheduling (no decode in a
step that prefills: our engine's `mixed_chunk=False`). With round-robin on both sides the placement
is identical, so any difference in TTFT/TPOT is the two engines' scheduling.

Reported per run: TTFT p50/p90/p99, TPOT p50/p90 (per request: (end − first token)/(output − 1)),
prefix-cache hit rate (cached / prompt tokens), load imbalance (max / mean over replicas of the
prompt + output tokens placed there), CPU seconds of the replay alone and simulated
requests per CPU second. Runs alternate which simulator goes first (the machine is shared).
Results: bench/results/simulate_vs_dynamo.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as host
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import dynamo_env
from bench.common import percentile, write_results
from bench.routing_workload import build
from inferbus.timing import roofline
from services.sim_engine.admission import CLIP_MAX_NEW_TOKENS_ESTIMATE, NEW_TOKEN_RATIO
from services.sim_engine.config import EngineConfig
from services.sim_engine.profile_table import TableStepModel, build_table, save_npz
from services.sim_engine.request import Request, StepResult
from services.sim_engine.scheduler import Engine
from tools.capacity import traces
from tools.capacity.fleetsim import FleetConfig, FleetSim, workload
from tools.capacity.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

RUNNER = Path(__file__).resolve().parent / "dynamo_replay.py"
# Dynamo's kv_router away from its defaults (KvRouterConfig keywords): a miss priced like ours
# (`miss_weight` 5), and decode load not counted in KV blocks.
ROUTER_VARIANTS: tuple[dict[str, Any], ...] = (
    {"overlap_score_weight": 5.0},
    {"overlap_score_weight": 5.0, "router_track_active_blocks": False},
)
# Our policy and Dynamo's router mode that play the same part.
PAIRS = (("round_robin", "round_robin"), ("affinity", "kv_router"))
QUIRKS_UP_TO = 8  # fleets this small also run our engine with the mocker's quirks (`MockerQuirks`)


class MockerQuirks(Engine):
    """Our engine with the two things Dynamo 1.6.1's mocker does in SGLang mode that SGLang does not
    (its source, lib/mocker/src/scheduler/sglang/), to measure what they change; not a model of
    SGLang. (1) A pass that completes prompts also runs a decode step over just those before
    their first token, though it is the prefill forward that samples it. (2) A long prompt is
    scheduled once its next chunk fits in free KV; SGLang needs room for the whole prompt and its
    output."""

    def step(self) -> StepResult:
        prefilling = [r for r in self.running if r.prefilling]
        result = super().step()
        first = [r for r in prefilling if not r.prefilling and r.first_token_time == self.now]
        if not first:
            return result
        context = sum(r.context_len - 1 for r in first)  # before the token the pass produced
        extra = self.step_model.step_time(len(first), context)
        self.now += extra
        for r in first:
            r.first_token_time = self.now
            if r.finish_time is not None:
                r.finish_time = self.now
        return replace(result, duration_s=result.duration_s + extra)

    def _prompt_room(self, request: Request, cached: int) -> int:
        chunk = self.config.chunked_prefill_size
        left = len(request.fill_ids) - cached
        needed = min(left, chunk) + 1 + int(NEW_TOKEN_RATIO * sum(
            min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS_ESTIMATE) for r in self.running))
        if left <= chunk:  # the last chunk: its output is reserved with it
            needed += min(request.max_new_tokens - len(request.output_ids), CLIP_MAX_NEW_TOKENS_ESTIMATE)
        return needed


def write_mooncake(requests: list[TraceRequest], path: Path) -> None:
    """The requests as Mooncake JSONL (timestamps in ms), the format both simulators read."""
    with path.open("w") as f:
        for r in requests:
            f.write(json.dumps({"timestamp": round(r.arrival_s * 1000, 3), "input_length": r.input_tokens,
                                "output_length": r.output_tokens, "hash_ids": list(r.hash_ids)}) + "\n")


def dynamo_engine(engine: EngineConfig, kv_tokens: int, table_path: Path) -> dict[str, Any]:
    """The mocker's engine settings matching ours (`dynamo.mocker` flags in the config's words):
    SGLang scheduling, which, as SGLang by default, never decodes in a step that prefills (our
    engine with `mixed_chunk=False`)."""
    return {"engine": {
        "backend": "sglang", "worker_type": "aggregated",
        "num_gpu_blocks": kv_tokens // engine.block_size, "block_size": engine.block_size,
        "max_num_seqs": engine.max_running_requests, "max_num_batched_tokens": engine.chunked_prefill_size,
        "enable_prefix_caching": True, "enable_chunked_prefill": True,
        "sglang": {"chunked_prefill_size": engine.chunked_prefill_size},
        "timing_model": {"type": "external", "provider": "dynamo_profile", "config": {"path": str(table_path)}},
    }}


def imbalance(tokens_by_worker: dict[Any, int], replicas: int) -> float:
    """Max over mean of prompt + output tokens per replica (replicas that got nothing count as 0)."""
    mean = sum(tokens_by_worker.values()) / replicas
    return max(tokens_by_worker.values()) / mean if mean else float("nan")


def run_dynamo(trace_path: Path, engine: dict[str, Any], replicas: int, mode: str,
               router_config: dict[str, Any] | None = None) -> dict[str, Any]:
    job = {"trace": str(trace_path), "engine": engine, "num_workers": replicas, "router_mode": mode,
           "trace_block_size": MOONCAKE_BLOCK_TOKENS, "router_config": router_config}
    result = subprocess.run([str(dynamo_env.ensure()), str(RUNNER)], input=json.dumps(job), capture_output=True,
                            text=True, env=dict(os.environ, RUST_LOG="warn"))
    if result.returncode != 0:
        raise RuntimeError(f"dynamo replay failed:\n{result.stderr[-3000:]}")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    rows = out["per_request"]
    ttft = [r["ttft_ms"] / 1000 for r in rows if r.get("ttft_ms") is not None]
    # Dynamo's per-request itl_ms is (end − first token) / (output − 1): our TPOT.
    tpot = [r["itl_ms"] / 1000 for r in rows if r.get("itl_ms") is not None and r.get("output_length", 0) > 1]
    prompt = sum(r.get("input_length", 0) for r in rows)
    cached = sum(r.get("reused_input_tokens", 0) for r in rows)
    summary = out["summary"]
    by_worker: dict[Any, int] = {}
    for r in rows:
        worker = r.get("decode_worker_idx")
        by_worker[worker] = by_worker.get(worker, 0) + r.get("input_length", 0) + r.get("output_length", 0)
    return {
        "simulator": "dynamo.replay", "policy": mode, "replicas": replicas, "requests": len(rows),
        "completed": summary.get("completed_requests", len(ttft)),
        "hit_rate": cached / prompt if prompt else summary.get("prefix_cache_reused_ratio"),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p90_s": percentile(tpot, 90),
        "imbalance": imbalance(by_worker, replicas),
        "cpu_s": out["cpu_s"], "wall_s": out["wall_s"], "req_per_cpu_s": len(rows) / out["cpu_s"],
        "summary": summary,
    }


def run_ours(requests: list[TraceRequest], engine: EngineConfig, step: TableStepModel, replicas: int,
             policy: str, quirks: bool = False) -> dict[str, Any]:
    sim = FleetSim(FleetConfig(replicas=replicas, policy=policy, engine=engine), requests, step_model=step,
                   engine_factory=MockerQuirks if quirks else Engine)
    report = sim.run()
    by_worker: dict[Any, int] = {r.worker_id: r.engine.prompt_tokens_total + r.engine.generation_tokens_total
                                 for r in sim.replicas}
    return {
        "simulator": "inferbus FleetSim + mocker quirks" if quirks else "inferbus FleetSim",
        "policy": policy,
        "replicas": replicas,
        "requests": report.requests,
        "completed": report.completed,
        "hit_rate": report.hit_rate,
        "ttft_p50_s": report.ttft_p50_s,
        "ttft_p90_s": report.ttft_p90_s,
        "ttft_p99_s": report.ttft_p99_s,
        "tpot_p50_s": report.tpot_p50_s,
        "tpot_p90_s": report.tpot_p90_s,
        "cpu_s": report.cpu_s,
        "wall_s": report.wall_s,
        "req_per_cpu_s": report.req_per_cpu_s,
        "imbalance": imbalance(by_worker, replicas),
    }


def run_fast(requests: list[TraceRequest], engine: EngineConfig, step: TableStepModel, replicas: int,
             policy: str = "round_robin") -> dict[str, Any]:
    """The fast simulator (`FastFleet`: analytic replicas, compiled when built) with a prefix cache
    per replica fed the trace's block ids, no admission control; `affinity` places by those caches."""
    from tools.capacity.fleetsim.fast import FastConfig, FastFleet

    arrivals = [(r.arrival_s, r.input_tokens, r.output_tokens, 0) for r in requests]
    fleet = FastFleet(FastConfig(replicas=replicas, policy=policy, engine=engine, admission=False), arrivals,
                      step_model=step, prefix_blocks=[tuple(r.hash_ids) for r in requests],
                      prefix_block_tokens=MOONCAKE_BLOCK_TOKENS)
    summary = fleet.run()
    engines = [node.replica for node in fleet.nodes.values()]
    prompt = sum(e.prompt_tokens for e in engines)
    return {
        "simulator": f"inferbus FastFleet ({summary.build})", "policy": policy, "replicas": replicas,
        "requests": summary.requests, "completed": summary.completed,
        "hit_rate": sum(e.cached_tokens for e in engines) / prompt if prompt else 0.0,
        "ttft_p50_s": summary.ttft_p50_s, "ttft_p90_s": summary.ttft_p90_s, "ttft_p99_s": summary.ttft_p99_s,
        "tpot_p50_s": summary.tpot_p50_s, "tpot_p90_s": summary.tpot_p90_s,
        "cpu_s": summary.cpu_s, "wall_s": summary.wall_s, "req_per_cpu_s": summary.req_per_cpu_s,
        "imbalance": imbalance({e.name: e.prompt_tokens + e.output_tokens for e in engines}, replicas),
    }


def agreement(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    """Our number over Dynamo's, per metric (1.00 = identical)."""
    keys = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p90_s", "hit_rate")
    return {k: ours[k] / theirs[k] if theirs.get(k) else float("nan") for k in keys}


def compare(requests: list[TraceRequest], engine: EngineConfig, kv_tokens: int, step: TableStepModel,
            table_path: Path, replicas: int, workdir: Path, first: str) -> list[dict[str, Any]]:
    trace_path = workdir / f"trace-{replicas}.jsonl"
    write_mooncake(requests, trace_path)
    mocker = dynamo_engine(engine, kv_tokens, table_path)
    out = []
    for ours_policy, dynamo_mode in PAIRS:
        runs: dict[str, dict[str, Any]] = {}
        order = ("dynamo", "ours") if first == "dynamo" else ("ours", "dynamo")
        for side in order:
            runs[side] = (run_dynamo(trace_path, mocker, replicas, dynamo_mode) if side == "dynamo"
                          else run_ours(requests, engine, step, replicas, ours_policy))
        first = order[1]  # alternate who goes first
        pair: dict[str, Any] = {"replicas": replicas, "ours": runs["ours"], "dynamo": runs["dynamo"],
                                "order": list(order), "ratio": agreement(runs["ours"], runs["dynamo"])}
        # The fast simulator on the same trace, prefix caches per replica.
        pair["fast"] = run_fast(requests, engine, step, replicas, ours_policy)
        pair["fast_ratio"] = agreement(pair["fast"], runs["dynamo"])
        if ours_policy == "round_robin" and replicas <= QUIRKS_UP_TO:
            # Our engine with Dynamo's mocker quirks: how much of the difference they explain.
            pair["quirks"] = run_ours(requests, engine, step, replicas, ours_policy, quirks=True)
            pair["quirks_ratio"] = agreement(pair["quirks"], runs["dynamo"])
        for side in ("ours", "quirks", "fast", "dynamo"):
            if side not in pair:
                continue
            r = pair[side]
            print(
                f"  {replicas:>4} × {r['policy']:<12} {r['simulator']:<18} hit {r['hit_rate']:6.1%}  TTFT p50/p90/p99 "
                f"{r['ttft_p50_s'] * 1e3:7,.0f} / {r['ttft_p90_s'] * 1e3:7,.0f} / {r['ttft_p99_s'] * 1e3:7,.0f} ms  "
                f"TPOT p90 {r['tpot_p90_s'] * 1e3:5.1f} ms  CPU {r['cpu_s']:6.2f} s ({r['req_per_cpu_s']:,.0f} "
                "req/CPU-s)",
                flush=True,
            )
        out.append(pair)
    return out


def router_variants(requests: list[TraceRequest], engine: EngineConfig, kv_tokens: int, table_path: Path,
                    replicas: int, workdir: Path) -> list[dict[str, Any]]:
    """Dynamo's kv_router with other settings on the same requests (cheap: its replay is fast)."""
    trace_path = workdir / f"trace-{replicas}.jsonl"
    out = []
    for config in ROUTER_VARIANTS:
        r = run_dynamo(trace_path, dynamo_engine(engine, kv_tokens, table_path), replicas, "kv_router", config)
        r["router_config"] = config
        print(
            f"  {replicas:>4} × kv_router {config}: hit {r['hit_rate']:6.1%}  TTFT p90 {r['ttft_p90_s'] * 1e3:7,.0f} "
            f"ms  imbalance {r['imbalance']:.2f}",
            flush=True,
        )
        out.append(r)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = roofline(args.gpu, args.tp)
    engine0 = EngineConfig(gpu=args.gpu, tp=args.tp)
    kv_tokens = model.kv_capacity_tokens() // engine0.block_size * engine0.block_size
    table = build_table(model)
    step = TableStepModel(table)
    results: dict[str, Any] = {
        "command": "python -m bench.simulate_vs_dynamo " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": host.platform()},
        "dynamo": dynamo_env.VERSION,
        "engine": {"gpu": args.gpu, "tp": args.tp, "kv_capacity_tokens": kv_tokens, "block_size": engine0.block_size,
                   "chunked_prefill_size": engine0.chunked_prefill_size,
                   "max_running_requests": engine0.max_running_requests,
                   "table": {"prefill_points": len(table.prefill_tokens),
                             "decode_grid": [len(table.decode_kv_tokens), len(table.decode_context)]}},
        "comparisons": [], "large": [],
    }
    with tempfile.TemporaryDirectory(prefix="simulate-vs-dynamo-") as tmp:
        workdir = Path(tmp)
        table_path = workdir / "profile.npz"
        save_npz(table, table_path)
        engine = EngineConfig(gpu=args.gpu, tp=args.tp, kv_capacity_tokens=kv_tokens, profile_table=str(table_path),
                              mixed_chunk=False)
        first = "dynamo"
        for replicas in args.replicas:
            load = build(str(args.trace), engines=replicas, gpu=args.gpu, tp=args.tp, kv_capacity_tokens=kv_tokens,
                         load=args.load, sample_families=args.sample_families, limit=args.requests, seed=args.seed)
            print(f"{replicas} replicas: {len(load.requests)} requests at {load.rate:.2f} req/s", flush=True)
            comparison = {
                "replicas": replicas,
                "workload": load.summary(),
                "pairs": compare(load.requests, engine, kv_tokens, step, table_path, replicas, workdir, first),
            }
            if replicas > 1:
                comparison["kv_router_variants"] = router_variants(load.requests, engine, kv_tokens, table_path,
                                                                   replicas, workdir)
            results["comparisons"].append(comparison)
            first = "ours" if first == "dynamo" else "dynamo"
        if args.speed_seconds > 0:
            print(
                f"speed: {args.speed_replicas} replicas at {args.large_rate:.0f} req/s for {args.speed_seconds:.0f} s",
                flush=True,
            )
            results["speed"] = speed(args, engine, step, kv_tokens, table_path, workdir)
        for replicas in args.large_replicas:
            base = build(str(args.trace), engines=replicas, gpu=args.gpu, tp=args.tp, kv_capacity_tokens=kv_tokens,
                         load=args.load, sample_families=1.0, limit=args.large_requests, seed=args.seed).requests
            requests = workload.at_rate(base, args.large_rate)
            print(f"{replicas} replicas at {args.large_rate:.0f} req/s: {len(requests)} requests", flush=True)
            results["large"].append({"replicas": replicas, "rate_rps": args.large_rate, "requests": len(requests),
                                     "pairs": compare(requests, engine, kv_tokens, step, table_path, replicas,
                                                      workdir, first)})
    return results


def speed(args: argparse.Namespace, engine: EngineConfig, step: TableStepModel, kv_tokens: int, table_path: Path,
          workdir: Path) -> dict[str, Any]:
    """Simulator speed on the fast simulator's own benchmark: 200 replicas, Poisson arrivals at
    833 req/s with Azure-conversation lengths (`bench/simulate.py`), no prefix reuse on either side
    (the fast simulator's replicas take cache hits as a statistic, not from prefixes)."""
    from tools.capacity import mix as mix_mod
    from tools.capacity.fleetsim.day import constant
    from tools.capacity.fleetsim.fast import FastConfig, FastFleet

    mix = mix_mod.load(traces.find("azure_2023_conv.csv"), 0.0)
    arrivals = [(t, i, o, 0) for t, i, o, _ in constant(args.large_rate, args.speed_seconds, mix, seed=1)]
    requests, block = [], 0
    for t, i, o, _ in arrivals:
        blocks = -(-i // MOONCAKE_BLOCK_TOKENS)
        requests.append(TraceRequest(t, i, o, tuple(range(block, block + blocks))))  # no two share a block
        block += blocks
    trace_path = workdir / "speed.jsonl"
    write_mooncake(requests, trace_path)
    replicas = args.speed_replicas
    rows = []
    for side in ("dynamo", "ours", "dynamo", "ours"):  # twice each, alternating; the better of two counts
        if side == "dynamo":
            r = run_dynamo(trace_path, dynamo_engine(engine, kv_tokens, table_path), replicas, "round_robin")
        else:
            summary = FastFleet(FastConfig(replicas=replicas, policy="least_loaded", engine=engine, admission=False),
                                arrivals, step_model=step).run()
            r = {"simulator": "inferbus FastFleet", "policy": "least_loaded", "replicas": replicas,
                 "requests": summary.requests, "ttft_p90_s": summary.ttft_p90_s, "tpot_p90_s": summary.tpot_p90_s,
                 "cpu_s": summary.cpu_s, "req_per_cpu_s": summary.req_per_cpu_s}
        print(f"  speed: {r['simulator']:<18} {r['requests']:,} requests in {r['cpu_s']:.2f} CPU-s "
              f"({r['req_per_cpu_s']:,.0f} req/CPU-s)", flush=True)
        rows.append({k: r[k] for k in ("simulator", "policy", "replicas", "requests", "ttft_p90_s", "tpot_p90_s",
                                       "cpu_s", "req_per_cpu_s")})
    return {"rate_rps": args.large_rate, "virtual_s": args.speed_seconds, "replicas": replicas,
            "mean_input_tokens": sum(a[1] for a in arrivals) / len(arrivals),
            "mean_output_tokens": sum(a[2] for a in arrivals) / len(arrivals), "runs": rows}


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None or seconds != seconds else f"{seconds * 1000:,.0f}"


def _rows(pairs: list[dict[str, Any]]) -> list[str]:
    out = ["| replicas | policy | simulator | hit rate | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 ms | imbalance | "
           "CPU s | req/CPU-s |", "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for pair in pairs:
        for side in ("ours", "quirks", "fast", "dynamo"):
            if side not in pair:
                continue
            r = pair[side]
            out.append(f"| {r['replicas']} | {r['policy']} | {r['simulator']} | {r['hit_rate']:.1%} | "
                       f"{_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p90_s'])} / {_ms(r['ttft_p99_s'])} | "
                       f"{r['tpot_p50_s'] * 1000:.1f} / {r['tpot_p90_s'] * 1000:.1f} | {r['imbalance']:.2f} | "
                       f"{r['cpu_s']:.2f} | "
                       f"{r['req_per_cpu_s']:,.0f} |")
    out += ["", "Ours over Dynamo's (1.00 = the same):", "",
            "| replicas | policies | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | TPOT p90 | hit rate | speed |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for pair in pairs:
        for side, key in (("ours", "ratio"), ("quirks", "quirks_ratio"), ("fast", "fast_ratio")):
            if side not in pair:
                continue
            q = pair[key]
            speed = pair[side]["req_per_cpu_s"] / pair["dynamo"]["req_per_cpu_s"]
            name = {"ours": "FleetSim", "quirks": "FleetSim + mocker quirks", "fast": "FastFleet"}[side]
            out.append(f"| {pair['ours']['replicas']} | {name} {pair[side]['policy']} / {pair['dynamo']['policy']} | "
                       + " | ".join(f"{q[k]:.3f}" for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s",
                                                             "tpot_p90_s", "hit_rate"))
                       + f" | {speed:.3f} |")
    return out


def markdown(results: dict[str, Any]) -> str:
    e = results["engine"]
    out = [
        f"# inferbus simulator against Dynamo {results['dynamo']}'s replay ({results['date']})", "",
        f"Command: `{results['command']}`. Machine: {results['machine']['cpus']} CPUs (shared), Python "
        f"{results['machine']['python']}. Engine on both sides: the profile table of the {e['gpu']} TP{e['tp']} "
        f"roofline ({e['table']['prefill_points']} prefill points, {e['table']['decode_grid'][0]}×"
        f"{e['table']['decode_grid'][1]} decode grid), KV {e['kv_capacity_tokens']:,} tokens in "
        f"{e['block_size']}-token blocks, chunked prefill {e['chunked_prefill_size']}, at most "
        f"{e['max_running_requests']} running requests. Virtual time on both sides; CPU is the replay call "
        "alone (process time). See bench/simulate_vs_dynamo.py.", "",
    ]
    for comparison in results["comparisons"]:
        w = comparison["workload"]
        n = comparison["replicas"]
        out += [f"## {n} replica{'s' if n != 1 else ''}, {w['requests']:,} requests at {w['rate_req_s']:.2f} req/s", "",
                f"Mooncake synthetic, {w['families_kept']} of {w['families_total']} prefix families, mean input "
                f"{w['mean_input_tokens']:,.0f} / output {w['mean_output_tokens']:,.0f} tokens; load "
                f"{w['target_load']:.0%} at perfect-affinity hits (finite-cache bound {w['bound_hit_rate']:.1%}, "
                f"ceiling {w['ceiling_hit_rate']:.1%}).", ""]
        out += _rows(comparison["pairs"]) + [""]
        if comparison.get("kv_router_variants"):
            out += ["Dynamo's kv_router with other settings (`KvRouterConfig`), same requests:", "",
                    "| settings | hit rate | TTFT p50 / p90 / p99 ms | TPOT p90 ms | imbalance |",
                    "| --- | ---: | ---: | ---: | ---: |"]
            for r in comparison["kv_router_variants"]:
                settings = ", ".join(f"{k}={v}" for k, v in r["router_config"].items())
                out.append(f"| {settings} | {r['hit_rate']:.1%} | {_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p90_s'])} / "
                           f"{_ms(r['ttft_p99_s'])} | {r['tpot_p90_s'] * 1000:.1f} | {r['imbalance']:.2f} |")
            out.append("")
    if "speed" in results:
        sp = results["speed"]
        out += [f"## Speed: {sp['replicas']} replicas, Azure-conversation lengths at {sp['rate_rps']:.0f} req/s "
                f"for {sp['virtual_s']:.0f} virtual s", "",
                f"Mean input {sp['mean_input_tokens']:,.0f} / output {sp['mean_output_tokens']:,.0f} tokens, no prefix "
                "reuse. Ours is the fast simulator (`inferbus simulate`: analytic replicas, least-loaded placement); "
                "Dynamo's is its replay (per-step mocker engines, round-robin). Each ran twice, alternating.", "",
                "| simulator | placement | requests | TTFT p90 ms | TPOT p90 ms | CPU s | req/CPU-s |",
                "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in sp["runs"]:
            out.append(f"| {r['simulator']} | {r['policy']} | {r['requests']:,} | {_ms(r['ttft_p90_s'])} | "
                       f"{r['tpot_p90_s'] * 1000:.1f} | {r['cpu_s']:.2f} | {r['req_per_cpu_s']:,.0f} |")
        out.append("")
    for large in results["large"]:
        out += [f"## Scale: {large['replicas']} replicas at {large['rate_rps']:.0f} req/s "
                f"({large['requests']:,} requests, far beyond the fleet's capacity: speed is the point)", ""]
        out += _rows(large["pairs"]) + [""]
    return "\n".join(out) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(p) for p in text.split(",") if p.strip()]

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=None,
                   help="Mooncake JSONL (default: mooncake_synthetic.jsonl, found as tools.capacity.traces.find does)")
    p.add_argument("--gpu", default="H100", choices=["H100", "H200"])
    p.add_argument("--tp", type=int, default=2, choices=[1, 2, 4, 8])
    p.add_argument("--replicas", type=ints, default=[1, 4], help="comma list of fleet sizes (default 1,4)")
    p.add_argument("--load", type=float, default=0.8, help="fleet utilisation at perfect-affinity hits")
    p.add_argument("--sample-families", type=float, default=0.25, help="share of the trace's prefix families kept")
    p.add_argument("--requests", type=int, default=None, help="at most this many requests per comparison")
    p.add_argument("--large-replicas", type=ints, default=[200], help="fleet sizes of the speed runs ('' for none)")
    p.add_argument("--large-rate", type=float, default=833.0, help="arrival rate of the speed runs (req/s)")
    p.add_argument("--large-requests", type=int, default=None, help="at most this many requests in the speed runs")
    p.add_argument("--speed-seconds", type=float, default=10.0,
                   help="virtual seconds of the speed run (Azure chats at --large-rate; 0 skips it)")
    p.add_argument("--speed-replicas", type=int, default=200, help="replicas of the speed run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--name", default="simulate_vs_dynamo", help="result file name (without extension)")
    args = p.parse_args(argv)
    args.trace = traces.find(args.trace or "mooncake_synthetic.jsonl")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_results(args.out, args.name, run(args), markdown)


if __name__ == "__main__":
    main()
