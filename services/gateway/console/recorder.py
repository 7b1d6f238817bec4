"""Each gateway adds what its SLO metrics gained to per-minute totals in Redis, for the console.

Prometheus keeps these series in a deployment; a local platform has no Prometheus, and the
console must show the day's SLO attainment on either. So every `interval_s` each gateway reads
its own `inferbus_ttft_seconds`, `inferbus_tpot_seconds`, `inferbus_requests_total` and
`inferbus_shed_total` (the objects `/metrics` renders), and adds the difference from its last
read to the hash of the current minute:

    inferbus:{console}:slo:<minute start>   hash  n, e, s, t0..t13, p0..p11   (kept `retention_s`)

The sum over gateways is the platform's. A failed write is not lost: the last read is only
advanced once Redis took the increments, so the next write carries them (into a later minute).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis.asyncio as aioredis
from prometheus_client.metrics import MetricWrapperBase

from inferbus.runtime import logs

from .. import metrics
from . import slo

log = logs.get(__name__)

SLO_PREFIX = "inferbus:{console}:slo:"


def minute_key(minute: int) -> str:
    return f"{SLO_PREFIX}{minute}"


def _samples(metric: MetricWrapperBase) -> list[tuple[str, Mapping[str, str], float]]:
    return [(s.name, s.labels, s.value) for family in metric.collect() for s in family.samples]


def read_gateway_metrics() -> slo.Counts:
    """This process's SLO metrics now (cumulative since it started)."""
    return slo.from_samples(_samples(metrics.TTFT), _samples(metrics.TPOT), _samples(metrics.REQUESTS),
                            _samples(metrics.SHED))


class SloRecorder:
    def __init__(self, redis: aioredis.Redis, *, interval_s: float = 10.0, retention_s: int = 2 * 86400,
                 read: Callable[[], slo.Counts] = read_gateway_metrics, clock: Callable[[], float] = time.time) -> None:
        self.redis = redis
        self.interval_s = interval_s
        self.retention_s = retention_s
        self.read = read
        self.clock = clock
        self._last = slo.Counts()  # a new process's counters start at zero: all they hold is new
        self._task: asyncio.Task[None] | None = None

    async def flush(self) -> bool:
        """Add what the counters gained to the current minute; False if Redis did not take it."""
        now = self.read()
        gained = slo.delta(now, self._last)
        if gained.empty():
            self._last = now
            return True
        minute = int(self.clock() // 60) * 60
        key = minute_key(minute)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                for name, value in gained.fields().items():
                    pipe.hincrby(key, name, value)
                pipe.expireat(key, minute + self.retention_s)
                await pipe.execute()
        except aioredis.RedisError as error:
            log.warning("slo_record_failed", error=repr(error))
            return False
        self._last = now
        return True

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="console-slo-recorder")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.flush()  # what the last interval gained

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("slo_record_failed")


async def read_minutes(redis: aioredis.Redis, start: int, end: int) -> dict[int, slo.Counts]:
    """The platform's per-minute totals in [start, end) (minute starts)."""
    minutes = list(range(start // 60 * 60, end, 60))
    async with redis.pipeline(transaction=False) as pipe:
        for minute in minutes:
            pipe.hgetall(minute_key(minute))
        raws: Iterable[Any] = await pipe.execute()
    return {minute: slo.Counts.from_fields(raw) for minute, raw in zip(minutes, raws) if raw}
