"""The plan as markdown (arithmetic line by line, for finance), as JSON, and as plots.

`markdown`, `summary` and `to_json` are pure; `write_plots` draws PNGs with matplotlib (imported
there, so the planner itself does not need it).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from inferbus.runtime.extras import require
from inferbus.timing import lora_adapter_bytes, lora_load_s
from inferbus.zones import left_after_zone_loss, replicas_for_zone_loss, spread
from tools.capacity.plan import report_topology
from tools.capacity.plan.model import OperatingPoint, Workload
from tools.capacity.plan.options import Variant
from tools.capacity.plan.planner import Plan, PlanInputs, Row, fleet_terms, zone_factor
from tools.capacity.plan.sizing import POOLED_FROM_REPLICAS

SCHEMA = "inferbus.plan/v1"


# ---- formatting -----------------------------------------------------------------------------

def _n(value: float, digits: int = 0) -> str:
    """A number with thousands separators, or '∞'."""
    if value is None or math.isnan(value):
        return "–"
    if not math.isfinite(value):
        return "∞"
    return f"{value:,.{digits}f}"


def _ms(seconds: float, digits: int = 1) -> str:
    return f"{_n(seconds * 1e3, digits)} ms"


def _usd(value: float, digits: int = 2) -> str:
    return f"${_n(value, digits)}" if math.isfinite(value) else _n(value)


def _pct(value: float, digits: int = 1) -> str:
    return "∞" if not math.isfinite(value) else f"{value * 100:.{digits}f}%"


def _price(value: float) -> str:
    """Dollars per million tokens: three decimals for small prices."""
    return _usd(value, 3 if value < 1 else 2)


# ---- JSON -----------------------------------------------------------------------------------

def _clean(value: Any) -> Any:
    """JSON-safe: inf/nan become null, tuples lists, dict keys strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _point(point: OperatingPoint | None) -> dict[str, Any] | None:
    if point is None:
        return None
    return {**asdict(point), "prefill_share": point.prefill_share}


def to_json(plan: Plan) -> dict[str, Any]:
    """Everything the report shows, machine-readable."""
    inputs = plan.inputs
    cheapest = plan.cheapest
    rows = []
    for row in plan.rows:
        sweep = None
        if row.sweep is not None:
            sweep = asdict(row.sweep)
            sweep["points"] = [{"rate_rps": r, "ttft_p90_s": a, "tpot_p90_s": b} for r, a, b in row.sweep.points]
        rows.append({
            "config": row.name, "gpu": row.gpu, "tp": row.tp, "usd_per_gpu_hour": row.usd_per_gpu_hour,
            "feasible": row.feasible, "infeasible": row.infeasible, "goodput_source": row.source,
            "goodput_rps_per_replica": row.goodput_rps, "binding": row.binding,
            "model_goodput_rps_per_replica": row.model_goodput.rps, "model_binding": row.model_goodput.binding,
            "model_limits_rps": row.model_goodput.limits, "kv_capacity_tokens": row.kv_capacity_tokens,
            "replicas": row.replicas, "replicas_exact": row.replicas_exact,
            "replicas_spare_exact": row.sizing.by_spare if row.sizing else None,
            "replicas_set_by": row.sizing.binding if row.sizing else None, "prefill_pool": row.pool,
            "prefill_unpooled": row.unpooled,
            "model_error": row.sizing.model_error if row.sizing else None, "gpus": row.gpus,
            "warm_replicas": row.warm_replicas, "gpus_with_warm_pool": row.gpus_total,
            "speculative_decoding": row.spec_on, "spec_goodput_rps_per_replica": row.spec_goodput_rps,
            "plain_goodput_rps_per_replica": row.plain_goodput_rps,
            "usd_per_hour": row.cost.usd_per_hour if row.cost else None,
            "kv_use_at_goodput": row.point.kv_fraction if row.point else None,
            "kv_headroom_at_goodput": 1 - row.point.kv_fraction if row.point else None,
            "kv_headroom_tokens_at_goodput": row.kv_capacity_tokens - row.point.kv_tokens if row.point else None,
            "cost": asdict(row.cost) if row.cost else None,
            "at_goodput": _point(row.point), "at_fleet_rate": _point(row.fleet_point),
            "warm_pool": asdict(row.warm) if row.warm else None, "sweep": sweep,
            "curve": [{"rate_rps": p.rate_rps, "ttft_p90_s": p.ttft_p90_s, "tpot_p90_s": p.tpot_p90_s,
                       "kv_fraction": p.kv_fraction} for p in row.curve],
            "warnings": list(row.warnings), "cheapest": row is cheapest,
        })
    ramp = None
    if inputs.ramp is not None:
        ramp = {"rps_per_s": inputs.ramp.rps_per_s, "rps_per_min": inputs.ramp.rps_per_s * 60,
                "source": inputs.ramp.source, "trace": asdict(inputs.ramp.trace) if inputs.ramp.trace else None}
    return _clean({
        "schema": SCHEMA,
        "inputs": {
            "rate_rps": inputs.rate_rps, "rate": inputs.rate_text, "mix": dict(inputs.mix),
            "slo": asdict(inputs.slo), "gpu_prices_usd_per_gpu_hour": dict(inputs.gpu_prices), "tp": list(inputs.tps),
            "preset": inputs.preset, "assumptions": asdict(inputs.assumptions), "headroom": inputs.headroom,
            "cold_start_s": inputs.cold_start_s, "warm_start_s": inputs.warm_start_s, "ramp": ramp,
            "engine": engine_json(inputs), "zones": inputs.zones, "forecast_error": inputs.forecast_error,
            "prefill_queue": inputs.prefill_queue, "model_error": fleet_terms(inputs).model_error,
            "pooled_model_error": inputs.pooled_model_error if inputs.prefill_queue == "pooled" else None,
        },
        "workload": {**asdict(inputs.workload), "uncached_tokens": inputs.workload.uncached_tokens},
        "rows": rows,
        "cheapest": cheapest.name if cheapest else None,
        "topology": report_topology.topology_json(plan) if plan.disaggregated else None,
    })


def engine_json(inputs: PlanInputs) -> dict[str, Any]:
    spec = inputs.spec
    return {
        "weights": inputs.weights, "kv_cache": inputs.kv_cache,
        "speculative_candidate": None if spec is None else {
            "draft_tokens": spec.draft_tokens, "acceptance": spec.acceptance, "draft_cost": spec.draft_cost,
            "tokens_per_step": spec.tokens_per_step},
        "lora_adapters": inputs.lora_adapters, "lora_rank": inputs.lora_rank, "lora_slots": inputs.lora_slots,
    }


def variants_json(variants: list[Variant]) -> list[dict[str, Any]]:
    def row(r: Row | None) -> dict[str, Any] | None:
        if r is None:
            return None
        return {"config": r.name, "feasible": r.feasible, "infeasible": r.infeasible,
                "goodput_rps_per_replica": r.goodput_rps, "binding": r.binding, "speculative_decoding": r.spec_on,
                "replicas": r.replicas, "warm_replicas": r.warm_replicas, "gpus": r.gpus_total,
                "usd_per_hour": r.cost.usd_per_hour if r.cost else None,
                "usd_per_1m_output_all_in": r.cost.usd_per_1m_output_all_in if r.cost else None}
    return _clean([{"variant": v.label, "engine": engine_json(v.inputs), "same_config": row(v.same_config),
                    "cheapest": row(v.cheapest)} for v in variants])


def _variant_cell(row: Row | None, base: Row | None) -> list[str]:
    if row is None:
        return ["–", "–", "–"]
    if not row.feasible or row.cost is None:
        return [f"{row.name}: infeasible", "–", "–"]
    spec = ", spec on" if row.spec_on else ""
    delta = ""
    if base is not None and base.cost is not None:
        dollars = row.cost.usd_per_hour - base.cost.usd_per_hour
        delta = f" ({row.gpus_total - base.gpus_total:+,} GPUs, {'−' if dollars < 0 else '+'}{_usd(abs(dollars), 0)}/h)"
    return [f"{row.name}{spec}, {_n(row.goodput_rps, 2)} req/s", f"{row.gpus_total:,}{delta}",
            _usd(row.cost.usd_per_hour, 0)]


def variants_table(variants: list[Variant]) -> str:
    """What each engine option changes, for the plan's GPU × TP and at each variant's own cheapest."""
    base = variants[0].same_config if variants else None
    head = ["engine", "plan's config", "GPUs", "$/hour", "cheapest config", "GPUs", "$/hour"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in variants:
        cells = [v.label, *_variant_cell(v.same_config, base), *_variant_cell(v.cheapest, base)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- tables ---------------------------------------------------------------------------------

COLUMNS = ["config", "goodput from", "req/s per replica", "binds", "replicas", "warm pool", "GPUs", "$/hour",
           "$/1M input", "$/1M output", "all-in $/1M output", "KV used (free)"]


def _row_cells(row: Row, cheapest: Row | None) -> list[str]:
    name = f"**{row.name} ★**" if row is cheapest else row.name
    if not row.feasible or row.cost is None:
        return [name, row.source, "–", "**infeasible** (below)", "–", "–", "–", "–", "–", "–", "–", "–"]
    warm = str(row.warm.replicas) if row.warm else "no ramp given"
    cost = row.cost
    source = row.source + (" + spec" if row.spec_on else "")
    cells = [name, source, _n(row.goodput_rps, 2), str(row.binding), _n(row.replicas), warm, _n(row.gpus_total),
             _usd(cost.usd_per_hour), _price(cost.usd_per_1m_input), _price(cost.usd_per_1m_output),
             _price(cost.usd_per_1m_output_all_in), _kv(row)]
    if row is cheapest:
        cells = [c if c.startswith("**") else f"**{c}**" for c in cells]
    return cells


def _kv(row: Row) -> str:
    if row.point is None or not row.point.stable:
        return "–"
    return f"{_pct(row.point.kv_fraction, 0)} ({_pct(1 - row.point.kv_fraction, 0)})"


def comparison_table(plan: Plan) -> str:
    """One line per GPU × TP, the cheapest in bold; reasons for infeasible rows underneath."""
    cheapest = plan.cheapest
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_row_cells(row, cheapest)) + " |" for row in plan.rows]
    reasons = [f"- {row.name} is infeasible: {row.infeasible}." for row in plan.rows if not row.feasible]
    return "\n".join(lines + ([""] + reasons if reasons else []))


def summary(plan: Plan) -> str:
    """What the command prints: the comparison table and the cheapest row."""
    inputs = plan.inputs
    cheapest = plan.cheapest
    rate = (
        inputs.rate_text if inputs.rate_text.endswith("/s") else f"{inputs.rate_text} ({_n(inputs.rate_rps, 1)} req/s)"
    )
    head = (f"Plan for {rate} of mix {inputs.mix.get('name')}, "
            f"SLO TTFT p90 ≤ {_ms(inputs.slo.ttft_p90_s, 0)}, TPOT p90 ≤ {_ms(inputs.slo.tpot_p90_s, 0)}, "
            f"{_pct(inputs.headroom, 0)} headroom, {inputs.preset} preset, chunk {inputs.assumptions.chunk_tokens:,}.")
    tail = (f"Cheapest: {cheapest.name}, {cheapest.replicas:,} serving + {cheapest.warm_replicas:,} warm replicas = "
            f"{cheapest.gpus_total:,} GPUs, {_usd(cheapest.cost.usd_per_hour)}/hour."
            if cheapest and cheapest.cost else "No feasible configuration.")
    if cheapest and cheapest.cost and inputs.zones > 1 and cheapest.goodput_rps > 0:
        needed = inputs.rate_rps / cheapest.goodput_rps * (1 + inputs.headroom)
        tail += "\n" + " ".join(_zone_lines(cheapest.replicas, inputs.zones, needed)).strip().replace("**", "")
    if cheapest and cheapest.binding == "TTFT" and inputs.prefill_queue == "per-replica" and cheapest.source == "model":
        tail += ("\nTTFT binds with each replica its own prefill queue; placed by the router's affinity policy "
                 "the queues pool: the default, --prefill-queue pooled, prices that (docs/planning.md).")
    warnings = [f"warning ({row.name}): {w}" for row in plan.rows for w in row.warnings]
    topology = report_topology.summary_line(plan)
    return "\n".join([head, "", comparison_table(plan), "", tail, *([topology] if topology else []), *warnings]) + "\n"


# ---- markdown -------------------------------------------------------------------------------

def _inputs_section(plan: Plan) -> list[str]:
    i, w, a = plan.inputs, plan.inputs.workload, plan.inputs.assumptions
    mix = i.mix
    lines = [
        "## Inputs", "",
        f"- **Peak rate:** {i.rate_text} = **{_n(i.rate_rps, 1)} requests/s**.",
        f"- **SLO:** p90 TTFT ≤ {_ms(i.slo.ttft_p90_s, 0)}, p90 TPOT ≤ {_ms(i.slo.tpot_p90_s, 0)} "
        "(goodput = the highest rate one replica serves while both hold).",
        f"- **Mix:** `{mix.get('name')}` ({mix.get('source')}).", "",
    ]
    classes = mix.get("classes") or []
    if classes and all("input_tokens" in c for c in classes):
        lines += ["| class | share | input tokens | output tokens | cached fraction |", "|---|---|---|---|---|"]
        lines += [
            f"| {c['name']} | {_pct(c['share'], 0)} | {c['input_tokens']} | {c['output_tokens']} | "
            f"{_pct(c['cached_fraction'], 0)} |"
            for c in classes
        ]
        lines.append("")
    elif classes:
        lines += [f"  {c['name']}: {c.get('trace_requests', '?')} requests of a trace, each equally likely."
                  for c in classes]
        lines.append("")
    u90 = ("the 90th-percentile request's uncached prompt, from the mix" if w.ttft_tokens_derived
           else "given with --ttft-tokens")
    lines += [
        "What the mix means per request (means over requests):",
        "",
        f"- input {_n(w.input_tokens, 1)} tokens, of which {_n(w.cached_tokens, 1)} cached → "
        f"**uncached u = {_n(w.uncached_tokens, 1)}** tokens to prefill; output **o = {_n(w.output_tokens, 1)}** "
        "tokens.",
        f"- E[u²] = {_n(w.uncached_sq, 0)} tokens² (the spread of prefill work; drives the queueing wait).",
        f"- decode context c_d = E[o · (input + o/2)] ÷ E[o] = **{_n(w.decode_ctx_tokens, 0)}** tokens: the KV a "
        "decoding sequence reads each step, weighted by how many steps it stays (long answers stay longer).",
        f"- prefill context c_p = E[u · (cached + input)/2] ÷ E[u] = {_n(w.prefill_ctx_tokens, 0)} "
        "tokens: what a prefill token attends to.",
        f"- TTFT is quoted for u₉₀ = **{_n(w.ttft_tokens, 0)}** uncached tokens ({u90}).",
        "",
        f"- **Timing model:** the simulated engine's roofline (docs/sim-engine.md), `{i.preset}` preset (±20%); "
        f"chunked prefill {a.chunk_tokens:,} tokens per step; KV use ≤ {_pct(a.kv_limit, 0)}; prefill priced in whole "
        "chunks (a chunk step is compute-bound, a decode step memory-bound); TPOT p90 = mean step + "
        f"{a.tpot_p90_z:.4f} × the spread of a request's mean step; headroom {_pct(i.headroom, 0)} (forecast error, "
        "N+1, the model's error)"
        + (f"; {i.zones} zones, one of which may be lost (× {zone_factor(i.zones):.3f})." if i.zones > 1 else "."),
        f"- **Engine:** {i.weights.upper()} weights, {i.kv_cache.upper()} KV cache; "
        + (
            f"speculative decoding candidate k = {i.spec.draft_tokens} draft tokens at acceptance α = "
            f"{i.spec.acceptance:g} (E = (1 − α^(k+1)) ÷ (1 − α) = {i.spec.tokens_per_step:.2f} tokens per step; each "
            f"draft step {i.spec.draft_cost:g} × a decode step), on in a row only where it raises the goodput; "
            if i.spec
            else "no speculative decoding; "
        )
        + (
            f"{i.lora_adapters} LoRA adapters of rank {i.lora_rank} spread evenly, {i.lora_slots} per batch; each "
            f"holds {lora_adapter_bytes(i.lora_rank) / 1e6:,.0f} MB and loads in {lora_load_s(i.lora_rank) * 1e3:,.0f} "
            "ms"
            + (
                f" (more adapters than slots: requests for an adapter outside the batch's {i.lora_slots} wait for a "
                "slot, and a swap costs that load time)."
                if i.lora_adapters > i.lora_slots
                else "."
            )
            if i.lora_adapters
            else "base model only (no LoRA adapters)."
        ),
        f"- **Cold start** {i.cold_start_s:g} s, **warm start** {i.warm_start_s:g} s.",
    ]
    if i.ramp is None:
        lines.append("- **Ramp:** none given (`--ramp` or `--ramp-trace`), so no warm pool is sized.")
    elif i.ramp.trace is None:
        lines.append(f"- **Ramp:** {_n(i.ramp.rps_per_s * 60, 1)} req/s per minute (given) = "
                     f"{i.ramp.rps_per_s:.3f} req/s per second.")
    else:
        t = i.ramp.trace
        lines.append(
            f"- **Ramp** from `{i.ramp.source}`: {t.minutes} whole minutes, busiest minute {t.trace_peak_rps:.2f} "
            f"req/s; every minute's rate × {_n(t.scale, 1)} so the busiest equals the planned {_n(i.rate_rps, 1)} "
            f"req/s. Steepest rise within one {t.window_s:g} s cold start: minute {t.from_minute} → {t.to_minute}, "
            f"+{_n(t.rise_rps, 1)} req/s = **{t.ramp_rps_per_s:.3f} req/s per second** ({_n(t.ramp_rps_per_s * 60, 1)} "
            "per minute).")
    lines.append("")
    return lines


def _steady_state_lines(row: Row, p: OperatingPoint, plan: Plan, label: str) -> list[str]:
    w, a, slo = plan.inputs.workload, plan.inputs.assumptions, plan.inputs.slo
    lam = p.rate_rps
    e = plan.inputs.spec.tokens_per_step if row.spec_on and plan.inputs.spec else 1.0
    per_e = f" ÷ E ({e:.2f} tokens per step)" if e != 1.0 else ""
    return [
        f"   {label}",
        f"   - step time t = **{_ms(p.step_s, 2)}** (the fixed point: the mean of the decode-only and "
        "full-chunk steps below, whose batch and chunk share themselves grow with t)",
        f"   - decode batch B = λ × o × t{per_e} = {lam:.3f} × {_n(w.output_tokens, 0)} × {p.step_s:.5f} "
        f"s{' ÷ ' + format(e, '.2f') if per_e else ''} = "
        f"{p.decode_batch:.1f} sequences",
        f"   - prefill runs in whole chunks: share of steps with a chunk f = λ × u × t ÷ chunk = {lam:.3f} × "
        f"{_n(w.uncached_tokens, 0)} × {p.step_s:.5f} s ÷ {a.chunk_tokens:,} = {p.chunk_step_share:.4f}",
        f"   - decode-only step t_d = {_ms(p.decode_only_step_s, 2)}; step with a full chunk t_f = "
        f"{_ms(p.full_chunk_step_s, 2)}; mean step t = f × t_f + (1 − f) × t_d = {p.chunk_step_share:.4f} × "
        f"{_ms(p.full_chunk_step_s, 2)} + {1 - p.chunk_step_share:.4f} × {_ms(p.decode_only_step_s, 2)} = "
        f"{_ms(p.step_s, 2)}",
        f"   - KV held S = B × c_d = {p.decode_batch:.1f} × {_n(w.decode_ctx_tokens, 0)} = {_n(p.kv_tokens, 0)} tokens "
        f"= **{_pct(p.kv_fraction)}** of {_n(row.kv_capacity_tokens, 0)} (limit {_pct(a.kv_limit, 0)})",
        f"   - spread of a request's mean step σ = (t_f − t_d) × √(f × (1 − f) ÷ {'(o ÷ E)' if per_e else 'o'}) = "
        f"{_ms(p.full_chunk_step_s - p.decode_only_step_s, 2)} × √({p.chunk_step_share:.4f} × "
        f"{1 - p.chunk_step_share:.4f} ÷ {w.output_tokens / e:,.1f}) = {_ms(p.tpot_spread_s, 2)}",
        f"   - TPOT p90 = {'(' if per_e else ''}t + {a.tpot_p90_z:.4f} × σ{')' + per_e if per_e else ''} = "
        f"{'(' if per_e else ''}{_ms(p.step_s, 2)} + {_ms(a.tpot_p90_z * p.tpot_spread_s, 2)}"
        f"{') ÷ ' + format(e, '.2f') if per_e else ''} = "
        f"**{_ms(p.tpot_p90_s)}** (SLO {_ms(slo.tpot_p90_s, 0)})",
        f"   - prefill rate μ = {a.chunk_tokens:,} ÷ t(full chunk) = {a.chunk_tokens:,} ÷ {p.full_chunk_step_s:.5f} s "
        f"= {_n(p.prefill_rate_tok_s, 0)} tokens/s; prefill load ρ = λ × u ÷ μ = {p.prefill_load:.3f}",
        *_wait_lines(p, w, lam, row.pool, row.unpooled),
        f"   - TTFT p90 = u₉₀ ÷ μ + W₉₀ + {a.ttft_steps:g} × t = "
        f"{_ms(p.ttft_prefill_s)} + {_ms(p.queue_wait_p90_s)} + {_ms(a.ttft_steps * p.step_s)} = "
        f"**{_ms(p.ttft_p90_s, 0)}** (SLO {_ms(slo.ttft_p90_s, 0)})",
    ]


def _wait_lines(p: OperatingPoint, w: Workload, lam: float, pool: int | None, unpooled: int | None) -> list[str]:
    """The prompt's wait for prefill: its replica's own M/G/1 queue, or the pool's M/G/c queue."""
    u2, mu, rho = _n(w.uncached_sq, 0), _n(p.prefill_rate_tok_s, 0), p.prefill_load
    if pool is None:
        why = ("each replica its own queue" if unpooled is None else
               f"each replica its own queue: priced pooled, {unpooled} would be left serving, fewer than the "
               f"{POOLED_FROM_REPLICAS} that pool")
        return [
            f"   - queue wait W_q = λ × E[u²] ÷ μ² ÷ (2 × (1 − ρ)) = {lam:.3f} × {u2} ÷ {mu}² ÷ {2 * (1 - rho):.3f} "
            f"= {_ms(p.queue_wait_s)}; its p90 W₉₀ = ln 10 × W_q = {_ms(p.queue_wait_p90_s)} ({why})",
        ]
    waits = p.queue_waits
    given = p.queue_wait_s / waits if waits > 0 else 0.0
    return [
        f"   - queue wait, the router pooling the prefill queues of the {pool} replicas left serving (M/G/c): "
        f"C = Erlang C({pool}, {pool * rho:.2f}) = {waits:.3f}, m = E[u²] ÷ (2 × u × μ) ÷ (c × (1 − ρ)) = "
        f"{_ms(given)}, W_q = C × m = {_ms(p.queue_wait_s)}, W₉₀ = m × ln(10 × C) = {_ms(p.queue_wait_p90_s)}",
    ]


def _goodput_lines(row: Row, plan: Plan) -> list[str]:
    g = row.model_goodput
    limits = g.limits
    alone = ", ".join(f"{c} alone would allow {_n(limits[c], 2)}" for c in ("TTFT", "TPOT", "KV")
                      if c != g.binding and c in limits)
    model_line = (f"**{_n(g.rps, 3)} req/s**, limited by **{g.binding}** ({alone}; the steady state ends at "
                  f"{_n(limits.get('saturation', math.inf), 2)} req/s)")
    if g.infeasible:
        model_line = f"no goodput: {g.infeasible}"
    if row.source == "model":
        return [f"1. **Goodput per replica** (timing model, bisection on λ): {model_line}."]
    s = row.sweep
    assert s is not None
    per = f", {s.replicas} replicas behind the endpoint: rates divided by {s.replicas}" if s.replicas > 1 else ""
    lines = [f"1. **Goodput per replica, measured** (`{s.source}`{per}): the best sweep step meeting the SLO served "
             f"{_n(s.passing_rps or 0, 3)} req/s per replica."]
    if s.failing_rps is not None and s.crossing is not None:
        at_pass, at_fail, target, frac = s.crossing
        lines.append(f"   The next step up ({_n(s.failing_rps, 3)} req/s per replica) missed {s.binding}: p90 "
                     f"{_ms(at_fail)} against {_ms(at_pass)} at the passing step. The target {_ms(target)} lies "
                     f"{_pct(frac)} of the way, so goodput = {_n(s.passing_rps or 0, 3)} + {frac:.3f} × "
                     f"({_n(s.failing_rps, 3)} − {_n(s.passing_rps or 0, 3)}) = **{_n(row.goodput_rps, 3)} req/s**.")
    elif s.failing_rps is not None:
        lines.append(f"   The next step up ({_n(s.failing_rps, 3)} req/s per replica) failed on {s.binding}, so the "
                     f"goodput stays at the passing step: **{_n(row.goodput_rps, 3)} req/s**.")
    else:
        lines.append(f"   No step above it failed, so **{_n(row.goodput_rps, 3)} req/s** is a lower bound.")
    lines.append(f"   The timing model alone would say {model_line}.")
    return lines


def _row_section(row: Row, plan: Plan) -> list[str]:
    i = plan.inputs
    star = " ★ cheapest" if row is plan.cheapest else ""
    title = f"### {row.name} — goodput from the {'timing model' if row.source == 'model' else 'measured sweep'}{star}"
    if not row.feasible or row.cost is None:
        reason = str(row.infeasible)
        return [f"### {row.name} — infeasible", "", f"{reason[:1].upper()}{reason[1:]}.", ""]
    c, p, fp = row.cost, row.point, row.fleet_point
    lines = [title, "", f"One replica = {row.tp} × {row.gpu} at {_usd(row.usd_per_gpu_hour)} per GPU-hour.", ""]
    lines += _goodput_lines(row, plan)
    if p is not None and p.stable:
        label = ("At that rate the model's steady state is:" if row.source == "model"
                 else "At that rate the timing model estimates (KV use and latencies not measured by the sweep):")
        lines += _steady_state_lines(row, p, plan, label)
    elif p is not None:
        lines.append("   The timing model has no steady state at this rate (the measured server outruns the model), "
                     "so KV use and the cost split below are not estimated.")
    lam, h = row.goodput_rps, i.headroom
    zones = f" × {i.zones} ÷ {i.zones - 1} (one zone lost)" if i.zones > 1 else ""
    if row.spec_goodput_rps is not None:
        lines.append(f"   Speculative decoding: goodput {_n(row.spec_goodput_rps, 3)} req/s with it, "
                     f"{_n(row.plain_goodput_rps or 0, 3)} without: **{'on' if row.spec_on else 'off'}** in this row.")
    warm = row.warm_replicas
    here = ", as here" if row.sizing and row.sizing.binding == "N+1" else ""
    lines += [
        f"2. **Replicas** = max(⌈peak ÷ goodput × (1 + headroom){' × Z ÷ (Z − 1)' if zones else ''}⌉, "
        "⌈peak ÷ goodput × (1 + forecast error) × (1 + model error)⌉ + 1) = "
        f"{fleet_terms(i).arithmetic(lam, row.sizing)} **serving** (the second term: one replica down, the rest "
        f"serve the busiest minute; it binds in a fleet of a few replicas{here}).",
        *_zone_lines(row.replicas, i.zones, i.rate_rps / lam * (1 + h) if lam > 0 else 0.0),
        f"3. **GPUs** = (serving + warm pool) × TP = ({row.replicas:,} + {warm:,}) × {row.tp} = **{row.gpus_total:,}** "
        "(warm pool: step 7).",
        f"4. **Cost per hour** = {row.gpus_total:,} GPUs × {_usd(row.usd_per_gpu_hour)} = **{_usd(c.usd_per_hour)}**, "
        f"of which the serving fleet {_usd(c.serving_usd_per_hour)} and the warm pool "
        f"{_usd(c.usd_per_hour - c.serving_usd_per_hour)} "
        f"(at peak the serving fleet runs at {_n(i.rate_rps, 1)} ÷ ({row.replicas:,} × {lam:.3f}) = "
        f"{_pct(c.utilisation)} of its goodput).",
        f"5. **All-in $ per 1M output tokens** (every GPU-hour charged to output): output served = "
        f"{_n(i.rate_rps, 2)} req/s × {_n(i.workload.output_tokens, 0)} tokens × 3,600 s = "
        f"{_n(c.output_mtok_per_hour, 1)} M tokens/hour; {_usd(c.usd_per_hour)} ÷ {_n(c.output_mtok_per_hour, 1)} = "
        f"**{_price(c.usd_per_1m_output_all_in)}**, warm pool included. The usual form prices the serving fleet "
        f"alone: {_usd(row.usd_per_gpu_hour)} × 10⁶ ÷ (3,600 × {_n(c.output_tok_s_per_gpu, 1)} output tok/s per GPU at "
        f"goodput × {c.utilisation:.3f} utilisation) = {_price(c.usd_per_1m_output_serving)}.",
    ]
    if fp is not None and fp.stable:
        share = c.prefill_share
        lines += [
            f"6. **Split between input and output.** At the fleet's operating rate ({_n(i.rate_rps, 2)} ÷ "
            f"{row.replicas:,} = {fp.rate_rps:.3f} req/s per replica) a step takes {_ms(fp.step_s, 2)} on average; "
            f"without prefill (its {_n(fp.prefill_tokens_per_step, 0)} tokens per step on average) it would take "
            f"{_ms(fp.decode_only_step_s, 2)}, so prefill causes {_pct(share)} of GPU time.",
            f"   - input: {_usd(c.usd_per_hour)} × {_pct(share)} = {_usd(c.usd_per_hour * share)}/hour ÷ "
            f"{_n(c.input_mtok_per_hour, 1)} M input tokens/hour = **{_price(c.usd_per_1m_input)} per 1M input "
            f"tokens** (cached ones included; {_price(c.usd_per_1m_uncached_input)} per 1M uncached tokens actually "
            "prefilled)",
            f"   - output: {_usd(c.usd_per_hour)} × {_pct(1 - share)} = {_usd(c.usd_per_hour * (1 - share))}/hour ÷ "
            f"{_n(c.output_mtok_per_hour, 1)} M output tokens/hour = **{_price(c.usd_per_1m_output)} per 1M output "
            "tokens**",
        ]
    else:
        lines.append("6. **Split between input and output:** not computed — the timing model has no steady state at "
                     "the fleet's operating rate, so it cannot say how GPU time divides.")
    if row.warm is not None:
        wp = row.warm
        lines += [
            f"7. **Warm pool** = ⌈ramp × cold start ÷ goodput⌉ = ⌈{wp.ramp_rps_per_s:.3f} req/s per s × "
            f"{wp.cold_start_s:g} s ÷ {lam:.3f}⌉ = ⌈{_n(wp.rise_rps, 1)} ÷ {lam:.3f}⌉ = **{wp.replicas:,} replicas** "
            f"({wp.gpus:,} GPUs, {_usd(wp.gpus * row.usd_per_gpu_hour)}/hour, in the price above: loaded replicas hold "
            "their GPUs).",
            f"   While warm replicas wake ({wp.warm_start_s:g} s) the rate rises {_n(wp.warm_start_rise_rps, 1)} "
            f"req/s; the fleet's headroom is {row.replicas:,} × {lam:.3f} − {_n(i.rate_rps, 1)} = "
            f"{_n(wp.headroom_rps, 1)} req/s: "
            + ("**covered**." if wp.covered_by_headroom else "**not covered** — raise the headroom or the warm pool."),
        ]
    for warning in row.warnings:
        lines.append(f"\n> **Warning:** {warning}")
    lines.append("")
    return lines


def markdown(plan: Plan, plots: list[str] | None = None, variants: list[Variant] | None = None) -> str:
    """The report: inputs, the comparison, each row's arithmetic, how costs are split, limitations."""
    i = plan.inputs
    cheapest = plan.cheapest
    sources = sorted({r.source for r in plan.rows})
    lines = [
        f"# Capacity plan: {i.rate_text} of `{i.mix.get('name')}`",
        "",
        "Goodput per replica comes from "
        + (
            " and ".join(
                {"model": "the timing model (the simulated engine's roofline, ±20%)", "sweep": "measured sweeps"}[s]
                for s in sources
            )
        )
        + "; the **goodput from** column says which, row by row.",
        "",
    ]
    lines += _inputs_section(plan)
    lines += ["## Comparison", "", comparison_table(plan), ""]
    if cheapest and cheapest.cost:
        lines += [
            f"**Cheapest feasible: {cheapest.name}** — {cheapest.replicas:,} replicas, {cheapest.gpus:,} GPUs, "
            f"{_usd(cheapest.cost.usd_per_hour)}/hour, {_price(cheapest.cost.usd_per_1m_output_all_in)} per 1M "
            "output tokens all-in (ranked by $/hour of every GPU kept running: serving fleet, headroom and warm pool).",
            "",
        ]
    else:
        lines += ["**No configuration is feasible** under this SLO; see the reasons below.", ""]
    lines += [
        "Columns: *req/s per replica* is the goodput; *binds* is the constraint that limits it (TTFT, TPOT or KV); "
        "*$/1M input* and *$/1M output* split the bill by the GPU time each causes (below); *all-in $/1M output* "
        "charges the whole bill to output tokens (the usual convention); *KV used (free)* is the share of the KV "
        "cache held at the goodput (and left free); *warm pool* is the replicas kept loaded to cover one cold start of "
        "load growth; *GPUs* and *$/hour* count the serving replicas (headroom included) and the warm pool.", "",
    ]
    lines += report_topology.markdown(plan)
    if variants:
        lines += ["## What the engine options change", "",
                  "The plan again with one engine option changed (timing model only): in the plan's own configuration "
                  "and at each variant's cheapest; differences against the plan in brackets.", "",
                  variants_table(variants), ""]
    for name in plots or []:
        lines += [f"![{name}]({name})", ""]
    lines += ["## The arithmetic, row by row", ""]
    for row in plan.rows:
        lines += _row_section(row, plan)
    lines += [
        "## How the numbers are made", "",
        "- **Steady state of one replica** (tools/capacity/plan/model.py): at λ req/s the engine decodes "
        "B = λ·o·t sequences per step (each stays o steps) and holds S = B·c_d KV tokens; prefill runs in whole "
        "chunks, so a share f = λ·u·t ÷ chunk of steps carries a full chunk (t_f, compute-bound) and the rest decode "
        "only (t_d, memory-bound); the mean step t = f·t_f + (1 − f)·t_d is solved as a fixed point. A request's "
        "TPOT is the mean of its o steps: TPOT p90 = t + z₉₀·σ, σ = (t_f − t_d)·√(f(1 − f) ÷ o), z₉₀ = 1.2816. "
        "With speculative decoding a step yields E tokens per sequence: B = λ·o·t ÷ E, o ÷ E steps per request "
        "and TPOT p90 = (t + z₉₀·σ) ÷ E.",
        "- **TTFT** = the 90th-percentile prompt's own prefill at the full-chunk rate μ, plus the p90 of the "
        "queueing wait (each replica its own queue: M/G/1, Pollaczek–Khinchine, ln 10 × mean for an exponential "
        f"tail; pooled, the default: one M/G/c queue in front of the c ≥ {POOLED_FROM_REPLICAS} replicas left serving, "
        "Erlang C with Allen and Cunneen's correction and M/M/c's tail), plus two steps.",
        "- **Goodput** = the highest λ at which TTFT p90, TPOT p90 and KV use all meet their targets; each "
        "constraint's own limit is found by bisection and the smallest binds. A measured sweep replaces this for its "
        "GPU × TP: the best step meeting the SLO (re-judged against this plan's SLO), interpolated toward the first "
        "failing step, divided by the replicas the sweep drove.",
        "- **Cost split**: input tokens pay for the GPU time their prefill adds to the steps "
        "(T(B, S, n_p) − T(B, S, 0), at the fleet's operating rate); output tokens pay for the rest — every step's "
        "floor of weight streaming, KV reads and overheads, which decoding needs anyway.",
        "", "## Limitations", "",
        "- The timing model is a roofline fitted to published numbers (±20%); measure with `inferbus sweep` and pass "
        "`--sweep` to replace it.",
        "- Poisson arrivals and a steady state are assumed; bursts above the headroom queue. KV use counts decoding "
        "sequences only (prompts being prefilled and cached prefixes kept for reuse add to it).",
        "- The warm pool sizes for the steepest per-minute rise of the ramp trace, scaled to the planned peak; a "
        "small trace scaled up also scales its sampling noise, which overstates the ramp.",
        "",
    ]
    return "\n".join(lines)


# ---- plots ----------------------------------------------------------------------------------

def write_plots(plan: Plan, out: Path) -> list[str]:
    """`fleet.png` (GPUs and $/hour per config) and `latency.png` (TTFT/TPOT p90 vs per-replica rate)."""
    matplotlib = require("matplotlib", "plots", "the plan plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    feasible = [r for r in plan.rows if r.feasible and r.cost]
    cheapest = plan.cheapest
    names = [r.name + (" (sweep)" if r.source == "sweep" else "") for r in feasible]
    colors = ["tab:green" if r is cheapest else "tab:blue" for r in feasible]
    fig, (ax_gpu, ax_usd) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = range(len(feasible))
    ax_gpu.bar(x, [r.gpus for r in feasible], color=colors, label="serving fleet")
    ax_gpu.bar(x, [r.warm.gpus if r.warm else 0 for r in feasible], bottom=[r.gpus for r in feasible],
               color="lightgray", label="warm pool")
    for j, r in enumerate(feasible):
        warm = f" + {r.warm.gpus} warm" if r.warm and r.warm.gpus else ""
        ax_gpu.text(
            j, r.gpus_total, f"{r.gpus:,}{warm}\n({r.replicas} × TP{r.tp})", ha="center", va="bottom", fontsize=7
        )
        ax_usd.text(j, r.cost.usd_per_hour, f"${r.cost.usd_per_hour:,.0f}", ha="center", va="bottom", fontsize=8)  # type: ignore[union-attr]
    ax_gpu.set_title(f"GPUs for {plan.inputs.rate_text}")
    ax_gpu.set_ylabel("GPUs")
    from matplotlib.patches import Patch

    ax_gpu.legend(handles=[Patch(color="tab:blue", label="serving fleet"), Patch(color="tab:green", label="cheapest"),
                           Patch(color="lightgray", label="warm pool")], fontsize=8)
    ax_usd.bar(x, [r.cost.usd_per_hour for r in feasible], color=colors)  # type: ignore[union-attr]
    ax_usd.set_title("Serving fleet $/hour (green: cheapest)")
    ax_usd.set_ylabel("$ per hour")
    for ax in (ax_gpu, ax_usd):
        ax.set_xticks(list(x), names, rotation=20, fontsize=8)
        ax.margins(y=0.18)
    fig.tight_layout()
    fig.savefig(out / "fleet.png", dpi=110)
    plt.close(fig)

    slo = plan.inputs.slo
    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, r in enumerate(feasible):
        color = f"C{k}"
        if r.curve:
            rates = [p.rate_rps for p in r.curve]
            ax_ttft.plot(rates, [p.ttft_p90_s * 1e3 for p in r.curve], color=color, label=f"{r.name} model")
            ax_tpot.plot(rates, [p.tpot_p90_s * 1e3 for p in r.curve], color=color, label=f"{r.name} model")
        if r.sweep is not None:
            pts = [(a, b * 1e3, c * 1e3) for a, b, c in r.sweep.points if math.isfinite(b) and math.isfinite(c)]
            ax_ttft.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, marker="x", label=f"{r.name} sweep")
            ax_tpot.scatter([p[0] for p in pts], [p[2] for p in pts], color=color, marker="x", label=f"{r.name} sweep")
        for ax in (ax_ttft, ax_tpot):
            ax.axvline(r.goodput_rps, color=color, linestyle=":", linewidth=1)
        if r.point is not None and r.point.stable:
            ax_ttft.plot([r.goodput_rps], [r.point.ttft_p90_s * 1e3], "o", color=color, markersize=5)
            ax_tpot.plot([r.goodput_rps], [r.point.tpot_p90_s * 1e3], "o", color=color, markersize=5)
    ax_ttft.axhline(slo.ttft_p90_s * 1e3, color="red", linestyle="--", label="SLO")
    ax_tpot.axhline(slo.tpot_p90_s * 1e3, color="red", linestyle="--", label="SLO")
    ax_ttft.set_ylim(0, slo.ttft_p90_s * 1e3 * 2)
    ax_tpot.set_ylim(0, slo.tpot_p90_s * 1e3 * 2)
    ax_ttft.set_title("TTFT p90 vs load (dot and dotted line: goodput λ_max)", fontsize=10)
    ax_tpot.set_title("TPOT p90 vs load (dot and dotted line: goodput λ_max)", fontsize=10)
    for ax, label in ((ax_ttft, "TTFT p90 (ms)"), (ax_tpot, "TPOT p90 (ms)")):
        ax.set_xlabel("requests/s per replica")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax_tpot.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=110)
    plt.close(fig)
    return ["fleet.png", "latency.png"]


def _zone_lines(replicas: int, zones: int, needed: float) -> list[str]:
    """The N+1-per-zone rule for this row: the spread, and what is left when a zone is lost."""
    if zones < 2:
        return []
    per_zone = spread(replicas, zones)
    left = left_after_zone_loss(per_zone)
    line = (
        f"   **N+1 per zone:** spread evenly, {' + '.join(map(str, per_zone))} across the {zones} zones (Kubernetes: "
        f"topology spread, maxSkew 1 by zone); losing the largest zone leaves {left:,}"
    )
    enough = replicas_for_zone_loss(needed, zones)
    if enough <= replicas:
        return [line + f" ≥ the {needed:.2f} the peak needs with headroom; the warm pool, spread the same way, "
                       "refills the lost zone's share."]
    return [line + f", fewer than the {needed:.2f} the peak needs with headroom: in whole replicas per zone the rule "
                   f"needs **{enough:,}** serving ({' + '.join(map(str, spread(enough, zones)))})."]
