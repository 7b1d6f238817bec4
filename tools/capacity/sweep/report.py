"""Sweep results → `sweep.json` (schema `inferbus.capacity.sweep/v1`), `sweep.csv`, PNG plots and a text table."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inferbus.runtime.extras import require
from tools.capacity.sweep.metrics import knee

SCHEMA = "inferbus.capacity.sweep/v1"
LATENCIES = ("ttft_s", "tpot_s", "itl_s", "e2e_s")
STATS = ("mean", "p50", "p90", "p99")
CSV_COLUMNS = (
    ["concurrency", "rate_rps", "duration_s", "requests", "completed", "errors", "error_kinds", "request_rps",
     "input_tok_s", "output_tok_s"]
    + [f"{name[:-2]}_{stat}_s" for name in LATENCIES for stat in STATS]
    + ["slo_attainment", "slo_met", "goodput_rps", "client_limited", "client_cpu_util", "client_loop_lag_p99_s",
       "client_achieved_vs_target"]
)


def _clean(value: Any) -> Any:
    """NaN (no samples) → None, so the JSON is standard."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def write_json(result: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(_clean(result), indent=2) + "\n")


def csv_row(step: dict[str, Any]) -> dict[str, Any]:
    """One step flattened to the CSV columns (`ttft_p90_s`, `client_cpu_util`, ...)."""
    row: dict[str, Any] = {key: step[key] for key in CSV_COLUMNS if key in step}
    row["error_kinds"] = ";".join(f"{k}:{v}" for k, v in step["error_kinds"].items())
    for name in LATENCIES:
        for stat in STATS:
            row[f"{name[:-2]}_{stat}_s"] = step[name][stat]
    for key in ("cpu_util", "loop_lag_p99_s", "achieved_vs_target"):
        row[f"client_{key}"] = step["client"][key]
    return {k: ("" if v is None or (isinstance(v, float) and math.isnan(v)) else v) for k, v in row.items()}


def write_csv(steps: Sequence[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for step in steps:
            writer.writerow(csv_row(step))


def _load(step: dict[str, Any]) -> float:
    return float(step["concurrency"] if step["concurrency"] is not None else step["rate_rps"])


def write_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Latency vs load (TTFT, TPOT, ITL, E2E percentiles, SLO lines) and throughput/goodput vs load
    with the knee marked. Client-limited steps are drawn hollow: their numbers describe the client."""
    matplotlib = require("matplotlib", "plots", "the sweep plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["steps"]
    if not steps:
        return []
    xlabel = "concurrency" if result["mode"] == "concurrency" else "offered rate (req/s)"
    loads = [_load(s) for s in steps]
    log_x = len(loads) > 2 and min(loads) > 0 and max(loads) / min(loads) >= 8
    limited = [s["client_limited"] for s in steps]
    title = f"{result['model']} @ {result['url']} — mix {result['mix']['name']}"

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    slo = result["slo"]
    targets = {"ttft_s": slo["ttft_p90_s"], "tpot_s": slo["tpot_p90_s"]}
    names = {"ttft_s": "TTFT", "tpot_s": "TPOT", "itl_s": "ITL (chunk gap)", "e2e_s": "end-to-end latency"}
    for ax, name in zip(axes.flat, LATENCIES):
        for stat, style in (("p50", "-o"), ("p90", "-s"), ("p99", ":^")):
            values = [
                1000 * v if v is not None and not math.isnan(v) else math.nan for v in (s[name][stat] for s in steps)
            ]
            line, = ax.plot(loads, values, style, label=stat)
            for x, y, hollow in zip(loads, values, limited):
                if hollow:
                    ax.plot([x], [y], "o", mfc="white", mec=line.get_color(), ms=10)
        if name in targets:
            ax.axhline(1000 * targets[name], color="red", ls="--", lw=1, label=f"SLO p90 ≤ {1000 * targets[name]:g} ms")
        ax.set_title(names[name])
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        _ticks(ax, loads, log_x)
    for ax in axes[1]:
        ax.set_xlabel(xlabel)
    fig.suptitle(title + ("\n(hollow circles: client-limited steps)" if any(limited) else ""), fontsize=10)
    fig.tight_layout()
    latency_png = out_dir / "sweep_latency.png"
    fig.savefig(latency_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(loads, [s["request_rps"] for s in steps], "-o", label="throughput (completed req/s)")
    ax.plot(loads, [s["goodput_rps"] for s in steps], "-s", label="goodput (req/s meeting the SLO)")
    for x, s, hollow in zip(loads, steps, limited):
        if hollow:
            ax.plot([x], [s["request_rps"]], "o", mfc="white", mec="gray", ms=11)
    best = knee(steps)
    if best is not None:
        ax.axvline(_load(best), color="green", ls="--", lw=1)
        rightmost = _load(best) == max(loads)
        ax.annotate(f"knee: {best['goodput_rps']:.2f} req/s\nat {xlabel} {_load(best):g}",
                    (_load(best), best["goodput_rps"]), textcoords="offset points",
                    xytext=(-130 if rightmost else 8, -30), fontsize=9)
    ax2 = ax.twinx()
    ax2.plot(loads, [100 * s["slo_attainment"] for s in steps], ":", color="gray", label="SLO attainment (%)")
    ax2.set_ylim(0, 105)
    ax2.set_ylabel("SLO attainment (%)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("req/s")
    _ticks(ax, loads, log_x)
    ax.grid(alpha=0.3)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper left")
    ax.set_title(
        f"goodput knee — SLO p90 TTFT ≤ {1000 * slo['ttft_p90_s']:g} ms, p90 TPOT ≤ {1000 * slo['tpot_p90_s']:g} ms",
        fontsize=10,
    )
    fig.tight_layout()
    goodput_png = out_dir / "sweep_goodput.png"
    fig.savefig(goodput_png, dpi=110)
    plt.close(fig)
    return [latency_png, goodput_png]


def _ticks(ax: Any, loads: Sequence[float], log_x: bool) -> None:
    """Log-2 x axis for geometric sweeps, ticks at the loads measured, plain numbers."""
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xticks(list(loads))
    ax.set_xticklabels([f"{x:g}" for x in loads])
    ax.minorticks_off()


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{1000 * value:.1f}"


def table(result: dict[str, Any]) -> str:
    """A plain-text summary, one line per step."""
    head = ["load", "req/s", "out tok/s", "TTFT p50/p90 ms", "TPOT p50/p90 ms", "E2E p90 ms", "SLO att.", "goodput",
            "errors", "notes"]
    rows = []
    for s in result["steps"]:
        notes = []
        if s["slo_met"]:
            notes.append("SLO met")
        if s["client_limited"]:
            notes.append("CLIENT-LIMITED")
        rows.append(
            [
                f"{_load(s):g}",
                f"{s['request_rps']:.2f}",
                f"{s['output_tok_s']:.0f}",
                f"{_ms(s['ttft_s']['p50'])}/{_ms(s['ttft_s']['p90'])}",
                f"{_ms(s['tpot_s']['p50'])}/{_ms(s['tpot_s']['p90'])}",
                _ms(s["e2e_s"]["p90"]),
                f"{100 * s['slo_attainment']:.0f}%",
                f"{s['goodput_rps']:.2f}",
                str(s["errors"]),
                ", ".join(notes),
            ]
        )
    widths = [max(len(str(x)) for x in column) for column in zip(head, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in [head, *rows]]
    return "\n".join(lines)
