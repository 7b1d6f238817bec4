"""`python -m bench.simulate`: the fast fleet simulator's speed, its agreement with the per-step
simulator, and a day of Azure traffic at an 833 req/s peak on a static fleet.

Parts (`--part`, default all; each writes its JSON under bench/results/, and the markdown report
`bench/results/simulate.md` is rebuilt from whichever JSONs exist):

- speed: 200 serving replicas (H100 TP2), Poisson arrivals at 833 req/s for 120 virtual seconds,
  lengths from the Azure conversation trace (30 % of each prompt cached); simulated requests per
  CPU-second (`time.process_time`), for least-loaded and affinity placement and load reports every
  0.25 / 0.5 / 1 s, with the compiled build (`tools.capacity.accel`) and as pure Python.
- validate: the same workloads through the per-step `FleetSim` (the engine's real scheduler) and
  the fast fleet; TTFT and TPOT p50/p90 side by side.
- day: 24 h, the Azure conversation trace's per-minute rate shape tiled under a diurnal envelope,
  peak minute 833 req/s, on a static fleet sized by the planner's arithmetic
  (`tools.commands.simulate.size_fleet`: the planner's replica model at the engine's chunk
  size, × 1.15 headroom); time series plotted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from services.sim_engine.config import EngineConfig
from tools.capacity import accel, traces
from tools.capacity import mix as mix_mod
from tools.capacity.fleetsim import FleetConfig, FleetSim, capacity, workload
from tools.capacity.fleetsim.day import DayWorkload, constant, rate_shape
from tools.capacity.fleetsim.fast import FastConfig, FastFleet
from tools.commands.simulate import size_fleet, write_report

RESULTS = Path(__file__).parent / "results"
TRACE = "azure_2023_conv.csv"
PEAK_RPS = 833.0
PRICE = 2.50


def machine() -> dict[str, object]:
    load = os.getloadavg()
    return {"cpus": os.cpu_count(), "loadavg_1m": round(load[0], 2), "python": platform.python_version()}


def speed() -> dict[str, object]:
    """Both builds, each in a child process of its own (a process imports one of them)."""
    before = machine()
    builds = {}
    for build, env in (("compiled", {}), ("pure Python", {"INFERBUS_PURE_PYTHON": "1"})):
        completed = subprocess.run([sys.executable, "-m", "bench.simulate", "--part", "speed-rows"],
                                   env=dict(os.environ, **env), capture_output=True, text=True, check=True)
        builds[build] = json.loads(completed.stdout.splitlines()[-1])
        print(build, builds[build], flush=True)
    return {
        "machine": machine(),
        "machine_before": before,
        "rate_rps": PEAK_RPS,
        "virtual_s": 120.0,
        "rows": [
            dict(row, build=build)
            for build, found in builds.items()
            if found["active"] == (build == "compiled")
            for row in found["rows"]
        ],
        "compiled_unavailable": accel.check(),
    }


def speed_rows() -> dict[str, object]:
    mix = mix_mod.load(traces.find(TRACE), 0.3)
    arrivals = list(constant(PEAK_RPS, 120.0, mix, seed=1))
    rows = []
    for policy in ("least_loaded", "affinity"):
        for interval in (1.0, 0.5, 0.25):
            best = None
            for _ in range(3):  # best of three: the machine is shared, process time still wobbles
                summary = FastFleet(FastConfig(replicas=200, policy=policy, load_interval_s=interval), arrivals).run()
                if best is None or summary.cpu_s < best.cpu_s:
                    best = summary
            assert best is not None
            rows.append({
                "policy": policy, "replicas": 200, "load_interval_s": interval, "requests": best.requests,
                "cpu_s": round(best.cpu_s, 3), "req_per_cpu_s": round(best.req_per_cpu_s), "events": best.events,
                "ttft_p90_ms": round(best.ttft_p90_s * 1000, 1), "tpot_p90_ms": round(best.tpot_p90_s * 1000, 2),
            })
    return {"active": accel.active(), "rows": rows}


def validate() -> dict[str, object]:
    engine = EngineConfig()
    rows = []
    cases = [("round_robin", 0.75, 4, 1500), ("least_loaded", 0.75, 4, 1500), ("affinity", 0.75, 4, 1500),
             ("least_loaded", 0.9, 8, 3000), ("affinity", 0.9, 8, 3000)]
    azure = traces.load(traces.find(TRACE))
    for policy, load, replicas, n in cases + [("least_loaded", 0.8, 8, 4000)]:
        source = azure[:n] if (policy, load, replicas, n) not in cases else workload.azure_like(n)
        rate = capacity.rate_for_load(source, engine, replicas=replicas, load=load)
        trace = workload.at_rate(source, rate)
        slow = FleetSim(FleetConfig(replicas=replicas, policy=policy, engine=engine), trace).run()
        fast = FastFleet(
            FastConfig(replicas=replicas, policy=policy, engine=engine, admission=False, load_interval_s=0.25),
            [(r.arrival_s, r.input_tokens, r.output_tokens, 0) for r in trace],
        ).run()
        row: dict[str, object] = {
            "workload": "azure_like" if (policy, load, replicas, n) in cases else "azure_conv (real order)",
            "policy": policy, "replicas": replicas, "load": load, "requests": n, "rate_rps": round(rate, 2),
            "completed": [slow.completed, fast.completed],
        }
        for key in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s"):
            a, b = getattr(slow, key), getattr(fast, key)
            row[key.replace("_s", "_ms")] = [round(a * 1000, 1), round(b * 1000, 1), round(b / a - 1, 3)]
        row["req_per_cpu_s"] = [round(slow.req_per_cpu_s), round(fast.req_per_cpu_s)]
        rows.append(row)
        print(row, flush=True)
    return {"machine": machine(), "rows": rows}


def day(hours: float = 24.0, policy: str = "least_loaded") -> dict[str, object]:
    path = traces.find(TRACE)
    mix = mix_mod.load(path, 0.3)
    engine = EngineConfig()
    sizing = size_fleet(mix, engine, PEAK_RPS)
    work = DayWorkload(rate_shape(traces.load(path), 60.0), 60.0, hours * 3600, PEAK_RPS, mix, seed=0)
    config = FastConfig(replicas=sizing.replicas, engine=engine, policy=policy, price_per_gpu_hour=PRICE)
    last = [0.0]

    def progress(now: float) -> None:
        if now - last[0] >= 3600:
            last[0] = now
            print(f"  virtual {now / 3600:.0f} h", flush=True)

    summary = FastFleet(config, work.arrivals(), progress=progress).run()
    # The trace by name (found on INFERBUS_TRACES_DIR), so the report names no machine's folders.
    inputs = {
        "trace": path.name,
        "mix": {**mix.describe(), "source": path.name},
        "peak_rps": PEAK_RPS,
        "duration_h": hours,
        "shape": "tile",
        "trough": 0.35,
        "replicas": sizing.replicas,
        "sizing": sizing.method,
        "policy": policy,
        "expected_requests": round(work.expected_requests()),
    }
    write_report(summary, RESULTS, inputs, stem="simulate_day")
    print(summary.markdown(), flush=True)
    return {"machine": machine(), "inputs": inputs, "summary": summary.as_dict(series=False)}


def report() -> str:
    lines = ["# Fast fleet simulator: speed, validation, a day of Azure traffic", "",
             "Produced by `python -m bench.simulate` (see its docstring and docs/simulator.md).", ""]
    data = {part: json.loads((RESULTS / f"simulate_{part}.json").read_text())
            for part in ("speed", "validate", "day") if (RESULTS / f"simulate_{part}.json").exists()}
    if "speed" in data:
        s = data["speed"]
        lines += ["## Speed (200 replicas, H100 TP2, 833 req/s Poisson for 120 virtual s)", "",
                  f"Machine: {s.get('machine_before', s['machine'])} before, {s['machine']} after "
                  "(2 cores shared with other jobs; CPU time by `time.process_time`, "
                  "best of three runs). Build: `compiled` is `tools.capacity.accel`'s mypyc build of "
                  "`fleetsim.analytic` and `fleetsim.fast` (what `make install` sets up), `pure Python` the same "
                  "source run by the interpreter (`INFERBUS_PURE_PYTHON=1`); both give the same results to the "
                  "last digit (tests/test_accel.py).", "",
                  "| build | policy | load reports every | requests | CPU s | simulated req / CPU-s | events | TTFT "
                  "p90 ms | TPOT p90 ms |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in s["rows"]:
            lines.append(
                f"| {r.get('build', 'pure Python')} | {r['policy']} | {r['load_interval_s']} s | {r['requests']:,} "
                f"| {r['cpu_s']:.2f} | {r['req_per_cpu_s']:,} | {r['events']:,} | {r['ttft_p90_ms']} "
                f"| {r['tpot_p90_ms']} |"
            )
        if s.get("compiled_unavailable"):
            lines.append(f"\nNo compiled build was measured: {s['compiled_unavailable']}.")
        lines.append("")
    if "validate" in data:
        lines += ["## Agreement with the per-step simulator (`FleetSim`: the engine's real scheduler)", "",
                  "Each cell: per-step / fast / relative difference. Same arrivals, same lengths, no cache hits.", "",
                  "| workload | policy | replicas | load | requests | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT "
                  "p90 ms | req/CPU-s (per-step / fast) |",
                  "| --- | --- | ---: | ---: | ---: | --- | --- | --- | --- | --- |"]
        for r in data["validate"]["rows"]:
            cells = " | ".join(f"{v[0]} / {v[1]} / {v[2]:+.1%}" for v in
                               (r["ttft_p50_ms"], r["ttft_p90_ms"], r["tpot_p50_ms"], r["tpot_p90_ms"]))
            lines.append(
                f"| {r['workload']} | {r['policy']} | {r['replicas']} | {r['load']} | {r['requests']:,} | {cells} "
                f"| {r['req_per_cpu_s'][0]:,} / {r['req_per_cpu_s'][1]:,} |"
            )
        lines.append("")
    if "day" in data:
        d = data["day"]
        lines += [
            "## A day of Azure conversation traffic, 833 req/s peak, static fleet",
            "",
            f"Inputs: {d['inputs']['duration_h']} h, the trace's per-minute shape tiled under a diurnal envelope "
            f"(night at {d['inputs']['trough']:.0%} of the peak), {d['inputs']['replicas']} replicas "
            f"({d['inputs']['sizing']}), {d['inputs']['policy']}. Machine: {d['machine']}.",
            "",
            (RESULTS / "simulate_day.md").read_text().split("\n", 3)[3]
            if (RESULTS / "simulate_day.md").exists()
            else "",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["all", "speed", "validate", "day", "report", "speed-rows"], default="all",
                        help="speed-rows: the speed table of the build this process imports, as JSON (speed runs it)")
    parser.add_argument("--hours", type=float, default=24.0, help="virtual hours of the day run")
    args = parser.parse_args()
    if args.part == "speed-rows":
        print(json.dumps(speed_rows()))
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    parts = ["speed", "validate", "day"] if args.part == "all" else [] if args.part == "report" else [args.part]
    for part in parts:
        started = time.process_time()
        result = {"speed": speed, "validate": validate, "day": lambda: day(args.hours)}[part]()
        result["bench_cpu_s"] = round(time.process_time() - started, 1)
        (RESULTS / f"simulate_{part}.json").write_text(json.dumps(result, indent=1))
    (RESULTS / "simulate.md").write_text(report())
    print(f"wrote {RESULTS / 'simulate.md'}")


if __name__ == "__main__":
    main()
