"""The load generator: streams requests at a fixed concurrency (closed loop) or at Poisson arrivals
(open loop) and records, per request, when it was sent and when each content chunk arrived.

One asyncio event loop in one process: honest about its own limits rather than fast. While a step
runs it samples its own CPU time and event-loop lag, and how far the achieved load fell short of
the target, so that `metrics.client_verdict` can say when the client was the bottleneck.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import httpx

from tools.capacity.sweep.prompts import Prepared
from tools.capacity.sweep.records import ClientSample, RequestRecord, StepRun

LAG_PROBE_S = 0.01  # the loop-lag probe's sleep; lag = how much later than this it wakes


def _content(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


async def send(client: httpx.AsyncClient, path: str, prepared: Prepared, record: RequestRecord) -> RequestRecord:
    """Stream one request into `record` (never raises for request failures: they are recorded)."""
    clock = time.perf_counter
    try:
        async with client.stream(
            "POST",
            path,
            content=prepared.body,
            headers={"content-type": "application/json", "accept": "text/event-stream"},
        ) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error, record.error_message = f"http_{response.status_code}", text[:300]
                return record
            done = False
            async for line in response.aiter_lines():
                now = clock()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    # Read on to the end of the body: leaving early closes the connection instead
                    # of returning it to the pool, and every request would pay a new TCP connect.
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event and not event.get("choices"):
                    error = event["error"]
                    record.error = "stream_error"
                    record.error_message = str(error.get("message", error) if isinstance(error, dict) else error)[:300]
                    return record
                choices = event.get("choices") or ()
                if choices and _content(choices[0]):
                    record.chunks.append(now)
                usage = event.get("usage")
                if usage:
                    record.input_tokens = usage.get("prompt_tokens")
                    record.output_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = details.get("cached_tokens")
            if not done:
                record.error, record.error_message = "incomplete", "the stream ended without [DONE]"
            elif not record.chunks:
                record.error, record.error_message = "no_content", "the stream carried no content"
    except httpx.TimeoutException as exc:
        record.error, record.error_message = "timeout", repr(exc)
    except httpx.TransportError as exc:
        record.error, record.error_message = "connection", repr(exc)
    except (ValueError, AttributeError, TypeError) as exc:  # bad JSON or an unexpected shape
        record.error, record.error_message = "protocol", repr(exc)
    finally:
        record.end = clock()
    return record


class _LagProbe:
    """Samples event-loop lag while a step runs: a busy loop delays every timestamp it takes."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _probe(self) -> None:
        clock = time.perf_counter
        while True:
            before = clock()
            await asyncio.sleep(LAG_PROBE_S)
            self.lags.append(max(0.0, clock() - before - LAG_PROBE_S))

    def start(self) -> None:
        self._task = asyncio.create_task(self._probe())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


def _load_avg() -> float | None:
    try:
        import os

        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


async def run_concurrency(client: httpx.AsyncClient, path: str, requests: Sequence[Prepared], concurrency: int,
                          on_done: Callable[[], None] = lambda: None, think_s: float = 0.0) -> StepRun:
    """Closed loop: `concurrency` workers (simulated users), each sending its next request
    `think_s` after its last one ends (0: at once)."""
    monitor = _LagProbe()
    records: list[RequestRecord] = []
    reissue: list[float] = []
    # (from, to) of each worker's think time before a send: part of the loop, not a shortfall
    thinking: list[tuple[float, float]] = []
    next_index = 0
    dispatch_end = 0.0
    started = time.perf_counter()
    cpu0 = time.process_time()

    async def worker() -> None:
        nonlocal next_index, dispatch_end
        last_end = None
        while next_index < len(requests):
            if last_end is not None and think_s > 0:
                await asyncio.sleep(think_s)
                # Counted even when the other users took what was left meanwhile: this user was
                # thinking up to the window's end, which may fall inside this think.
                thinking.append((last_end, time.perf_counter()))
                if next_index >= len(requests):
                    break
            prepared = requests[next_index]
            next_index += 1
            record = RequestRecord(prepared.kind, time.perf_counter())
            records.append(record)
            if last_end is not None:
                reissue.append(record.start - last_end)
            await send(client, path, prepared, record)
            last_end = record.end
            on_done()
            if next_index >= len(requests):
                dispatch_end = dispatch_end or time.perf_counter()

    monitor.start()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await monitor.stop()
    wall = time.perf_counter() - started
    # Achieved concurrency over the window in which every worker had something to send: after the
    # last dispatch the loop necessarily drains, which is not a client shortfall.
    window_end = dispatch_end or time.perf_counter()
    area = _inflight_area(records, started, window_end) + _area(thinking, started, window_end)
    achieved = area / ((window_end - started) * concurrency) if window_end > started else 1.0
    sample = ClientSample(wall, time.process_time() - cpu0, monitor.lags, min(1.0, achieved), _load_avg(), reissue)
    return StepRun(records, sample)


def _inflight_area(records: Sequence[RequestRecord], start: float, end: float) -> float:
    """Request-seconds in flight within [start, end]."""
    return _area(((r.start, r.end or end) for r in records), start, end)


def _area(spans: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of `spans` (from, to) within [start, end]."""
    return sum(max(0.0, min(stop, end) - max(begin, start)) for begin, stop in spans)


async def run_rate(client: httpx.AsyncClient, path: str, requests: Sequence[Prepared], rate: float, seed: int,
                   on_done: Callable[[], None] = lambda: None, arrival: str = "poisson") -> StepRun:
    """Open loop: arrivals at `rate` per second, Poisson (exponential gaps) or `constant` (equal
    gaps), each request sent at its arrival time whatever is in flight."""
    rng = random.Random(seed)
    monitor = _LagProbe()
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task[RequestRecord]] = []
    clock = time.perf_counter
    started = clock()
    cpu0 = time.process_time()
    monitor.start()
    offset = 0.0
    for prepared in requests:
        target = started + offset
        delay = target - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        record = RequestRecord(prepared.kind, clock(), scheduled=target)
        records.append(record)

        async def one(prepared: Prepared = prepared, record: RequestRecord = record) -> RequestRecord:
            try:
                return await send(client, path, prepared, record)
            finally:
                on_done()

        tasks.append(asyncio.create_task(one()))
        offset += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
    await asyncio.gather(*tasks)
    await monitor.stop()
    wall = clock() - started
    # Scheduled span over the actual dispatch span: 1.0 when every request left on time.
    scheduled_span = (records[-1].scheduled or started) - started if records else 0.0
    actual_span = (records[-1].start - started) if records else 0.0
    achieved = scheduled_span / actual_span if actual_span > 0 else 1.0
    sample = ClientSample(wall, time.process_time() - cpu0, monitor.lags, min(1.0, achieved), _load_avg())
    return StepRun(records, sample)
