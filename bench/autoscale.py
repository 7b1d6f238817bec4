"""`python -m bench.autoscale`: the autoscaler's measured proof in the fast fleet simulator.

Two scenarios, each against three fleets, all with cold start 120 s and warm start 5 s, H100 TP2
replicas, least-loaded placement, the gateway's admission control, $2.50 per GPU-hour:

- day: the Azure conversation trace's per-minute rate shape tiled hour after hour under the
  diurnal envelope (night at 35 % of the peak at 04:00, peak at 16:00), the busiest minute at
  833 req/s: exactly `bench/simulate.py`'s day (same arrivals, seed 0), 24 h, 31.6 M requests,
  ~20 CPU-minutes per autoscaled fleet. The static fleet's day is that bench's result
  (bench/results/simulate_day.json: same arrivals on the same 121 replicas; a static fleet starts
  nothing, so cold starts do not change it), not re-run. `--hours H` below 24 compresses the
  envelope into H hours, with the request rate not compressed (steeper ramps); `--quick`: 1 h.
- spike: Poisson arrivals at a steady 833 / 3 req/s that triple (to 833 req/s) for 60 s at
  minute 10, then return; 20 minutes in all (`--quick`: spike at minute 5, 11 minutes).

Fleets:
- static: sized for the 833 req/s peak by the planner's arithmetic (`size_fleet`, as
  `bench/simulate.py`: the planner's per-replica goodput × 1.15 headroom); never changes.
- threshold: `services.autoscaler.threshold.ThresholdController`, KEDA/HPA-like (waiting
  requests per replica > 5, HPA formula, tolerance and stabilisation windows; cold starts only).
- autoscaler: `services.autoscaler.simulated.PolicyController` running `AutoscalePolicy` (SLO
  pressure, forecast-driven capacity at the planner's goodput, warm pool, slow scale-down).
- threshold-floor (spike only): the threshold policy with minReplicas at the starting need, so
  it does not drop the fleet whenever nothing waits.
Both autoscaled fleets start with the replicas the planner's arithmetic gives for the scenario's
starting rate, and min 1 replica.

Writes bench/results/autoscale.md, autoscale.json and autoscale_<scenario>.png (`--quick`:
autoscale_quick*). `--scenario`/`--fleet` run a part, `--stem`/`--out` name its output, and
`--from a.json b.json …` rebuilds the report from parts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.autoscaler.policy import PolicyConfig
from services.autoscaler.simulated import PolicyController
from services.autoscaler.threshold import ThresholdConfig, ThresholdController
from services.sim_engine.config import EngineConfig
from tools.capacity import mix as mix_mod
from tools.capacity import traces
from tools.capacity.fleetsim.day import Arrival, DayWorkload, diurnal, rate_shape
from tools.capacity.fleetsim.fast import FastConfig, FastFleet, StaticController
from tools.commands.simulate import size_fleet

RESULTS = Path(__file__).parent / "results"
TRACE = "azure_2023_conv.csv"
PEAK_RPS = 833.0
PRICE = 2.50
COLD_START_S = 120.0
WARM_START_S = 5.0
CACHED_FRACTION = 0.3
FLEETS = ("static", "threshold", "autoscaler")
EXTRA = {"spike": ("threshold-floor",)}  # cheap enough to run only on the short scenario


@dataclass
class CompressedDay(DayWorkload):
    """`DayWorkload` "tile" with the diurnal envelope's 24 h compressed into the run's duration."""

    envelope_day_s: float = 86_400.0

    def _raw_rates(self) -> list[tuple[float, float, float]]:
        out, t, i = [], 0.0, 0
        squeeze = 86_400.0 / self.envelope_day_s
        while t < self.duration_s:
            end = min(t + self.bin_s, self.duration_s)
            rate = self.shape[i % len(self.shape)] * diurnal((t + end) / 2 * squeeze, self.trough, self.trough_hour)
            out.append((t, end, rate))
            t, i = end, i + 1
        return out


def _spike(base_rps: float, factor: float, spike_at_s: float, spike_s: float, duration_s: float, mix: mix_mod.Mix,
           seed: int = 0) -> Iterator[Arrival]:
    """Piecewise-constant Poisson arrivals: base, base × factor for spike_s, base."""
    rng = random.Random(seed)
    for start, end, rate in ((0.0, spike_at_s, base_rps), (spike_at_s, spike_at_s + spike_s, base_rps * factor),
                             (spike_at_s + spike_s, duration_s, base_rps)):
        t = start + rng.expovariate(rate)
        while t < end:
            request = mix.sample(rng)
            yield t, request.input_tokens, request.output_tokens, request.cached_tokens
            t += rng.expovariate(rate)


class Recorder:
    """Wraps a controller; records the fleet by phase and the arrival rate at every call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.interval_s = inner.interval_s
        self.rows: list[tuple[float, float, int, int, int, int]] = []  # t, req/s, serving, warm, starting, draining

    def decide(self, signals: Any, fleet: Any) -> None:
        self.rows.append((round(signals.t, 1), round(signals.arrival_rps, 1), signals.serving, signals.warm,
                          signals.starting, signals.draining))
        self.inner.decide(signals, fleet)


def scenario_inputs(name: str, quick: bool, hours: float) -> dict[str, Any]:
    if name == "day":
        hours = 1.0 if quick else hours
        envelope = ("the 24 h diurnal envelope (night at 35 % of the peak at 04:00, peak at 16:00)" if hours == 24 else
                    f"the 24 h diurnal envelope (night at 35 % of the peak at 04:00, peak at 16:00) compressed into "
                    f"{hours:g} h; the request rate is not compressed")
        return {
            "scenario": "day",
            "duration_s": hours * 3600,
            "peak_rps": PEAK_RPS,
            "trough": 0.35,
            "hours": hours,
            "envelope": f"The Azure conversation trace's per-minute rate shape tiled hour after hour under {envelope}, "
            "the busiest minute at 833 req/s; seed 0 (as bench/simulate.py's day)",
        }
    spike_at = 300.0 if quick else 600.0
    duration = 660.0 if quick else 1200.0
    return {"scenario": "spike", "duration_s": duration, "base_rps": round(PEAK_RPS / 3, 2), "factor": 3.0,
            "spike_at_s": spike_at, "spike_s": 60.0, "peak_rps": PEAK_RPS}


def arrivals_for(inputs: dict[str, Any], mix: mix_mod.Mix, path: Path) -> tuple[Iterator[Arrival], float, float]:
    """The arrival stream, the rate at t = 0 and the expected request count."""
    if inputs["scenario"] == "day":
        work = CompressedDay(rate_shape(traces.load(path), 60.0), 60.0, inputs["duration_s"], PEAK_RPS, mix,
                             trough=inputs["trough"], trough_hour=4.0, seed=0, envelope_day_s=inputs["duration_s"])
        bins = work.rates()
        return work.arrivals(), bins[0][2], work.expected_requests()
    base = inputs["base_rps"]
    expected = base * inputs["duration_s"] + base * (inputs["factor"] - 1) * inputs["spike_s"]
    return (_spike(base, inputs["factor"], inputs["spike_at_s"], inputs["spike_s"], inputs["duration_s"], mix, seed=0),
            base, expected)




def policy_config(goodput: float, overrides: dict[str, float] | None = None) -> PolicyConfig:
    """The autoscaler's settings: the planner's goodput, the scenario's start
    times, serving bounds well above the peak, a warm pool of at most 15 sized from the ramp (no
    burst memory: a pool sized for the day's largest burst cost more than it saved); everything
    else `PolicyConfig`'s defaults (unless `--set` overrides them)."""
    settings: dict[str, Any] = {"goodput_rps": round(goodput, 2), "cold_start_s": COLD_START_S,
                                "warm_start_s": WARM_START_S, "max_serving": 200, "max_warm": 14, "max_replicas": 240,
                                "burst_memory_s": 0.0, **(overrides or {})}
    return PolicyConfig(**settings)


def run_one(args: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    fleet_name, inputs = args
    path = traces.find(TRACE)
    mix = mix_mod.load(path, CACHED_FRACTION)
    engine = EngineConfig()
    sizing = size_fleet(mix, engine, PEAK_RPS)
    arrivals, rate0, expected = arrivals_for(inputs, mix, path)
    start = max(1, math.ceil(rate0 * 1.15 / sizing.replica_goodput_rps - 1e-9))
    if fleet_name == "static":
        controller: Any = StaticController(interval_s=15.0)
        replicas = sizing.replicas
    elif fleet_name == "threshold":
        controller = ThresholdController(ThresholdConfig(min_replicas=1, max_replicas=240))
        replicas = start
    elif fleet_name == "threshold-floor":
        # The same, with minReplicas at the starting need: how an operator keeps a queue-length
        # HPA from dropping the fleet whenever nothing waits.
        controller = ThresholdController(ThresholdConfig(min_replicas=start, max_replicas=240))
        replicas = start
    else:
        controller = PolicyController(
            policy_config(sizing.replica_goodput_rps, inputs.get("overrides")), interval_s=5.0
        )
        replicas = start
    recorder = Recorder(controller)
    config = FastConfig(replicas=replicas, engine=engine, price_per_gpu_hour=PRICE, cold_start_s=COLD_START_S,
                        warm_start_s=WARM_START_S)
    last = [0.0]

    def progress(now: float) -> None:
        if now - last[0] >= 3600:
            last[0] = now
            print(f"  {inputs['scenario']} {fleet_name}: virtual {now / 3600:.0f} h", flush=True)

    summary = FastFleet(config, arrivals, controller=recorder, progress=progress).run()
    series = [{"t": mn.t_s, "arrivals": mn.arrivals, "rejected": mn.rejected, "completed": mn.completed,
               "ttft_p90_ms": _ms(mn.ttft_p90_s), "tpot_p90_ms": _ms(mn.tpot_p90_s), "serving": mn.serving,
               "started": mn.started, "within_slo": mn.within_slo} for mn in summary.series]
    out: dict[str, Any] = {
        "fleet": fleet_name, "scenario": inputs["scenario"], "initial_replicas": replicas,
        "expected_requests": round(expected), "summary": summary.as_dict(series=False), "series": series,
        "controls": recorder.rows, "peak_billed": max([r[2] + r[3] + r[4] + r[5] for r in recorder.rows] + [replicas]),
    }
    if fleet_name == "autoscaler":
        decisions = controller.decisions
        changes = [d for d in decisions if d.direction != "hold"]
        out["decisions"] = {"total": len(decisions), "up": sum(d.direction == "up" for d in decisions),
                            "down": sum(d.direction == "down" for d in decisions),
                            "examples": [f"t={d.at:.0f}s {d.reason}" for d in _examples(changes)]}
        out["config"] = {k: getattr(controller.policy.config, k) for k in controller.policy.config.__dataclass_fields__}
    elif fleet_name.startswith("threshold"):
        decisions = controller.decisions
        changes = [d for d in decisions if d.desired != d.replicas]
        out["decisions"] = {"total": len(decisions), "up": sum(d.desired > d.replicas for d in decisions),
                            "down": sum(d.desired < d.replicas for d in decisions),
                            "examples": [f"t={d.at:.0f}s {d.reason}" for d in _examples(changes)]}
        out["config"] = {k: getattr(controller.policy.config, k) for k in controller.policy.config.__dataclass_fields__}
    out["sizing"] = {"replicas": sizing.replicas, "goodput_rps": round(sizing.replica_goodput_rps, 3),
                     "method": sizing.method}
    print(f"  {inputs['scenario']:>5} {fleet_name:>10}: {summary.minute_attainment:.2%} minutes, "
          f"{summary.request_attainment:.2%} requests, {summary.gpu_hours:,.1f} GPU-h, "
          f"{summary.cpu_s:,.0f} CPU s", flush=True)
    return out


def _examples(changes: list[Any]) -> list[Any]:
    if len(changes) <= 6:
        return changes
    ups = [d for d in changes if "scale up" in d.reason][:3]
    downs = [d for d in changes if "scale down" in d.reason][:3]
    return ups + downs


def _ms(value: float) -> float | None:
    return None if value is None or math.isnan(value) or math.isinf(value) else round(value * 1000, 1)


# ---- report ------------------------------------------------------------------------------------


def table(runs: list[dict[str, Any]]) -> list[str]:
    static = next((r for r in runs if r["fleet"] == "static"), None)
    lines = [
        "| fleet | minutes within SLO | requests within SLO | shed | TTFT p90 / p99 ms | GPU-hours | vs static | cost "
        "| peak serving | peak billed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        s = r["summary"]
        share = f"{s['gpu_hours'] / static['summary']['gpu_hours']:.1%}" if static else "–"
        lines.append(
            f"| {r['fleet']} | {s['minute_attainment']:.2%} of {s['minutes']} | {s['request_attainment']:.2%} "
            f"| {s['rejected']:,} | {_fmt(s['ttft_p90_s'])} / {_fmt(s['ttft_p99_s'])} | {s['gpu_hours']:,.1f} | "
            f"{share} | ${s['cost_usd']:,.0f} | {s['peak_serving']} | {r['peak_billed']} |")
    return lines


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:,.0f}"


def plot(scenario: str, runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    day = scenario == "day"
    unit, div = ("h", 3600.0) if day else ("min", 60.0)
    fig, axes = plt.subplots(len(runs) + 1, 1, figsize=(11, 2.6 * (len(runs) + 1)), sharex=True)
    for ax, r in zip(axes, runs):
        rows = r["controls"]
        t = [row[0] / div for row in rows]
        serving = [row[2] for row in rows]
        warm = [row[3] for row in rows]
        starting = [row[4] for row in rows]
        draining = [row[5] for row in rows]
        ax.stackplot(t, serving, warm, starting, draining, labels=["serving", "warm", "starting", "draining"],
                     colors=["#4c72b0", "#55a868", "#dd8452", "#c0c0c0"], step="post", alpha=0.85)
        ax.set_ylabel("replicas")
        twin = ax.twinx()
        minutes = r["series"]
        twin.plot([mn["t"] / div for mn in minutes], [mn["arrivals"] / 60 for mn in minutes], color="black", lw=0.8,
                  label="arrivals req/s (per minute)")
        twin.set_ylabel("req/s")
        twin.set_ylim(bottom=0)
        ax.set_ylim(bottom=0)
        s = r["summary"]
        ax.set_title(f"{r['fleet']}: {s['minute_attainment']:.2%} of minutes within SLO, {s['gpu_hours']:,.0f} GPU-h, "
                     f"${s['cost_usd']:,.0f}", fontsize=9)
        ax.legend(loc="upper left", fontsize=7)
        twin.legend(loc="upper right", fontsize=7)
    ax = axes[-1]
    top = 60_000.0  # minutes whose p90 is a shed request (infinite) or beyond a minute, drawn here
    for r in runs:
        minutes = r["series"]
        ax.plot(
            [mn["t"] / div for mn in minutes],
            [
                min(top, mn["ttft_p90_ms"])
                if mn["ttft_p90_ms"] is not None
                else (top if mn["arrivals"] or mn["completed"] else math.nan)
                for mn in minutes
            ],
            lw=0.9,
            label=f"{r['fleet']} p90 TTFT",
        )
    ax.axhline(800, color="red", ls=":", lw=0.8, label="SLO 800 ms")
    ax.axhline(top, color="grey", ls=":", lw=0.6, label="≥ 60 s or > 10 % shed")
    ax.set_yscale("log")
    ax.set_ylabel("p90 TTFT per minute (ms)")
    ax.set_xlabel(f"virtual time ({unit})")
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(data: dict[str, Any]) -> str:
    lines = ["# Autoscaler proof in the fast fleet simulator", "",
             "Produced by `python -m bench.autoscale" + (" --quick" if data["quick"] else "") +
             "` (see its docstring and docs/autoscaling.md). "
             f"Cold start {COLD_START_S:g} s, warm start {WARM_START_S:g} s, H100 TP2, least-loaded placement, "
             f"admission control on, ${PRICE:.2f}/GPU-hour. SLO: p90 TTFT ≤ 800 ms and p90 TPOT ≤ 40 ms per minute; "
             "a request is within SLO if its TTFT and TPOT are (a shed request is not).", "",
             f"Machine: {data['machine']}. Bench CPU: {data['bench_cpu_s']} s.", ""]
    if data.get("commands"):
        lines += (
            ["Run in pieces (two cores shared with other work) and merged:", "", "```"] + data["commands"] + ["```", ""]
        )
    for scenario in data["scenarios"]:
        runs = [r for r in data["runs"] if r["scenario"] == scenario["scenario"]]
        if not runs:
            continue
        if scenario["scenario"] == "day":
            lines += [f"## Day: Azure conversation shape, 833 req/s peak, {scenario['duration_s'] / 3600:g} h", "",
                      f"{scenario['envelope']}. Expected requests: {runs[0]['expected_requests']:,}.", ""]
        else:
            lines += [f"## Spike: {scenario['base_rps']} req/s, ×{scenario['factor']:g} for {scenario['spike_s']:g} s "
                      f"at t = {scenario['spike_at_s']:g} s, {scenario['duration_s'] / 60:g} min", "",
                      f"Expected requests: {runs[0]['expected_requests']:,}.", ""]
        lines += table(runs) + [""]
        lines += [f"{r['fleet']}: from {r['source']}, not re-run (no per-minute series in the plot)." for r in runs
                  if r.get("source")]
        lines += ["", f"![{scenario['scenario']}](autoscale_{scenario['scenario']}.png)", ""]
        for r in runs:
            if "decisions" in r:
                d = r["decisions"]
                lines += [f"{r['fleet']}: {d['total']} decisions, {d['up']} up, {d['down']} down. Examples:", ""]
                lines += [f"- `{e}`" for e in d["examples"]] + [""]
    sizing = data["runs"][0]["sizing"]
    lines += ["## Settings", "", f"- static: {sizing['replicas']} replicas ({sizing['method']})."]
    for fleet in ("threshold", "threshold-floor", "autoscaler"):
        config = next((r["config"] for r in data["runs"] if r["fleet"] == fleet), None)
        if config is not None:
            lines.append(f"- {fleet}: `{json.dumps(config)}`")
    lines += [
        "- both autoscaled fleets start with ⌈rate(0) × 1.15 ÷ goodput⌉ replicas; the autoscaler's warm pool starts "
        "empty.",
        "",
    ]
    return "\n".join(lines)


def static_day_from_simulate(inputs: dict[str, Any]) -> dict[str, Any] | None:
    """The static fleet's day from `bench/simulate.py --part day` (bench/results/simulate_day.json):
    the same arrivals (same shape, peak, seed) on the same 121 replicas; a static fleet starts
    nothing, so the cold start does not matter. Saves ~20 CPU-minutes; it has no per-minute series."""
    path = RESULTS / "simulate_day.json"
    if inputs["scenario"] != "day" or inputs.get("hours") != 24 or not path.exists():
        return None
    data = json.loads(path.read_text())
    day_in = data["inputs"]
    if (day_in.get("peak_rps"), day_in.get("duration_h"), day_in.get("trough"), day_in.get("shape")) != (
            PEAK_RPS, 24.0, 0.35, "tile"):
        return None
    replicas = day_in["replicas"]
    return {"fleet": "static", "scenario": "day", "initial_replicas": replicas,
            "expected_requests": day_in["expected_requests"], "summary": data["summary"], "series": [],
            "controls": [[0.0, 0.0, replicas, 0, 0, 0], [inputs["duration_s"], 0.0, replicas, 0, 0, 0]],
            "peak_billed": replicas, "source": "bench/results/simulate_day.json (bench/simulate.py --part day)",
            "sizing": {"replicas": replicas, "goodput_rps": None, "method": day_in["sizing"]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 h compressed day, 11 min spike")
    parser.add_argument("--hours", type=float, default=24.0,
                        help="the day's length; below 24 the diurnal envelope is compressed into it (default 24)")
    parser.add_argument("--scenario", choices=["all", "day", "spike"], default="all")
    parser.add_argument("--fleet", choices=["all", *FLEETS, "threshold-floor"], default="all")
    parser.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a PolicyConfig field of the autoscaler (experiments)")
    parser.add_argument("--stem", default=None, help="output file stem (default autoscale / autoscale_quick)")
    parser.add_argument("--command", action="append", default=None,
                        help="with --from: a command that produced the inputs, recorded in the report")
    parser.add_argument("--from", dest="merge", nargs="+", default=None, metavar="JSON",
                        help="build the report from these earlier outputs instead of running (runs are merged)")
    args = parser.parse_args()
    out = Path(args.out)
    if args.merge:
        merge(args, out)
        return
    out.mkdir(parents=True, exist_ok=True)
    scenarios = [scenario_inputs(s, args.quick, args.hours) for s in (("day", "spike") if args.scenario == "all"
                                                                      else (args.scenario,))]
    overrides = {k: (float(v) if "." in v else int(v)) for k, v in (item.split("=", 1) for item in args.set)}
    for scenario in scenarios:
        scenario["overrides"] = overrides
    fleets = FLEETS if args.fleet == "all" else (args.fleet,)
    jobs = [(f, s) for s in scenarios for f in fleets + (EXTRA.get(s["scenario"], ()) if args.fleet == "all" else ())]
    reused = [r for r in (static_day_from_simulate(s) for s in scenarios if "static" in fleets) if r is not None]
    if reused:  # the static day is bench/simulate.py's: same arrivals, same fleet
        jobs = [(f, s) for f, s in jobs if not (f == "static" and s["scenario"] == "day")]
    started = time.time()
    cpu0 = time.process_time()
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            runs = list(pool.map(run_one, jobs))
        bench_cpu = sum(r["summary"]["cpu_s"] for r in runs)
    else:
        runs = [run_one(j) for j in jobs]
        bench_cpu = time.process_time() - cpu0
    runs = reused + runs
    load = os.getloadavg()
    data = {"quick": args.quick, "machine": {"cpus": os.cpu_count(), "loadavg_1m": round(load[0], 2),
                                             "python": platform.python_version()},
            "bench_cpu_s": round(bench_cpu, 1), "wall_s": round(time.time() - started, 1),
            "scenarios": scenarios, "runs": runs}
    stem = args.stem or ("autoscale_quick" if args.quick else "autoscale")
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    for scenario in scenarios:
        runs_s = [r for r in runs if r["scenario"] == scenario["scenario"]]
        if runs_s:
            plot(scenario["scenario"], runs_s, out / f"{stem}_{scenario['scenario']}.png")
    text = report(data)
    if stem != "autoscale":
        text = text.replace("](autoscale_", f"]({stem}_")
    (out / f"{stem}.md").write_text(text)
    print(text)



def merge(args: argparse.Namespace, out: Path) -> None:
    scenarios: dict[str, dict[str, Any]] = {}
    runs: list[dict[str, Any]] = []
    machine_info, cpu, wall = None, 0.0, 0.0
    for name in args.merge:
        data = json.loads(Path(name).read_text())
        machine_info = data["machine"]
        cpu += data["bench_cpu_s"]
        wall += data.get("wall_s", 0.0)
        for scenario in data["scenarios"]:
            scenarios.setdefault(scenario["scenario"], scenario)
        runs += data["runs"]
    for scenario in scenarios.values():
        if not any(r["scenario"] == scenario["scenario"] and r["fleet"] == "static" for r in runs):
            static = static_day_from_simulate(scenario)
            if static is not None:
                runs.append(static)
    order = {
        f: i for i, f in enumerate(("static", "threshold", "threshold-floor", "autoscaler", "autoscaler, min_warm 78"))
    }
    runs.sort(key=lambda r: (r["scenario"] != "day", order.get(r["fleet"], 9)))
    data = {"quick": False, "machine": machine_info, "bench_cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
            "scenarios": [scenarios[k] for k in ("day", "spike") if k in scenarios], "runs": runs,
            "commands": list(args.command or [])}
    stem = args.stem or "autoscale"
    for scenario in data["scenarios"]:
        runs_s = [r for r in runs if r["scenario"] == scenario["scenario"]]
        plot(scenario["scenario"], runs_s, out / f"{stem}_{scenario['scenario']}.png")
    for r in runs:  # the merged JSON keeps the fleet by phase once a minute (the plots used every tick)
        if len(r["controls"]) > 2000:
            r["controls"] = [row for row in r["controls"] if int(row[0]) % 60 == 0]
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    text = report(data)
    if stem != "autoscale":
        text = text.replace("](autoscale_", f"]({stem}_")
    (out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
