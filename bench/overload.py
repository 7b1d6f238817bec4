"""Overload: a platform offered about three times what it can finish, as a production day might.

    python -m bench.overload [--seconds S] [--factor F | --rate R] [--slots N] [--time-scale X] [--out bench/results]
    python -m bench.overload --quick   # 16 slots, 3x, 45 s of arrivals, engines at 1/3 speed: a few minutes

Two workers (simulated H100 TP2 at real speed, a few slots each) and an open-loop arrival stream
of long answers at `factor` times the rate the fleet can finish (measured first: one 200-token
request's service time, scaled to the mean answer). Real speed, because at 10x the token streams
of a few hundred clients saturate the shared CPU of one machine and the test would measure the
client, not the platform. Every request is a streamed chat completion through the official OpenAI SDK, with
no retries. What a platform that sheds early must show:

- a large share shed at once with 503 `overloaded` and a small, bounded `retry-after`;
- admitted requests start within their band's queue budget (TTFT p99);
- no false death verdicts (no worker dies here, so every `dead` verdict would be false);
- zero dropped usage events (every admitted request has its tenant event on the USAGE stream)
  and zero duplicates (no request id billed to its tenant twice; every event counted as it is on
  the stream, never folded by request id);
- the ledger's output tokens equal the tokens delivered to the clients.

The scenario's functions are shared with the end-to-end test (tests/test_e2e_overload.py), which
runs it scaled down.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats
import openai
from openai.types.chat import ChatCompletionMessageParam

from bench.common import percentile, write_results
from proto import messages as m
from proto import subjects

MODEL = "meta-llama/Llama-3.3-70B-Instruct"


@dataclass
class Outcome:
    started: float
    status: int = 0  # 200, or the HTTP status of the refusal / error
    code: str = ""
    request_id: str = ""
    retry_after: str | None = None
    retry_after_ms: str | None = None
    ttft: float | None = None
    duration: float = 0.0
    delivered: int = 0  # completion tokens the client was told it received (its usage chunk)
    usage_chunks: int = 0  # usage chunks received: one per stream, a second would be a duplicate
    finished: bool = False  # the stream ended with a finish reason and usage
    error: str = ""


# An application's system prompt, the same in every request and longer than two 64-token prefix
# blocks: the router places requests by prefix on the worker that has it cached, so admitted
# requests wait in that worker's own queue as well as in the shared one, as in production.
SYSTEM_PROMPT = " ".join(f"Rule {k}: answer in plain English, in full sentences, and at length." for k in range(12))


def prompt(i: int) -> str:
    return f"Request {i}: write a long essay about topic {i}."


def messages(i: int) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt(i)}]


async def one(client: openai.AsyncOpenAI, i: int, max_tokens: int, started: float) -> Outcome:
    outcome = Outcome(started=started)
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages(i), max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
        outcome.status = 200
        async for chunk in stream:
            outcome.request_id = chunk.id.removeprefix("chatcmpl-")
            if chunk.choices and chunk.choices[0].delta.content and outcome.ttft is None:
                outcome.ttft = time.monotonic() - started
            if chunk.usage is not None:
                outcome.delivered += chunk.usage.completion_tokens  # a duplicate chunk counts twice
                outcome.usage_chunks += 1
                outcome.finished = True
    except openai.APIStatusError as error:
        outcome.status = error.status_code
        body = error.body if isinstance(error.body, dict) else {}
        outcome.code = str(body.get("code") or (body.get("error") or {}).get("code") or "")
        outcome.retry_after = error.response.headers.get("retry-after")
        outcome.retry_after_ms = error.response.headers.get("retry-after-ms")
        outcome.request_id = error.response.headers.get("x-request-id", "")
    except openai.APIError as error:  # an error event mid-stream
        outcome.error = str(error)
    outcome.duration = time.monotonic() - started
    return outcome


async def meter_lag(samples: list[float], period_s: float = 0.1) -> None:
    """How late this process's event loop wakes from a sleep: the delay every send and every
    received chunk of the clients also suffers (cancel the task to stop)."""
    while True:
        asked = time.monotonic()
        await asyncio.sleep(period_s)
        samples.append(time.monotonic() - asked - period_s)


async def offer(base_url: str, api_key: str, rate: float, seconds: float, max_tokens: tuple[int, int],
                seed: int = 1, loop_lag: list[float] | None = None) -> list[Outcome]:
    """Open loop: request i is sent at i / rate whatever happened to the others. `loop_lag`, when
    given, collects the clients' own event-loop lag: where it is large, the clients, not the
    platform, are what is slow, and their TTFT measures them."""
    rng = random.Random(seed)
    meter = asyncio.ensure_future(meter_lag(loop_lag)) if loop_lag is not None else None
    # openai's annotation names the httpx2 it is built on; httpx's client, which it takes as well,
    # is what this module imports.
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=2000),  # type: ignore[arg-type]
                                                              timeout=300))
    begin = time.monotonic()
    tasks = []
    for i in range(int(rate * seconds)):
        delay = begin + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(client, i, rng.randint(*max_tokens), time.monotonic())))
    outcomes = list(await asyncio.gather(*tasks))
    if meter is not None:
        meter.cancel()
    await client.close()
    return outcomes


async def ledger(nats_url: str, tenant: str, request_ids: set[str], timeout: float = 30.0) -> list[m.UsageEvent]:
    """Usage events of `request_ids` on the USAGE stream, waiting up to `timeout` for all of them."""
    nc = await nats.connect(nats_url)
    try:
        deadline = time.monotonic() + timeout
        while True:
            found: list[m.UsageEvent] = []
            sub = await nc.jetstream().subscribe(subjects.usage_filter(tenant), ordered_consumer=True)
            try:
                while True:
                    msg = await sub.next_msg(timeout=1.0)
                    event = msgspec.msgpack.decode(msg.data, type=m.UsageEvent)
                    if event.request_id in request_ids:
                        found.append(event)
            except nats.errors.TimeoutError:
                pass
            await sub.unsubscribe()
            billed = {e.request_id for e in found if e.billed_to == "tenant"}
            if billed >= request_ids or time.monotonic() > deadline:
                return found
            await asyncio.sleep(1.0)
    finally:
        await nc.close()


def gateway_metrics(gateway_url: str) -> dict[str, float]:
    """The gateway's Prometheus counters as {"name{labels}": value}."""
    values: dict[str, float] = {}
    for line in httpx.get(gateway_url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def gateway_ttfts(log_path: Path, field: str = "ttft_ms") -> dict[str, float]:
    """The TTFT the gateway measured for each request (its `request` log lines, at info level):
    from the gateway taking the request to its first token, without the client's and the HTTP
    stack's own delays, which on a loaded machine can be seconds. `admit_ms`: from the request
    reaching the gateway's handler to its admission (authenticated, parsed, rendered, in quota)."""
    found: dict[str, float] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            entry = msgspec.json.decode(line)
        except msgspec.DecodeError:
            continue
        if isinstance(entry, dict) and entry.get("event") == "request" and entry.get(field) is not None:
            found[str(entry.get("request_id"))] = float(entry[field]) / 1000
    return found


def summarize(outcomes: list[Outcome], events: list[m.UsageEvent], metrics: dict[str, float],
              budget_s: float, gateway_ttft: dict[str, float] | None = None) -> dict[str, Any]:
    admitted = [o for o in outcomes if o.status == 200]
    shed = [o for o in outcomes if o.status == 503 and o.code == "overloaded"]
    retry_after = [int(o.retry_after or 0) for o in shed]
    ttfts = sorted(o.ttft for o in admitted if o.ttft is not None)
    # Until the first request finishes the fleet's rate is unknown (only a lower bound sheds):
    # the TTFT of what was sent after that is the policy's steady state.
    measured_from = min((o.started + o.duration for o in admitted if o.finished), default=None)
    steady = sorted(o.ttft for o in admitted if o.ttft is not None and measured_from is not None
                    and o.started >= measured_from)
    # Every event as it is on the ledger: a request billed twice shows as two events, not one.
    tenant_events = [e for e in events if e.billed_to == "tenant"]
    billed = Counter(e.request_id for e in tenant_events)
    platform = [e for e in events if e.billed_to == "platform"]
    admitted_ids = {o.request_id for o in admitted if o.request_id}
    at_gateway = sorted((gateway_ttft or {})[i] for i in admitted_ids if i in (gateway_ttft or {}))
    steady_ids = {o.request_id for o in admitted if measured_from is not None and o.started >= measured_from}
    steady_at_gateway = sorted((gateway_ttft or {})[i] for i in steady_ids if i in (gateway_ttft or {}))
    return {
        "offered": len(outcomes),
        "admitted": len(admitted),
        "shed": len(shed),
        "shed_share": len(shed) / len(outcomes) if outcomes else 0.0,
        "other_refusals": len(outcomes) - len(admitted) - len(shed),
        "retry_after_s": {"min": min(retry_after, default=0), "max": max(retry_after, default=0)},
        "retry_after_ms_present": all(o.retry_after_ms for o in shed),
        "first_shed_after_s": min((o.started - outcomes[0].started for o in shed), default=None),
        "admitted_finished": sum(o.finished for o in admitted),
        "admitted_errors": sum(1 for o in admitted if not o.finished),
        "ttft_s": {"p50": percentile(ttfts, 50), "p90": percentile(ttfts, 90), "p99": percentile(ttfts, 99),
                   "max": ttfts[-1] if ttfts else None},
        "steady_ttft_s": {"after_s": None if measured_from is None else measured_from - outcomes[0].started,
                          "admitted": len(steady), "p90": percentile(steady, 90), "p99": percentile(steady, 99),
                          "max": steady[-1] if steady else None},
        "budget_s": budget_s,
        "admitted_over_budget": sum(1 for t in ttfts if t > budget_s),
        "gateway_ttft_s": {"requests": len(at_gateway), "p50": percentile(at_gateway, 50),
                           "p90": percentile(at_gateway, 90), "p99": percentile(at_gateway, 99),
                           "max": at_gateway[-1] if at_gateway else None,
                           "over_budget": sum(1 for t in at_gateway if t > budget_s)},
        "steady_gateway_ttft_s": {"requests": len(steady_at_gateway), "p50": percentile(steady_at_gateway, 50),
                                  "p90": percentile(steady_at_gateway, 90),
                                  "over_budget": sum(1 for t in steady_at_gateway if t > budget_s)},
        "death_verdicts": {"dead": metrics.get('inferbus_worker_death_verdicts_total{verdict="dead"}', 0.0),
                           "alive": metrics.get('inferbus_worker_death_verdicts_total{verdict="alive"}', 0.0)},
        "migrations": metrics.get("inferbus_migrations_total", 0.0),
        "placements": {"worker": metrics.get('inferbus_placements_total{target="worker"}', 0.0),
                       "shared": metrics.get('inferbus_placements_total{target="any"}', 0.0),
                       "over_budget": metrics.get("inferbus_placements_over_budget_total", 0.0)},
        "dropped_usage_events": sum(1 for i in admitted_ids if not billed[i]),
        "duplicate_usage_events": sum(count - 1 for count in billed.values() if count > 1),
        "duplicate_usage_chunks": sum(o.usage_chunks - 1 for o in admitted if o.usage_chunks > 1),
        "delivered_tokens": sum(o.delivered for o in admitted),
        "ledger_tokens": sum(e.usage.completion_tokens for e in tenant_events if e.request_id in admitted_ids),
        "platform_events": len(platform),
        "platform_tokens": sum(e.usage.completion_tokens for e in platform),
    }


def service_time(base_url: str, api_key: str, max_tokens: int) -> float:
    """Seconds one request of `max_tokens` takes on an idle fleet."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    started = time.monotonic()
    client.chat.completions.create(model=MODEL, messages=messages(-1),  # type: ignore[arg-type]
                                   max_tokens=max_tokens, temperature=0)
    return time.monotonic() - started


PROBE_TOKENS = 200


def run(seconds: float, factor: float, workers: int, slots: int, max_tokens: tuple[int, int],
        budget_s: float, time_scale: float = 1.0, rate: float | None = None) -> dict[str, Any]:
    from inferbus.local.ports import free_port
    from inferbus.local.stack import Stack, StackConfig
    from tools.commands.local_platform import demo_key
    from tools.commands.main import new_admin_key

    stack = Stack(StackConfig(
        state_dir=Path(tempfile.mkdtemp(prefix="inferbus-overload-")), gateway_port=free_port(), workers=workers,
        # info: the gateway's `request` lines carry the TTFT it measured (one line per request).
        time_scale=time_scale, log_level="info", admin_key=new_admin_key(),
        extra_env={"INFERBUS_WORKER_MAX_RUNNING": str(slots), "INFERBUS_QUEUE_BUDGET_STANDARD_S": str(budget_s),
                   "INFERBUS_REQUEST_TIMEOUT_S": "600"},
    ))
    stack.start(timeout=120)
    try:
        key = asyncio.run(demo_key(stack.redis_url))
        base_url = stack.gateway_url + "/v1"
        per_request = service_time(base_url, key, PROBE_TOKENS) * (sum(max_tokens) / 2) / PROBE_TOKENS
        capacity = workers * slots / per_request
        # With many slots the machine's CPU, not the slot count, is what limits: offer a given rate.
        rate = factor * capacity if rate is None else rate
        lag: list[float] = []
        outcomes = asyncio.run(offer(base_url, key, rate, seconds, max_tokens, loop_lag=lag))
        ids = {o.request_id for o in outcomes if o.status == 200 and o.request_id}
        events = asyncio.run(ledger(stack.nats_url, "demo", ids))
        results = summarize(outcomes, events, gateway_metrics(stack.gateway_url), budget_s,
                            gateway_ttfts(stack.get("gateway").log_path))
        lag.sort()
        admits = sorted(gateway_ttfts(stack.get("gateway").log_path, "admit_ms").values())
        results["gateway_admit_s"] = {"p50": percentile(admits, 50), "p90": percentile(admits, 90),
                                      "max": admits[-1] if admits else None}
        results["client_loop_lag_s"] = {"p50": percentile(lag, 50), "p90": percentile(lag, 90),
                                        "max": lag[-1] if lag else None}
    finally:
        stack.stop()
        stack.rmtree()
    results.update(when=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), seconds=seconds,
                   factor=rate / capacity,
                   workers=workers, slots=slots, max_tokens=list(max_tokens), service_time_s=per_request,
                   capacity_rps=capacity, offered_rps=rate, time_scale=time_scale)
    return results


def markdown(r: dict[str, Any]) -> str:
    ttft = r["ttft_s"]
    fmt = lambda x: "–" if x is None else f"{x:.2f}"  # noqa: E731
    scale = r.get("time_scale", 1.0)
    speed = "real speed" if scale == 1.0 else f"1/{scale:g} of real speed"
    return "\n".join([
        f"# Overload: {r['factor']:.1f}× what the fleet's slots finish ({r['when']})", "",
        f"Command: `python -m bench.overload` (part of `make bench`). {r['workers']} simulated H100 TP2 workers at "
        f"{speed}, {r['slots']} slots each; streamed chat completions of {r['max_tokens'][0]}–{r['max_tokens'][1]} "
        f"tokens through the OpenAI SDK without retries. One request takes ~{r['service_time_s']:.1f} s on an idle "
        f"fleet, so the fleet finishes ~{r['capacity_rps']:.2f} req/s; offered {r['offered_rps']:.2f} req/s for "
        f"{r['seconds']:.0f} s. Standard band queue budget {r['budget_s']:.0f} s.", "",
        "| measure | value |", "| --- | --- |",
        f"| offered | {r['offered']} |",
        f"| admitted | {r['admitted']} ({r['admitted_finished']} finished, {r['admitted_errors']} ended in an error) |",
        f"| shed with 503 `overloaded` | {r['shed']} ({r['shed_share']:.0%}); first after "
        f"{fmt(r['first_shed_after_s'])} s |",
        f"| `retry-after` on the 503s | {r['retry_after_s']['min']}–{r['retry_after_s']['max']} s "
        f"(`retry-after-ms` on all: {r['retry_after_ms_present']}) |",
        f"| admitted TTFT p50 / p90 / p99 / max | {fmt(ttft['p50'])} / {fmt(ttft['p90'])} / {fmt(ttft['p99'])} / "
        f"{fmt(ttft['max'])} s |",
        f"| admitted over the budget | {r['admitted_over_budget']} |",
        f"| the same, measured by the gateway (request taken to first token): p50 / p90 / p99 / max | "
        f"{fmt(r['gateway_ttft_s']['p50'])} / {fmt(r['gateway_ttft_s']['p90'])} / {fmt(r['gateway_ttft_s']['p99'])} / "
        f"{fmt(r['gateway_ttft_s']['max'])} s ({r['gateway_ttft_s']['over_budget']} over the budget, of "
        f"{r['gateway_ttft_s']['requests']}) |",
        f"| admitted after the first completion ({fmt(r['steady_ttft_s']['after_s'])} s): TTFT p90 / p99 / max | "
        f"{fmt(r['steady_ttft_s']['p90'])} / {fmt(r['steady_ttft_s']['p99'])} / {fmt(r['steady_ttft_s']['max'])} s "
        f"({r['steady_ttft_s']['admitted']} requests) |",
        f"| the same after the first completion, measured by the gateway: p50 / p90 | "
        f"{fmt(r['steady_gateway_ttft_s']['p50'])} / {fmt(r['steady_gateway_ttft_s']['p90'])} s "
        f"({r['steady_gateway_ttft_s']['over_budget']} over the budget, of {r['steady_gateway_ttft_s']['requests']}) |",
        *([f"| admission in the gateway (its handler reached to admitted) p50 / p90 / max | "
           f"{fmt(r['gateway_admit_s']['p50'])} / {fmt(r['gateway_admit_s']['p90'])} / "
           f"{fmt(r['gateway_admit_s']['max'])} s |"] if "gateway_admit_s" in r else []),
        *([f"| the clients' own event-loop lag p50 / p90 / max (their TTFT includes it) | "
           f"{fmt(r['client_loop_lag_s']['p50'])} / {fmt(r['client_loop_lag_s']['p90'])} / "
           f"{fmt(r['client_loop_lag_s']['max'])} s |"] if "client_loop_lag_s" in r else []),
        f"| false death verdicts (`dead`; no worker died) | {r['death_verdicts']['dead']:.0f} "
        f"(late heartbeats answered the probe: {r['death_verdicts']['alive']:.0f}) |",
        f"| migrations | {r['migrations']:.0f} |",
        f"| queued on a worker's own queue (prefix placement) / on the shared queue | "
        f"{r['placements']['worker']:.0f} / {r['placements']['shared']:.0f} (placements moved to the shared queue "
        f"because that worker's wait exceeded the budget: {r['placements']['over_budget']:.0f}) |",
        f"| dropped usage events | {r['dropped_usage_events']} |",
        f"| duplicate usage events (a request billed twice) / duplicate usage chunks to clients | "
        f"{r.get('duplicate_usage_events', '–')} / {r.get('duplicate_usage_chunks', '–')} |",
        f"| ledger output tokens / delivered | {r['ledger_tokens']} / {r['delivered_tokens']} |",
        f"| platform-cost events (abandoned attempts) | {r['platform_events']} ({r['platform_tokens']} tokens) |",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0, help="how long arrivals are offered")
    parser.add_argument("--factor", type=float, default=3.0, help="offered rate / the rate the fleet finishes")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8, help="INFERBUS_WORKER_MAX_RUNNING of each worker")
    parser.add_argument("--rate", type=float, default=None,
                        help="offered req/s instead of --factor × the slots' capacity (with many slots, such as "
                             "the default 256, the machine's CPU limits first: offer what overloads it)")
    parser.add_argument("--min-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--budget", type=float, default=3.0, help="standard band queue budget (s)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="engine time scale (3: a third of real speed, so that the clients' own CPU on a shared "
                             "machine does not set the pace)")
    parser.add_argument("--quick", action="store_true",
                        help="--seconds 45 --slots 16 --min-tokens 200 --max-tokens 300 --time-scale 3")
    parser.add_argument("--name", default="overload", help="results file name (without extension)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.slots, args.min_tokens, args.max_tokens, args.time_scale = 45.0, 16, 200, 300, 3.0
    results = run(args.seconds, args.factor, args.workers, args.slots, (args.min_tokens, args.max_tokens), args.budget,
                  args.time_scale, args.rate)
    write_results(args.out, args.name, results, markdown)


if __name__ == "__main__":
    main()
