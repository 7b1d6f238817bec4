"""How fast the canary's gates decide, and the smallest regression each one catches.

`python -m bench.canary` (about 6 minutes on 2 busy cores) writes results/canary.{json,md}.

Latencies come from the per-step simulated engine (services/sim_engine/scheduler.Engine, H100 TP2,
the roofline timing model) driven open-loop in virtual time: Poisson arrivals at a per-engine rate,
prompts and outputs of a chat mix. A "regressed" candidate is the same engine with every step
`factor` times longer (an engine upgrade with slower kernels). For each factor the SLO gate
(inferbus.releases.slo_gate, the code the router runs) is given what a canary at 5% of 833 req/s
collects in a window (candidate and baseline requests drawn from those pools) many times over;
the detection rate is the share of fail verdicts. The gate is at the level of a canary from 5% (two
steps judged), whose sequential tests hold that level over every look; here it is read once, at
the window's end, which is when a regression's evidence is largest. Error rates and the eval gate are binomial, so
they are drawn directly. Requests of one engine share its load, so drawing them independently
makes the gate look a little sharper than it is on a real fleet: read the numbers as a floor.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inferbus.releases import canary, eval_gate, slo_gate
from inferbus.timing import roofline
from proto import messages as m
from services.sim_engine.config import EngineConfig
from services.sim_engine.request import Request
from services.sim_engine.sampling import SamplingParams
from services.sim_engine.scheduler import Engine

RESULTS = Path(__file__).parent / "results"
FLEET_RATE = 833.0  # req/s: the platform's design peak
SHARE = 0.05
ENGINE_RATE = 2.5  # req/s per engine: TTFT p90 0.6 s, TPOT p90 31-34 ms on this mix, inside the SLO
WINDOWS_S = (5.0, 60.0, 300.0)  # 5 s: just over the 200 requests before any verdict, at 5%
FACTORS = (1.0, 1.05, 1.10, 1.15, 1.2, 1.3)
TRIALS = 200
POOL_S = 600.0  # virtual seconds of traffic per simulated engine
ENGINES_PER_POOL = 4
STEPS_JUDGED = len(canary.steps_from(SHARE)) - 1  # a canary from 5%: 5% and 25% judged, then 100%


@dataclass
class Slowed:
    base: object
    factor: float

    @property
    def tokens_per_step(self) -> float:
        return self.base.tokens_per_step  # type: ignore[attr-defined]

    def step_time(self, *args: float, **kwargs: float) -> float:
        return self.base.step_time(*args, **kwargs) * self.factor  # type: ignore[attr-defined]


def engine_samples(factor: float, duration_s: float, seed: int, rate: float = 0.0) -> list[tuple[float, float]]:
    """(TTFT, TPOT) of every request an engine finished in `duration_s` virtual seconds."""
    rng = random.Random(seed)
    engine = Engine(EngineConfig(gpu="H100", tp=2), Slowed(roofline("H100", 2), factor))
    arrivals, t = [], 0.0
    while t < duration_s:
        t += rng.expovariate(rate or ENGINE_RATE)
        arrivals.append(t)
    pending = 0
    samples = []
    next_arrival = 0
    live: list[Request] = []
    while next_arrival < len(arrivals) or engine.has_work:
        while next_arrival < len(arrivals) and arrivals[next_arrival] <= engine.now:
            prompt = max(64, min(8000, int(rng.lognormvariate(math.log(1200), 0.8))))
            output = max(8, min(1000, int(rng.lognormvariate(math.log(180), 0.7))))
            request = Request(rid=f"r{next_arrival}", input_ids=[rng.randrange(30_000) for _ in range(prompt)],
                              sampling=SamplingParams(max_new_tokens=output, ignore_eos=True))
            engine.add(request)
            live.append(request)
            next_arrival += 1
            pending += 1
        if not engine.has_work:
            engine.advance(arrivals[next_arrival] - engine.now)
            continue
        result = engine.step()
        for update in result.updates:
            if update.finish_reason is not None:
                r = update.request
                if r.first_token_time is not None and r.finish_time is not None and len(r.output_ids) > 1:
                    samples.append((r.first_token_time - r.arrival_time,
                                    (r.finish_time - r.first_token_time) / (len(r.output_ids) - 1)))
    warm = len(samples) // 10  # the first requests met an empty engine
    return samples[warm:]


def pool_probabilities(pool: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """The pool's TTFT and TPOT as bucket probabilities of the histograms workers report."""
    ttft, tpot = [0] * (len(m.LATENCY_BUCKETS_S) + 1), [0] * (len(m.TPOT_BUCKETS_S) + 1)
    for first, per_token in pool:
        m.observe(ttft, m.LATENCY_BUCKETS_S, first)
        m.observe(tpot, m.TPOT_BUCKETS_S, per_token)
    return [c / len(pool) for c in ttft], [c / len(pool) for c in tpot]


def window_of(probabilities: tuple[list[float], list[float]], n: int, rng: np.random.Generator,
              failed: int = 0) -> slo_gate.Window:
    """What a window of `n` requests drawn from a pool reports (multinomial counts per bucket)."""
    return slo_gate.Window(ttft=rng.multinomial(n, probabilities[0]).tolist(),
                           tpot=rng.multinomial(n, probabilities[1]).tolist(), ok=n - failed, failed=failed)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    started = time.monotonic()
    # A candidate at 5% of the fleet runs on many engines (17 at this rate), the baseline on all the
    # others: each pool is several independent engines, so that one engine's queueing history
    # (its latencies are correlated in time) does not stand for a release.
    def pool(factor: float, seed: int) -> list[tuple[float, float]]:
        return [s for k in range(ENGINES_PER_POOL) for s in engine_samples(factor, POOL_S, seed=seed * 100 + k)]

    pools = {factor: pool(factor, int(factor * 1000)) for factor in FACTORS}
    baseline_samples = pool(1.0, 7)
    baseline = pool_probabilities(baseline_samples)
    candidates = {factor: pool_probabilities(pool) for factor, pool in pools.items()}
    draw = np.random.default_rng(17)
    report: dict = {"fleet_rate": FLEET_RATE, "share": SHARE, "engine_rate": ENGINE_RATE, "trials": TRIALS,
                    "baseline_pool": {"requests": len(baseline_samples),
                                      "ttft_p90_s": quantile([s[0] for s in baseline_samples], 0.9),
                                      "tpot_p90_s": quantile([s[1] for s in baseline_samples], 0.9)},
                    "pools": {str(f): {"requests": len(p), "ttft_p90_s": quantile([s[0] for s in p], 0.9),
                                       "tpot_p90_s": quantile([s[1] for s in p], 0.9)} for f, p in pools.items()},
                    "slo": {}, "errors": {}, "eval": {}}
    candidate_rate, baseline_rate = FLEET_RATE * SHARE, FLEET_RATE * (1 - SHARE)
    configs = {"default (10% tolerance)": slo_gate.SloConfig(),
               "no tolerance": slo_gate.SloConfig(latency_tolerance=0.0, ttft_slack_s=0.0, tpot_slack_s=0.0)}
    for window in WINDOWS_S:
        n_c, n_b = int(candidate_rate * window), int(baseline_rate * window)
        for name, config in configs.items():
            row = {}
            for factor, probabilities in candidates.items():
                fails = sum(slo_gate.verdict(window_of(baseline, n_b, draw), window_of(probabilities, n_c, draw),
                                             config, STEPS_JUDGED).outcome == "fail" for _ in range(TRIALS))
                row[str(factor)] = fails / TRIALS
            report["slo"][f"{window:g}s {name}"] = {"candidate_requests": n_c, "baseline_requests": n_b,
                                                     "fail_rate_by_step_factor": row}
        # Error rate: baseline 0.1%; the smallest candidate rate failed in >= 80% of windows.
        config = slo_gate.SloConfig()
        found = None
        for candidate_errors in [0.001 + i * 0.0005 for i in range(40)] + [0.025, 0.03, 0.04, 0.05, 0.075, 0.1]:
            fails = 0
            for _ in range(TRIALS):
                base_failed, cand_failed = int(draw.binomial(n_b, 0.001)), int(draw.binomial(n_c, candidate_errors))
                outcome, _ = slo_gate.compare_rate("error", base_failed, n_b, cand_failed, n_c, config.error_tolerance,
                                                   slo_gate.rollback_level(config, STEPS_JUDGED), {})
                fails += outcome == "fail"
            if fails / TRIALS >= 0.8:
                found = candidate_errors
                break
        report["errors"][f"{window:g}s"] = {"baseline_error_rate": 0.001, "smallest_detected_rate": found}
    suite = eval_gate.load_suite("arithmetic")
    n = len(suite.items) * suite.repeats
    for base_score in (0.95, 0.80):
        caught = None
        for drop in [i / 200 for i in range(1, 60)]:
            fails = sum(
                eval_gate.compare(
                    int(draw.binomial(n, base_score - drop)), n, int(draw.binomial(n, base_score)), n, suite.threshold
                ).outcome
                == "fail"
                for _ in range(TRIALS)
            )
            if fails / TRIALS >= 0.8:
                caught = drop
                break
        passes_1pt = (
            sum(
                eval_gate.compare(
                    int(draw.binomial(n, base_score - 0.01)), n, int(draw.binomial(n, base_score)), n, suite.threshold
                ).outcome
                == "pass"
                for _ in range(TRIALS)
            )
            / TRIALS
        )
        report["eval"][str(base_score)] = {"answers_per_release": n, "threshold": suite.threshold,
                                           "smallest_drop_failed_80pct": caught, "one_point_drop_pass_rate": passes_1pt}
    report["time_to_min_samples_s"] = {f"{share:.0%}": slo_gate.SloConfig().min_samples / (FLEET_RATE * share)
                                       for share in (0.01, 0.05, 0.25)}
    report["seconds"] = round(time.monotonic() - started, 1)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "canary.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "canary.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = ["# Canary gates: time to a verdict and the smallest regression caught", "",
             (f"`python -m bench.canary`; {report['trials']} draws per point; candidate at {report['share']:.0%} of "
              f"{report['fleet_rate']:g} req/s; latencies from the per-step simulated engine (H100 TP2, "
              f"{report['engine_rate']:g} req/s per engine, chat mix). {report['seconds']} s."), "",
             "Requests before the SLO gate may give any verdict (200 per side): " +
             ", ".join(f"{k}: {v:.1f} s" for k, v in report["time_to_min_samples_s"].items()), "",
             "## SLO gate: share of windows that fail, by how much longer the candidate's steps are", ""]
    factors = list(next(iter(report["slo"].values()))["fail_rate_by_step_factor"])
    lines.append("| window, tolerance | candidate / baseline requests | " + " | ".join(f"×{f}" for f in factors) + " |")
    lines.append("|---|---|" + "---|" * len(factors))
    for name, row in report["slo"].items():
        lines.append(f"| {name} | {row['candidate_requests']} / {row['baseline_requests']} | "
                     + " | ".join(f"{v:.0%}" for v in row["fail_rate_by_step_factor"].values()) + " |")
    base = report["baseline_pool"]
    lines += [
        "",
        f"Baseline pool: {base['requests']} requests, TTFT / TPOT p90 {base['ttft_p90_s'] * 1000:.0f} / "
        f"{base['tpot_p90_s'] * 1000:.1f} ms. "
        "Candidate pools (TTFT / TPOT p90 by step factor): "
        + "; ".join(
            f"×{f}: {p['ttft_p90_s'] * 1000:.0f} / {p['tpot_p90_s'] * 1000:.1f} ms" for f, p in report["pools"].items()
        ),
        "",
    ]
    lines += ["## Error rate (baseline 0.1%, allowed +0.2 points)", ""]
    for window, row in report["errors"].items():
        lines.append(
            f"- {window} window: failed in ≥ 80% of windows from a candidate error rate of "
            f"{row['smallest_detected_rate']:.2%}"
            if row["smallest_detected_rate"]
            else f"- {window}: none found"
        )
    lines += ["", "## Eval gate (shipped suite `arithmetic`)", ""]
    for base, row in report["eval"].items():
        lines.append(
            f"- baseline score {float(base):.0%}, {row['answers_per_release']} answers per release, allowed drop "
            f"{row['threshold']:.0%}: a drop of {row['smallest_drop_failed_80pct']:.1%} fails in ≥ 80% of "
            f"runs; a 1-point drop passes in {row['one_point_drop_pass_rate']:.0%} (else inconclusive: the canary "
            "holds)"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
