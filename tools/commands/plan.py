"""`inferbus plan`: the thin shell around the planner (reads files, writes the report)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import click

from inferbus.timing import GPUS, KV_LINKS, PRECISIONS, PRESETS, KvLink, SpecDecoding, kv_link
from tools.capacity import mix as mix_mod
from tools.capacity.plan import deploy, options, report, sweep_table
from tools.capacity.plan.model import Assumptions, Slo, Workload
from tools.capacity.plan.planner import PREFILL_QUEUES, PlanError, PlanInputs, make_plan
from tools.capacity.plan.sizing import FORECAST_ERROR, MODEL_ERROR, POOLED_FROM_REPLICAS, POOLED_MODEL_ERROR
from tools.capacity.plan.topology import plan_topology
from tools.capacity.plan.warm_pool import Ramp, ramp_from_arrivals

_SWEEP_SPEC = re.compile(r"^(?P<gpu>[A-Za-z0-9]+):(?P<tp>\d+)=(?P<path>.+)$")
_SLO_KEYS = ("ttft_p90_ms", "tpot_p90_ms")


def _amount(value: float) -> str:
    """50000 → '50,000'; 833.5 → '833.5' (never scientific notation)."""
    return f"{int(value):,}" if float(value).is_integer() else f"{value:,.2f}".rstrip("0")


def _parse_gpus(text: str) -> dict[str, float]:
    prices: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, price = item.partition(":")
        name = name.strip().upper()
        if name not in GPUS:
            raise click.BadParameter(f"unknown GPU {name!r}; known: {', '.join(sorted(GPUS))}", param_hint="--gpu")
        try:
            prices[name] = float(price) if sep else _no_price(name)
        except ValueError:
            raise click.BadParameter(
                f"price of {name} must be $ per GPU-hour, got {price!r}", param_hint="--gpu"
            ) from None
        if prices[name] < 0:
            raise click.BadParameter(f"price of {name} must not be negative", param_hint="--gpu")
    if not prices:
        raise click.BadParameter("give at least one GPU, e.g. H100:2.50", param_hint="--gpu")
    return prices


def _no_price(name: str) -> float:
    raise click.BadParameter(f"{name} needs a price in $ per GPU-hour, e.g. {name}:2.50", param_hint="--gpu")


def _parse_tps(text: str) -> list[int]:
    try:
        tps = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint="--tp") from None
    from inferbus.timing import ALL_REDUCE_S

    bad = [tp for tp in tps if tp not in ALL_REDUCE_S]
    if bad or not tps:
        raise click.BadParameter(f"TP must be among {sorted(ALL_REDUCE_S)}, got {text!r}", param_hint="--tp")
    return tps


def _parse_slo(text: str | None, ttft_ms: float | None, tpot_ms: float | None) -> Slo:
    values = {"ttft_p90_ms": 800.0, "tpot_p90_ms": 40.0}
    given: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _SLO_KEYS:
            raise click.BadParameter(f"expected {'=…,'.join(_SLO_KEYS)}=…, got {item!r}", param_hint="--slo")
        try:
            given[key] = float(value)
        except ValueError:
            raise click.BadParameter(
                f"{key} must be a number of milliseconds, got {value!r}", param_hint="--slo"
            ) from None
    for key, flag in (("ttft_p90_ms", ttft_ms), ("tpot_p90_ms", tpot_ms)):
        if flag is not None:
            if key in given and given[key] != flag:
                raise click.UsageError(f"--slo says {key}={given[key]:g} but --{key.replace('_', '-')} says {flag:g}")
            given[key] = flag
    values.update(given)
    if min(values.values()) <= 0:
        raise click.BadParameter("SLO targets must be positive milliseconds", param_hint="--slo")
    return Slo(ttft_p90_s=values["ttft_p90_ms"] / 1000, tpot_p90_s=values["tpot_p90_ms"] / 1000)


def _load_sweep(spec: str, slo: Slo, plan_mix: dict) -> sweep_table.SweepGoodput:  # type: ignore[type-arg]
    match = _SWEEP_SPEC.match(spec)
    gpu = tp = None
    path = Path(spec)
    if match and not path.exists():
        gpu, tp, path = match["gpu"].upper(), int(match["tp"]), Path(match["path"])
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise click.BadParameter(f"cannot read {path}: {error.strerror}", param_hint="--sweep") from None
    except json.JSONDecodeError as error:
        raise click.BadParameter(f"{path} is not JSON: {error}", param_hint="--sweep") from None
    try:
        sweep = sweep_table.parse(data, str(path), gpu, tp)
        if sweep.gpu and sweep.gpu not in GPUS:
            raise sweep_table.SweepError(f"{path}: GPU {sweep.gpu!r} unknown; known: {', '.join(sorted(GPUS))}")
        return sweep_table.goodput(sweep, slo, plan_mix)
    except sweep_table.SweepError as error:
        raise click.BadParameter(str(error), param_hint="--sweep") from None


def _parse_spec(text: str | None) -> SpecDecoding | None:
    if text is None:
        return None
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        return SpecDecoding(int(parts[0]), float(parts[1]), *(float(p) for p in parts[2:]))
    except ValueError as error:
        detail = str(error) if str(error) else "expected K:ACCEPTANCE[:DRAFT_COST]"
        raise click.BadParameter(f"{detail}, e.g. 3:0.7 (got {text!r})", param_hint="--spec") from None


def _parse_kv_link(text: str) -> KvLink:
    """`rdma`, `nvlink`, or either with its bandwidth per GPU replaced: `rdma:25` (GB/s, one way)."""
    name, sep, rate = text.partition(":")
    try:
        return kv_link(name.strip().lower(), float(rate) if sep else None)
    except ValueError as error:
        detail = str(error) if "link" in str(error) else f"bandwidth must be GB/s per GPU, got {rate!r}"
        raise click.BadParameter(f"{detail}; e.g. rdma, nvlink or rdma:25", param_hint="--kv-link") from None


def _command_line(ctx: click.Context) -> str:
    """The command as it would be typed, options at their defaults left out (for the overlay's header)."""
    words = ["inferbus", "plan"]
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name in (
            "emit_deploy",
            "worker_manifest",
            "out",
            "as_json",
            "no_plots",
            "compare",
        ):
            continue
        value = ctx.params.get(param.name)
        if value is None or value == param.default or value == ():
            continue
        flag = max(param.opts, key=len)
        if param.is_flag:
            words.append(flag if value else (param.secondary_opts or [flag])[0])
            continue
        for item in value if isinstance(value, tuple) else (value,):
            # A trace is named by its file name: it is looked up on the traces path.
            words += [
                flag,
                Path(item).name if isinstance(item, Path) else f"{item:g}" if isinstance(item, float) else str(item),
            ]
    words += ["--emit-deploy", str(ctx.params["emit_deploy"])]
    return shlex.join(words)


def _load_ramp(ramp: float | None, ramp_trace: Path | None, rate_rps: float, cold_start_s: float) -> Ramp | None:
    if ramp is not None and ramp_trace is not None:
        raise click.UsageError("give --ramp or --ramp-trace, not both")
    if ramp is not None:
        if ramp < 0:
            raise click.BadParameter("the ramp must not be negative", param_hint="--ramp")
        return Ramp(ramp / 60.0, "given")
    if ramp_trace is None:
        return None
    from tools.capacity import traces

    try:
        arrivals = [r.arrival_s for r in traces.load(traces.find(ramp_trace))]
        found = ramp_from_arrivals(arrivals, rate_rps, cold_start_s)
    except (ValueError, KeyError, OSError) as error:
        raise click.BadParameter(f"{ramp_trace}: {error}", param_hint="--ramp-trace") from None
    return Ramp(found.ramp_rps_per_s, str(ramp_trace), found)


@click.command("plan", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--rpm", type=click.FloatRange(min=0, min_open=True),
              help="Peak requests per minute to plan for, e.g. --rpm 50000 (= 833.3 req/s).")
@click.option("--rps", type=click.FloatRange(min=0, min_open=True),
              help="Peak requests per second, instead of --rpm, e.g. --rps 833.")
@click.option(
    "--mix",
    "mix_name",
    default="worked-example",
    show_default=True,
    help="Workload mix: a built-in name (worked-example = an assumed chat mix, docs/capacity.md), a YAML spec "
    "(docs/planning.md) or a trace file (.jsonl Mooncake, .csv Azure).",
)
@click.option("--cached-fraction", type=click.FloatRange(0, 1, max_open=True), default=None,
              help="Prefix-cache hit share for trace mixes without block ids (Azure), e.g. 0.3.")
@click.option("--slo", "slo_text", default=None,
              help="SLO as key=value in milliseconds, e.g. --slo ttft_p90_ms=800,tpot_p90_ms=40 (the defaults).")
@click.option("--ttft-p90-ms", type=float, default=None, help="p90 time-to-first-token target, e.g. 800.")
@click.option("--tpot-p90-ms", type=float, default=None, help="p90 time-per-output-token target, e.g. 40.")
@click.option("--gpu", "gpu_text", default="H100:2.50,H200:3.50", show_default=True,
              help="GPU types and their price in $ per GPU-hour, comma-separated, e.g. H100:2.50,H200:3.50.")
@click.option("--tp", "tp_text", default="1,2,4", show_default=True,
              help="Tensor-parallel widths to compare (GPUs per replica), e.g. 2,4.")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="latency", show_default=True,
              help="Timing-model preset: latency (online serving, fitted to NVIDIA NIM's measurements) or throughput "
                   "(offline upper bound).")
@click.option("--chunk", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Chunked-prefill budget in tokens per step, e.g. 8192 (the worked example uses 2048; the "
                   "simulated engine defaults to 512).")
@click.option("--headroom", type=click.FloatRange(min=0), default=0.15, show_default=True,
              help="Spare capacity on top of peak ÷ goodput for N+1, bursts and imbalance, e.g. 0.25.")
@click.option("--forecast-error", type=click.FloatRange(min=0), default=FORECAST_ERROR, show_default=True,
              help="How far the busiest minute may come in above the planned peak, e.g. 0.2: with one replica "
                   "down, each fleet (and each disaggregated pool) still serves peak × (1 + this) × "
                   f"{1 + MODEL_ERROR:g} (the model's error). Binds over --headroom in fleets of a few replicas.")
@click.option("--prefill-queue", type=click.Choice(PREFILL_QUEUES), default="pooled", show_default=True,
              help="How placement treats the replicas' prefill queues. pooled: one queue in front of the replicas "
                   "left serving (M/G/c), as the router's default policy, affinity, makes them by placing on the "
                   "least queued prefill work; a replica's goodput then grows with the fleet, its TTFT limit sizes "
                   f"the fleet with a {POOLED_MODEL_ERROR:.0%} model error (checked against the fleet simulator, "
                   f"docs/planning.md), and a fleet that would serve fewer than {POOLED_FROM_REPLICAS} replicas is "
                   "priced per replica (so few do not pool). per-replica: each its own queue (M/G/1), as a random "
                   "or request-counting placement (--policy least_loaded, round_robin) leaves them.")
@click.option("--kv-limit", type=click.FloatRange(0, 1, min_open=True), default=0.9, show_default=True,
              help="Highest fraction of the KV cache a replica may plan to hold, e.g. 0.8.")
@click.option("--ttft-tokens", type=click.FloatRange(min=1), default=None,
              help="Uncached prompt tokens the TTFT p90 is computed for [default: the mix's 90th percentile, "
                   "1,500 for worked-example], e.g. 2000.")
@click.option("--sweep", "sweep_specs", multiple=True, metavar="[GPU:TP=]PATH",
              help="A measured `inferbus sweep` result replacing the model's goodput for its GPU × TP; repeatable. "
                   "Prefix GPU:TP= when the file does not record its hardware, e.g. --sweep H100:2=sweep.json.")
@click.option("--cold-start-s", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="Seconds from launching a replica to serving (weights load, graph capture), e.g. 300.")
@click.option("--warm-start-s", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="Seconds for a warm (sleeping) replica to serve, e.g. 1.")
@click.option("--ramp", type=float, default=None, metavar="RPS_PER_MIN",
              help="How fast the load rises, in req/s per minute, to size the warm pool, e.g. --ramp 120.")
@click.option("--ramp-trace", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Read the ramp from a trace instead: the steepest per-minute rise within one cold start, "
                   "scaled so the trace's busiest minute equals the planned rate, e.g. azure_2023_conv.csv "
                   "(a path, or a file name looked up in INFERBUS_TRACES_DIR and traces/).")
@click.option("--weights", type=click.Choice(sorted(PRECISIONS)), default="fp8", show_default=True,
              help="Precision of the model weights: fp8 (SGLang --quantization fp8) or bf16 (the checkpoint's own).")
@click.option("--kv-cache", type=click.Choice(sorted(PRECISIONS)), default="fp8", show_default=True,
              help="Precision of the KV cache: fp8 (--kv-cache-dtype fp8_e4m3, half the bytes per token) or bf16.")
@click.option("--spec", "spec_text", default=None, metavar="K:ACCEPTANCE[:DRAFT_COST]",
              help="Consider speculative decoding: K draft tokens per step, each accepted with probability "
                   "ACCEPTANCE, a draft step costing DRAFT_COST × a decode step (default 0.1); used in a row only "
                   "where it raises the goodput within the SLO, e.g. --spec 3:0.7.")
@click.option("--lora-adapters", type=click.IntRange(min=0), default=0, show_default=True,
              help="Distinct LoRA adapters the traffic spreads over evenly (0: base model only), e.g. 16.")
@click.option("--lora-rank", type=click.IntRange(min=1), default=16, show_default=True,
              help="Rank of the adapters (their size and per-step cost; SGLang --max-lora-rank), e.g. 64.")
@click.option("--max-loras-per-batch", "lora_slots", type=click.IntRange(min=1), default=8, show_default=True,
              help="Adapter slots on the GPU: most distinct adapters in one batch (SGLang's option of that name).")
@click.option("--zones", type=click.IntRange(min=1), default=1, show_default=True,
              help="Zones the serving fleet spreads over; with more than one it is sized to hold the peak "
                   "with one zone lost (× Z ÷ (Z − 1)), e.g. 3.")
@click.option("--disagg/--no-disagg", default=True, show_default=True,
              help="Also price a disaggregated fleet (a prefill pool and a decode pool, every TP pair) and choose the "
                   "cheaper topology that holds the SLO.")
@click.option("--kv-link", "kv_link_text", default="rdma", show_default=True, metavar="LINK[:GBPS]",
              help=f"Disaggregated: the link prefill sends KV to decode over, {' or '.join(sorted(KV_LINKS))} "
                   "(RDMA between nodes: one 400 Gb/s NIC per GPU, 50 GB/s; NVLink inside a node: 450 GB/s per GPU "
                   "one way), optionally with its GB/s per GPU replaced, e.g. rdma:25.")
@click.option("--compare/--no-compare", default=True, show_default=True,
              help="Also plan with each engine option flipped (BF16, speculative decoding, 1/8/32 adapters) and "
                   "show what each changes in GPUs and $ (about ten seconds more).")
@click.option("--emit-deploy", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write a kustomize overlay (a Component: list the directory under `components:` of the "
                   "kustomization holding the worker and autoscaler) for the chosen topology into this directory: "
                   "engine arguments, standby workers (warm pool), autoscaler bounds, with the arithmetic in a "
                   "comment, e.g. deploy/k8s/plan. A disaggregated choice deploys both pools: the worker "
                   "Deployment as the decode pool and worker-prefill as the prefill pool, each with its TP, "
                   "role and autoscaler bounds.")
@click.option("--worker-manifest", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --emit-deploy and a disaggregated choice: the base worker manifest the prefill pool's "
                   "Deployment is copied from (default: worker.yaml beside the --emit-deploy directory, as "
                   "deploy/k8s/worker.yaml is beside deploy/k8s/plan).")
@click.option("--model", "model_id", default="meta-llama/Llama-3.3-70B-Instruct", show_default=True,
              help="With --emit-deploy: the model the engine loads (keep equal to INFERBUS_MODEL).")
@click.option("--model-revision", default=None,
              help="With --emit-deploy: the model repository commit to pin (40 hex digits); without it the engine "
                   "reads it from the ConfigMap model-revision, which must exist before pods start.")
@click.option("--spec-draft-model", default=None,
              help="With --emit-deploy and speculative decoding on: the EAGLE draft model's path or repository.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory for plan.md, plan.json, fleet.png and latency.png, e.g. --out plan/.")
@click.option("--no-plots", is_flag=True, help="With --out, skip the PNGs (no matplotlib needed).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON instead of the summary table.")
@click.pass_context
def plan(ctx: click.Context, rpm: float | None, rps: float | None, mix_name: str, cached_fraction: float | None,
         slo_text: str | None, ttft_p90_ms: float | None, tpot_p90_ms: float | None, gpu_text: str, tp_text: str,
         preset: str, chunk: int, headroom: float, forecast_error: float, prefill_queue: str, kv_limit: float,
         ttft_tokens: float | None,
         sweep_specs: tuple[str, ...], cold_start_s: float, warm_start_s: float, ramp: float | None,
         ramp_trace: Path | None, weights: str, kv_cache: str, spec_text: str | None, lora_adapters: int,
         lora_rank: int, lora_slots: int, zones: int, disagg: bool, kv_link_text: str, compare: bool,
         emit_deploy: Path | None, worker_manifest: Path | None,
         model_id: str, model_revision: str | None, spec_draft_model: str | None, out: Path | None,
         no_plots: bool, as_json: bool) -> None:
    """Plan replicas, GPUs and dollars for a peak rate of a workload mix under a latency SLO.

    For every GPU type and TP width: the goodput of one replica (highest req/s with p90 TTFT and
    TPOT within the SLO and the KV cache under its limit), the constraint that binds, replicas =
    ⌈peak ÷ goodput × (1 + headroom)⌉ (in a small fleet: enough that one replica fewer still serves
    the peak with --forecast-error), the warm pool that covers a cold start, GPUs and $/hour
    counting both, $ per 1M input and output tokens and KV use. Goodput comes from the timing
    model of the simulated engine's roofline (docs/sim-engine.md; with the engine options: precision, speculative
    decoding, LoRA) unless a measured sweep is given for that GPU × TP; the report says which, shows the
    arithmetic line by line and what each engine option changes. Beside them it prices a
    disaggregated fleet (prefill pool + decode pool, the KV over --kv-link) and says which topology
    is cheaper and why. --emit-deploy writes the chosen topology as a kustomize overlay (a disaggregated one:
    both pools).

    \b
    Examples:
      inferbus plan --rpm 50000 --tp 2,4 --out plan/
      inferbus plan --rps 833 --mix mix.yaml --slo ttft_p90_ms=500,tpot_p90_ms=30 --gpu H200:3.50
      inferbus plan --rpm 50000 --sweep H100:2=sweep.json --ramp-trace azure_2023_conv.csv
      inferbus plan --rpm 50000 --spec 3:0.7 --lora-adapters 16 --zones 3
      inferbus plan --rpm 50000 --tp 1,2,4 --ramp-trace azure_2023_conv.csv --cold-start-s 600 \\
          --emit-deploy deploy/k8s/plan
    """
    if (rpm is None) == (rps is None):
        raise click.UsageError("give the peak rate with exactly one of --rpm or --rps, e.g. --rpm 50000")
    rate_rps = rps if rps is not None else rpm / 60.0  # type: ignore[operator]
    rate_text = f"{_amount(rps)} requests/s" if rps is not None else f"{_amount(rpm)} requests/min"  # type: ignore[arg-type]
    slo = _parse_slo(slo_text, ttft_p90_ms, tpot_p90_ms)
    prices, tps = _parse_gpus(gpu_text), _parse_tps(tp_text)
    try:
        mix = mix_mod.load(mix_name, cached_fraction)
        workload = Workload.from_mix(mix, ttft_tokens)
    except (mix_mod.MixError, ValueError) as error:
        raise click.BadParameter(str(error), param_hint="--mix") from None
    described = mix.describe()
    sweeps = [_load_sweep(spec, slo, described) for spec in sweep_specs]
    try:
        inputs = PlanInputs(
            rate_rps=rate_rps, rate_text=rate_text, workload=workload, mix=described, slo=slo, gpu_prices=prices,
            tps=tps, preset=preset, assumptions=Assumptions(chunk_tokens=chunk, kv_limit=kv_limit), headroom=headroom,
            forecast_error=forecast_error, prefill_queue=prefill_queue,
            cold_start_s=cold_start_s, warm_start_s=warm_start_s,
            ramp=_load_ramp(ramp, ramp_trace, rate_rps, cold_start_s), weights=weights, kv_cache=kv_cache,
            spec=_parse_spec(spec_text), lora_adapters=lora_adapters, lora_rank=lora_rank, lora_slots=lora_slots,
            zones=zones, disaggregation=disagg, kv_link=_parse_kv_link(kv_link_text),
        )
        result = make_plan(inputs, sweeps)
        variants = options.compare(result) if compare else []
    except PlanError as error:
        raise click.UsageError(str(error)) from None
    if emit_deploy is not None:
        if result.cheapest is None:
            raise click.UsageError("--emit-deploy: no configuration is feasible, so there is nothing to deploy")
        try:
            target = deploy.DeployTarget(model=model_id, command=_command_line(ctx),
                                         revision=model_revision, draft_model=spec_draft_model)
            choice = plan_topology(result)
            if choice.topology == "disaggregated":
                assert choice.disaggregated is not None
                manifest = worker_manifest or emit_deploy.parent / "worker.yaml"
                try:
                    base = manifest.read_text()
                except OSError as error:
                    raise ValueError(f"the prefill pool copies the base worker Deployment: cannot read {manifest} "
                                     f"({error.strerror}); give it with --worker-manifest") from None
                files = deploy.disaggregated_overlay(result, choice.disaggregated, target, base)
                deployed = choice.disaggregated.name
            else:
                files = deploy.overlay(result, result.cheapest, target)
                deployed = result.cheapest.name
        except ValueError as error:
            raise click.UsageError(f"--emit-deploy: {error}") from None
    data = report.to_json(result)
    data["engine_options"] = report.variants_json(variants)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        plots = [] if no_plots else report.write_plots(result, out)
        (out / "plan.md").write_text(report.markdown(result, plots, variants))
        (out / "plan.json").write_text(json.dumps(data, indent=2) + "\n")
    if emit_deploy is not None:
        emit_deploy.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (emit_deploy / name).write_text(text)
    if as_json:
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(report.summary(result), nl=False)
        if variants:
            click.echo("\nWhat the engine options change (timing model):\n" + report.variants_table(variants) + "\n")
        if emit_deploy is not None:
            click.echo(f"Wrote the {deployed} overlay to {emit_deploy}/ "
                       f"({', '.join(files)}).")
        if out is not None:
            click.echo(
                f"Wrote {out / 'plan.md'} and {out / 'plan.json'}"
                + ("" if no_plots else " with fleet.png and latency.png")
                + "."
            )
