"""Aggregated against disaggregated in the fleet simulator: the plan's choice, checked at full scale.

    python -m bench.pd [--peak-rps 20] [--duration 20m] [--goodput-duration 5m] [--cases long-prompt conversation]

For each mix (the Mooncake synthetic trace, long prompts; the Mooncake conversation trace), with
the seed's SLO (TTFT p90 ≤ 800 ms, TPOT p90 ≤ 40 ms) and H100 at TP 2, 4 and 8:

1. **The plan priced per replica** (`inferbus plan --prefill-queue per-replica`, each replica its
   own M/G/1 prefill queue) for `--peak-rps`: its cheapest aggregated row, its cheapest
   disaggregated pair, the topology it chooses and why, and the GPUs of each.
2. **The same GPUs** (the aggregated plan's serving GPUs): the aggregated fleet and the
   disaggregated one (the cheapest pair's TP widths, at the plan's P:D ratio and at every other
   split of those GPUs, the best kept) in the fleet
   simulator (`tools.capacity.fleetsim.pd`, both topologies on the same machinery):
   **goodput per GPU**, the highest Poisson rate of the mix at which ≥ 90% of requests meet both
   SLOs (DistServe's definition; bisection, `--goodput-duration` of virtual time per trial) over
   the GPUs; and TTFT/TPOT p90 at the planned peak.
3. **Tight and right** for each topology's planned fleet, under the stresses of
   `bench.tight_and_right`: the trace's own arrival shape for `--duration`, its busiest minute 10%
   above the planned peak and one replica down (in each pool); right = ≥ 99% of minutes within the
   SLO; tight = a fleet 10% smaller (each pool) holds fewer. The aggregated plan also runs behind
   the router's own placement policies (`FastFleet`, `affinity` and `least_loaded`), down to the
   smallest fleet that holds: `PdFleet` places by each replica's exact unfinished work.
4. **The plan as `inferbus plan` makes it by default** (`--prefill-queue pooled`, one M/G/c
   prefill queue, per replica below four serving): the same checks of both its fleets, and its TP8
   aggregated plan at each of `POOLED_PEAKS` behind `affinity`, also with a 10% model error beside
   the plan's 16%.
5. **The worked example, pooled** (`--worked-example-duration`): 50,000 requests/min of its chat
   mix, where the pooled plan chooses disaggregation; both topologies' plans under the same
   stresses on the Azure conversation trace's arrival shape.

Writes bench/results/pd.{json,md}. A few CPU-minutes.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import write_results
from services.sim_engine.config import EngineConfig
from tools.capacity import mix as mix_mod
from tools.capacity import traces
from tools.capacity.fleetsim.day import DayWorkload, constant, parse_duration, rate_shape
from tools.capacity.fleetsim.fast import FastConfig, FastFleet
from tools.capacity.fleetsim.pd import PdConfig, PdFleet, PdSummary, Pool
from tools.capacity.plan.disagg import DisaggRow, cheapest
from tools.capacity.plan.model import Slo, Workload
from tools.capacity.plan.planner import PlanInputs, Row, make_plan
from tools.capacity.plan.sizing import POOLED_MODEL_ERROR
from tools.capacity.plan.topology import plan_topology

ROOT = Path(__file__).resolve().parents[1]
CASES = {"long-prompt": "mooncake_synthetic.jsonl", "conversation": "mooncake_conversation.jsonl"}
TPS = (2, 4, 8)
ATTAINMENT = 0.90  # goodput: the highest rate at which this share of requests meets both SLOs
TARGET = 0.99  # tight and right: share of minutes within the SLO
SMALLER = 0.9
FORECAST_ERROR = 0.10
LOST = 1
ROUTER_POLICIES = ("affinity", "least_loaded")
LOAD_INTERVAL_S = 0.25  # how often workers report their load (INFERBUS_LOAD_INTERVAL_S's default)
WORKED_EXAMPLE = "worked-example"
ARRIVAL_SHAPE = "azure_2023_conv.csv"  # the worked example's arrival shape, as bench.tight_and_right's
POOLED_PEAKS = (5.0, 10.0, 20.0, 40.0, 80.0)  # peaks (req/s) the pooled plan is checked at
LOWER_MODEL_ERROR = 0.10  # beside the pooled plan's own: why it is not lower


def engine(tp: int, chunk: int) -> EngineConfig:
    return EngineConfig(gpu="H100", tp=tp, chunked_prefill_size=chunk)


def aggregated_config(row: Row, replicas: int, chunk: int) -> PdConfig:
    return PdConfig(decode=Pool(replicas, engine(row.tp, chunk)))


def disaggregated_config(pair: DisaggRow, prefill: int, decode: int, chunk: int,
                          prefill_chunk: int | None = None) -> PdConfig:
    """`prefill_chunk`: the prefill pool's chunked-prefill size (default `chunk`). A prefill-only
    engine stalls no decode stream with a long chunk, so its chunk is its own setting; the decode
    pool's (`chunk`) only sizes the one-token prefill that emits a request's first token."""
    return PdConfig(decode=Pool(decode, engine(pair.tp_decode, chunk)),
                    prefill=Pool(prefill, engine(pair.tp_prefill, prefill_chunk or chunk)), link=pair.link)


def split(pair: DisaggRow, gpus: int) -> tuple[int, int]:
    """Prefill and decode replicas of `pair` on `gpus` GPUs at the plan's P:D ratio (at least one each)."""
    share = pair.prefill_gpus / pair.gpus
    prefill = max(1, round(gpus * share / pair.tp_prefill))
    decode = max(1, (gpus - prefill * pair.tp_prefill) // pair.tp_decode)
    while prefill * pair.tp_prefill + decode * pair.tp_decode > gpus and prefill > 1:
        prefill -= 1
    return prefill, decode


def decode_counts(gpus: int, pair: DisaggRow) -> list[int]:
    """Decode replicas to try on `gpus` GPUs: 1, 2, 3, 4, 6, 8, 12, … while a prefill replica fits."""
    out, d = [], 1
    while gpus - d * pair.tp_decode >= pair.tp_prefill:
        out.append(d)
        d = d + 1 if d < 4 else int(d * 1.5)
    return out


def chunk_of(config: PdConfig) -> int:
    """The chunked-prefill size of the pool that computes prompts (aggregated: the one pool)."""
    return (config.prefill or config.decode).engine.chunked_prefill_size


def unbound_decode(config: PdConfig) -> PdConfig:
    """`config` with a decode pool ten times larger: its prefill pool's own goodput, the ceiling a
    disaggregated fleet of these prefill replicas reaches if its decode pool cost nothing."""
    return replace(config, decode=replace(config.decode, replicas=config.decode.replicas * 10))


def run(config: PdConfig, arrivals: Any) -> PdSummary:
    return PdFleet(config, arrivals).run()


def goodput(config: PdConfig, mix: mix_mod.Mix, seconds: float, seed: int, guess: float) -> tuple[float, PdSummary]:
    """The highest Poisson rate with ≥ 90% of requests within both SLOs (bisection to 2%)."""
    def holds(rate: float) -> tuple[bool, PdSummary]:
        summary = run(config, constant(rate, seconds, mix, seed))
        return summary.request_attainment >= ATTAINMENT, summary

    low, high = 0.0, max(guess, 0.1)
    best: PdSummary | None = None
    ok, summary = holds(high)
    while ok:
        low, best = high, summary
        high *= 1.5
        ok, summary = holds(high)
    while high - low > 0.02 * high:
        mid = (low + high) / 2
        ok, summary = holds(mid)
        if ok:
            low, best = mid, summary
        else:
            high = mid
    assert best is not None or low == 0.0
    return low, best if best is not None else summary


def best_split(pair: DisaggRow, gpus: int, chunk: int, prefill_chunk: int, mix: mix_mod.Mix, seconds: float,
               seed: int, peak: float, splits: list[dict[str, Any]]) -> tuple[PdConfig, float, PdSummary]:
    """The best split of `gpus` between the pools with the prefill pool at `prefill_chunk`: the
    plan's P:D ratio first, then every decode count. The plan's ratio is for its own peak; at the
    goodput the load is higher, so every split of the same GPUs is tried and the best kept
    (DistServe searches placements too). Each trial is appended to `splits`."""
    p, d = split(pair, gpus)
    config = disaggregated_config(pair, p, d, chunk, prefill_chunk)
    rate, at_goodput = goodput(config, mix, seconds, seed, guess=peak)
    tried: list[float] = []
    for decode in decode_counts(gpus, pair):
        trial = disaggregated_config(pair, (gpus - decode * pair.tp_decode) // pair.tp_prefill, decode, chunk,
                                     prefill_chunk)
        trial_rate, trial_at = goodput(trial, mix, seconds, seed, guess=rate)
        splits.append({"fleet": describe(trial), "prefill_chunk": prefill_chunk, "gpus": trial.gpus,
                       "goodput_rps": trial_rate})
        tried.append(trial_rate)
        print(f"  split {describe(trial)}, prefill chunk {prefill_chunk}: goodput {trial_rate:.2f} req/s", flush=True)
        if trial_rate > rate:
            config, rate, at_goodput = trial, trial_rate, trial_at
        if len(tried) >= 3 and tried[-1] < tried[-2] < tried[-3] and tried[-1] < 0.9 * rate:
            break  # past the best split: fewer prefill replicas only lose more
    return config, rate, at_goodput


def stressed(config: PdConfig, fraction: float, lost: int) -> PdConfig:
    """`config` with each pool scaled by `fraction` (rounded down, at least one) and `lost` down in each."""
    def pool(p: Pool) -> Pool:
        return replace(p, replicas=max(1, math.floor(p.replicas * fraction) - lost))
    return replace(config, decode=pool(config.decode), prefill=pool(config.prefill) if config.prefill else None)


def tight_and_right(config: PdConfig, mix: mix_mod.Mix, shape: list[float], peak: float, seconds: float,
                    seed: int) -> dict[str, Any]:
    out = {}
    for name, fraction in (("planned", 1.0), ("10% smaller", SMALLER)):
        fleet = stressed(config, fraction, LOST)
        workload = DayWorkload(shape, 60.0, seconds, peak * (1 + FORECAST_ERROR), mix, mode="tile", seed=seed)
        summary = run(fleet, workload.arrivals())
        out[name] = {"gpus_provisioned": stressed(config, fraction, 0).gpus, "gpus_up": fleet.gpus,
                     **{k: getattr(summary, k) for k in ("minutes", "minute_attainment", "request_attainment",
                                                          "ttft_p90_s", "tpot_p90_s", "requests", "decode_kv_peak")},
                     # The minutes that missed: what missed, and how far.
                     "missed": [{k: minute[k] for k in ("t_s", "ttft_p90_s", "tpot_p90_s")}
                                for minute in summary.series if not minute["within_slo"]]}
        print(f"  tight and right, {summary.topology} {name}: {fleet.gpus} GPUs up → "
              f"{summary.minute_attainment:.1%} of {summary.minutes} minutes", flush=True)
    out["right"] = out["planned"]["minute_attainment"] >= TARGET
    out["tight"] = out["10% smaller"]["minute_attainment"] < TARGET
    return out


def production_router(config: PdConfig, mix: mix_mod.Mix, shape: list[float], peak: float, seconds: float,
                      seed: int) -> dict[str, Any]:
    """The aggregated plan under the tight-and-right stresses, placed by the router's own policies
    (`FastFleet`: load reports every 250 ms, `affinity` the default, `least_loaded`) rather than by
    `PdFleet`'s exact least unfinished work: the planned fleet, one 10% smaller, and the smallest
    fleet that holds."""
    engine, planned = config.decode.engine, config.decode.replicas
    workload = DayWorkload(shape, 60.0, seconds, peak * (1 + FORECAST_ERROR), mix, mode="tile", seed=seed)
    out: dict[str, Any] = {}
    for policy in ROUTER_POLICIES:
        seen: dict[int, dict[str, Any]] = {}

        def held(provisioned: int, policy: str = policy, seen: dict[int, dict[str, Any]] = seen) -> dict[str, Any]:
            if provisioned in seen:  # the walk down passes the 10% smaller fleet again
                return seen[provisioned]
            up = max(1, provisioned - LOST)
            fast = FastConfig(replicas=up, engine=engine, seed=seed, slo_ttft_s=config.slo_ttft_s,
                              slo_tpot_s=config.slo_tpot_s, policy=policy, load_interval_s=LOAD_INTERVAL_S)
            summary = FastFleet(fast, workload.arrivals()).run()
            seen[provisioned] = {"replicas": provisioned, "up": up, "gpus_provisioned": provisioned * engine.tp,
                                 "gpus_up": up * engine.tp, "minutes": summary.minutes,
                                 "minute_attainment": summary.minute_attainment, "ttft_p90_s": summary.ttft_p90_s,
                                 "tpot_p90_s": summary.tpot_p90_s}
            return seen[provisioned]

        runs = {"planned": held(planned), "10% smaller": held(max(1, math.floor(planned * SMALLER)))}
        smallest = None
        for provisioned in range(planned, LOST, -1):  # down from the plan until a fleet misses
            trial = held(provisioned)
            if trial["minute_attainment"] < TARGET:
                break
            smallest = trial
        out[policy] = {**runs, "smallest_holding": smallest,
                       "right": runs["planned"]["minute_attainment"] >= TARGET,
                       "tight": runs["10% smaller"]["minute_attainment"] < TARGET}
        print(f"  production router ({policy}), aggregated: planned {runs['planned']['minute_attainment']:.1%}, "
              f"10% smaller {runs['10% smaller']['minute_attainment']:.1%}, smallest holding "
              f"{smallest['replicas'] if smallest else '–'} replicas", flush=True)
    return out


def pooled_peaks(inputs: PlanInputs, mix: mix_mod.Mix, shape: list[float], seconds: float,
                 seed: int) -> list[dict[str, Any]]:
    """The pooled plan (`--prefill-queue pooled`) at each of `POOLED_PEAKS` against the simulator
    behind the router's `affinity` policy, under the tight-and-right stresses: with the pooled model
    error the plan uses and with `LOWER_MODEL_ERROR`, whether the planned fleet holds (right), whether
    one 10% smaller does not (tight), and the smallest fleet that holds."""
    out = []
    for peak in POOLED_PEAKS:
        workload = DayWorkload(shape, 60.0, seconds, peak * (1 + FORECAST_ERROR), mix, mode="tile", seed=seed)
        seen: dict[int, float] = {}

        def held(provisioned: int, workload: DayWorkload = workload, seen: dict[int, float] = seen) -> float:
            up = max(1, provisioned - LOST)
            if up not in seen:
                fast = FastConfig(replicas=up, engine=engine(8, inputs.assumptions.chunk_tokens), seed=seed,
                                  slo_ttft_s=inputs.slo.ttft_p90_s, slo_tpot_s=inputs.slo.tpot_p90_s,
                                  policy="affinity", load_interval_s=LOAD_INTERVAL_S)
                seen[up] = FastFleet(fast, workload.arrivals()).run().minute_attainment
            return seen[up]

        point: dict[str, Any] = {"peak_rps": peak}
        for name, error in (("plan", POOLED_MODEL_ERROR), ("lower_error", LOWER_MODEL_ERROR)):
            plan = make_plan(replace(inputs, rate_rps=peak, tps=[8], prefill_queue="pooled", pooled_model_error=error,
                                     disaggregation=False))
            row = plan.cheapest
            assert row is not None and row.sizing is not None
            smaller = max(1, math.floor(row.replicas * SMALLER))
            point[name] = {"model_error": row.sizing.model_error, "replicas": row.replicas,
                           "pool": row.pool, "unpooled": row.unpooled, "planned": held(row.replicas),
                           "smaller": smaller,
                           "smaller_held": held(smaller)}
            point[name]["right"] = point[name]["planned"] >= TARGET
            point[name]["tight"] = point[name]["smaller_held"] < TARGET
        planned = point["plan"]["replicas"]
        smallest = None
        if held(planned) >= TARGET:
            smallest = planned
            while smallest - 1 > LOST and held(smallest - 1) >= TARGET:
                smallest -= 1
        point["smallest_holding"] = smallest
        out.append(point)
        plan_point = point["plan"]
        print(f"  pooled plan at {peak:g} req/s: {planned} × TP8 ({_pool(plan_point)}) → "
              f"{plan_point['planned']:.1%} of minutes; 10% smaller {plan_point['smaller_held']:.1%}; smallest "
              f"holding {smallest}; with {LOWER_MODEL_ERROR:.0%} model error {point['lower_error']['replicas']} → "
              f"{point['lower_error']['planned']:.1%}", flush=True)
    return out


def worked_example_pooled(seconds: float, seed: int) -> dict[str, Any]:
    """The worked example (50,000 requests/min of its chat mix, H100 and H200 at TP 1/2/4) planned
    with pooled prefill queues, where the plan chooses disaggregation: both topologies' planned
    fleets under the tight-and-right stresses on the Azure conversation trace's arrival shape, as
    `bench.tight_and_right` checks the TP2 aggregated plan."""
    mix = mix_mod.load(WORKED_EXAMPLE)
    peak = 50_000 / 60
    inputs = PlanInputs(rate_rps=peak, rate_text="50,000 requests/min", workload=Workload.from_mix(mix),
                        mix=mix.describe(), slo=Slo(), gpu_prices={"H100": 2.5, "H200": 3.5}, tps=[1, 2, 4],
                        prefill_queue="pooled")
    plan = make_plan(inputs)
    choice, agg, pair = plan_topology(plan), plan.cheapest, cheapest(plan.disaggregated)
    assert agg is not None and pair is not None
    print(f"worked example, pooled prefill queues: plan chooses {choice.topology}: {pair.name} "
          f"{pair.prefill_replicas} + {pair.decode_replicas} ({pair.gpus_total} GPUs) against {agg.name} × "
          f"{agg.replicas} ({agg.gpus_total} GPUs)", flush=True)
    shape = rate_shape(traces.load(traces.find(ARRIVAL_SHAPE)), 60.0)
    chunk = inputs.assumptions.chunk_tokens
    planned = {"aggregated": aggregated_config(agg, agg.replicas, chunk),
               "disaggregated": disaggregated_config(pair, pair.prefill_replicas, pair.decode_replicas, chunk)}
    return {"chosen": choice.topology, "reason": choice.reason,
            "aggregated": {"config": agg.name, "replicas": agg.replicas, "gpus": agg.gpus_total},
            "disaggregated": {"config": pair.name, "prefill_replicas": pair.prefill_replicas,
                              "prefill_pool": pair.prefill_pool, "decode_replicas": pair.decode_replicas,
                              "gpus": pair.gpus_total},
            "tight_and_right": {name: tight_and_right(config, mix, shape, peak, seconds, seed)
                                for name, config in planned.items()}}


def run_case(label: str, trace: str, peak: float, seconds: float, goodput_s: float, seed: int,
             agg_chunks: tuple[int, ...] = (), prefill_chunks: tuple[int, ...] = ()) -> dict[str, Any]:
    mix = mix_mod.load(traces.find(trace))
    inputs = PlanInputs(rate_rps=peak, rate_text=f"{peak:g} requests/s", workload=Workload.from_mix(mix),
                        mix=mix.describe(), slo=Slo(), gpu_prices={"H100": 2.5}, tps=list(TPS))
    plan = make_plan(replace(inputs, prefill_queue="per-replica"))
    choice = plan_topology(plan)
    agg, pair = plan.cheapest, cheapest(plan.disaggregated)
    if agg is None or pair is None:
        raise SystemExit(
            f"{label}: the plan has no feasible {'aggregated row' if agg is None else 'disaggregated pair'}"
        )
    chunk = inputs.assumptions.chunk_tokens
    print(f"{label}, priced per replica: plan chooses {choice.topology} — {choice.reason}", flush=True)
    gpus = agg.gpus
    p, d = split(pair, gpus)
    same = {"aggregated": aggregated_config(agg, gpus // agg.tp, chunk),
            "disaggregated": disaggregated_config(pair, p, d, chunk)}
    compared: dict[str, dict[str, Any]] = {}
    splits: list[dict[str, Any]] = []
    # Each topology at the plan's chunk (the fleet the plan prices), then at each chunk of its own
    # list (the same search for both: an aggregated replica trades TTFT against TPOT with its
    # chunk, a prefill-only replica has no TPOT to protect), the best kept.
    by_chunk: dict[str, dict[int, dict[str, Any]]] = {"aggregated": {}, "disaggregated": {}}
    for name, config in same.items():
        t0 = time.process_time()
        own = agg_chunks if name == "aggregated" else prefill_chunks
        for size in dict.fromkeys((chunk, *own)):
            if name == "aggregated":
                trial_config = aggregated_config(agg, gpus // agg.tp, size)
                rate, at_goodput = goodput(trial_config, mix, goodput_s, seed, guess=peak * trial_config.gpus / gpus)
            else:
                trial_config, rate, at_goodput = best_split(pair, gpus, chunk, size, mix, goodput_s, seed, peak, splits)
            by_chunk[name][size] = {"config": trial_config, "rate": rate, "at_goodput": at_goodput}
            print(f"  same GPUs, {name} ({describe(trial_config)}, chunk {size}): goodput {rate:.2f} req/s = "
                  f"{rate / trial_config.gpus:.4f} per GPU", flush=True)
        cpu = time.process_time() - t0
        for which, size in (
            ("plan_chunk", chunk),
            ("best_chunk", max(by_chunk[name], key=lambda c: by_chunk[name][c]["rate"])),
        ):
            found = by_chunk[name][size]
            config, rate = found["config"], found["rate"]
            at_peak = run(config, constant(peak, goodput_s, mix, seed))
            compared.setdefault(which, {})[name] = {
                "gpus": config.gpus, "fleet": describe(config), "chunk": size, "goodput_rps": rate,
                "goodput_rps_per_gpu": rate / config.gpus, "at_goodput": found["at_goodput"].as_dict(),
                "at_peak": at_peak.as_dict(), "cpu_s": cpu, "plan_split": describe(same[name]),
            }
            print(f"  {which}, {name} ({describe(config)}, chunk {size}): goodput {rate:.2f} req/s = "
                  f"{rate / config.gpus:.4f} per GPU; at {peak:g} req/s TTFT p90 {at_peak.ttft_p90_s * 1e3:.0f} ms, "
                  f"TPOT p90 {at_peak.tpot_p90_s * 1e3:.1f} ms", flush=True)
    best_disagg = by_chunk["disaggregated"][compared["best_chunk"]["disaggregated"]["chunk"]]["config"]
    alone, _ = goodput(unbound_decode(best_disagg), mix, goodput_s, seed,
                       guess=compared["best_chunk"]["disaggregated"]["goodput_rps"])
    assert best_disagg.prefill is not None
    ceiling = {"prefill_pool": f"{best_disagg.prefill.replicas} prefill × TP{best_disagg.prefill.engine.tp}",
               "prefill_gpus": best_disagg.prefill.gpus, "goodput_rps": alone,
               "goodput_rps_per_prefill_gpu": alone / best_disagg.prefill.gpus,
               # The most the same GPUs could give if the decode pool cost no GPU at all.
               "bound_over_aggregated_best": alone / best_disagg.prefill.gpus
               / compared["best_chunk"]["aggregated"]["goodput_rps_per_gpu"],
               "bound_over_aggregated_plan_chunk": alone / best_disagg.prefill.gpus
               / compared["plan_chunk"]["aggregated"]["goodput_rps_per_gpu"]}
    print(f"  prefill pool alone ({ceiling['prefill_pool']}, decode unbounded): {alone:.2f} req/s = "
          f"{ceiling['goodput_rps_per_prefill_gpu']:.4f} per prefill GPU", flush=True)
    shape = rate_shape(traces.load(traces.find(trace)), 60.0)
    planned = {"aggregated": aggregated_config(agg, agg.replicas, chunk),
               "disaggregated": disaggregated_config(pair, pair.prefill_replicas, pair.decode_replicas, chunk)}
    checks = {name: tight_and_right(config, mix, shape, peak, seconds, seed) for name, config in planned.items()}
    routers = production_router(planned["aggregated"], mix, shape, peak, seconds, seed)
    # The same checks for the default plan, which prices the router's pooling (--prefill-queue pooled).
    pooled_plan = make_plan(replace(inputs, prefill_queue="pooled"))
    pooled_agg, pooled_pair = pooled_plan.cheapest, cheapest(pooled_plan.disaggregated)
    assert pooled_agg is not None and pooled_pair is not None, "the pooled plan lost a feasible fleet"
    print(f"{label}, pooled prefill queues: plan chooses {plan_topology(pooled_plan).topology}: "
          f"{pooled_agg.replicas} × TP{pooled_agg.tp} or {pooled_pair.name} "
          f"{pooled_pair.prefill_replicas} + {pooled_pair.decode_replicas}", flush=True)
    pooled_planned = {
        "aggregated": aggregated_config(pooled_agg, pooled_agg.replicas, chunk),
        "disaggregated": disaggregated_config(pooled_pair, pooled_pair.prefill_replicas, pooled_pair.decode_replicas,
                                              chunk)}
    pooled_checks = {name: tight_and_right(config, mix, shape, peak, seconds, seed)
                     for name, config in pooled_planned.items()}
    pooled_routers = production_router(pooled_planned["aggregated"], mix, shape, peak, seconds, seed)
    peaks = pooled_peaks(inputs, mix, shape, seconds, seed)
    ratios = {which: c["disaggregated"]["goodput_rps_per_gpu"] / c["aggregated"]["goodput_rps_per_gpu"]
              for which, c in compared.items()}
    ratio = ratios["best_chunk"]
    chosen = choice.topology
    return {
        "case": label, "trace": trace, "peak_rps": peak, "chosen": chosen, "reason": choice.reason,
        "plan": {"aggregated": {"config": agg.name, "gpus": agg.gpus, "goodput_rps_per_replica": agg.goodput_rps,
                                "binding": agg.binding, "usd_per_hour": agg.cost.usd_per_hour if agg.cost else None},
                 "disaggregated": {"config": pair.name, "gpus": pair.gpus, "prefill_replicas": pair.prefill_replicas,
                                   "decode_replicas": pair.decode_replicas, "ratio": pair.ratio,
                                   "usd_per_hour": pair.usd_per_hour}},
        "same_gpus": compared, "disaggregated_splits": splits, "disaggregated_over_aggregated_goodput_per_gpu": ratio,
        "ratio_at_plan_chunk": ratios["plan_chunk"], "prefill_pool_alone": ceiling,
        "chunks": {name: {str(size): {"fleet": describe(found["config"]), "goodput_rps": found["rate"],
                                      "goodput_rps_per_gpu": found["rate"] / found["config"].gpus}
                          for size, found in sizes.items()} for name, sizes in by_chunk.items()},
        "chosen_over_aggregated_goodput_per_gpu": ratio if chosen == "disaggregated" else 1.0,
        "tight_and_right": checks,
        "production_router": routers,
        "pooled": {"chosen": plan_topology(pooled_plan).topology,
                   "plan": {"aggregated": {"config": pooled_agg.name, "replicas": pooled_agg.replicas,
                                           "pool": pooled_agg.pool, "gpus": pooled_agg.gpus,
                                           "goodput_rps_per_replica": pooled_agg.goodput_rps},
                            "disaggregated": {"config": pooled_pair.name, "gpus": pooled_pair.gpus,
                                              "prefill_replicas": pooled_pair.prefill_replicas,
                                              "decode_replicas": pooled_pair.decode_replicas}},
                   "tight_and_right": pooled_checks, "production_router": pooled_routers,
                   "peaks": peaks},
    }


def describe(config: PdConfig) -> str:
    d = config.decode
    if config.prefill is None:
        return f"{d.replicas} × TP{d.engine.tp}"
    p = config.prefill
    return f"{p.replicas} prefill × TP{p.engine.tp} + {d.replicas} decode × TP{d.engine.tp}"


def markdown(results: dict[str, Any]) -> str:
    lines = ["# Aggregated against disaggregated in the fleet simulator (`python -m bench.pd`)", "",
             f"{results['command']}; SLO TTFT p90 ≤ 800 ms, TPOT p90 ≤ 40 ms; H100, TP 2/4/8, the plan's chunked "
             f"prefill 2,048 (and each topology's own chunks, below), "
             f"KV over RDMA (50 GB/s per GPU). Goodput = the highest Poisson rate at which ≥ {ATTAINMENT:.0%} of "
             f"requests meet both SLOs ({results['goodput_duration_s']:.0f} s of virtual time per trial), over the "
             f"GPUs. Tight and right: the trace's arrival shape for {results['duration_s'] / 60:.0f} min, busiest "
             f"minute {FORECAST_ERROR:.0%} above the peak, {LOST} replica down in each pool.", ""]
    for case in results["cases"]:
        plan = case["plan"]
        lines += [f"## {case['case']} (`{case['trace']}`, {case['peak_rps']:g} req/s peak)", "",
                  f"Priced per replica (`--prefill-queue per-replica`), the plan chooses **{case['chosen']}**: "
                  f"{case['reason']}.", "",
                  f"Plan: aggregated {plan['aggregated']['config']} — {plan['aggregated']['gpus']} GPUs; "
                  f"disaggregated {plan['disaggregated']['config']} — {plan['disaggregated']['prefill_replicas']} + "
                  f"{plan['disaggregated']['decode_replicas']} replicas, {plan['disaggregated']['gpus']} GPUs "
                  f"(P:D {plan['disaggregated']['ratio']}).", "",
                  "| same GPUs | chunk | fleet | goodput req/s | goodput req/s per GPU | at the peak: TTFT p90 | "
                  "TPOT p90 | requests within SLO |", "|---|---|---|---|---|---|---|---|"]
        for which, label in (("plan_chunk", "the plan's chunk"), ("best_chunk", "each its best chunk")):
            for name, r in case["same_gpus"][which].items():
                peak = r["at_peak"]
                lines.append(f"| {name}, {label} | {r['chunk']:,} | {r['fleet']} ({r['gpus']} GPUs) | "
                             f"{r['goodput_rps']:.2f} | {r['goodput_rps_per_gpu']:.4f} | "
                             f"{peak['ttft_p90_s'] * 1e3:,.0f} ms | {peak['tpot_p90_s'] * 1e3:.1f} ms | "
                             f"{peak['request_attainment']:.1%} |")
        ceiling = case["prefill_pool_alone"]
        lines += ["", "Goodput per GPU by chunk (the chunked-prefill size of the pool that computes prompts; "
                      "disaggregated: the best split of the GPUs at that prefill chunk):", "",
                  "| topology | chunk | fleet | goodput req/s | per GPU |", "|---|---|---|---|---|"]
        for name, sizes in case["chunks"].items():
            for size, found in sizes.items():
                lines.append(f"| {name} | {int(size):,} | {found['fleet']} | {found['goodput_rps']:.2f} | "
                             f"{found['goodput_rps_per_gpu']:.4f} |")
        lines += [
            "",
            "Goodput per GPU, disaggregated ÷ aggregated: "
            f"**{case['disaggregated_over_aggregated_goodput_per_gpu']:.2f}×** "
            f"with each topology at its best chunk; {case['ratio_at_plan_chunk']:.2f}× with both at the "
            f"plan's chunk. The chosen topology ({case['chosen']}) ÷ aggregated: "
            f"{case['chosen_over_aggregated_goodput_per_gpu']:.2f}×.",
            "",
            f"The prefill pool alone ({ceiling['prefill_pool']}, its decode pool ten times larger so that it "
            f"never binds): {ceiling['goodput_rps']:.2f} req/s = {ceiling['goodput_rps_per_prefill_gpu']:.4f} "
            f"per prefill GPU: even with a decode pool that cost no GPU, disaggregation could reach at most "
            f"{ceiling['bound_over_aggregated_best']:.2f}× the aggregated goodput per GPU at its best chunk "
            f"({ceiling['bound_over_aggregated_plan_chunk']:.2f}× at the plan's chunk).",
            "",
            "| tight and right | planned GPUs (up) | minutes within SLO | 10% smaller (up) | minutes within SLO "
            "| verdict |",
            "|---|---|---|---|---|---|",
        ]
        for name, check in case["tight_and_right"].items():
            a, b = check["planned"], check["10% smaller"]
            verdict = f"{'right' if check['right'] else 'not right'}, {'tight' if check['tight'] else 'not tight'}"
            lines.append(f"| {name} | {a['gpus_provisioned']} ({a['gpus_up']}) | {a['minute_attainment']:.1%} of "
                         f"{a['minutes']} | {b['gpus_provisioned']} ({b['gpus_up']}) | {b['minute_attainment']:.1%} | "
                         f"{verdict} |")
        for policy, check in case.get("production_router", {}).items():
            a, b, least = check["planned"], check["10% smaller"], check["smallest_holding"]
            verdict = f"{'right' if check['right'] else 'not right'}, {'tight' if check['tight'] else 'not tight'}"
            smallest = f"; smallest holding {least['gpus_provisioned']} ({least['gpus_up']})" if least else ""
            lines.append(f"| aggregated, the router's `{policy}` policy | {a['gpus_provisioned']} ({a['gpus_up']}) | "
                         f"{a['minute_attainment']:.1%} of {a['minutes']} | {b['gpus_provisioned']} ({b['gpus_up']}) | "
                         f"{b['minute_attainment']:.1%} | {verdict}{smallest} |")
        pooled = case.get("pooled")
        if pooled:
            a, d = pooled["plan"]["aggregated"], pooled["plan"]["disaggregated"]
            lines += ["", f"With the router's pooling priced (`--prefill-queue pooled`, the default) the plan chooses "
                          f"**{pooled['chosen']}**: aggregated {a['replicas']} × {a['config']} ({a['gpus']} GPUs, "
                          f"{a['goodput_rps_per_replica']:.2f} req/s per replica with {a['pool']} pooled); "
                          f"disaggregated {d['config']} {d['prefill_replicas']} + {d['decode_replicas']} "
                          f"({d['gpus']} GPUs).", "",
                      "| tight and right, pooled plan | planned GPUs (up) | minutes within SLO | 10% smaller (up) | "
                      "minutes within SLO | verdict |", "|---|---|---|---|---|---|"]
            for name, check in pooled["tight_and_right"].items():
                lines.append(_check_row(name, check))
            for policy, check in pooled["production_router"].items():
                lines.append(_check_row(f"aggregated, the router's `{policy}` policy", check))
            lines += ["", "The pooled plan at other peaks, TP8, behind `affinity` under the same stresses (planned "
                          "replicas → share of minutes within the SLO with one down):", "",
                      "| peak req/s | pooled plan (prefill queues) | holds | 10% smaller | holds | right, tight | "
                      "smallest "
                      f"holding | with {LOWER_MODEL_ERROR:.0%} model error | holds |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for point in pooled["peaks"]:
                a, lower = point["plan"], point["lower_error"]
                lines.append(f"| {point['peak_rps']:g} | {a['replicas']} ({_pool(a)}) | {a['planned']:.1%} | "
                             f"{a['smaller']} | {a['smaller_held']:.1%} | {'right' if a['right'] else 'not right'}, "
                             f"{'tight' if a['tight'] else 'not tight'} | {point['smallest_holding'] or '–'} | "
                             f"{lower['replicas']} | {lower['planned']:.1%} |")
        lines.append("")
    worked = results.get("worked_example_pooled")
    if worked:
        a, d = worked["aggregated"], worked["disaggregated"]
        lines += ["## The worked example with pooled prefill queues", "",
                  f"50,000 requests/min of the worked example's chat mix, H100 and H200 at TP 1/2/4, "
                  f"`--prefill-queue pooled`: the plan chooses **{worked['chosen']}**: {worked['reason']}.", "",
                  f"Disaggregated: {d['config']}, {d['prefill_replicas']} prefill ({d['prefill_pool']} pooled) + "
                  f"{d['decode_replicas']} decode replicas, {d['gpus']} GPUs; aggregated: {a['config']} × "
                  f"{a['replicas']}, {a['gpus']} GPUs. Tight and right on the Azure conversation trace's arrival "
                  "shape (as `bench.tight_and_right`):", "",
                  "| tight and right | planned GPUs (up) | minutes within SLO | 10% smaller (up) | minutes within SLO "
                  "| verdict |", "|---|---|---|---|---|---|",
                  *(_check_row(name, check) for name, check in worked["tight_and_right"].items()), ""]
    return "\n".join(lines)


def _pool(point: dict[str, Any]) -> str:
    """How a pooled plan priced the prefill queues: the pool, or per replica below four serving."""
    if point.get("pool") is not None:
        return f"pool {point['pool']}"
    return f"per replica: {point['unpooled']} would pool"


def _check_row(name: str, check: dict[str, Any]) -> str:
    a, b, least = check["planned"], check["10% smaller"], check.get("smallest_holding")
    verdict = f"{'right' if check['right'] else 'not right'}, {'tight' if check['tight'] else 'not tight'}"
    if not check["right"] and a.get("missed"):
        missed = [f"minute {m['t_s'] / 60:.0f}, TTFT p90 {m['ttft_p90_s'] * 1e3:,.0f} ms, "
                  f"TPOT p90 {m['tpot_p90_s'] * 1e3:.1f} ms" for m in a["missed"]]
        verdict += f" (missed: {'; '.join(missed)}; decode KV peak {a['decode_kv_peak']:.0%})"
    smallest = f"; smallest holding {least['gpus_provisioned']} ({least['gpus_up']})" if least else ""
    return (f"| {name} | {a['gpus_provisioned']} ({a['gpus_up']}) | {a['minute_attainment']:.1%} of {a['minutes']} | "
            f"{b['gpus_provisioned']} ({b['gpus_up']}) | {b['minute_attainment']:.1%} | {verdict}{smallest} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--peak-rps", type=float, default=20.0)
    parser.add_argument("--duration", default="20m", help="virtual time of each tight-and-right run")
    parser.add_argument("--goodput-duration", default="5m", help="virtual time of each goodput trial")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--agg-chunks", type=int, nargs="*", default=[1024, 4096],
                        help="aggregated chunked-prefill sizes tried beside the plan's")
    parser.add_argument("--prefill-chunks", type=int, nargs="*", default=[4096, 8192, 16384],
                        help="the disaggregated prefill pool's chunked-prefill sizes tried beside the plan's")
    parser.add_argument("--worked-example-duration", default="20m",
                        help="virtual time of the worked example's pooled check (0 skips it; ~2.5 CPU-min per 20m)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--name", default="pd")
    args = parser.parse_args()
    seconds, goodput_s = parse_duration(args.duration), parse_duration(args.goodput_duration)
    cases = [run_case(label, CASES[label], args.peak_rps, seconds, goodput_s, args.seed, tuple(args.agg_chunks),
                      tuple(args.prefill_chunks)) for label in args.cases]
    command = (f"`python -m bench.pd --peak-rps {args.peak_rps:g} --duration {args.duration} "
               f"--goodput-duration {args.goodput_duration} --cases {' '.join(args.cases)} "
               f"--agg-chunks {' '.join(map(str, args.agg_chunks))} "
               f"--prefill-chunks {' '.join(map(str, args.prefill_chunks))} "
               f"--worked-example-duration {args.worked_example_duration}`")
    results: dict[str, Any] = {"command": command, "duration_s": seconds, "goodput_duration_s": goodput_s,
                               "cases": cases}
    worked_s = parse_duration(args.worked_example_duration) if args.worked_example_duration != "0" else 0.0
    if worked_s > 0:
        results["worked_example_pooled"] = worked_example_pooled(worked_s, args.seed)
    write_results(args.out, args.name, results, markdown)


if __name__ == "__main__":
    main()
