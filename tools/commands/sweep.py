"""`inferbus sweep`: a concurrency or request-rate sweep against any OpenAI-compatible endpoint.

Heavy imports (httpx, matplotlib, the mix loader) happen inside the command so that
`inferbus --help` stays fast.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click


def _positive_list(kind: type) -> Any:
    def parse(ctx: click.Context, param: click.Parameter, value: str | None) -> list[Any] | None:
        if value is None:
            return None
        items = []
        for part in value.split(","):
            part = part.strip()
            try:
                item = kind(part)
            except ValueError:
                item = None
            if item is None or not item > 0 or (isinstance(item, float) and not math.isfinite(item)):
                noun = "integers" if kind is int else "numbers"
                raise click.BadParameter(f"expected positive {noun} separated by commas (e.g. 1,2,4), got {part!r}")
            items.append(item)
        return items

    return parse


def _json_object(ctx: click.Context, param: click.Parameter, value: str | None) -> dict[str, Any]:
    if not value:
        return {}
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise click.BadParameter("expected a JSON object, e.g. '{\"temperature\": 0}'")
    return parsed


def base_url(url: str) -> str:
    """`http://host:port`, `.../v1` or `.../v1/` → the `/v1` base the endpoints hang off."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise click.BadParameter(f"expected an http:// or https:// URL, got {url!r}", param_hint="--url")
    return url if url.endswith("/v1") else url + "/v1"


@click.command("sweep", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--url", required=True, help="Base URL of the OpenAI-compatible server: the inferbus gateway, SGLang or "
              "vLLM, e.g. http://127.0.0.1:8080 (a trailing /v1 is optional).")
@click.option("--model", required=True, help="Model name sent in every request (as listed by GET /v1/models).")
@click.option("--api-key", envvar=["INFERBUS_API_KEY", "OPENAI_API_KEY"], default=None,
              help="Bearer token; default from $INFERBUS_API_KEY or $OPENAI_API_KEY. Bare engines need none.")
@click.option("--mix", "mix_name", default="worked-example", show_default=True,
              help="Workload: a built-in mix name, a YAML length-distribution spec, or a trace (.jsonl Mooncake, "
                   ".csv Azure) whose requests are sampled.")
@click.option("--cached-fraction", type=click.FloatRange(0, 1, max_open=True), default=None,
              help="For traces without prefix block ids (Azure): share of each prompt a prefix cache holds.")
@click.option("--concurrency", callback=_positive_list(int), default=None,
              help="Closed-loop steps: requests kept in flight, comma-separated, e.g. 1,2,4,8,16.")
@click.option("--rate", callback=_positive_list(float), default=None,
              help="Open-loop steps instead: arrivals per second (see --arrival), comma-separated, e.g. 0.5,1,2,4.")
@click.option("--arrival", type=click.Choice(["poisson", "constant"]), default="poisson", show_default=True,
              help="With --rate: exponential gaps between arrivals (Poisson) or equal gaps.")
@click.option("--requests", "requests_per_step", type=click.IntRange(1), default=None,
              help="Measured requests per step. Default: max(16, 4 × concurrency), or max(16, 20 s × rate).")
@click.option("--think-time-ms", type=click.FloatRange(0), default=0.0, show_default=True,
              help="Closed loop only: each simulated user waits this long after a response before its next "
                   "request (a user's think time; or, to offer the load another closed-loop tool offers, its "
                   "re-issue delay: aiperf's is ~5-8 ms). 0 sends at once.")
@click.option("--warmup", type=click.IntRange(0), default=0, show_default=True,
              help="Requests sent first in every step at the step's load and left out of its statistics; the step's "
                   "measured requests start when they have all finished (aiperf's --warmup-request-count).")
@click.option("--endpoint", type=click.Choice(["chat", "completions"]), default="chat", show_default=True,
              help="/v1/chat/completions (prompt in one user message) or /v1/completions (raw prompt).")
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True,
              help="Send ignore_eos (SGLang/vLLM extension) so every request generates exactly its mix output "
                   "length, as aiperf users do with --extra-inputs ignore_eos:true.")
@click.option("--extra-body", callback=_json_object, default=None,
              help="JSON object merged into every request body, e.g. '{\"temperature\": 0}'.")
@click.option("--slo-ttft-ms", type=click.FloatRange(0, min_open=True), default=800.0, show_default=True,
              help="SLO: p90 time to first token, in ms.")
@click.option("--slo-tpot-ms", type=click.FloatRange(0, min_open=True), default=40.0, show_default=True,
              help="SLO: p90 time per output token after the first, in ms.")
@click.option("--gpu", default=None, help="Metadata for the planner: the GPU the endpoint runs on, e.g. H100.")
@click.option("--tp", type=click.IntRange(1), default=None, help="Metadata: tensor-parallel GPUs per replica.")
@click.option("--replicas", type=click.IntRange(1), default=1, show_default=True,
              help="Metadata: engine replicas behind the URL (the planner divides the goodput by it).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the mix sample, prompts and arrivals.")
@click.option("--timeout", type=click.FloatRange(0, min_open=True), default=600.0, show_default=True,
              help="Seconds a request may wait for its next byte before it counts as a timeout error.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="sweep-results", show_default=True,
              help="Directory for sweep.json, sweep.csv, sweep_latency.png and sweep_goodput.png (rewritten "
                   "after every step, so an interrupted sweep keeps its finished steps).")
@click.option("--plots/--no-plots", default=True, show_default=True, help="Write the PNG plots.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar on stderr.")
def sweep(url: str, model: str, api_key: str | None, mix_name: str, cached_fraction: float | None,
          concurrency: list[int] | None, rate: list[float] | None, arrival: str, requests_per_step: int | None,
          think_time_ms: float, warmup: int,
          endpoint: str, ignore_eos: bool, extra_body: dict[str, Any], slo_ttft_ms: float, slo_tpot_ms: float,
          gpu: str | None, tp: int | None, replicas: int, seed: int, timeout: float, out_dir: str, plots: bool,
          progress: bool) -> None:
    """Measure latency, throughput and SLO goodput at increasing load.

    Every step sends requests drawn from MIX with streaming on and records per request TTFT, TPOT,
    the gaps between chunks (ITL) and end-to-end latency; per step it reports their mean and
    p50/p90/p99, request and token throughput (token counts from the server's usage), errors by
    kind, SLO attainment and goodput. Definitions match NVIDIA aiperf's (docs/sweep.md).

    The load generator is one Python process. It measures its own CPU use, event-loop lag and the
    load it actually achieved; a step where it, not the server, was the bottleneck is flagged
    client_limited and warned about — expect that at high concurrency on a small machine.

    \b
    Examples:
      inferbus sweep --url http://127.0.0.1:8080 --model meta-llama/Llama-3.3-70B-Instruct \\
          --api-key $KEY --mix worked-example --concurrency 1,2,4,8,16,32
      inferbus sweep --url http://gpu-box:30000 --model llama --mix chat.yaml --rate 0.5,1,2,4 \\
          --requests 200 --gpu H100 --tp 2 --out results/h100-tp2
      inferbus sweep --url http://127.0.0.1:30000 --model m --endpoint completions \\
          --mix traces/azure_2023_conv.csv --cached-fraction 0.3 --concurrency 4,16
    """
    from tools.capacity import mix as mix_module
    from tools.capacity.sweep.metrics import SLO

    if (concurrency is None) == (rate is None):
        raise click.UsageError("give exactly one of --concurrency (closed loop) or --rate (open loop)")
    if think_time_ms and rate is not None:
        raise click.UsageError("--think-time-ms applies to --concurrency (closed loop) only: with --rate, arrivals "
                               "do not wait for responses")
    try:
        workload = mix_module.load(mix_name, cached_fraction=cached_fraction)
    except mix_module.MixError as exc:
        raise click.BadParameter(str(exc), param_hint="--mix") from exc
    except (OSError, ValueError, KeyError) as exc:
        raise click.BadParameter(f"cannot read {mix_name}: {exc}", param_hint="--mix") from exc
    base = base_url(url)
    mode = "concurrency" if concurrency is not None else "rate"
    loads: list[float] = list(concurrency if concurrency is not None else rate)  # type: ignore[arg-type]
    slo = SLO(slo_ttft_ms / 1000, slo_tpot_ms / 1000)
    result: dict[str, Any] = {
        "schema": "inferbus.capacity.sweep/v1", "url": url, "model": model, "endpoint": endpoint,
        "mix": workload.describe(), "slo": slo.as_dict(),
        "hardware": {"gpu": gpu, "tp": tp, "replicas": replicas},
        "mode": mode, "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "client": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "settings": {"warmup": warmup, "seed": seed, "arrival": arrival if mode == "rate" else None,
                     "think_time_ms": think_time_ms if mode == "concurrency" else None,
                     "ignore_eos": ignore_eos, "extra_body": extra_body},
        "steps": [],
    }
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(f"cannot create {out}: {exc}", param_hint="--out") from exc
    counts = [requests_per_step or default_requests(mode, load) for load in loads]
    try:
        asyncio.run(_run(result, workload, base, api_key, loads, counts, warmup, ignore_eos, extra_body, slo,
                         seed, timeout, out, plots, progress))
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted: {len(result['steps'])} finished step(s) are in {out}", err=True)
        sys.exit(130)
    from tools.capacity.sweep.report import table

    click.echo(table(result))
    limited = [s for s in result["steps"] if s["client_limited"]]
    if limited:
        click.echo(f"warning: {len(limited)} step(s) were client-limited; their latencies describe this load "
                   "generator, not the server (see 'client' in sweep.json)", err=True)
    click.echo(f"results: {out / 'sweep.json'}, {out / 'sweep.csv'}" + (", plots *.png" if plots else ""))


def default_requests(mode: str, load: float) -> int:
    return max(16, 4 * int(load)) if mode == "concurrency" else max(16, math.ceil(20 * load))


async def _probe(client: Any, base: str, path: str, model: str, body: bytes) -> None:
    """Check URL, key and model before the sweep, so that a wrong one fails here in one line.
    `GET /models` first (no generation: the server's own metrics then count only the sweep's
    requests); a server without it gets one 1-token request instead."""
    import httpx

    async def call(method: str, url: str, content: bytes | None = None) -> tuple[int, str]:
        try:
            response = await client.request(method, url, content=content, headers={"content-type": "application/json"})
        except httpx.TransportError as exc:
            raise click.ClickException(f"cannot reach {base}{url}: {exc or type(exc).__name__}") from None
        return response.status_code, response.text

    status, text = await call("GET", "/models")
    if status == 200:
        try:
            listed = [m.get("id") for m in json.loads(text).get("data", [])]
        except (ValueError, AttributeError):
            listed = []
        if listed and model not in listed and model.split(":")[0] not in listed:  # "base:adapter" for LoRA
            raise click.ClickException(
                f"{base}/models does not list model {model!r} (it lists: {', '.join(map(str, listed))})")
        return
    if status in (401, 403):
        raise click.ClickException(f"{base}/models answered HTTP {status}: {_message(text)} (check --api-key)")
    status, text = await call("POST", path, body)
    if status != 200:
        raise click.ClickException(f"{base}{path} answered HTTP {status}: {_message(text)}")
    if "data:" not in text:
        raise click.ClickException(f"{base}{path} did not stream (no 'data:' events); is it OpenAI-compatible?")


def _message(text: str) -> str:
    """The `error.message` of an OpenAI-style error body, else the body (cut short)."""
    try:
        error = json.loads(text).get("error", text)
        message = error.get("message", error) if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = text
    return str(message)[:300]


async def _run(result: dict[str, Any], workload: Any, base: str, api_key: str | None, loads: list[float],
               counts: list[int], warmup: int, ignore_eos: bool, extra_body: dict[str, Any], slo: Any, seed: int,
               timeout: float, out: Path, plots: bool, progress: bool) -> None:
    import httpx

    from tools.capacity.sweep import loadgen, report
    from tools.capacity.sweep.metrics import step_stats
    from tools.capacity.sweep.prompts import ENDPOINT_PATHS, PromptBuilder

    builder = PromptBuilder(result["endpoint"], result["model"], ignore_eos=ignore_eos, seed=seed,
                            extra_body=extra_body)
    path = ENDPOINT_PATHS[result["endpoint"]]
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    done = 0
    total = sum(counts) + warmup * len(loads)
    bar = (click.progressbar(length=total, label="sweep", file=sys.stderr, show_pos=True, show_eta=True)
           if progress else None)

    def finished_one() -> None:
        nonlocal done
        done += 1

    async def ticker() -> None:
        shown = 0
        while True:
            await asyncio.sleep(0.25)
            if bar is not None and done > shown:
                bar.update(done - shown)
                shown = done

    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0))) as client:
        await _probe(client, base, path, result["model"], builder.probe())
        tick = asyncio.create_task(ticker())
        try:
            for index, (load, count) in enumerate(zip(loads, counts)):
                samples = workload.sample_many(warmup + count, seed)
                prepared = [builder.prepare(r, f"{result['started_at']}:{index}:{j}") for j, r in enumerate(samples)]
                if bar is not None:
                    bar.label = f"step {index + 1}/{len(loads)} ({result['mode']} {load:g})"
                # Warm-up first, drained, then the measured requests from a clean start (as aiperf's
                # warm-up phase): connections are open and caches warm, no request straddles both.
                for batch in (prepared[:warmup], prepared[warmup:]):
                    if not batch:
                        continue
                    if result["mode"] == "concurrency":
                        run = await loadgen.run_concurrency(client, path, batch, int(load), finished_one,
                                                            result["settings"]["think_time_ms"] / 1000)
                    else:
                        run = await loadgen.run_rate(client, path, batch, float(load), seed + index, finished_one,
                                                     result["settings"]["arrival"])
                step = step_stats(run.records, run.client, slo,
                                  concurrency=int(load) if result["mode"] == "concurrency" else None,
                                  rate_rps=float(load) if result["mode"] == "rate" else None)
                result["steps"].append(step)
                report.write_json(result, out / "sweep.json")
                report.write_csv(result["steps"], out / "sweep.csv")
                newline = "\n" if bar is not None else ""  # off the progress bar's line
                if step["client_limited"]:
                    reasons = "; ".join(step["client"]["reasons"])
                    click.echo(f"{newline}warning: {result['mode']} {load:g} is client-limited ({reasons}): the load "
                               "generator, not the server, is the bottleneck here", err=True)
                if step["errors"]:
                    click.echo(f"{newline}note: {result['mode']} {load:g}: {step['errors']} error(s) "
                               f"{step['error_kinds']}", err=True)
        finally:
            tick.cancel()
            if bar is not None:
                bar.update(done - bar.pos)
                bar.render_finish()
    if plots:
        report.write_plots(result, out)
