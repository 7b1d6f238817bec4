"""`inferbus simulate`: a day of traffic on a fleet in minutes of CPU (the fast fleet simulator).

The shell around `fast.FastFleet`: reads the trace and the mix, builds the arrival stream
(`day.DayWorkload`), sizes the fleet when not told (`size_fleet`), runs with a progress bar on
virtual time, prints a summary and writes `simulate.md`, `simulate.json` and `simulate.png`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import click

from inferbus.timing import SpecDecoding
from services.autoscaler.policy import PolicyConfig
from services.autoscaler.simulated import PolicyController
from services.sim_engine.config import EngineConfig
from tools.capacity import mix as mix_mod
from tools.capacity import traces
from tools.capacity.fleetsim.day import DayWorkload, parse_duration, rate_shape
from tools.capacity.fleetsim.engine_model import roofline_for, step_model_for
from tools.capacity.fleetsim.fast import FastConfig, FastFleet
from tools.capacity.fleetsim.timeseries import Summary, plot

HEADROOM = 1.15  # the planner's default: forecast error, N+1 and the model's error (docs/planning.md)


@dataclass(frozen=True)
class Sizing:
    replicas: int
    replica_goodput_rps: float
    binding: str | None
    method: str


def size_fleet(mix: mix_mod.Mix, engine: EngineConfig, peak_rps: float, *, slo_ttft_s: float = 0.8,
               slo_tpot_s: float = 0.040, headroom: float = HEADROOM, lora_adapters: int = 0) -> Sizing:
    """Replicas for `peak_rps` by the planner's arithmetic (`tools.capacity.plan.model`, its
    steady-state replica model at the engine's chunk size): ⌈peak ÷ per-replica goodput × headroom⌉."""
    from tools.capacity.plan.model import Assumptions, ReplicaModel, Slo, Workload

    model = roofline_for(engine, lora=lora_adapters > 0)
    capacity = engine.kv_capacity_tokens or model.kv_capacity_tokens()
    goodput = ReplicaModel(
        model,
        capacity,
        Workload.from_mix(mix),
        Assumptions(chunk_tokens=engine.chunked_prefill_size),
        lora_adapters=lora_adapters,
        lora_slots=engine.max_loras_per_batch,
    ).goodput(Slo(slo_ttft_s, slo_tpot_s))
    if goodput.rps <= 0:
        raise ValueError(f"no replica of {engine.gpu} TP{engine.tp} meets the SLO on this mix: {goodput.infeasible}")
    return Sizing(math.ceil(peak_rps / goodput.rps * headroom), goodput.rps, goodput.binding,
                  f"tools.capacity.plan.model goodput {goodput.rps:.2f} req/s per replica ({goodput.binding} binds) "
                  f"× {headroom} headroom")


def _parse_spec(text: str | None) -> SpecDecoding | None:
    """'3:0.7' or '3:0.7:0.1' → SpecDecoding(3, 0.7[, 0.1]); as `inferbus plan --spec`."""
    if text is None:
        return None
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"--spec must look like K:ACCEPTANCE[:DRAFT_COST], e.g. 3:0.7 (got {text!r})")
    try:
        return SpecDecoding(int(parts[0]), float(parts[1]), *(float(p) for p in parts[2:]))
    except ValueError as error:
        raise ValueError(f"--spec {text!r}: {error}") from None


def parse_fleet(text: str) -> tuple[str, int, int]:
    """'H100:2x234' → ('H100', 2, 234): GPU, TP, replicas."""
    match = re.fullmatch(r"\s*(H100|H200):(\d+)x(\d+)\s*", text, flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"--fleet must look like H100:2x234 (GPU:TPxREPLICAS), got {text!r}")
    return match.group(1).upper(), int(match.group(2)), int(match.group(3))


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--trace", "trace_name", default="azure_2023_conv.csv", show_default=True,
              help="Trace whose arrival-rate shape (and, unless --mix, request lengths) drive the run: a path, "
                   "or a file name in the traces folder ($INFERBUS_TRACES_DIR).")
@click.option("--mix", "mix_name", default=None, help="Request lengths from this mix instead of the trace "
              "(a built-in name such as worked-example, a YAML spec or another trace).")
@click.option("--mix-cached-fraction", default=0.3, show_default=True, type=click.FloatRange(0, 0.99),
              help="Share of each prompt a prefix cache holds, for traces without prefix ids (Azure).")
@click.option("--peak-rps", default=833.0, show_default=True, type=click.FloatRange(min=0.001),
              help="The busiest bin of the run reaches this arrival rate (req/s).")
@click.option("--duration", default="24h", show_default=True, help="Virtual time to simulate: 24h, 1h, 90m, 600s.")
@click.option("--shape", type=click.Choice(["tile", "stretch"]), default="tile", show_default=True,
              help="A day from a 1-hour trace: tile = the trace's hour repeated under a diurnal envelope; "
                   "stretch = its rate shape stretched over the duration.")
@click.option("--bin", "bin_s", default=60.0, show_default=True, type=click.FloatRange(min=1.0),
              help="Seconds per bin of the trace's rate shape.")
@click.option("--trough", default=0.35, show_default=True, type=click.FloatRange(0.01, 1.0),
              help="Night-time rate as a share of the day's peak (tile shape, runs longer than the trace).")
@click.option("--fleet", default=None, help="GPU:TPxREPLICAS, e.g. H100:2x234. Default: --gpu/--tp and "
              "--replicas, or a fleet sized by the planner's arithmetic for --peak-rps.")
@click.option("--gpu", type=click.Choice(["H100", "H200"]), default="H100", show_default=True)
@click.option("--tp", type=click.Choice(["1", "2", "4", "8"]), default="2", show_default=True)
@click.option("--replicas", type=click.IntRange(min=1), default=None,
              help="Serving replicas (static fleet). Default: sized for --peak-rps (see --fleet).")
@click.option("--policy", type=click.Choice(["least_loaded", "affinity", "round_robin"]), default="affinity",
              show_default=True,
              help="The router's placement policy; the default is the router's own (INFERBUS_ROUTER_POLICY). "
                   "least_loaded counts requests, not prompt tokens: on long-prompt mixes it needed more than "
                   "twice the replicas for the same TTFT (docs/simulator.md).")
@click.option("--admission/--no-admission", default=True, show_default=True,
              help="Shed requests with the gateway's OverloadPolicy (3 s standard-band budget).")
@click.option("--load-interval", default=0.25, show_default=True, type=click.FloatRange(min=0.01),
              help="Seconds between a replica's load reports to the router (the live worker's "
                   "INFERBUS_LOAD_INTERVAL_S). Least-loaded barely notices; affinity routes worse at 1, "
                   "which costs a third less CPU.")
@click.option("--autoscale", is_flag=True,
              help="Let the autoscaler's policy (services/autoscaler, the code the service runs) size the fleet "
                   "from the run's load instead of a static fleet: it starts with what the first minute needs, "
                   "cold-starts and warm-starts replicas, and may not exceed --replicas × 1.5.")
@click.option("--autoscale-goodput", type=click.FloatRange(min=0.01), default=None,
              help="Interactive req/s per replica the autoscaler sizes with. Default: the planner's goodput for "
                   "the mix at the engine's chunked-prefill budget (see docs/autoscaling.md).")
@click.option("--cold-start", default=120.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds from starting a replica to serving (with --autoscale).")
@click.option("--warm-start", default=5.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds from promoting a warm replica to serving (with --autoscale).")
@click.option("--chunk", default=512, show_default=True, type=click.IntRange(min=1),
              help="The engines' chunked-prefill budget in tokens per step (SGLang --chunked-prefill-size), e.g. 2048.")
@click.option("--spec", "spec_text", default=None, metavar="K:ACCEPTANCE[:DRAFT_COST]",
              help="Engines with speculative decoding: K draft tokens per step, each accepted with probability "
                   "ACCEPTANCE, a draft step costing DRAFT_COST × a decode step (default 0.1), e.g. 3:0.7.")
@click.option("--lora-adapters", type=click.IntRange(min=0), default=0, show_default=True,
              help="LoRA adapters the traffic spreads over evenly (0: base model only): each step pays the batched "
                   "LoRA kernels for the distinct adapters in its batch, at most --max-loras-per-batch, e.g. 16.")
@click.option("--lora-rank", type=click.IntRange(min=1), default=16, show_default=True,
              help="Rank of the adapters (their per-step cost).")
@click.option("--max-loras-per-batch", "lora_slots", type=click.IntRange(min=1), default=8, show_default=True,
              help="Adapter slots per engine: most distinct adapters in one batch.")
@click.option("--slo-ttft-ms", default=800.0, show_default=True, type=click.FloatRange(min=1))
@click.option("--slo-tpot-ms", default=40.0, show_default=True, type=click.FloatRange(min=0.1))
@click.option("--price", default=2.50, show_default=True, type=click.FloatRange(min=0), help="$ per GPU-hour.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--out", "out_dir", default="simulate-out", show_default=True, type=click.Path(file_okay=False),
              help="Where simulate.md, simulate.json and simulate.png go.")
@click.option("--progress/--no-progress", default=True, show_default=True)
def simulate(trace_name: str, mix_name: str | None, mix_cached_fraction: float, peak_rps: float, duration: str,
             shape: str, bin_s: float, trough: float, fleet: str | None, gpu: str, tp: str, replicas: int | None,
             policy: str, admission: bool, load_interval: float, autoscale: bool, autoscale_goodput: float | None,
             cold_start: float, warm_start: float, chunk: int, spec_text: str | None, lora_adapters: int,
             lora_rank: int, lora_slots: int, slo_ttft_ms: float, slo_tpot_ms: float, price: float,
             seed: int, out_dir: str, progress: bool) -> None:
    """Replay a day of traffic on a simulated fleet: SLO attainment, goodput, GPU-hours and $.

    A discrete-event simulator on a virtual clock (no network, no GPUs): the router's placement
    policy and the gateway's overload policy decide, analytic engine replicas (the simulated
    engine's timing model) serve. The trace gives the arrival-rate shape, scaled so its busiest
    minute reaches --peak-rps; a day tiles the trace's hour under a diurnal envelope (see
    docs/simulator.md).

    \b
    Examples:
      inferbus simulate --duration 1h --peak-rps 833              # fleet sized by the planner's arithmetic
      inferbus simulate --fleet H100:2x140 --duration 24h --price 2.50 --out day
      inferbus simulate --trace azure_2023_code.csv --mix worked-example --replicas 240 --policy least_loaded
      inferbus simulate --duration 24h --autoscale --cold-start 120 --warm-start 5   # the autoscaler sizes it
      inferbus simulate --duration 1h --chunk 2048 --spec 3:0.7 --lora-adapters 16   # engine options
    """
    try:
        seconds = parse_duration(duration)
        trace_path = traces.find(trace_name)
        trace = traces.load(trace_path)
        mix = mix_mod.load(mix_name, None) if mix_name else mix_mod.load(trace_path, mix_cached_fraction)
        if fleet:
            gpu, tp_width, replicas = parse_fleet(fleet)
        else:
            tp_width = int(tp)
        spec = _parse_spec(spec_text)
        engine = EngineConfig(gpu=gpu, tp=tp_width, chunked_prefill_size=chunk, max_lora_rank=lora_rank,
                              max_loras_per_batch=lora_slots)
        if spec is not None:
            engine = replace(engine, speculative_num_steps=spec.draft_tokens, speculative_acceptance=spec.acceptance,
                             speculative_draft_cost=spec.draft_cost)
        step_model = step_model_for(engine, lora_adapters)
        sizing_note = "given"
        sizing = size_fleet(mix, engine, peak_rps, slo_ttft_s=slo_ttft_ms / 1000, slo_tpot_s=slo_tpot_ms / 1000,
                            lora_adapters=lora_adapters)
        if replicas is None:
            replicas = sizing.replicas
            sizing_note = sizing.method
        workload = DayWorkload(
            rate_shape(trace, bin_s), bin_s, seconds, peak_rps, mix, mode=shape, trough=trough, seed=seed
        )
        controller = None
        if autoscale:
            controller, replicas, sizing_note = autoscaler_for(
                workload, autoscale_goodput or sizing.replica_goodput_rps, replicas,
                cold_start, warm_start, slo_ttft_ms / 1000, slo_tpot_ms / 1000)
    except (ValueError, FileNotFoundError, mix_mod.MixError) as error:
        raise click.UsageError(str(error)) from error
    config = FastConfig(
        replicas=replicas, engine=engine, policy=policy, seed=seed, admission=admission, load_interval_s=load_interval,
        slo_ttft_s=slo_ttft_ms / 1000, slo_tpot_s=slo_tpot_ms / 1000, price_per_gpu_hour=price,
        cold_start_s=cold_start, warm_start_s=warm_start,
    )
    expected = workload.expected_requests()
    click.echo(f"{engine.gpu} TP{engine.tp} × {replicas} replicas ({sizing_note}); {policy}; "
               f"~{expected:,.0f} requests over {seconds / 3600:.2f} h, peak {peak_rps:g} req/s")
    if progress:
        with click.progressbar(length=int(seconds), label="virtual time", show_eta=True) as bar:
            done = [0]

            def advance(now: float) -> None:
                step = min(int(now), int(seconds)) - done[0]
                if step > 0:
                    bar.update(step)
                    done[0] += step

            summary = FastFleet(config, workload.arrivals(), controller=controller, progress=advance,
                                step_model=step_model).run()
    else:
        summary = FastFleet(config, workload.arrivals(), controller=controller, step_model=step_model).run()
    paths = write_report(
        summary,
        Path(out_dir),
        {
            "trace": str(trace_path),
            "mix": mix.describe(),
            "peak_rps": peak_rps,
            "duration_s": seconds,
            "shape": shape,
            "bin_s": bin_s,
            "trough": trough,
            "sizing": sizing_note,
            "replicas": replicas,
            "admission": admission,
            "load_interval_s": load_interval,
            "seed": seed,
            "autoscale": autoscale,
            "chunk": chunk,
            "spec": spec_text,
            "lora_adapters": lora_adapters,
            "lora_rank": lora_rank if lora_adapters else None,
            **(
                {
                    "cold_start_s": cold_start,
                    "warm_start_s": warm_start,
                    "autoscaler": {
                        k: getattr(controller.policy.config, k) for k in controller.policy.config.__dataclass_fields__
                    },
                }
                if controller is not None
                else {}
            ),
        },
    )
    click.echo(summary.markdown())
    click.echo("wrote " + ", ".join(str(p) for p in paths))


def autoscaler_for(workload: DayWorkload, goodput_rps: float, cap_replicas: int, cold_start_s: float,
                   warm_start_s: float, slo_ttft_s: float, slo_tpot_s: float) -> tuple[PolicyController, int, str]:
    """The autoscaler's policy as the run's controller, the replicas it starts with (what the
    first bin's rate needs, with the policy's headroom) and a note for the report."""
    config = PolicyConfig(goodput_rps=round(goodput_rps, 3), cold_start_s=cold_start_s, warm_start_s=warm_start_s,
                          ttft_slo_s=slo_ttft_s, tpot_slo_s=slo_tpot_s, max_serving=math.ceil(cap_replicas * 1.5),
                          max_warm=15, max_replicas=math.ceil(cap_replicas * 1.5) + 15)
    first_rate = workload.rates()[0][2]
    start = min(config.max_serving, max(1, math.ceil(first_rate * (1 + config.headroom) / config.goodput_rps)))
    return (PolicyController(config, interval_s=5.0), start,
            f"autoscaled from {start}, sizing at {config.goodput_rps:.2f} req/s per replica, at most "
            f"{config.max_serving} serving")


def write_report(summary: Summary, out: Path, inputs: dict[str, object], stem: str = "simulate") -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    pngs = plot(summary, out, stem)
    md = out / f"{stem}.md"
    md.write_text(f"# inferbus simulate\n\nInputs: `{json.dumps(inputs, default=str)}`\n\n" + summary.markdown()
                  + "".join(f"\n![time series]({p.name})\n" for p in pngs))
    data = out / f"{stem}.json"
    data.write_text(json.dumps({"inputs": inputs, "summary": summary.as_dict()}, indent=1, default=str))
    return [md, data, *pngs]
