"""`python -m bench.batch`: the batch band's measured proof.

Interactive load alone, then the same interactive load with a large batch beside it: interactive
p90 TTFT and TPOT must stay within 10 % of the interactive-only run while batch consumes ≥ 80 %
of the spare token capacity. Two parts (`--part sim|live|all`):

sim: the per-step fleet simulator (`tools.capacity.fleetsim.FleetSim`: the router's placement policy,
  the sim engine's real scheduler with priority scheduling, and with a batch band the batch
  service's `FeedPolicy` and the workers' `PreemptionPolicy`, unchanged). A fleet of H100 TP2
  replicas (`--replicas`, default 40) sized by the planner: the interactive peak is the rate the
  planner's arithmetic serves on that many replicas (`size_fleet`: per-replica goodput at the SLO,
  p90 TTFT 0.8 s / TPOT 40 ms, × 1.15 headroom). Interactive lengths from the Azure conversation
  trace (no prefix sharing), steady Poisson arrivals at the peak and at `--offpeak-share` of it.
  Per variant: interactive only; interactive + a 50,000-line batch under the adaptive policies
  with their shipped defaults; the same with the `--experiments` (other settings of the same
  policies, or overrides of the worker behaviour the simulator models: `max_prefilling`,
  `engine_priority`); and the oracle sweep:
  interactive + the batch at a fixed batch concurrency per replica (`--oracle-levels`, no feed
  or preemption policy). Everything is measured over the same window (`--warmup` s after the
  start, `--duration` s long; the same interactive arrivals in every run). Batch tokens are
  counted when generated (output) and when a line's first token comes (its prompt, once).

  Spare token capacity, two definitions (batch output tokens per second; input tokens are in the
  JSON too):
  (i) SLO-bound: the fleet's capacity at the SLO (the planner's goodput) minus what interactive
      uses, filled with batch-shaped work: (1 − ρ) × replicas × G_batch × mean batch output,
      ρ = interactive rate ÷ (replicas × G_interactive), G = the planner's per-replica goodput of
      each mix. Filling it would take interactive TPOT up to the SLO, far more than +10 %.
  (ii) oracle: the most batch output tok/s a fixed per-replica batch concurrency gets with
      interactive p90 TTFT and TPOT both within 10 % of the interactive-only run and within the
      SLO (the sweep's best feasible level, and a linear interpolation to the level where the first
      limit is reached exactly, which is the reference the share is computed against).

live: the platform (`inferbus.local.stack.Stack`, as tests/conftest.py starts it) with simulated
  workers at `--time-scale`; an interactive Poisson load through the official `openai` SDK, alone
  and then with a batch submitted through the SDK's files/batches API, alternated `--live-rounds`
  times (the machine is shared: its load drifts); interactive p90 TTFT/TPOT measured client-side,
  batch tokens/s from the batch's `usage` over the measured window. Spare (i) as above for the
  live fleet; spare (ii) from the simulator's oracle sweep for the same replicas and rate.

Writes bench/results/batch.json, batch.md and batch_sim.png (`--quick`: batch_quick.*).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Final

from services.sim_engine.config import EngineConfig
from tools.capacity import mix as mix_mod
from tools.capacity import traces
from tools.capacity.fleetsim import FleetConfig, FleetSim
from tools.capacity.fleetsim.batch import BatchSpec, LineLengths
from tools.capacity.stats import percentile
from tools.capacity.traces import TraceRequest
from tools.commands.simulate import HEADROOM, size_fleet

RESULTS = Path(__file__).parent / "results"
TRACE = "azure_2023_conv.csv"
SLO_TTFT_S = 0.8
SLO_TPOT_S = 0.040
TOLERANCE = 0.10  # interactive p90 may grow by this much
SPARE_TARGET = 0.80
BATCH_LINES = 50_000  # the API's largest batch
# More adaptive runs, each with other settings of the same policies or a worker change (see
# `--experiments`; `max_prefilling` overrides the worker's limit on batch lines in prefill,
# `engine_priority: false` runs engines without priority scheduling, whose workers abort batch lines
# for interactive work stalled in the engine and pull none meanwhile). None by default: the
# shipped defaults now include what the earlier experiments tried (one batch line in prefill per
# worker, engine priority instead of aborts for work waiting in the engine, the step-time cap where
# lines are pulled, a latency budget relative to interactive alone).
DEFAULT_EXPERIMENTS: dict[str, dict[str, object]] = {}


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2), "python": platform.python_version()}


# ---- simulator ----------------------------------------------------------------------------------


def interactive_trace(rate: float, seconds: float, seed: int) -> list[TraceRequest]:
    """Poisson arrivals at `rate` for `seconds`, lengths drawn from the Azure conversation trace."""
    mix = mix_mod.load(traces.find(TRACE), 0.0)
    rng = random.Random(seed)
    t, out = 0.0, list[TraceRequest]()
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        request = mix.sample(rng)
        out.append(TraceRequest(t, request.input_tokens, request.output_tokens))


def planner(replicas: int, engine: EngineConfig) -> dict[str, Any]:
    """The planner's goodput per replica for the interactive and the batch mix, and the peak rate
    a fleet of `replicas` is sized for."""
    interactive = mix_mod.load(traces.find(TRACE), 0.0)
    batch = LineLengths().mix()
    g_int = size_fleet(interactive, engine, 1.0, slo_ttft_s=SLO_TTFT_S, slo_tpot_s=SLO_TPOT_S)
    g_batch = size_fleet(batch, engine, 1.0, slo_ttft_s=SLO_TTFT_S, slo_tpot_s=SLO_TPOT_S)
    return {
        "interactive_goodput_rps": g_int.replica_goodput_rps, "interactive_binding": g_int.binding,
        "interactive_mean_in": interactive.mean_input_tokens, "interactive_mean_out": interactive.mean_output_tokens,
        "batch_goodput_rps": g_batch.replica_goodput_rps, "batch_binding": g_batch.binding,
        "batch_mean_in": batch.mean_input_tokens, "batch_mean_out": batch.mean_output_tokens,
        "peak_rps": replicas * g_int.replica_goodput_rps / HEADROOM,
    }


def window_metrics(sim: FleetSim, start: float, end: float) -> dict[str, Any]:
    jobs = [j for j in sim.jobs if start <= j.arrival_s < end]
    done = [(j, j.first_token_s) for j in jobs if j.status == "completed" and j.first_token_s is not None]
    ttft = [first - j.arrival_s for j, first in done]
    tpot = [(j.finish_s - first) / (j.delivered - 1) for j, first in done if j.delivered > 1 and j.finish_s]
    out: dict[str, Any] = {
        "requests": len(jobs), "completed": len(done),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p90_s": percentile(tpot, 90),
        "interactive_out_tok_s": sum(j.output_tokens for j in jobs) / (end - start),
    }
    if sim.band is not None:
        output, prompt = sim.band.tokens_between(start, end)
        report = sim.band.report()
        out.update({
            "batch_out_tok_s": output / (end - start), "batch_in_tok_s": prompt / (end - start),
            "batch_lines_done": report.completed, "batch_lines_started": report.started,
            "preemptions": report.preemptions, "preempted_lines": report.preempted_lines,
            "engine_retractions": report.engine_retractions, "recompute_tokens": report.recompute_tokens,
        })
    else:
        out.update({"batch_out_tok_s": 0.0, "batch_in_tok_s": 0.0})
    return out


def series(sim: FleetSim, bin_s: float, end: float) -> list[dict[str, Any]]:
    """Per bin: interactive p90 TTFT (by arrival) and TPOT (by finish), batch tok/s and lines running."""
    bins = int(math.ceil(end / bin_s))
    ttft: list[list[float]] = [[] for _ in range(bins)]
    tpot: list[list[float]] = [[] for _ in range(bins)]
    for j in sim.jobs:
        if j.status != "completed" or j.first_token_s is None:
            continue
        i = int(j.arrival_s // bin_s)
        if i < bins:
            ttft[i].append(j.first_token_s - j.arrival_s)
        if j.finish_s and j.finish_s // bin_s < bins and j.delivered > 1:
            tpot[int(j.finish_s // bin_s)].append((j.finish_s - j.first_token_s) / (j.delivered - 1))
    band = sim.band
    running = [0.0] * bins
    counts = [0] * bins
    if band is not None:
        for t, _outstanding, n in band.in_flight_samples:
            i = int(t // bin_s)
            if i < bins:
                running[i] += n
                counts[i] += 1
    rows = []
    for i in range(bins):
        out_tokens = in_tokens = 0
        if band is not None:
            out_tokens, in_tokens = band.tokens_between(i * bin_s, (i + 1) * bin_s)
        rows.append({
            "t": i * bin_s, "ttft_p90_ms": _ms(percentile(ttft[i], 90)), "tpot_p90_ms": _ms(percentile(tpot[i], 90)),
            "batch_out_tok_s": round(out_tokens / bin_s, 1), "batch_in_tok_s": round(in_tokens / bin_s, 1),
            "batch_running": round(running[i] / counts[i], 1) if counts[i] else 0.0,
        })
    return rows


def reason_kind(reason: str) -> str:
    """A FeedState reason without its numbers ("3 request(s) waiting in …" → "request(s) waiting in …")."""
    words = [w for w in reason.split() if not any(ch.isdigit() for ch in w)]
    return " ".join(words[:6])


def spread(sim: FleetSim) -> dict[str, float]:
    """How evenly batch lines sat on the replicas, from the feed-tick samples of the band."""
    samples = sim.band.spread_samples if sim.band is not None else []
    if not samples:
        return {}
    return {"mean_max": sum(mx for _, mx, _ in samples) / len(samples),
            "mean_mean": sum(mean for _, _, mean in samples) / len(samples)}


def _ms(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else round(value * 1000, 2)


def run_sim(job: dict[str, Any]) -> dict[str, Any]:
    """One run: {'variant', 'mode' (interactive|adaptive|fixed), 'level', 'rate', sizes...}."""
    engine = EngineConfig()
    horizon = job["warmup"] + job["duration"]
    trace = interactive_trace(job["rate"], horizon, seed=job["seed"])
    spec = None
    if job["mode"] != "interactive":
        feed_config = preemption_config = None
        experiment = job.get("experiment") or {}
        if experiment:
            from services.batch.feed import FeedConfig
            from services.worker.preemption import PreemptionConfig

            feed_config = FeedConfig(**experiment.get("feed", {}))
            preemption_config = PreemptionConfig(**experiment.get("preemption", {}))
        spec = BatchSpec(lines=job["lines"], seed=job["seed"] + 1, stop_with_interactive=True,
                         fixed_concurrency=job["level"] if job["mode"] == "fixed" else None,
                         feed_config=feed_config, preemption_config=preemption_config, series_bin_s=1.0,
                         max_prefilling=experiment.get("max_prefilling"))
        engine = EngineConfig(priority_scheduling=experiment.get("engine_priority", True))
    config = FleetConfig(replicas=job["replicas"], engine=engine, policy=job["policy"], seed=job["seed"],
                         load_interval_s=0.25)
    cpu0 = time.process_time()
    sim = FleetSim(config, trace, batch=spec)
    report = sim.run()
    cpu = time.process_time() - cpu0
    out = {key: job[key] for key in ("variant", "mode", "level", "rate")}
    out.update(window_metrics(sim, job["warmup"], horizon))
    out.update({"cpu_s": round(cpu, 1), "unfinished": report.unfinished, "failed": report.failed,
                "utilisation": report.utilisation})
    if sim.band is not None and sim.band.feed_states:
        states = [st for t, st in sim.band.feed_states if job["warmup"] <= t < horizon]
        out["feed"] = {
            "ticks": len(states), "paused_share": sum(st.pressure for st in states) / max(1, len(states)),
            "reasons": dict(Counter(reason_kind(st.reason) for st in states).most_common()),
            "mean_target": sum(st.target for st in states) / max(1, len(states)),
            "mean_spare": sum(st.spare for st in states) / max(1, len(states)),
        }
    if sim.band is not None:
        out["batch_per_replica"] = spread(sim)
    if job.get("series"):
        out["series"] = series(sim, 5.0, horizon)
    print(f"  {job['variant']:>8} {job['mode']:>11} {job['level'] if job['level'] is not None else '':>3}: "
          f"TTFT p90 {_ms(out['ttft_p90_s'])} ms, TPOT p90 {_ms(out['tpot_p90_s'])} ms, "
          f"batch {out['batch_out_tok_s']:,.0f} out tok/s, {cpu:.0f} CPU s", flush=True)
    return out


def sim_part(args: argparse.Namespace) -> dict[str, Any]:
    engine = EngineConfig()
    plan = planner(args.replicas, engine)
    variants = {"peak": plan["peak_rps"], "offpeak": plan["peak_rps"] * args.offpeak_share}
    variants = {name: rate for name, rate in variants.items() if name in args.variants}
    common = {"replicas": args.replicas, "warmup": args.warmup, "duration": args.duration, "lines": args.lines,
              "policy": args.policy, "seed": args.seed}
    jobs = []
    for name, rate in variants.items():
        jobs.append({**common, "variant": name, "mode": "interactive", "level": None, "rate": rate, "series": True})
        jobs.append({**common, "variant": name, "mode": "adaptive", "level": None, "rate": rate, "series": True})
        for label, experiment in args.experiments.items():
            jobs.append({**common, "variant": name, "mode": f"experiment: {label}", "level": None, "rate": rate,
                         "experiment": experiment, "series": True})
        for level in args.oracle_levels:
            jobs.append({**common, "variant": name, "mode": "fixed", "level": level, "rate": rate})
    started = time.perf_counter()
    before = machine()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            runs = list(pool.map(run_sim, jobs))
    else:
        runs = [run_sim(job) for job in jobs]
    result: dict[str, Any] = {
        "inputs": {
            **common,
            "gpu": engine.gpu,
            "tp": engine.tp,
            "variants": variants,
            "oracle_levels": args.oracle_levels,
            "experiments": args.experiments,
            "batch_lengths": LineLengths().__dict__,
            "trace": TRACE,
            "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S},
        },
        "planner": plan,
        "machine": {"before": before, "after": machine()},
        "wall_s": round(time.perf_counter() - started, 1),
        "cpu_s": round(sum(r["cpu_s"] for r in runs), 1),
        "variants": {},
    }
    for name, rate in variants.items():
        result["variants"][name] = analyse(name, rate, [r for r in runs if r["variant"] == name], plan, args.replicas)
    return result


def analyse(name: str, rate: float, runs: list[dict[str, Any]], plan: dict[str, Any], replicas: int) -> dict[str, Any]:
    base = next(r for r in runs if r["mode"] == "interactive")
    adaptive = next(r for r in runs if r["mode"] == "adaptive")
    fixed = sorted((r for r in runs if r["mode"] == "fixed"), key=lambda r: r["level"])

    def ratios(run: dict[str, Any]) -> dict[str, float]:
        return {"ttft": run["ttft_p90_s"] / base["ttft_p90_s"], "tpot": run["tpot_p90_s"] / base["tpot_p90_s"]}

    def excess(run: dict[str, Any]) -> float:
        """> 0: past +10 % of the interactive-only p90, or past the SLO itself (either metric)."""
        return max(run["ratio"]["ttft"] - 1 - TOLERANCE, run["ratio"]["tpot"] - 1 - TOLERANCE,
                   run["ttft_p90_s"] / SLO_TTFT_S - 1, run["tpot_p90_s"] / SLO_TPOT_S - 1)

    base["ratio"] = {"ttft": 1.0, "tpot": 1.0}
    experiments = [r for r in runs if r["mode"].startswith("experiment")]
    for run in fixed + [adaptive] + experiments:
        run["ratio"] = ratios(run)
        run["within"] = max(run["ratio"].values()) <= 1 + TOLERANCE
        run["within_slo"] = run["ttft_p90_s"] <= SLO_TTFT_S and run["tpot_p90_s"] <= SLO_TPOT_S
    # (i) SLO-bound spare capacity, in batch-shaped output tokens.
    rho = rate / (replicas * plan["interactive_goodput_rps"])
    spare_i = max(0.0, 1 - rho) * replicas * plan["batch_goodput_rps"] * plan["batch_mean_out"]
    # (ii) the oracle: the best fixed level within +10 % and within the SLO, and a linear
    # interpolation to the level where the first limit is reached exactly.
    feasible = [r for r in fixed if excess(r) <= 0]
    best = max(feasible, key=lambda r: r["batch_out_tok_s"], default=None)
    interpolated = best["batch_out_tok_s"] if best else 0.0
    how = "the best feasible level (every level swept was feasible: a lower bound)" if best else "no level feasible"
    points = [(0, excess(base), 0.0)] + [(r["level"], excess(r), r["batch_out_tok_s"]) for r in fixed]
    for (l0, e0, b0), (l1, e1, b1) in zip(points, points[1:]):
        if e0 <= 0 < e1:
            f = -e0 / (e1 - e0)
            interpolated = max(interpolated, b0 + f * (b1 - b0))
            how = (f"interpolated between levels {l0} and {l1} to where the first limit (+10 % on a p90, or the "
                   "SLO) is reached exactly")
            break
    return {
        "rate_rps": rate, "utilisation_of_slo_capacity": rho, "runs": runs,
        "interactive_only": base, "adaptive": adaptive,
        "spare_i_out_tok_s": spare_i,
        "spare_ii_best_level": best["level"] if best else None,
        "spare_ii_best_out_tok_s": best["batch_out_tok_s"] if best else 0.0,
        "spare_ii_out_tok_s": interpolated, "spare_ii_method": how,
        "share_i": adaptive["batch_out_tok_s"] / spare_i if spare_i else None,
        "share_ii": adaptive["batch_out_tok_s"] / interpolated if interpolated else None,
        "experiments": [{"mode": r["mode"], "batch_out_tok_s": r["batch_out_tok_s"], "within": r["within"],
                         "within_slo": r["within_slo"],
                         "ratio": r["ratio"], "share_i": r["batch_out_tok_s"] / spare_i if spare_i else None,
                         "share_ii": r["batch_out_tok_s"] / interpolated if interpolated else None}
                        for r in experiments],
        "adaptive_within": adaptive["within"], "adaptive_within_slo": adaptive["within_slo"],
    }


# ---- report -----------------------------------------------------------------------------------


def _f(value: float | None, scale: float = 1000.0, digits: int = 1) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value * scale:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def markdown(results: dict[str, Any]) -> str:
    out = ["# Batch on spare capacity: interactive latency vs batch throughput", ""]
    sim = results.get("sim")
    if sim:
        out += sim_markdown(sim)
    live = results.get("live")
    if live:
        out += live_markdown(live)
    return "\n".join(out) + "\n"


def sim_markdown(sim: dict[str, Any]) -> list[str]:
    i, p = sim["inputs"], sim["planner"]
    out = [
        "## Simulator at fleet scale", "", f"`{sim.get('command')}` ({sim.get('date')}).", "",
        f"{i['replicas']} × {i['gpu']} TP{i['tp']} replicas, {i['policy']} placement, the per-step simulator "
        f"(the sim engine's scheduler with priority scheduling; the production `FeedPolicy` and "
        f"`PreemptionPolicy`). Interactive: Azure conversation lengths (mean {p['interactive_mean_in']:.0f} in / "
        f"{p['interactive_mean_out']:.0f} out, no prefix sharing), steady Poisson. The planner's goodput at the SLO "
        f"(p90 TTFT {i['slo']['ttft_s'] * 1000:.0f} ms, TPOT {i['slo']['tpot_s'] * 1000:.0f} ms): "
        f"{p['interactive_goodput_rps']:.2f} interactive req/s per replica ({p['interactive_binding']} binds), so the "
        f"fleet's peak is {p['peak_rps']:.1f} req/s (× 1.15 headroom). Batch: {i['lines']:,} lines, prompts lognormal "
        f"median {i['batch_lengths']['input_median']:.0f} / p90 {i['batch_lengths']['input_p90']:.0f}, outputs median "
        f"{i['batch_lengths']['output_median']:.0f} / p90 {i['batch_lengths']['output_p90']:.0f} (mean "
        f"{p['batch_mean_in']:.0f} in / {p['batch_mean_out']:.0f} out; the planner's batch-mix goodput "
        f"{p['batch_goodput_rps']:.2f} req/s per replica). Window: {i['warmup']:g} s warm-up, then {i['duration']:g} s "
        f"measured; the same interactive arrivals in every run. {sim['cpu_s']:,.0f} CPU s in all.",
        "",
        "| load | run | interactive TTFT p50 / p90 ms (p90 vs alone) | TPOT p50 / p90 ms (p90 vs alone) "
        "| batch out / in tok/s | batch lines done | preemptions |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, v in sim["variants"].items():
        base = v["interactive_only"]
        experiments = [r for r in v["runs"] if r["mode"].startswith("experiment")]
        for run in [base, v["adaptive"]] + experiments + [r for r in v["runs"] if r["mode"] == "fixed"]:
            label = {"interactive": "interactive only", "adaptive": "**+ batch, adaptive (shipped defaults)**",
                     "fixed": f"+ batch, fixed {run['level']} per replica (oracle sweep)"}.get(
                run["mode"], "+ batch, " + run["mode"])
            ratio = run.get("ratio")
            ttft = f"{_f(run['ttft_p50_s'])} / {_f(run['ttft_p90_s'])}" + (
                f" ({ratio['ttft'] - 1:+.1%})" if ratio else ""
            )
            tpot = f"{_f(run['tpot_p50_s'], digits=2)} / {_f(run['tpot_p90_s'], digits=2)}" + (
                f" ({ratio['tpot'] - 1:+.1%})" if ratio else "")
            out.append(f"| {name} {v['rate_rps']:.0f} req/s | {label} | {ttft} | {tpot} "
                       f"| {run['batch_out_tok_s']:,.0f} / {run['batch_in_tok_s']:,.0f} "
                       f"| {run.get('batch_lines_done', 0):,} | {run.get('preemptions', 0):,} |")
    out += ["", "| load | utilisation of SLO capacity | spare (i) SLO-bound, out tok/s | spare (ii) oracle, out tok/s "
            "| adaptive batch out tok/s | share of (i) | share of (ii) | interactive within 10% |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, v in sim["variants"].items():
        a = v["adaptive"]
        out.append(f"| {name} | {v['utilisation_of_slo_capacity']:.0%} | {v['spare_i_out_tok_s']:,.0f} "
                   f"| {v['spare_ii_out_tok_s']:,.0f} (best level {v['spare_ii_best_level']}: "
                   f"{v['spare_ii_best_out_tok_s']:,.0f}) | {a['batch_out_tok_s']:,.0f} | {_pct(v['share_i'])} "
                   f"| {_pct(v['share_ii'])} | {'yes' if v['adaptive_within'] else 'no'}"
                   f"{'' if v.get('adaptive_within_slo', True) else ', past the SLO'} "
                   f"(TTFT {a['ratio']['ttft'] - 1:+.1%}, TPOT {a['ratio']['tpot'] - 1:+.1%}) |")
    if i.get("experiments"):
        out += ["", "Experiments (not what ships: the same policy code with other settings, and `max_prefilling`, a "
                "worker change modelled in the simulator: a worker pulls a batch line only while fewer than that many "
                "of its batch lines are still being prefilled; `engine_priority: false`, engines without priority "
                "scheduling, whose workers abort batch lines for interactive work stalled in the engine):", ""]
        out += [f"- {label}: `{json.dumps(e)}`" for label, e in i["experiments"].items()]
        out += [
            "",
            "| load | experiment | batch out tok/s | share of (i) | share of (ii) | interactive p90 TTFT / TPOT vs "
            "alone |",
            "| --- | --- | ---: | ---: | ---: | --- |",
        ]
        for name, v in sim["variants"].items():
            for e in v.get("experiments", []):
                out.append(f"| {name} | {e['mode'].removeprefix('experiment: ')} | {e['batch_out_tok_s']:,.0f} "
                           f"| {_pct(e['share_i'])} | {_pct(e['share_ii'])} "
                           f"| {e['ratio']['ttft'] - 1:+.1%} / {e['ratio']['tpot'] - 1:+.1%} |")
    out += ["", "Spare token capacity (batch output tokens per second):", "",
            "- (i) SLO-bound: (1 − ρ) × replicas × G_batch × mean batch output, with ρ = interactive rate ÷ "
            "(replicas × G_interactive) and G the planner's per-replica goodput at the SLO for each mix. It is what "
            "the fleet could serve at the SLO minus what interactive uses; using it all would take interactive TPOT "
            "up to the 40 ms SLO, far beyond +10 %.",
            "- (ii) oracle: the most batch output tok/s a fixed per-replica batch concurrency reaches while "
            "interactive p90 TTFT and TPOT both stay within 10 % of the interactive-only run and within the SLO "
            "(at the peak, +10 % TPOT would pass the 40 ms SLO); a sweep without the adaptive policy; "
            + "; ".join(f"{n}: {v['spare_ii_method']}" for n, v in sim["variants"].items()) + ".",
            "", "![interactive latency and batch throughput over time](batch_sim.png)", ""]
    return out


def plot(sim: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = sim["variants"]
    fig, axes = plt.subplots(3, len(variants), figsize=(6.5 * len(variants), 9), sharex=True, squeeze=False)
    for col, (name, v) in enumerate(variants.items()):
        runs = [("interactive only", v["interactive_only"]), ("+ batch, adaptive (shipped)", v["adaptive"])]
        runs += [("+ batch, " + r["mode"].removeprefix("experiment: "), r) for r in v["runs"]
                 if r["mode"].startswith("experiment")]
        t = [row["t"] for row in v["interactive_only"]["series"]]
        for k, (label, run) in enumerate(runs):
            rows = run["series"]
            axes[0][col].plot(t, [row["ttft_p90_ms"] for row in rows], color=f"C{k}", lw=1, label=label)
            axes[1][col].plot(t, [row["tpot_p90_ms"] for row in rows], color=f"C{k}", lw=1, label=label)
            if k:
                axes[2][col].plot(t, [row["batch_out_tok_s"] for row in rows], color=f"C{k}", lw=1, label=label)
        axes[0][col].set_title(f"{name}: {v['rate_rps']:.0f} req/s interactive on {sim['inputs']['replicas']} replicas",
                               fontsize=10)
        axes[0][col].set_ylabel("interactive p90 TTFT ms (5 s bins)")
        axes[1][col].set_ylabel("interactive p90 TPOT ms")
        ax = axes[2][col]
        if v["spare_ii_out_tok_s"]:
            ax.axhline(v["spare_ii_out_tok_s"], color="black", ls=":", lw=0.8, label="spare (ii): oracle at +10 %")
        ax.set_ylabel("batch output tok/s")
        ax.set_xlabel("virtual s (window starts at %g s)" % sim["inputs"]["warmup"])
        for row in axes:
            row[col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- live -------------------------------------------------------------------------------------


CHAT_PATH: Final = "/v1/chat/completions"
MODEL = "meta-llama/Llama-3.3-70B-Instruct"
LIVE_MAX_IN, LIVE_MAX_OUT = 4_096, 1_024  # interactive lengths clipped to keep a live run short


def _content(rng: random.Random, tokens: int) -> str:
    """About `tokens` prompt tokens of chat content (one token per word; the template adds ~30)."""
    from tools.capacity.sweep.prompts import words

    return words(rng, max(1, tokens - 30))


async def interactive_load(
    client: Any, rate: float, seconds: float, seed: int, text_seed: int
) -> list[dict[str, float]]:
    """Poisson chat requests at `rate` for `seconds`, streamed; per request: start, TTFT, TPOT.

    `seed` draws arrivals and lengths, `text_seed` the prompts' words: two runs with one seed
    and two text seeds have the same arrivals and lengths and nothing for a prefix cache to share."""
    import asyncio

    mix = mix_mod.load(traces.find(TRACE), 0.0)
    rng = random.Random(seed)
    text_rng = random.Random(text_seed)
    records: list[dict[str, float]] = []

    async def one(start: float, n_in: int, n_out: int, text: str) -> None:
        first = last = None
        tokens = 0
        try:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=n_out, temperature=0,
                stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].delta.content:
                    if first is None:
                        first = now
                    last = now
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        except Exception as error:  # counted, not fatal: the report shows errors
            records.append({"start": start, "error": 1.0, "message": repr(error)[:200]})  # type: ignore[dict-item]
            return
        record = {"start": start, "error": 0.0, "tokens": float(tokens)}
        if first is not None:
            record["ttft_s"] = first - start
            if last is not None and tokens > 1:
                record["tpot_s"] = (last - first) / (tokens - 1)
        records.append(record)

    tasks = []
    begin = time.perf_counter()
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        request = mix.sample(rng)
        n_in, n_out = min(request.input_tokens, LIVE_MAX_IN), min(request.output_tokens, LIVE_MAX_OUT)
        text = _content(text_rng, n_in)
        delay = begin + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(time.perf_counter(), n_in, n_out, text)))
    await asyncio.gather(*tasks)
    for record in records:
        record["start"] -= begin
    return records


def live_summary(records: list[dict[str, float]], warmup: float) -> dict[str, Any]:
    kept = [r for r in records if r["start"] >= warmup]
    ok = [r for r in kept if not r["error"]]
    ttft = [r["ttft_s"] for r in ok if "ttft_s" in r]
    tpot = [r["tpot_s"] for r in ok if "tpot_s" in r]
    return {"requests": len(kept), "errors": len(kept) - len(ok),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p90_s": percentile(tpot, 90)}


def batch_input(lines: int, seed: int) -> bytes:
    rng = random.Random(seed)
    out = []
    for i, (n_in, n_out) in enumerate(LineLengths().sample(lines, seed)):
        body = {"model": MODEL, "messages": [{"role": "user", "content": _content(rng, n_in)}], "max_tokens": n_out,
                "temperature": 0}
        out.append(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": CHAT_PATH, "body": body}))
    return ("\n".join(out) + "\n").encode()


def live_part(args: argparse.Namespace) -> dict[str, Any]:
    """Interactive alone, then with a batch, on a local platform (see the module docstring).

    The machine is shared, so its load drifts: the two conditions alternate, `--live-rounds`
    times, each round with its own arrivals, the same in both of its runs (a fresh batch each
    round, cancelled at the round's end); the requests of all rounds are pooled per condition.
    """
    import asyncio
    import tempfile
    import threading

    import openai

    from inferbus.local.ports import free_port
    from inferbus.local.stack import Stack, StackConfig
    from tools.commands.local_platform import demo_key
    from tools.commands.main import new_admin_key

    scale = args.time_scale
    engine = EngineConfig()
    plan = planner(args.live_workers, engine)
    virtual_rate = plan["peak_rps"] * args.live_share
    rate = virtual_rate / scale  # wall-clock requests per second
    state = Path(tempfile.mkdtemp(prefix="inferbus-bench-batch-"))
    stack = Stack(StackConfig(state_dir=state, workers=args.live_workers, time_scale=scale, gateway_port=free_port(),
                              admin_key=new_admin_key()))
    result: dict[str, Any] = {
        "inputs": {"workers": args.live_workers, "time_scale": scale, "seconds": args.live_seconds,
                   "warmup_s": args.live_warmup, "rounds": args.live_rounds, "share_of_peak": args.live_share,
                   "rate_wall_rps": rate, "rate_engine_rps": virtual_rate, "batch_lines": args.live_lines,
                   "interactive_clip": [LIVE_MAX_IN, LIVE_MAX_OUT]},
        "planner": plan, "machine": {"before": machine()}, "rounds": [],
    }
    print(f"live: {args.live_workers} workers at time scale {scale}, interactive {rate:.1f} req/s wall", flush=True)
    stack.start(timeout=120)
    try:
        key = asyncio.run(demo_key(stack.redis_url))
        base_url = stack.gateway_url + "/v1"

        async def load(seed: int, text_seed: int) -> list[dict[str, float]]:
            client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
            try:
                return await interactive_load(client, rate, args.live_seconds, seed, text_seed)
            finally:
                await client.close()

        sync = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
        warm(sync)
        pooled: dict[str, list[dict[str, float]]] = {"alone": [], "both": []}
        out_tokens = in_tokens = span = 0.0
        def with_batch(seed: int) -> tuple[list[dict[str, float]], dict[str, Any]]:
            """The interactive load beside a fresh batch (cancelled, and drained, at the end)."""
            file_id = sync.files.create(file=("batch.jsonl", batch_input(args.live_lines, seed + 1)),
                                        purpose="batch").id
            batch = sync.batches.create(input_file_id=file_id, endpoint=CHAT_PATH, completion_window="24h")
            deadline = time.monotonic() + 120
            while batch.status == "validating" and time.monotonic() < deadline:
                time.sleep(0.5)
                batch = sync.batches.retrieve(batch.id)
            if batch.status != "in_progress":
                raise RuntimeError(f"the batch did not start: {batch.status} {batch.errors}")
            samples: list[tuple[float, int, int, int]] = []
            stop = threading.Event()
            t0 = time.perf_counter()

            def sample(batch_id: str = batch.id) -> None:
                while not stop.is_set():
                    b = sync.batches.retrieve(batch_id)
                    usage, counts = b.usage, b.request_counts
                    samples.append((time.perf_counter() - t0, usage.output_tokens if usage else 0,
                                    usage.input_tokens if usage else 0, counts.completed if counts else 0))
                    stop.wait(1.0)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            time.sleep(args.live_warmup)  # the feed ramps up
            started = time.perf_counter() - t0
            both = asyncio.run(load(seed, text_seed=seed + 3))
            stop.set()
            sampler.join(5)
            window = [x for x in samples if x[0] >= started + args.live_warmup]
            info: dict[str, Any] = {"batch_id": batch.id, "usage_series": samples, "window": window}
            sync.batches.cancel(batch.id)
            deadline = time.monotonic() + 90
            final = sync.batches.retrieve(batch.id)
            while final.status not in ("cancelled", "completed", "failed", "expired") and time.monotonic() < deadline:
                time.sleep(1.0)
                final = sync.batches.retrieve(batch.id)
            info["status_after_cancel"] = final.status
            info["counts_after_cancel"] = final.request_counts.model_dump() if final.request_counts else None
            return both, info

        for round_no in range(args.live_rounds):
            seed = args.seed + 100 * round_no
            # ABBA: odd rounds run the batch first, so that a drift of the machine's speed over the
            # run weighs on both conditions alike.
            batch_first = round_no % 2 == 1
            load_before = os.getloadavg()[0]
            if batch_first:
                both, info = with_batch(seed)
                alone = asyncio.run(load(seed, text_seed=seed + 2))
            else:
                alone = asyncio.run(load(seed, text_seed=seed + 2))
                both, info = with_batch(seed)
            pooled["alone"] += [r for r in alone if r["start"] >= args.live_warmup]
            pooled["both"] += [r for r in both if r["start"] >= args.live_warmup]
            window = info.pop("window")
            row: dict[str, Any] = {"round": round_no, "batch_first": batch_first,
                                   "alone": live_summary(alone, args.live_warmup),
                                   "with_batch": live_summary(both, args.live_warmup),
                                   "loadavg_1m": [load_before, os.getloadavg()[0]], **info}
            if len(window) >= 2:
                d_span = window[-1][0] - window[0][0]
                out_tokens += window[-1][1] - window[0][1]
                in_tokens += window[-1][2] - window[0][2]
                span += d_span
                row["batch_out_tok_s_wall"] = (window[-1][1] - window[0][1]) / d_span
                row["batch_lines_done_in_window"] = window[-1][3] - window[0][3]
            row["ratio"] = {
                key: row["with_batch"][f"{key}_p90_s"] / row["alone"][f"{key}_p90_s"] for key in ("ttft", "tpot")
            }
            result["rounds"].append(row)
            print(f"  round {round_no}: alone {row['alone']['ttft_p90_s']:.3f} / {row['alone']['tpot_p90_s']:.4f} s, "
                  f"with batch {row['with_batch']['ttft_p90_s']:.3f} / {row['with_batch']['tpot_p90_s']:.4f} s, "
                  f"batch {row.get('batch_out_tok_s_wall', 0):,.0f} out tok/s, load {row['loadavg_1m'][0]:.1f} / "
                  f"{row['loadavg_1m'][1]:.1f}", flush=True)
        a = result["interactive_only"] = live_summary(pooled["alone"], 0.0)
        b = result["with_batch"] = live_summary(pooled["both"], 0.0)
        result["batch_out_tok_s_wall"] = out_tokens / span if span else 0.0
        result["batch_in_tok_s_wall"] = in_tokens / span if span else 0.0
        result["ratio"] = {"ttft": b["ttft_p90_s"] / a["ttft_p90_s"], "tpot": b["tpot_p90_s"] / a["tpot_p90_s"]}
        # Paired: each round's two runs have the same arrivals and follow each other; the geometric
        # mean of their ratios leaves out the drift between rounds that pooled percentiles mix in.
        result["paired_ratio"] = {key: math.exp(sum(math.log(r["ratio"][key]) for r in result["rounds"])
                                                / len(result["rounds"])) for key in ("ttft", "tpot")}
        # (i) SLO-bound spare, in engine time, turned into wall-clock tokens per second.
        rho = virtual_rate / (args.live_workers * plan["interactive_goodput_rps"])
        spare_i = max(0.0, 1 - rho) * args.live_workers * plan["batch_goodput_rps"] * plan["batch_mean_out"] / scale
        result["spare_i_out_tok_s_wall"] = spare_i
        result["share_i"] = result["batch_out_tok_s_wall"] / spare_i if spare_i else None
        oracle = live_oracle(args, virtual_rate)
        result["sim_oracle"] = oracle
        spare_ii = oracle["spare_ii_out_tok_s"] / scale
        result["spare_ii_out_tok_s_wall"] = spare_ii
        result["share_ii"] = result["batch_out_tok_s_wall"] / spare_ii if spare_ii else None
    finally:
        result["machine"]["after"] = machine()
        stack.stop()
        if os.environ.get("INFERBUS_KEEP_LOGS") is None:
            stack.rmtree()
        else:
            result["logs"] = str(state)
    return result


def live_oracle(args: argparse.Namespace, virtual_rate: float) -> dict[str, Any]:
    """Spare (ii) for the live fleet, from the simulator: the same replicas and interactive rate (in
    engine time), the oracle sweep of fixed batch lines per replica (a live sweep would take hours)."""
    common = {"replicas": args.live_workers, "warmup": 20.0, "duration": 120.0, "lines": 5_000,
              "policy": "least_loaded", "seed": args.seed, "variant": "live", "rate": virtual_rate}
    runs = [run_sim({**common, "mode": "interactive", "level": None}),
            run_sim({**common, "mode": "adaptive", "level": None})]
    runs += [run_sim({**common, "mode": "fixed", "level": level}) for level in (2, 4, 6, 8, 10)]
    out = analyse("live", virtual_rate, runs, planner(args.live_workers, EngineConfig()), args.live_workers)
    return {key: out[key] for key in ("spare_i_out_tok_s", "spare_ii_out_tok_s", "spare_ii_best_level",
                                      "spare_ii_method", "share_ii")} | {
        "levels": [{"level": r["level"], "ratio": r["ratio"], "batch_out_tok_s": r["batch_out_tok_s"]}
                   for r in runs if r["mode"] == "fixed"],
        "sim_adaptive_batch_out_tok_s": out["adaptive"]["batch_out_tok_s"]}


def warm(client: Any) -> None:
    """A few requests so that every process has its connections before the clock starts."""
    for _ in range(4):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4)


def live_markdown(live: dict[str, Any]) -> list[str]:
    i = live.get("inputs")
    if not i:
        return ["## Live, with the platform", "", f"Not measured: {live.get('error')}", ""]
    a, b = live.get("interactive_only"), live.get("with_batch")
    out = ["## Live, with the platform", "", f"`{live.get('command')}` ({live.get('date')}).", "",
           f"`inferbus.local.stack.Stack` (NATS, Redis, gateway, router, billing, batch service, {i['workers']} "
           f"workers with simulated H100 TP2 engines at time scale {i['time_scale']}: an engine second takes "
           f"{i['time_scale']} s). Interactive: Azure conversation lengths (clipped to {i['interactive_clip'][0]} / "
           f"{i['interactive_clip'][1]} tokens), Poisson at {i['rate_wall_rps']:.1f} req/s wall "
           f"({i['rate_engine_rps']:.2f} req/s of engine time, "
           f"{i['share_of_peak']:.0%} of the planner's peak for {i['workers']} replicas), streamed with the openai "
           f"SDK, {i['seconds']:g} s per run, the first {i['warmup_s']:g} s left out; latencies client-side in wall "
           f"time. Batch: {i['batch_lines']:,} chat lines through `files.create` + `batches.create`, tokens/s from the "
           f"batch's `usage` over the measured window.", ""]
    if not (a and b):
        return out + [f"Not measured: {live.get('error', 'no result')}", ""]
    out += ["| run | requests | TTFT p50 / p90 ms (p90 vs alone) | TPOT p50 / p90 ms (p90 vs alone) | errors "
            "| batch out / in tok/s (wall) |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
            f"| interactive only | {a['requests']} | {_f(a['ttft_p50_s'])} / {_f(a['ttft_p90_s'])} "
            f"| {_f(a['tpot_p50_s'], digits=2)} / {_f(a['tpot_p90_s'], digits=2)} | {a['errors']} | – |",
            f"| + batch | {b['requests']} | {_f(b['ttft_p50_s'])} / {_f(b['ttft_p90_s'])} "
            f"({live['ratio']['ttft'] - 1:+.1%}) "
            f"| {_f(b['tpot_p50_s'], digits=2)} / {_f(b['tpot_p90_s'], digits=2)} ({live['ratio']['tpot'] - 1:+.1%}) "
            f"| {b['errors']} "
            f"| {live.get('batch_out_tok_s_wall', 0):,.0f} / {live.get('batch_in_tok_s_wall', 0):,.0f} |", ""]
    paired = live.get("paired_ratio")
    if paired:
        out += [f"**Paired over the rounds** (geometric mean of each round's with-batch / alone p90, the two runs of a "
                f"round having the same arrivals and following each other): TTFT {paired['ttft'] - 1:+.1%}, TPOT "
                f"{paired['tpot'] - 1:+.1%}. The pooled row above mixes rounds whose alone baselines differ "
                "(the machine's load drifts), so it is shown but not the verdict.", ""]
    out += ["Per round (p90 TTFT / TPOT ms; the machine's 1-minute load average before and after the round):", "",
            "| round | order | alone | with batch | TTFT / TPOT vs alone | batch out tok/s | load avg | batch after "
            "cancel |",
            "| ---: | --- | --- | --- | --- | ---: | --- | --- |"]
    for row in live.get("rounds", []):
        ra, rb = row["alone"], row["with_batch"]
        ratio = row.get("ratio") or {k: rb[f"{k}_p90_s"] / ra[f"{k}_p90_s"] for k in ("ttft", "tpot")}
        order = "batch, alone" if row.get("batch_first") else "alone, batch"
        out.append(f"| {row['round']} | {order} | {_f(ra['ttft_p90_s'])} / {_f(ra['tpot_p90_s'], digits=2)} "
                   f"| {_f(rb['ttft_p90_s'])} / {_f(rb['tpot_p90_s'], digits=2)} "
                   f"| {ratio['ttft'] - 1:+.1%} / {ratio['tpot'] - 1:+.1%} | {row.get('batch_out_tok_s_wall', 0):,.0f} "
                   f"| {row['loadavg_1m'][0]:.1f} / {row['loadavg_1m'][1]:.1f} | {row.get('status_after_cancel')} "
                   f"{row.get('counts_after_cancel')} |")
    oracle = live.get("sim_oracle") or {}
    out += [
        "",
        f"Spare (i), SLO-bound, for this load: {live['spare_i_out_tok_s_wall']:,.0f} output tok/s wall; the batch "
        f"used {_pct(live['share_i'])} of it. Spare (ii), the oracle, from the simulator for the same "
        f"{i['workers']} replicas and rate (a live sweep would take hours): "
        f"{live.get('spare_ii_out_tok_s_wall', 0):,.0f} output "
        f"tok/s wall ({oracle.get('spare_ii_method', '')}); the batch used {_pct(live.get('share_ii'))} of it. "
        "(The simulator's own adaptive run on that fleet: "
        f"{oracle.get('sim_adaptive_batch_out_tok_s', 0) / i['time_scale']:,.0f} "
        "tok/s wall.)",
        "",
    ]
    return out


# ---- main -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--part", choices=["sim", "live", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="a small fleet and short windows (a CI-like check)")
    parser.add_argument("--replicas", type=int, default=40)
    parser.add_argument("--variants", default="peak,offpeak", help="comma-separated: peak, offpeak")
    parser.add_argument("--offpeak-share", type=float, default=0.5, help="off-peak rate as a share of the peak")
    parser.add_argument("--warmup", type=float, default=30.0, help="virtual seconds before the measured window")
    parser.add_argument("--duration", type=float, default=100.0, help="measured virtual seconds")
    parser.add_argument("--lines", type=int, default=BATCH_LINES)
    parser.add_argument("--oracle-levels", default="2,4,6,8", help="fixed batch lines per replica to sweep")
    parser.add_argument("--policy", default="least_loaded", choices=["least_loaded", "affinity", "round_robin"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--experiments", type=json.loads, default=DEFAULT_EXPERIMENTS,
                        help="JSON {name: {feed: {FeedConfig fields}, preemption: {PreemptionConfig fields}, "
                             "max_prefilling: n}}: one more adaptive run per load for each ('{}': none)")
    parser.add_argument("--jobs", type=int, default=1, help="simulator runs in parallel processes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--live-workers", type=int, default=2)
    parser.add_argument("--time-scale", type=float, default=1.0, help="live: wall seconds per engine second")
    parser.add_argument("--live-share", type=float, default=0.5, help="live: interactive rate as a share of the peak")
    parser.add_argument("--live-seconds", type=float, default=45.0, help="live: seconds of interactive load per run")
    parser.add_argument("--live-warmup", type=float, default=10.0, help="live: seconds left out at the start of a run")
    parser.add_argument("--live-lines", type=int, default=3_000)
    parser.add_argument("--live-rounds", type=int, default=2, help="live: alone / with-batch pairs, alternated")
    args = parser.parse_args()
    if args.quick:
        args.replicas, args.warmup, args.duration, args.lines = 8, 15.0, 45.0, 5_000
        args.oracle_levels = "4,8"
        args.live_seconds, args.live_lines, args.live_rounds = 30.0, 1_000, 1
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.oracle_levels = [int(v) for v in str(args.oracle_levels).split(",") if v.strip()]
    stem = "batch_quick" if args.quick else "batch"
    path = args.out / f"{stem}.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    command = "python -m bench.batch " + " ".join(sys.argv[1:])
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part in ("sim", "all"):
        results["sim"] = sim_part(args) | {"command": command, "date": date}
        plot(results["sim"], args.out / f"{stem}_sim.png")
    if args.part in ("live", "all"):
        try:
            results["live"] = live_part(args) | {"command": command, "date": date}
        except Exception as error:  # the report says what is missing rather than nothing at all
            results["live"] = {"error": f"{type(error).__name__}: {error}", "inputs": None}
            print(f"live part failed: {error!r}", flush=True)
    path.write_text(json.dumps(results, indent=2, default=float) + "\n")
    text = markdown(results).replace("batch_sim.png", f"{stem}_sim.png")
    (args.out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
