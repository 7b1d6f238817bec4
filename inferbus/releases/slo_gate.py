"""The SLO gate: is the candidate worse than the baseline on TTFT/TPOT p90, errors or cancels?

Both sides are read from the same per-worker histograms and counters the dashboards and the
autoscaler use (`WorkerLoad`: interactive requests only, cumulative, so deltas over a window are
exact), summed per release over the canary step's window.

The tests, each one-sided, each with the sample sizes it has:

- Latency (TTFT and TPOT): the baseline's p90, widened by a tolerance, is the threshold; if the
  candidate's p90 is no worse, at most 10% of its requests exceed it. The candidate's share above
  the threshold is compared with 10% by a one-sample z-test on a proportion: it fails when the
  share is significantly above 10% (z > `z_fail`), passes when the upper confidence bound of the
  share is below 10% + `p90_margin`.
- Error and cancel rates: a two-proportion z-test of candidate against baseline plus an allowed
  absolute increase (pooled variance, half a request of continuity so a zero rate has a variance).

No verdict is given before each side has `min_samples` requests in the window (with 200, a p90
that moved to the candidate's p80 fails at z > 2.33 with probability > 0.99; 20 requests say
nothing about a p90). `detectable_shift` gives the smallest regression a sample size resolves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from proto import messages as m

Outcome = Literal["pass", "fail", "wait"]


@dataclass
class SloConfig:
    min_samples: int = 200
    latency_tolerance: float = 0.10  # the candidate's p90 may be this much above the baseline's
    ttft_slack_s: float = 0.010  # and this much in absolute terms (histogram buckets are coarse)
    tpot_slack_s: float = 0.001
    p90_margin: float = 0.05  # pass: the share above the threshold is surely below 10% + this
    error_tolerance: float = 0.002  # allowed absolute increase of the error rate
    cancel_tolerance: float = 0.02  # and of the cancel rate (clients give up on slow answers)
    z_fail: float = 2.326  # one-sided 99%: a rollback on noise is rare
    z_pass: float = 1.645  # one-sided 95% bound for passing


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


def _latency(name: str, base: list[int], cand: list[int], bounds: tuple[float, ...], slack: float,
             config: SloConfig, numbers: dict[str, float]) -> tuple[Outcome, str]:
    base_p90 = m.hist_percentile(base, bounds, 0.9)
    cand_p90 = m.hist_percentile(cand, bounds, 0.9)
    if base_p90 is None or cand_p90 is None:
        return "wait", f"no {name} samples"
    threshold = base_p90 * (1 + config.latency_tolerance) + slack
    share, n = share_above(cand, bounds, threshold)
    se = math.sqrt(0.1 * 0.9 / n)
    z = (share - 0.1) / se
    upper = share + config.z_pass * math.sqrt(max(share * (1 - share), 0.1 * 0.9) / n)
    numbers.update({f"{name}_p90_baseline_s": base_p90, f"{name}_p90_candidate_s": cand_p90,
                    f"{name}_share_above": share, f"{name}_z": z})
    what = (f"{name} p90 {cand_p90 * 1000:.1f} ms vs baseline {base_p90 * 1000:.1f} ms: {share:.1%} of the candidate's "
            f"requests above {threshold * 1000:.1f} ms (z={z:.1f})")
    if z > config.z_fail:
        return "fail", what
    if upper <= 0.1 + config.p90_margin:
        return "pass", what
    return "wait", what


def _rate(name: str, base_bad: int, base_n: int, cand_bad: int, cand_n: int, tolerance: float,
          config: SloConfig, numbers: dict[str, float]) -> tuple[Outcome, str]:
    p_b, p_c = base_bad / base_n, cand_bad / cand_n
    pooled = (base_bad + cand_bad + 0.5) / (base_n + cand_n + 1)
    se = math.sqrt(pooled * (1 - pooled) * (1 / base_n + 1 / cand_n))
    z = (p_c - p_b - tolerance) / se
    numbers.update({f"{name}_rate_baseline": p_b, f"{name}_rate_candidate": p_c, f"{name}_z": z})
    what = f"{name} rate {p_c:.2%} vs baseline {p_b:.2%} (z={z:.1f})"
    return ("fail" if z > config.z_fail else "pass"), what


def verdict(baseline: Window, candidate: Window, config: SloConfig) -> Verdict:
    """Pass, fail or wait (too few requests, or not yet conclusive), with the numbers behind it."""
    numbers: dict[str, float] = {"baseline_requests": baseline.requests, "candidate_requests": candidate.requests}
    if baseline.requests < config.min_samples or candidate.requests < config.min_samples:
        return Verdict("wait", f"too few requests for a verdict: candidate {candidate.requests}, baseline "
                               f"{baseline.requests} (need {config.min_samples} each)", numbers)
    results = [
        _latency("ttft", baseline.ttft, candidate.ttft, m.LATENCY_BUCKETS_S, config.ttft_slack_s, config, numbers),
        _latency("tpot", baseline.tpot, candidate.tpot, m.TPOT_BUCKETS_S, config.tpot_slack_s, config, numbers),
        _rate("error", baseline.failed, baseline.requests, candidate.failed, candidate.requests,
              config.error_tolerance, config, numbers),
        _rate("cancel", baseline.cancelled, baseline.requests, candidate.cancelled, candidate.requests,
              config.cancel_tolerance, config, numbers),
    ]
    failed = [what for outcome, what in results if outcome == "fail"]
    if failed:
        return Verdict("fail", "SLO gate failed: " + "; ".join(failed), numbers)
    waiting = [what for outcome, what in results if outcome == "wait"]
    if waiting:
        return Verdict("wait", "SLO gate not conclusive yet: " + "; ".join(waiting), numbers)
    return Verdict("pass", "SLO gate passed: " + "; ".join(what for _, what in results), numbers)


def detectable_share(n: int, config: SloConfig, power_z: float = 0.842) -> float:
    """The smallest share of candidate requests above the widened baseline p90 that fails with 80%
    power at `n` candidate requests (10% is no regression)."""
    p0 = 0.1
    # Solve (p - p0) = z_fail·sqrt(p0(1-p0)/n) + z_power·sqrt(p(1-p)/n) by fixed point.
    p = p0 + 0.05
    for _ in range(50):
        p = p0 + (config.z_fail * math.sqrt(p0 * (1 - p0)) + power_z * math.sqrt(p * (1 - p))) / math.sqrt(n)
    return p


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
