"""How long a LoRA adapter's canary takes to a verdict at its own traffic.

`python -m bench.adapter_canary` (a few minutes) writes results/adapter_canary.{json,md}.

An adapter canary splits only that adapter's requests, so its clock is the adapter's request rate,
not the fleet's: the SLO gate gives no verdict before each version has `min_samples` (200)
requests in the step's window. This runs the code the platform runs, in virtual time: Poisson
arrivals of one adapter's requests at a rate, grouped in conversations (a new one with probability
1/4, else a later turn of one of the recent ones) split by the gateway's sticky per-conversation
split (`inferbus.releases.split`), each request's TTFT/TPOT drawn from a pool of the per-step
simulated engine (H100 TP2, chat mix, as bench/canary.py), and the router's step controller
(`inferbus.releases.canary.Controller`, `slo_gate`) ticking every second on the per-version
windows, with the default steps from 5% (5% → 25% → 100%) and the default 5-minute window. Both
versions fail 0.2% of their requests and their clients cancel 2%. A good candidate is the same
engine (drawn from the baseline's pool, with the same rates); a slow one has every step 30% longer
(TPOT p90 about +60%); an erroring one fails 5% of its requests. The controller reads the gate
every second, as the router does, so a good candidate's false rollbacks here include those of
looking again and again: they are counted over many canaries (`TRIALS_GOOD`) so that a rate of
1% is measurable.
Completion times are taken as arrival times (a request counts when it arrives, not a few seconds
later when it finishes): read times to a verdict as a lower bound by that much. The two versions'
latencies are drawn independently; on engines, both versions of an adapter share batches, so a
version whose own cost is higher slows the other's requests in the same batches too, and the
difference the gate sees is smaller than here. What it measures is the clock: how long a verdict
takes at a given adapter traffic.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time

from bench.canary import RESULTS, engine_samples, quantile
from inferbus.releases import canary, slo_gate, split
from proto import messages as m

RATES = (0.5, 2.0, 10.0, 41.65)  # req/s of one adapter; 41.65 is 5% of the platform's 833 req/s
TRIALS_GOOD = 400  # a good version's false rollbacks are rare: many canaries to count them
TRIALS_BAD = 40
ERROR_RATE = 0.002  # of both versions' requests (a good candidate's too)
CANCEL_RATE = 0.02
BAD_ERROR_RATE = 0.05  # the erroring candidate's
FIRST_SHARE = 0.05
WINDOW_S = 300.0
HORIZON_S = 6 * 3600.0
V1, V2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    latencies: list[tuple[float, float]]  # (TTFT, TPOT) pool its requests are drawn from
    error_rate: float = ERROR_RATE
    good: bool = False  # no worse than the baseline: a rollback of it is a false alarm


def serve(window: slo_gate.Window, latencies: list[tuple[float, float]], error_rate: float,
          rng: random.Random) -> None:
    """One request's outcome into a window, as workers count it: a failed one has no latency, a
    cancelled one its first token only."""
    ttft, tpot = rng.choice(latencies)
    draw = rng.random()
    if draw < error_rate:
        window.failed += 1
        return
    m.observe(window.ttft, m.LATENCY_BUCKETS_S, ttft)
    if draw < error_rate + CANCEL_RATE:
        window.cancelled += 1
        return
    m.observe(window.tpot, m.TPOT_BUCKETS_S, tpot)
    window.ok += 1


def run(rate: float, good: list[tuple[float, float]], candidate: Candidate, seed: int,
        config: slo_gate.SloConfig) -> tuple[str, float, list[tuple[float, str, float]]]:
    """(outcome, virtual seconds to it, [(t, action, share after)]) of one canary."""
    rng = random.Random(seed)
    spec = m.AdapterSpec(name="acme-bot", base_model="llama", version=V1, path="/v1", created=0.0,
                         candidate_version=V2, candidate_path="/v2")
    now = [0.0]
    controller = canary.Controller(lambda: now[0], config)
    rollout = canary.start(V1, V2, "llama", FIRST_SHARE, 0.0, sticky="prefix", window_s=WINDOW_S, adapter="acme-bot")
    windows = {V1: slo_gate.Window(), V2: slo_gate.Window()}
    conversations: list[str] = []
    started = 0
    steps: list[tuple[float, str, float]] = []
    next_arrival = rng.expovariate(rate)
    tick = 1.0
    verdict: slo_gate.Verdict | None = None  # the gate's last verdict, read again while nothing arrived
    while tick < HORIZON_S:
        if next_arrival < tick:
            verdict = None
        while next_arrival < tick:
            if not conversations or rng.random() < 0.25:
                started += 1
                conversations.append(f"conversation-{seed}-{started}")
                conversations[:] = conversations[-200:]
            key = "prefix:" + rng.choice(conversations)
            if split.adapter_version(rollout, spec, key) == V2:
                serve(windows[V2], candidate.latencies, candidate.error_rate, rng)
            else:
                serve(windows[V1], good, ERROR_RATE, rng)
            next_arrival += rng.expovariate(rate)
        now[0] = tick
        if verdict is None:
            verdict = slo_gate.verdict(windows[V1], windows[V2], config, canary.judged_steps(rollout))
        change = controller.decide(rollout, verdict)
        if change is not None and change.action != "hold":
            rollout = change.rollout
            steps.append((tick, change.action, rollout.share))
            if change.action in ("promote", "rollback"):
                return change.action, tick, steps
            windows = {V1: slo_gate.Window(), V2: slo_gate.Window()}  # a new step's window
            verdict = None
        tick += 1.0
    return "undecided", HORIZON_S, steps


def main() -> None:
    argparse.ArgumentParser(prog="python -m bench.adapter_canary", description=__doc__.split("\n\n")[0],
                            epilog="No options: it runs the whole comparison (several minutes).").parse_args()
    started = time.monotonic()
    # A good candidate is drawn from the baseline's own pool: the same distribution, so that any
    # rollback of it is the gate's false alarm, not a difference between two finite samples.
    baseline = [s for k in range(4) for s in engine_samples(1.0, 300.0, seed=950 + k)]
    slow = [s for k in range(4) for s in engine_samples(1.3, 300.0, seed=990 + k)]
    candidates = [(Candidate("good", baseline, good=True), TRIALS_GOOD), (Candidate("slow x1.3", slow), TRIALS_BAD),
                  (Candidate(f"erroring {BAD_ERROR_RATE:.0%}", baseline, error_rate=BAD_ERROR_RATE), TRIALS_BAD)]
    config = slo_gate.SloConfig()
    report: dict = {"rates": list(RATES), "first_share": FIRST_SHARE, "window_s": WINDOW_S,
                    "steps": canary.steps_from(FIRST_SHARE), "min_samples": config.min_samples,
                    "error_rate": ERROR_RATE, "cancel_rate": CANCEL_RATE, "config": dataclasses.asdict(config),
                    "pools": {name: {"requests": len(p), "ttft_p90_s": quantile([s[0] for s in p], 0.9),
                                     "tpot_p90_s": quantile([s[1] for s in p], 0.9)}
                              for name, p in (("baseline and good", baseline), ("slow x1.3", slow))},
                    "results": []}
    for rate in RATES:
        for candidate, trials in candidates:
            outcomes = [run(rate, baseline, candidate, seed=int(rate * 1000) + trial, config=config)
                        for trial in range(trials)]
            expected = "promote" if candidate.good else "rollback"
            times = [t for outcome, t, _ in outcomes if outcome == expected] or [math.nan]
            report["results"].append({
                "rate": rate, "candidate": candidate.name, "good": candidate.good, "trials": trials,
                "outcomes": {o: sum(1 for x, _, _ in outcomes if x == o) for o in ("promote", "rollback", "undecided")},
                "expected": expected, "median_s": quantile(times, 0.5), "p90_s": quantile(times, 0.9),
                "first_verdict_possible_s": config.min_samples / (rate * FIRST_SHARE),
            })
    report["seconds"] = round(time.monotonic() - started, 1)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "adapter_canary.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "adapter_canary.md").write_text(markdown(report))
    print(markdown(report))


def _duration(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def markdown(report: dict) -> str:
    pools = report["pools"]
    good = [row for row in report["results"] if row["good"]]
    false_rollbacks = sum(row["outcomes"]["rollback"] for row in good)
    canaries = sum(row["trials"] for row in good)
    lines = [
        "# Adapter canary: time to a verdict at the adapter's own traffic",
        "",
        f"`python -m bench.adapter_canary`; steps {' → '.join(f'{s:.0%}' for s in report['steps'])}, window "
        f"{report['window_s']:.0f} s, {report['min_samples']} requests per version before any verdict; both versions "
        f"fail {report['error_rate']:.1%} of requests and {report['cancel_rate']:.0%} are cancelled (the erroring "
        f"candidate fails more); {report['seconds']} s.",
        "",
        "Latency pools (TTFT / TPOT p90): " + "; ".join(
            f"{name} {p['ttft_p90_s'] * 1000:.0f} / {p['tpot_p90_s'] * 1000:.1f} ms" for name, p in pools.items()),
        "",
        f"**False rollbacks of a good version: {false_rollbacks} of {canaries} canaries "
        f"({false_rollbacks / canaries:.2%}).**",
        "",
        "| adapter req/s | candidate | canaries | promoted / rolled back / undecided (6 h) | median time to the right "
        "verdict | p90 | 200 requests on the candidate at 5% |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        o = row["outcomes"]
        lines.append(f"| {row['rate']:g} | {row['candidate']} | {row['trials']} | {o['promote']} / {o['rollback']} / "
                     f"{o['undecided']} | {_duration(row['median_s'])} ({row['expected']}) | {_duration(row['p90_s'])} "
                     f"| {_duration(row['first_verdict_possible_s'])} |")
    lines += [
        "",
        "The clock is the adapter's traffic: at 5% the candidate needs 200 / (0.05 × rate) seconds before the "
        "gate may say anything, and a pass at a step needs that within the window (else the step holds until it "
        "comes). A good candidate's rollbacks are false alarms: the controller reads the gate every second, and "
        "every look is a chance of one.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
