"""The plan report's topology part: the disaggregated pairs, the choice and its arithmetic.

Pure: strings and dicts from an already-made plan.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from inferbus.timing import GB
from tools.capacity.plan.disagg import DECODE_FIRST_TOKEN_STEPS, DisaggRow, cheapest
from tools.capacity.plan.model import Z90
from tools.capacity.plan.planner import Plan, fleet_terms
from tools.capacity.plan.sizing import POOLED_FROM_REPLICAS
from tools.capacity.plan.topology import TopologyChoice, plan_topology


def _ms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "–"
    return f"{seconds * 1e3:,.1f} ms" if seconds < 1 else f"{seconds * 1e3:,.0f} ms"


def _rps(value: float) -> str:
    return f"{value:,.3f}" if value < 10 else f"{value:,.2f}"


def pair_json(row: DisaggRow) -> dict[str, Any]:
    return {
        "config": row.name, "gpu": row.gpu, "tp_prefill": row.tp_prefill, "tp_decode": row.tp_decode,
        "feasible": row.feasible, "infeasible": row.infeasible, "kv_link": row.link.name,
        "kv_link_gb_s_per_gpu": row.link.bandwidth / GB, "transfer_tokens_p90": row.transfer_tokens,
        "transfer_p90_s": row.transfer_p90_s, "decode_rps_per_replica": row.decode_rps,
        "decode_binding": row.decode_binding, "decode_limits_rps": row.decode_limits,
        "decode_at_goodput": asdict(row.decode_point) if row.decode_point else None,
        "decode_kv_capacity_tokens": row.decode_kv_capacity_tokens,
        "prefill_ttft_budget_s": row.prefill_budget_s, "prefill_rps_per_replica": row.prefill_rps,
        "prefill_at_goodput": asdict(row.prefill_point) if row.prefill_point else None,
        "prefill_replicas": row.prefill_replicas, "decode_replicas": row.decode_replicas,
        "prefill_replicas_set_by": row.prefill_sizing.binding if row.prefill_sizing else None,
        "prefill_pool": row.prefill_pool, "prefill_unpooled": row.prefill_unpooled,
        "decode_replicas_set_by": row.decode_sizing.binding if row.decode_sizing else None,
        "prefill_warm_replicas": row.prefill_warm.replicas if row.prefill_warm else 0,
        "decode_warm_replicas": row.decode_warm.replicas if row.decode_warm else 0,
        "gpus": row.gpus, "gpus_with_warm_pools": row.gpus_total, "usd_per_hour": row.usd_per_hour,
        "prefill_to_decode_gpus": row.ratio, "ttft_p90_s": row.ttft_p90_s,
    }


def topology_json(plan: Plan) -> dict[str, Any]:
    choice = plan_topology(plan)
    best = cheapest(plan.disaggregated)
    return {
        "chosen": choice.topology, "reason": choice.reason,
        "aggregated_over_disaggregated_usd": None if math.isnan(choice.gain) else choice.gain,
        "cheapest_disaggregated": best.name if best else None,
        "disaggregated": [pair_json(r) for r in plan.disaggregated],
    }


def summary_line(plan: Plan) -> str:
    if not plan.disaggregated:
        return ""
    return f"Topology: {plan_topology(plan).reason}."


def _pairs_table(plan: Plan, best: DisaggRow | None) -> list[str]:
    lines = ["| prefill + decode | KV transfer p90 | decode req/s per replica (binds) | prefill TTFT share | "
             "prefill req/s per replica | replicas P + D (warm) | P:D GPUs | GPUs | $/hour |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in plan.disaggregated:
        if r.decode_kv_capacity_tokens <= 0 or r.decode_point is None:
            continue  # no KV room at all: listed below with the reason
        name = f"**{r.name}**" if r is best else r.name
        if not r.feasible:
            lines.append(f"| {name} | {_ms(r.transfer_p90_s)} | {_rps(r.decode_rps)} ({r.decode_binding}) | "
                         f"{_ms(r.prefill_budget_s)} | infeasible: {r.infeasible} | | | | |")
            continue
        warm = (r.prefill_warm.replicas if r.prefill_warm else 0, r.decode_warm.replicas if r.decode_warm else 0)
        lines.append(f"| {name} | {_ms(r.transfer_p90_s)} | {_rps(r.decode_rps)} ({r.decode_binding}) | "
                     f"{_ms(r.prefill_budget_s)} | {_rps(r.prefill_rps)} | {r.prefill_replicas:,} + "
                     f"{r.decode_replicas:,} ({warm[0]:,} + {warm[1]:,}) | {r.ratio} | {r.gpus_total:,} | "
                     f"${r.usd_per_hour:,.0f} |")
    return lines


def _arithmetic(r: DisaggRow, plan: Plan) -> list[str]:
    i, w = plan.inputs, plan.inputs.workload
    terms = fleet_terms(i)
    d, p = r.decode_point, r.prefill_point
    assert d is not None and p is not None
    link = r.link
    chunk = i.assumptions.chunk_tokens
    wait_p90 = ("ln 10 × W_q" if r.prefill_pool is None
                else f"W₉₀ (one M/G/c queue for the {r.prefill_pool} prefill replicas left serving: m · ln(10 · C))")
    if r.prefill_unpooled is not None:
        wait_p90 += (f" (each prefill replica its own queue: priced pooled, {r.prefill_unpooled} would be left "
                     f"serving, fewer than the {POOLED_FROM_REPLICAS} that pool)")
    lines = [
        f"### {r.name}", "",
        "Decode pool (decode-only steps, no prefill chunk in any of them):", "",
        f"- step t = T(B, S, 0, 0) = {_ms(d.step_s)} at λ_d = {_rps(r.decode_rps)} req/s: B = λ_d × o × t = "
        f"{_rps(r.decode_rps)} × {w.output_tokens:,.0f} × {d.step_s:.4f} = {d.batch:,.1f} sequences, "
        f"S = B × c_d = {d.resident_tokens:,.0f} tokens",
        f"- TPOT p90 = t = {_ms(d.tpot_p90_s)} (SLO {_ms(i.slo.tpot_p90_s)})",
        f"- KV reserved for prompts on their way in: R = λ_d × n × h = {_rps(r.decode_rps)} × {w.input_tokens:,.0f} × "
        f"{i.slo.ttft_p90_s:g} s = {d.reserved_tokens:,.0f} tokens (h: the TTFT SLO, how long the decode engine "
        "holds a prompt's KV before the transfer fills it)",
        f"- spread of S + R: z₉₀ × σ = {Z90:.4f} × √(B × E[c²] + λ_d × h × E[n²]) = {Z90:.4f} × √({d.batch:,.1f} × "
        f"{w.decode_ctx_sq:,.4g} + {_rps(r.decode_rps)} × {i.slo.ttft_p90_s:g} × {w.input_sq:,.4g}) = "
        f"{d.spread_tokens:,.0f} tokens (each a Poisson number of requests)",
        f"- KV use p90 = (S + R + z₉₀ × σ) ÷ capacity = ({d.resident_tokens:,.0f} + {d.reserved_tokens:,.0f} + "
        f"{d.spread_tokens:,.0f}) ÷ {r.decode_kv_capacity_tokens:,} = {d.kv_fraction:.1%} "
        f"(limit {i.assumptions.kv_limit:.0%})",
        "- limits: " + ", ".join(f"{k} alone {_rps(v)} req/s" for k, v in r.decode_limits.items())
        + f"; **{r.decode_binding}** binds", "",
        "KV transfer of the p90 prompt:", "",
        f"- x₉₀ = n₉₀ × KV bytes per token ÷ (min(TP_p, TP_d) × link) = {r.transfer_tokens:,.0f} × "
        f"{r.kv_bytes_per_token:,.0f} B ÷ ({min(r.tp_prefill, r.tp_decode)} × "
        f"{link.bandwidth / GB:,.0f} GB/s, {link.name}) = {_ms(r.transfer_p90_s)}", "",
        "Prefill pool (prefill-only steps):", "",
        f"- a {chunk:,}-token chunk step T(0, 0, {chunk:,}, c_p) = {_ms(p.chunk_step_s)}: μ = "
        f"{p.prefill_rate_tok_s:,.0f} tokens/s",
        f"- its share of the TTFT SLO = {_ms(i.slo.ttft_p90_s)} − x₉₀ {_ms(r.transfer_p90_s)} − "
        f"{DECODE_FIRST_TOKEN_STEPS:g} decode step {_ms(d.step_s)} = {_ms(r.prefill_budget_s)}",
        f"- at λ_p = {_rps(r.prefill_rps)} req/s: ρ = {p.load:.2f}, W_q = {_ms(p.queue_wait_s)}, TTFT_prefill p90 = "
        f"u₉₀ ÷ μ + {wait_p90} = {_ms(p.compute_p90_s)} + {_ms(p.ttft_p90_s - p.compute_p90_s)} = "
        f"{_ms(p.ttft_p90_s)}",
        f"- TTFT p90 = {_ms(p.ttft_p90_s)} + {_ms(r.transfer_p90_s)} + {_ms(r.decode_steps_s)} = {_ms(r.ttft_p90_s)}",
        "",
        "Fleet:", "",
        f"- prefill replicas = {terms.arithmetic(r.prefill_rps, r.prefill_sizing)} × TP{r.tp_prefill} = "
        f"{r.prefill_gpus:,} GPUs"
        + (f" + {r.prefill_warm.replicas:,} warm" if r.prefill_warm else ""),
        f"- decode replicas = {terms.arithmetic(r.decode_rps, r.decode_sizing)} × TP{r.tp_decode} = "
        f"{r.decode_gpus:,} GPUs"
        + (f" + {r.decode_warm.replicas:,} warm" if r.decode_warm else ""),
        "  (the headroom, or one replica beyond the busiest minute's need with the forecast and model error: "
        "whichever is more)",
        f"- P:D = {r.ratio} in GPUs; {r.gpus_total:,} GPUs with the warm pools × ${r.usd_per_gpu_hour:.2f} = "
        f"**${r.usd_per_hour:,.0f}/hour**", "",
    ]
    return lines


def markdown(plan: Plan) -> list[str]:
    """The report's section: the choice, every pair, the chosen (or cheapest) pair's arithmetic."""
    if not plan.disaggregated:
        return []
    choice: TopologyChoice = plan_topology(plan)
    best = cheapest(plan.disaggregated)
    link = plan.inputs.kv_link
    lines = [
        "## Topology: aggregated or disaggregated", "",
        f"**{choice.topology.capitalize()}** — {choice.reason}.", "",
        "A disaggregated fleet runs a prefill pool and a decode pool: decode replicas never carry a prefill chunk, "
        "prefill replicas send each prompt's KV to a decode replica over the link "
        f"(assumed: **{link.name}, {link.bandwidth / GB:,.0f} GB/s per GPU one way**; `--kv-link` changes it). Every "
        "prefill TP × decode TP pair on each GPU type, the cheapest in bold:", "",
    ]
    lines += _pairs_table(plan, best)
    no_kv = sorted({r.name for r in plan.disaggregated if r.decode_point is None and not r.feasible})
    if no_kv:
        lines += ["", f"Not priced (no KV room next to the weights on one side): {', '.join(no_kv)}."]
    lines.append("")
    if best is not None:
        lines += _arithmetic(best, plan)
    return lines
