"""The SLO gate: is the candidate worse than the baseline on TTFT/TPOT p90, errors or cancels?

Both sides are read from the same per-worker histograms and counters the dashboards and the
autoscaler use (`WorkerLoad`: interactive requests only, cumulative, so deltas over a window are
exact), summed per release over the canary step's window.

Four comparisons, each one-sided, each of the candidate's requests being "bad" or not:

- Latency (TTFT and TPOT): the baseline's p90, widened by a tolerance, is the threshold; if the
  candidate's p90 is no worse, at most 10% of its requests exceed it. Bad: a request above it.
- Error and cancel rates: bad is a failed (cancelled) request; a candidate no worse than the
  baseline has a rate of at most the baseline's plus an allowed absolute increase.

The controller reads the gate every second, through the step's window and past it while a step
holds, so a test made for one look would roll back good versions on noise simply by being looked
at often. Each comparison is therefore a mixture sequential probability ratio test (mSPRT), whose
error bound holds however often and for however long it is read:

    Λ_n = Σ_j w_j · (p_j / p₀)^k · ((1 − p_j) / (1 − p₀))^(n − k)

for k bad requests of the candidate's n, a reference rate p₀ (10% for latency, the baseline's rate
plus the tolerance for errors and cancels) and a fixed grid of worse rates p_j > p₀ with equal
weights w_j. Under any true rate ≤ p₀, Λ_n is a non-negative supermartingale starting at 1, so by
Ville's inequality P(Λ_n ever ≥ 1/α) ≤ α: the comparison fails when Λ_n reaches 1/α, and a good
version's chance of being failed by it is at most α over all looks together. The test is the method
of mixtures of H. Robbins, "Statistical methods related to the law of the iterated logarithm",
Ann. Math. Statist. 41(5), 1970; its use for A/B tests read continuously is R. Johari, P. Koomen,
L. Pekelis, D. Walsh, "Peeking at A/B tests: why it matters, and what to do about it", KDD 2017.
Here with the exact Bernoulli likelihood and a discrete mixing distribution, so it needs no normal
approximation (rare errors are counted as they are).

`SloConfig.false_rollback` (1%) is the bound for a whole canary: split evenly between the four
comparisons and the steps the gate judges (`steps`; each step's window starts over, so each is a
test of its own), the union bound keeps the sum within it. A latency comparison passes by the same
kind of test turned around: the candidate's share above the threshold is shown to be below
10% + `p90_margin` (the reference, with rates p_j below it) at level `false_pass`, so a version that
far worse passes a step with probability at most 5% however long the step holds. Error and cancel
rates pass the same way: the candidate's rate is shown to be below its reference plus
`rate_pass_margin`, at level `false_pass`; until then they wait, so a version that errors often
enough to matter cannot pass a step on a sample too small to fail it. Two approximations are not covered by the bound:
the latency threshold and the baseline's rates are the baseline's own estimates, taken as known (the baseline
has more requests than the candidate at steps up to 50%, and the tolerances are wider than their
noise), and a histogram's share above a threshold is interpolated inside its bucket.

No verdict is given before each side has `min_samples` requests in the window (20 requests say
nothing about a p90, and the baseline's estimates need a sample too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from proto import messages as m

Outcome = Literal["pass", "fail", "wait"]

ABOVE_P90 = 0.1  # the share of a release's requests above its own p90
COMPARISONS = 4  # TTFT, TPOT, errors, cancels: the false-rollback bound is split between them
# The mixture's grid: how far the alternatives lie from the reference, as fractions of the way to
# 1 (fail side) or to 0 (pass side). From barely worse to all bad, so that a small regression is
# found with a large sample and a gross one (a candidate that cannot load) at once.
MIXTURE_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.7, 0.95)


@dataclass
class SloConfig:
    min_samples: int = 200
    latency_tolerance: float = 0.10  # the candidate's p90 may be this much above the baseline's
    ttft_slack_s: float = 0.010  # and this much in absolute terms (histogram buckets are coarse)
    tpot_slack_s: float = 0.001
    p90_margin: float = 0.05  # pass: the share above the threshold is surely below 10% + this
    error_tolerance: float = 0.002  # allowed absolute increase of the error rate
    cancel_tolerance: float = 0.02  # and of the cancel rate (clients give up on slow answers)
    # pass: the error or cancel rate is surely below the rate that fails plus this
    rate_pass_margin: float = 0.025
    # A candidate no worse than its baseline is rolled back by this gate with probability at most
    # this over its whole canary, however often the gate is read.
    false_rollback: float = 0.01
    # A latency comparison passes a step for a candidate with 10% + p90_margin or more of its
    # requests above the threshold with probability at most this.
    false_pass: float = 0.05


@dataclass
class Window:
    """What one release did over a window: histogram counts and request outcomes."""

    ttft: list[int] = field(default_factory=lambda: [0] * (len(m.LATENCY_BUCKETS_S) + 1))
    tpot: list[int] = field(default_factory=lambda: [0] * (len(m.TPOT_BUCKETS_S) + 1))
    ok: int = 0
    failed: int = 0
    cancelled: int = 0

    @property
    def requests(self) -> int:
        return self.ok + self.failed + self.cancelled


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: str
    numbers: dict[str, float]


def share_above(counts: list[int], bounds: tuple[float, ...], threshold: float) -> tuple[float, int]:
    """The share of a histogram's samples above `threshold` (linear inside its bucket), and n."""
    total = sum(counts)
    if total == 0:
        return 0.0, 0
    above = 0.0
    low = 0.0
    for i, count in enumerate(counts):
        high = bounds[i] if i < len(bounds) else math.inf
        if count:
            if threshold <= low:
                above += count
            elif threshold < high:
                above += count * ((high - threshold) / (high - low) if high != math.inf else 1.0)
        low = high
    return above / total, total


def log_mixture_ratio(bad: float, n: int, reference: float, alternatives: list[float]) -> float:
    """log Λ: the likelihood of `bad` of `n` Bernoulli outcomes under each alternative rate against
    under `reference`, averaged over the alternatives (equal weights)."""
    logs = [bad * math.log(p / reference) + (n - bad) * math.log((1 - p) / (1 - reference)) for p in alternatives]
    top = max(logs)
    return top + math.log(sum(math.exp(x - top) for x in logs) / len(logs))


def worse_rates(reference: float) -> list[float]:
    """The mixture's alternatives to `reference` on the fail side: rates above it, up to nearly 1."""
    return [reference + (1 - reference) * f for f in MIXTURE_FRACTIONS]


def better_rates(reference: float) -> list[float]:
    """... and on the pass side: rates below it, down to nearly 0."""
    return [reference * (1 - f) for f in MIXTURE_FRACTIONS]


def rollback_level(config: SloConfig, steps: int) -> float:
    """α of one comparison at one step: the canary's false-rollback bound split between them."""
    return config.false_rollback / (COMPARISONS * max(1, steps))


def _latency(name: str, base: list[int], cand: list[int], bounds: tuple[float, ...], slack: float,
             config: SloConfig, alpha: float, numbers: dict[str, float]) -> tuple[Outcome, str]:
    base_p90 = m.hist_percentile(base, bounds, 0.9)
    cand_p90 = m.hist_percentile(cand, bounds, 0.9)
    if base_p90 is None or cand_p90 is None:
        return "wait", f"no {name} samples"
    threshold = base_p90 * (1 + config.latency_tolerance) + slack
    share, n = share_above(cand, bounds, threshold)
    worse = log_mixture_ratio(share * n, n, ABOVE_P90, worse_rates(ABOVE_P90))
    bound = ABOVE_P90 + config.p90_margin
    better = log_mixture_ratio(share * n, n, bound, better_rates(bound))
    to_fail, to_pass = math.log(1 / alpha), math.log(1 / config.false_pass)
    numbers.update({f"{name}_p90_baseline_s": base_p90, f"{name}_p90_candidate_s": cand_p90,
                    f"{name}_share_above": share, f"{name}_log_lr_worse": worse, f"{name}_log_lr_better": better,
                    "log_lr_to_fail": to_fail, "log_lr_to_pass": to_pass})
    what = (f"{name} p90 {cand_p90 * 1000:.1f} ms vs baseline {base_p90 * 1000:.1f} ms: {share:.1%} of the candidate's "
            f"{n} requests above {threshold * 1000:.1f} ms (evidence of >10%: {worse:.1f}, fails at {to_fail:.1f}; "
            f"of <{bound:.0%}: {better:.1f}, passes at {to_pass:.1f})")
    if worse >= to_fail:
        return "fail", what
    if better >= to_pass:
        return "pass", what
    return "wait", what


def compare_rate(name: str, base_bad: int, base_n: int, cand_bad: int, cand_n: int, tolerance: float,
                 alpha: float, numbers: dict[str, float], pass_margin: float = 0.025,
                 false_pass: float = 0.05) -> tuple[Outcome, str]:
    """Is the candidate's rate of bad requests (failed, cancelled) above the baseline's plus
    `tolerance`, by the mixture test at level `alpha` ("fail"), or surely below that plus
    `pass_margin`, at level `false_pass` ("pass")? Otherwise "wait". With what in words."""
    p_b, p_c = base_bad / base_n, cand_bad / cand_n
    # The baseline's rate with half a request of continuity, so that a baseline without a single
    # failure does not make the reference the tolerance alone.
    reference = min((base_bad + 0.5) / (base_n + 1) + tolerance, 0.99)
    worse = log_mixture_ratio(cand_bad, cand_n, reference, worse_rates(reference))
    bound = min(reference + pass_margin, 0.99)
    better = log_mixture_ratio(cand_bad, cand_n, bound, better_rates(bound))
    to_fail, to_pass = math.log(1 / alpha), math.log(1 / false_pass)
    numbers.update({f"{name}_rate_baseline": p_b, f"{name}_rate_candidate": p_c, f"{name}_log_lr_worse": worse,
                    f"{name}_log_lr_better": better})
    what = (f"{name} rate {p_c:.2%} vs baseline {p_b:.2%} (evidence of >{reference:.2%}: {worse:.1f}, "
            f"fails at {to_fail:.1f}; of <{bound:.2%}: {better:.1f}, passes at {to_pass:.1f})")
    if worse >= to_fail:
        return "fail", what
    return ("pass" if better >= to_pass else "wait"), what


def verdict(baseline: Window, candidate: Window, config: SloConfig, steps: int = 1) -> Verdict:
    """Pass, fail or wait (too few requests, or not yet conclusive), with the numbers behind it.
    `steps`: how many steps of the canary the gate judges (those below 100%), between which the
    false-rollback bound is split."""
    numbers: dict[str, float] = {"baseline_requests": baseline.requests, "candidate_requests": candidate.requests}
    if baseline.requests < config.min_samples or candidate.requests < config.min_samples:
        return Verdict("wait", f"too few requests for a verdict: candidate {candidate.requests}, baseline "
                               f"{baseline.requests} (need {config.min_samples} each)", numbers)
    alpha = rollback_level(config, steps)
    results = [
        _latency("ttft", baseline.ttft, candidate.ttft, m.LATENCY_BUCKETS_S, config.ttft_slack_s, config, alpha,
                 numbers),
        _latency("tpot", baseline.tpot, candidate.tpot, m.TPOT_BUCKETS_S, config.tpot_slack_s, config, alpha, numbers),
        compare_rate("error", baseline.failed, baseline.requests, candidate.failed, candidate.requests,
                     config.error_tolerance, alpha, numbers, config.rate_pass_margin, config.false_pass),
        compare_rate("cancel", baseline.cancelled, baseline.requests, candidate.cancelled, candidate.requests,
                     config.cancel_tolerance, alpha, numbers, config.rate_pass_margin, config.false_pass),
    ]
    failed = [what for outcome, what in results if outcome == "fail"]
    if failed:
        return Verdict("fail", "SLO gate failed: " + "; ".join(failed), numbers)
    waiting = [what for outcome, what in results if outcome == "wait"]
    if waiting:
        return Verdict("wait", "SLO gate not conclusive yet: " + "; ".join(waiting), numbers)
    return Verdict("pass", "SLO gate passed: " + "; ".join(what for _, what in results), numbers)


class Windows:
    """Per-release sums of workers' cumulative reports since a start (pure: fed `WorkerLoad`s)."""

    def __init__(self) -> None:
        self._last: dict[str, m.WorkerLoad] = {}
        self.by_release: dict[str, Window] = {}

    def reset(self) -> None:
        """Start a new window: from now on only what happens after counts."""
        self.by_release.clear()

    def on_load(self, load: m.WorkerLoad) -> None:
        previous = self._last.get(load.worker_id)
        self._last[load.worker_id] = load
        if not load.release or previous is None or previous.release != load.release:
            return  # the first report of a worker is its baseline, not a delta
        window = self.by_release.setdefault(load.release, Window())
        for total, new, old, bounds in ((window.ttft, load.ttft_hist, previous.ttft_hist, m.LATENCY_BUCKETS_S),
                                        (window.tpot, load.tpot_fine_hist, previous.tpot_fine_hist, m.TPOT_BUCKETS_S)):
            for i, count in enumerate(m.hist_delta(new, old, len(bounds) + 1)):
                total[i] += count
        restarted = load.finished_ok < previous.finished_ok
        window.ok += load.finished_ok - (0 if restarted else previous.finished_ok)
        window.failed += load.finished_failed - (0 if restarted else previous.finished_failed)
        window.cancelled += load.finished_cancelled - (0 if restarted else previous.finished_cancelled)

    def forget(self, worker_id: str) -> None:
        self._last.pop(worker_id, None)

    def of(self, release: str) -> Window:
        return self.by_release.get(release, Window())


def _add_delta(window: Window, new: m.AdapterOutcomes | m.WorkerLoad, old: m.AdapterOutcomes | m.WorkerLoad | None,
               ttft: list[int], tpot: list[int], old_ttft: list[int], old_tpot: list[int]) -> None:
    for total, now, before, bounds in ((window.ttft, ttft, old_ttft, m.LATENCY_BUCKETS_S),
                                       (window.tpot, tpot, old_tpot, m.TPOT_BUCKETS_S)):
        for i, count in enumerate(m.hist_delta(now, before, len(bounds) + 1)):
            total[i] += count
    restarted = old is None or new.finished_ok < old.finished_ok
    window.ok += new.finished_ok - (0 if restarted else old.finished_ok)  # type: ignore[union-attr]
    window.failed += new.finished_failed - (0 if restarted else old.finished_failed)  # type: ignore[union-attr]
    window.cancelled += new.finished_cancelled - (0 if restarted else old.finished_cancelled)  # type: ignore[union-attr]


class AdapterWindows:
    """Per adapter version (engine name), sums of workers' cumulative `adapter_outcomes` since a
    start (pure: fed `WorkerLoad`s). A version a worker's previous report did not have started
    from zero since (workers add a version on its first request), so all of it counts."""

    def __init__(self) -> None:
        self._last: dict[str, m.WorkerLoad] = {}
        self.by_version: dict[str, Window] = {}

    def reset(self, engine_names: set[str] | None = None) -> None:
        """Start a new window (for these versions only, or all)."""
        if engine_names is None:
            self.by_version.clear()
        for name in engine_names or ():
            self.by_version.pop(name, None)

    def on_load(self, load: m.WorkerLoad) -> None:
        previous = self._last.get(load.worker_id)
        self._last[load.worker_id] = load
        if previous is None:
            return  # the first report of a worker is its baseline, not a delta
        for name, outcomes in load.adapter_outcomes.items():
            old = previous.adapter_outcomes.get(name)
            window = self.by_version.setdefault(name, Window())
            _add_delta(window, outcomes, old, outcomes.ttft_hist, outcomes.tpot_fine_hist,
                       old.ttft_hist if old is not None else [], old.tpot_fine_hist if old is not None else [])

    def forget(self, worker_id: str) -> None:
        self._last.pop(worker_id, None)

    def of(self, engine_name: str) -> Window:
        return self.by_version.get(engine_name, Window())
