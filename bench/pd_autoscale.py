"""A disaggregated fleet, static against each pool autoscaled on its own signal, over a diurnal ramp.

    python -m bench.pd_autoscale [--peak-rps 100] [--duration 6h] [--cold-start-s 120]

The worked-example mix at the seed's SLO (TTFT p90 ≤ 800 ms, TPOT p90 ≤ 40 ms) on H100 at TP 2, 4
and 8: `inferbus plan`'s cheapest disaggregated pair for `--peak-rps`, then in the fleet simulator
(`tools.capacity.fleetsim.pd`) on the same arrivals (a day compressed into `--duration`: the
rate from 30% of the peak up to the peak and back in 24 steps, Poisson within each):

- **static**: both pools at the plan's serving replicas all the time;
- **autoscaled**: both pools start at what the trough needs and are sized every 5 s by the
  autoscaler's own `DisaggregatedPolicy` (`services.autoscaler.simulated_pd`): prefill on its
  TTFT budget share and queue, decode on TPOT and KV use, each with its plan goodput, at most the
  plan's serving replicas plus its warm pool (the plan's, for the day's steepest ramp), replicas
  warm `--cold-start-s` after launch; the prefill pool with its goodput by pool size (the router
  pools its queues), as `inferbus plan --emit-deploy` writes it;
- **autoscaled, one goodput**: the same with the prefill pool at the plan's one goodput at every size.

Reported: minutes within the SLO, requests within both SLOs, TTFT/TPOT p90, GPU-hours and the
pools' replicas over the day. Writes bench/results/pd_autoscale.{json,md}.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from bench.common import write_results
from services.autoscaler.policy import PolicyConfig
from services.autoscaler.roles import RoleBounds, role_configs
from services.autoscaler.simulated_pd import PdPolicyController
from services.sim_engine.config import EngineConfig
from tools.capacity import mix as mix_mod
from tools.capacity.fleetsim.day import DayWorkload, parse_duration
from tools.capacity.fleetsim.pd import PdConfig, PdFleet, PdSummary, Pool
from tools.capacity.plan.disagg import DisaggRow
from tools.capacity.plan.model import Slo, Workload
from tools.capacity.plan.planner import PlanInputs, make_plan
from tools.capacity.plan.topology import plan_topology
from tools.capacity.plan.warm_pool import Ramp

ROOT = Path(__file__).resolve().parents[1]
BINS = 24
TROUGH = 0.3
CHUNK = 2048


def diurnal_shape(bins: int = BINS, trough: float = TROUGH) -> list[float]:
    """Trough → peak → trough."""
    return [trough + (1 - trough) * (1 - math.cos(2 * math.pi * (i + 0.5) / bins)) / 2 for i in range(bins)]


def plan_pair(peak: float, duration_s: float, cold_start_s: float) -> tuple[DisaggRow, Any]:
    """The plan for the peak, its warm pools sized for the day's steepest ramp (`--ramp`)."""
    mix = mix_mod.worked_example()
    ramp = Ramp(peak * (1 - TROUGH) * math.pi / duration_s, "given")  # the steepest slope of the shape
    inputs = PlanInputs(rate_rps=peak, rate_text=f"{peak:g} requests/s", workload=Workload.from_mix(mix),
                        mix=mix.describe(), slo=Slo(), gpu_prices={"H100": 2.5}, tps=[2, 4, 8], ramp=ramp,
                        cold_start_s=cold_start_s)
    plan = make_plan(inputs)
    choice = plan_topology(plan)
    pair = choice.disaggregated
    if pair is None or not pair.feasible:
        raise SystemExit(f"no feasible disaggregated pair at {peak} req/s")
    return pair, plan


def configs(pair: DisaggRow, plan: Any, cold_start_s: float, by_serving: bool = True) -> dict[str, PolicyConfig]:
    """The autoscaler's settings as `inferbus plan --emit-deploy` writes them for this pair (without
    `by_serving`: the prefill pool at the plan's one goodput per replica, at every size)."""
    i = plan.inputs
    warm_p, warm_d = policy_warm(pair, "prefill"), policy_warm(pair, "decode")
    table = pair.prefill_pooled.table() if by_serving and pair.prefill_pooled is not None else ()
    base = PolicyConfig(ttft_slo_s=i.slo.ttft_p90_s, tpot_slo_s=i.slo.tpot_p90_s, headroom=i.headroom,
                        min_serving=2, cold_start_s=cold_start_s, warm_start_s=5.0, max_warm=max(warm_p, warm_d),
                        max_serving=max(pair.prefill_replicas, pair.decode_replicas),
                        max_replicas=max(pair.prefill_replicas + warm_p, pair.decode_replicas + warm_d))
    return role_configs(
        base,
        prefill=RoleBounds(pair.prefill_rps, pair.prefill_replicas, warm_p, pair.prefill_replicas + warm_p,
                           goodput_by_serving=table),
        decode=RoleBounds(pair.decode_rps, pair.decode_replicas, warm_d, pair.decode_replicas + warm_d),
        prefill_ttft_budget_s=pair.prefill_budget_s + pair.transfer_p90_s, decode_kv_budget=i.assumptions.kv_limit)


def policy_warm(pair: DisaggRow, role: str) -> int:
    warm = pair.prefill_warm if role == "prefill" else pair.decode_warm
    return warm.replicas if warm is not None else 0


def fleet_config(pair: DisaggRow, prefill: int, decode: int) -> PdConfig:
    def engine(tp: int) -> EngineConfig:
        return EngineConfig(gpu="H100", tp=tp, chunked_prefill_size=CHUNK)
    return PdConfig(decode=Pool(decode, engine(pair.tp_decode)), prefill=Pool(prefill, engine(pair.tp_prefill)),
                    link=pair.link)


def result(summary: PdSummary) -> dict[str, Any]:
    keys = ("requests", "completed", "minutes", "minute_attainment", "request_attainment", "ttft_p90_s",
            "tpot_p90_s", "gpu_hours")
    return {k: getattr(summary, k) for k in keys}


def run(peak: float, duration_s: float, cold_start_s: float, seed: int) -> dict[str, Any]:
    pair, plan = plan_pair(peak, duration_s, cold_start_s)
    workload = DayWorkload(diurnal_shape(), duration_s / BINS, duration_s, peak, mix_mod.worked_example(),
                           mode="stretch", seed=seed)
    out: dict[str, Any] = {
        "peak_rps": peak, "duration_s": duration_s, "cold_start_s": cold_start_s, "seed": seed,
        "pair": pair.name, "plan_prefill_replicas": pair.prefill_replicas, "plan_decode_replicas": pair.decode_replicas,
        "plan_prefill_rps": pair.prefill_rps, "plan_decode_rps": pair.decode_rps,
        "plan_prefill_warm": policy_warm(pair, "prefill"), "plan_decode_warm": policy_warm(pair, "decode"),
        "expected_requests": workload.expected_requests(),
    }
    started = time.perf_counter()
    static = PdFleet(fleet_config(pair, pair.prefill_replicas, pair.decode_replicas), workload.arrivals()).run()
    out["static"] = result(static) | {"prefill_replicas": pair.prefill_replicas,
                                      "decode_replicas": pair.decode_replicas, "cpu_s": time.perf_counter() - started}
    print(f"static: {static.minute_attainment:.1%} of {static.minutes} minutes, {static.gpu_hours:.1f} GPU-hours",
          flush=True)
    out["prefill_goodput_by_serving"] = pair.prefill_pooled.table() if pair.prefill_pooled else []
    for name, by_serving in (("autoscaled", True), ("autoscaled_one_goodput", False)):
        policy = configs(pair, plan, cold_start_s, by_serving)
        # Both pools start at what the trough needs, as the autoscaler would size them.
        trough = peak * TROUGH
        start_p = max(2, policy["prefill"].serving_for(trough))
        start_d = max(2, policy["decode"].serving_for(trough))
        started = time.perf_counter()
        fleet = PdFleet(fleet_config(pair, start_p, start_d), workload.arrivals(),
                        controller=PdPolicyController(policy), cold_start_s=cold_start_s)
        scaled = fleet.run()
        series = fleet.pool_series
        out[name] = result(scaled) | {
            "start_prefill_replicas": start_p, "start_decode_replicas": start_d,
            "prefill_serving_max": max(r["prefill_serving"] for r in series),
            "decode_serving_max": max(r["decode_serving"] for r in series),
            "prefill_serving_min": min(r["prefill_serving"] for r in series),
            "decode_serving_min": min(r["decode_serving"] for r in series),
            "cpu_s": time.perf_counter() - started,
            "series": [r for i, r in enumerate(series) if i % 12 == 0],  # one a minute
        }
        print(f"{name}: {scaled.minute_attainment:.1%} of {scaled.minutes} minutes, "
              f"{scaled.request_attainment:.1%} of requests, {scaled.gpu_hours:.1f} GPU-hours", flush=True)
    return out


def markdown(r: dict[str, Any], command: str) -> str:
    s, a, one = r["static"], r["autoscaled"], r["autoscaled_one_goodput"]

    def scaled(x: dict[str, Any]) -> str:
        return (f"prefill {x['prefill_serving_min']}–{x['prefill_serving_max']}, "
                f"decode {x['decode_serving_min']}–{x['decode_serving_max']} serving")

    table = r["prefill_goodput_by_serving"]
    rows = []
    for name, x, fleet in (("static", s, f"{s['prefill_replicas']} prefill + {s['decode_replicas']} decode"),
                           ("autoscaled, prefill goodput by pool size", a, scaled(a)),
                           ("autoscaled, the plan's one prefill goodput", one, scaled(one))):
        rows.append(f"| {name} | {fleet} | {x['minute_attainment']:.1%} of {x['minutes']} | "
                    f"{x['request_attainment']:.1%} | {x['ttft_p90_s'] * 1e3:,.0f} ms | {x['tpot_p90_s'] * 1e3:.1f} ms "
                    f"| {x['gpu_hours']:,.1f} |")
    saving = 1 - a["gpu_hours"] / s["gpu_hours"]
    return "\n".join([
        "# A disaggregated fleet, static against each pool autoscaled on its own signal (`python -m "
        "bench.pd_autoscale`)",
        "",
        f"`{command}`; worked-example mix, SLO TTFT p90 ≤ 800 ms, TPOT p90 ≤ 40 ms; the plan's pair for "
        f"{r['peak_rps']:g} req/s: **{r['pair']}** ({r['plan_prefill_replicas']} prefill + {r['plan_decode_replicas']} "
        f"decode serving replicas, warm pools of {r['plan_prefill_warm']} + {r['plan_decode_warm']}; goodput per "
        f"replica {r['plan_prefill_rps']:.2f} / {r['plan_decode_rps']:.2f} req/s). "
        f"A day compressed into {r['duration_s'] / 3600:g} h: {TROUGH:.0%} of the peak → the peak → back, "
        f"{r['expected_requests']:,.0f} requests; replicas warm {r['cold_start_s']:g} s after launch.",
        "",
        "| fleet | replicas | minutes within SLO | requests within both SLOs | TTFT p90 | TPOT p90 | GPU-hours |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Autoscaled uses {abs(saving):.0%} {'fewer' if saving >= 0 else 'more'} GPU-hours than the static fleet "
        "(its warm and starting replicas "
        "counted; the static fleet runs its serving replicas only, no warm pool).",
        "",
        "The router pools the prefill replicas' queues, so one prefill replica's goodput grows with the replicas "
        "serving: the plan gives the autoscaler it by pool size (`INFERBUS_AUTOSCALER_PREFILL_GOODPUT_BY_SERVING`), "
        + ", ".join(f"{n}: {g:.2f}" for n, g in table) + " req/s. The last row sizes the prefill pool at the plan's "
        "one number at every size instead, as the autoscaler did before it had the table.",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peak-rps", type=float, default=100.0)
    parser.add_argument("--duration", default="6h")
    parser.add_argument("--cold-start-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    command = (f"python -m bench.pd_autoscale --peak-rps {args.peak_rps:g} --duration {args.duration} "
               f"--cold-start-s {args.cold_start_s:g}")
    results = run(args.peak_rps, parse_duration(args.duration), args.cold_start_s, args.seed)
    write_results(args.out, "pd_autoscale", results, lambda r: markdown(r, command))


if __name__ == "__main__":
    main()
