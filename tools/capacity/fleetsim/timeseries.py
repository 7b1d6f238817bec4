"""Per-minute metrics of a fast fleet run, the SLO arithmetic over them, and the plots.

A request counts in the bucket (minute) in which it finished; a request shed by admission counts
in the minute it arrived, as a request whose TTFT is infinite (a 503 is not within any SLO).

- Minute attainment: share of minutes (with at least one request) whose p90 TTFT and p90 TPOT
  are within the SLO.
- Request attainment: share of requests with TTFT and TPOT within the SLO (TPOT only for ≥ 2
  output tokens); goodput is those requests per second, and their output tokens per second.
Percentiles by nearest rank.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from inferbus.runtime.extras import require

INF = float("inf")


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (q in 0..1) of unsorted values; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def quantiles(values: list[float], *qs: float) -> tuple[float, ...]:
    """`quantile` at each of `qs`, sorting once."""
    if not values:
        return tuple(math.nan for _ in qs)
    ordered = sorted(values)
    n = len(ordered)
    return tuple(ordered[min(n - 1, max(0, math.ceil(q * n) - 1))] for q in qs)


class Bucket:
    """What finished (or was shed) in one bucket; raw values are dropped once it is closed."""

    __slots__ = ("index", "arrivals", "rejected", "completed", "good", "output_tokens", "good_tokens",
                 "ttft", "tpot", "wait")  # `wait` (arrival → prefill start): kept for controller windows only

    def __init__(self, index: int) -> None:
        self.index = index
        self.arrivals = 0
        self.rejected = 0
        self.completed = 0
        self.good = 0
        self.output_tokens = 0
        self.good_tokens = 0
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.wait: list[float] = []


@dataclass
class Minute:
    t_s: float  # bucket start, virtual seconds
    arrivals: int
    rejected: int
    completed: int
    good: int
    output_tokens: int
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    serving: int
    started: int  # serving + warm + starting + draining: what is billed
    kv_use: float  # mean over serving replicas, at the bucket's end
    queued: int  # requests waiting for KV or a slot, fleet-wide, at the bucket's end
    within_slo: bool


def close(bucket: Bucket, width_s: float, slo_ttft_s: float, slo_tpot_s: float, *, serving: int, started: int,
          kv_use: float, queued: int) -> Minute:
    ttft_p50, ttft_p90 = quantiles(bucket.ttft, 0.5, 0.9)
    tpot_p50, tpot_p90 = quantiles(bucket.tpot, 0.5, 0.9)
    within = (not bucket.ttft or ttft_p90 <= slo_ttft_s) and (not bucket.tpot or tpot_p90 <= slo_tpot_s)
    return Minute(
        t_s=bucket.index * width_s, arrivals=bucket.arrivals, rejected=bucket.rejected, completed=bucket.completed,
        good=bucket.good, output_tokens=bucket.output_tokens, ttft_p50_s=ttft_p50,
        ttft_p90_s=ttft_p90, tpot_p50_s=tpot_p50, tpot_p90_s=tpot_p90,
        serving=serving, started=started, kv_use=kv_use,
        queued=queued, within_slo=within,
    )


def minute_attainment(minutes: list[Minute]) -> tuple[int, float]:
    """(minutes with a request, share of them within the SLO): a minute in which nothing arrived
    or finished says nothing about the SLO and does not count (NaN when none does)."""
    counted = [mn for mn in minutes if mn.arrivals or mn.completed]
    within = sum(mn.within_slo for mn in counted)
    return len(counted), within / len(counted) if counted else math.nan


@dataclass
class Summary:
    """One fast-fleet run; `as_dict()` is what the JSON report holds."""

    policy: str
    gpu: str
    tp: int
    duration_s: float
    requests: int
    completed: int
    rejected: int
    unfinished: int
    minutes: int
    minute_attainment: float
    request_attainment: float
    goodput_rps: float
    goodput_tok_s: float
    output_tok_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    gpu_hours: float
    replica_hours: float
    cost_usd: float
    price_per_gpu_hour: float
    peak_serving: int
    slo_ttft_s: float
    slo_tpot_s: float
    cpu_s: float
    wall_s: float
    req_per_cpu_s: float
    events: int
    build: str = ""  # "compiled" (tools.capacity.accel) or "pure Python": what ran, for the speed figures
    series: list[Minute] = field(default_factory=list, repr=False)

    def as_dict(self, series: bool = True) -> dict[str, Any]:
        data = asdict(self)
        if not series:
            data.pop("series")
        return _clean(data)

    def markdown(self) -> str:
        rows = [
            ("policy", self.policy),
            ("fleet", f"{self.gpu} TP{self.tp}, peak {self.peak_serving} serving"),
            ("virtual time", f"{self.duration_s / 3600:.2f} h"),
            (
                "requests (completed / shed / unfinished)",
                f"{self.requests:,} ({self.completed:,} / {self.rejected:,} / {self.unfinished:,})",
            ),
            (
                f"minutes within SLO (p90 TTFT ≤ {self.slo_ttft_s * 1000:.0f} ms, p90 TPOT ≤ "
                f"{self.slo_tpot_s * 1000:.0f} ms)",
                f"{self.minute_attainment:.2%} of {self.minutes:,}",
            ),
            ("requests within SLO", f"{self.request_attainment:.2%}"),
            ("goodput", f"{self.goodput_rps:,.1f} req/s, {self.goodput_tok_s:,.0f} output tok/s"),
            ("TTFT p50 / p90 / p99", f"{_ms(self.ttft_p50_s)} / {_ms(self.ttft_p90_s)} / {_ms(self.ttft_p99_s)} ms"),
            ("TPOT p50 / p90", f"{_ms(self.tpot_p50_s)} / {_ms(self.tpot_p90_s)} ms"),
            ("GPU-hours", f"{self.gpu_hours:,.1f} ({self.replica_hours:,.1f} replica-hours)"),
            ("cost", f"${self.cost_usd:,.0f} at ${self.price_per_gpu_hour:.2f}/GPU-hour"),
            (
                "simulator",
                f"{self.cpu_s:,.1f} CPU s, {self.req_per_cpu_s:,.0f} req/CPU-s, {self.events:,} events"
                + (f" ({self.build} build)" if self.build else ""),
            ),
        ]
        return "| metric | value |\n| --- | --- |\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


def _ms(value: float) -> str:
    return "–" if value is None or math.isnan(value) or math.isinf(value) else f"{value * 1000:,.0f}"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def plot(summary: Summary, out_dir: str | Path, stem: str = "simulate") -> list[Path]:
    """PNG plots of the time series: load and fleet, latency against the SLO, KV and queue."""
    matplotlib = require("matplotlib", "plots", "the simulation plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    series = summary.series
    if not series:
        return []
    width = (series[1].t_s - series[0].t_s) if len(series) > 1 else 60.0
    hours = [m.t_s / 3600 for m in series]
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    ax = axes[0]
    ax.plot(hours, [m.arrivals / width for m in series], label="arrivals req/s", lw=0.8)
    ax.plot(hours, [m.good / width for m in series], label="goodput req/s", lw=0.8)
    ax.set_ylabel("req/s")
    twin = ax.twinx()
    twin.plot(hours, [m.serving for m in series], color="black", lw=1.0, label="serving replicas")
    twin.plot(hours, [m.started for m in series], color="grey", lw=1.0, ls="--", label="billed replicas")
    twin.set_ylabel("replicas")
    ax.legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)
    ax.set_title(f"{summary.policy}: {summary.minute_attainment:.1%} of minutes within SLO, "
                 f"{summary.gpu_hours:,.0f} GPU-h, ${summary.cost_usd:,.0f}")
    ax = axes[1]
    ax.plot(hours, [_finite(m.ttft_p90_s) * 1000 for m in series], label="p90 TTFT ms", lw=0.8)
    ax.plot(hours, [_finite(m.tpot_p90_s) * 1000 for m in series], label="p90 TPOT ms", lw=0.8)
    ax.axhline(summary.slo_ttft_s * 1000, color="C0", ls=":", lw=0.8)
    ax.axhline(summary.slo_tpot_s * 1000, color="C1", ls=":", lw=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.legend(loc="upper left", fontsize=8)
    ax = axes[2]
    ax.plot(hours, [m.kv_use * 100 for m in series], label="KV use % (mean)", lw=0.8)
    ax.set_ylabel("KV %")
    twin = ax.twinx()
    twin.plot(hours, [m.queued for m in series], color="C3", lw=0.8, label="queued requests")
    twin.set_ylabel("queued")
    ax.legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("virtual time (h)")
    fig.tight_layout()
    path = out / f"{stem}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _finite(value: float) -> float:
    return math.nan if value is None or math.isinf(value) else value
