"""The tight-and-right check: the planned fleet holds the SLO, a fleet 10% smaller does not.

    python -m bench.tight_and_right [--duration 20m] [--out bench/results]

For each case (the worked example's mix, and the Azure conversation trace's own request lengths
with 30% of each prompt cached), `inferbus plan` sizes an H100 TP2 fleet for an 833 req/s peak,
then the fleet simulator (`inferbus simulate`'s FastFleet, the engine at the plan's chunked-prefill
budget) replays the Azure conversation trace's arrival shape, scaled so its busiest minute is the
peak, on the planned fleet and on one 10% smaller. Right: the planned fleet holds the SLO (p90 TTFT
≤ 800 ms and p90 TPOT ≤ 40 ms) in at least 99% of minutes; tight: the smaller one does not. The
same again for the fleet sized at the autoscaler's TPOT margin (the planner's goodput × 0.908,
services/autoscaler/simulated.py), which is what the autoscaler runs. Writes tight_and_right.md
and .json; `--fleets` reruns some fleets and keeps the other results of the same duration.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from inferbus import mix as mix_mod
from inferbus import traces
from inferbus.fleetsim.day import DayWorkload, parse_duration, rate_shape
from inferbus.fleetsim.fast import FastConfig, FastFleet
from inferbus.plan.model import Slo, Workload
from inferbus.plan.planner import PlanInputs, make_plan
from services.autoscaler.simulated import TPOT_MARGIN
from services.sim_engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
TRACE = "azure_2023_conv.csv"
PEAK_RPS = 833.3
TARGET = 0.99  # share of minutes within the SLO
SMALLER = 0.9
CASES = [("worked example", "worked-example", None), ("Azure conversation trace", TRACE, 0.3)]
FLEETS = ("planned", "10% smaller", "at the TPOT margin", "TPOT margin 10% smaller")


def run_case(label: str, mix_name: str, cached: float | None, seconds: float, seed: int,
             only: tuple[str, ...], earlier: dict[str, Any]) -> dict[str, Any]:
    mix = mix_mod.load(traces.find(mix_name) if mix_name.endswith(".csv") else mix_name, cached)
    inputs = PlanInputs(rate_rps=PEAK_RPS, rate_text=f"{PEAK_RPS} requests/s", workload=Workload.from_mix(mix),
                        mix=mix.describe(), slo=Slo(), gpu_prices={"H100": 2.5}, tps=[2])
    row = make_plan(inputs).rows[0]
    engine = EngineConfig(gpu="H100", tp=2, chunked_prefill_size=inputs.assumptions.chunk_tokens)
    shape = rate_shape(traces.load(traces.find(TRACE)), 60.0)
    margin = math.ceil(row.replicas_exact / TPOT_MARGIN - 1e-9)
    fleets = dict(zip(FLEETS, (row.replicas, math.floor(row.replicas * SMALLER), margin, math.floor(margin * SMALLER))))
    results = {}
    for name, replicas in fleets.items():
        if name not in only and earlier.get(name, {}).get("replicas") == replicas:
            results[name] = earlier[name]
            continue
        workload = DayWorkload(shape, 60.0, seconds, PEAK_RPS, mix, mode="tile", seed=seed)
        config = FastConfig(replicas=replicas, engine=engine, seed=seed, slo_ttft_s=0.8, slo_tpot_s=0.04,
                            price_per_gpu_hour=2.5)
        summary = FastFleet(config, workload.arrivals()).run()
        results[name] = {"replicas": replicas, **{k: getattr(summary, k) for k in (
            "minutes", "minute_attainment", "request_attainment", "requests", "rejected", "ttft_p90_s", "tpot_p90_s",
            "cpu_s")}}
        print(f"{label}: {name} {replicas} replicas → {summary.minute_attainment:.1%} of {summary.minutes} minutes "
              f"within the SLO (TTFT p90 {summary.ttft_p90_s * 1e3:.0f} ms, TPOT p90 {summary.tpot_p90_s * 1e3:.1f} ms)",
              flush=True)
    def held(name: str) -> bool:
        return results[name]["minute_attainment"] >= TARGET

    return {"case": label, "mix": mix_name, "cached_fraction": cached, "goodput_rps_per_replica": row.goodput_rps,
            "binding": row.binding, "fleets": {name: results[name] for name in FLEETS if name in results},
            "right": held("planned"), "tight": not held("10% smaller"),
            "margin_right": held("at the TPOT margin"), "margin_tight": not held("TPOT margin 10% smaller")}


def markdown(cases: list[dict[str, Any]], seconds: float) -> str:
    lines = ["# Tight and right: the planned fleet holds the SLO, a fleet 10% smaller does not", "",
             f"`python -m bench.tight_and_right`: H100 TP2 planned by `inferbus plan` for a {PEAK_RPS} req/s peak "
             f"(chunked prefill 2,048, SLO p90 TTFT ≤ 800 ms, TPOT ≤ 40 ms, 15% headroom); the fleet simulator "
             f"replays the arrival shape of `{TRACE}` scaled to that peak for {seconds / 60:.0f} minutes. "
             f"Right = at least {TARGET:.0%} of minutes within the SLO on the planned fleet; tight = fewer on one "
             f"{1 - SMALLER:.0%} smaller. The last two fleets are sized at the autoscaler's TPOT margin (the "
             f"planner's goodput × {TPOT_MARGIN:.3f}).", "",
             "| case | goodput per replica | fleet | replicas | minutes within SLO | requests within SLO | "
             "TTFT p90 | TPOT p90 | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for case in cases:
        for name, r in case["fleets"].items():
            key = "margin_" if "margin" in name else ""
            verdict = ("tight" if case[key + "tight"] else "**not tight**") if "smaller" in name else (
                "right" if case[key + "right"] else "**not right**")
            lines.append(f"| {case['case']} | {case['goodput_rps_per_replica']:.2f} req/s ({case['binding']}) | {name} | "
                         f"{r['replicas']} | {r['minute_attainment']:.1%} of {r['minutes']} | "
                         f"{r['request_attainment']:.1%} | {r['ttft_p90_s'] * 1e3:,.0f} ms | "
                         f"{r['tpot_p90_s'] * 1e3:.1f} ms | {verdict} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", default="20m", help="virtual time per run, e.g. 20m, 1h")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--fleets", default=",".join(FLEETS),
                        help=f"fleets to run, comma-separated among: {', '.join(FLEETS)}")
    args = parser.parse_args()
    seconds = parse_duration(args.duration)
    only = tuple(name.strip() for name in args.fleets.split(","))
    unknown = [name for name in only if name not in FLEETS]
    if unknown:
        parser.error(f"unknown fleets {unknown}; known: {', '.join(FLEETS)}")
    earlier: dict[str, dict[str, Any]] = {}
    previous = args.out / "tight_and_right.json"
    if previous.exists():
        data = json.loads(previous.read_text())
        if data.get("duration_s") == seconds:
            earlier = {case["case"]: case["fleets"] for case in data["cases"]}
    cases = [run_case(label, mix_name, cached, seconds, args.seed, only, earlier.get(label, {}))
             for label, mix_name, cached in CASES]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tight_and_right.json").write_text(json.dumps({"duration_s": seconds, "cases": cases}, indent=1) + "\n")
    text = markdown(cases, seconds)
    (args.out / "tight_and_right.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
