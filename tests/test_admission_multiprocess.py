"""Limits hold across gateway replicas: separate OS processes, each with its own event loop and Redis
connection, share one tenant's limits through Redis (started here on a free port)."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
import uuid
from multiprocessing.synchronize import Barrier
from typing import Any

import pytest
import redis.asyncio as aioredis

from inferbus.stores.admission import Admission, TenantLimits

pytestmark = pytest.mark.slow

PROCESSES = 4
IN_FLIGHT = 4  # concurrent admits per process, like a gateway serving several requests at once




def _replica(url: str, tenant: str, limits: TenantLimits, seconds: float, barrier: Barrier, results: Any) -> None:
    results.put(asyncio.run(_hammer(url, tenant, limits, seconds, barrier)))


async def _hammer(url: str, tenant: str, limits: TenantLimits, seconds: float, barrier: Barrier) -> dict[str, float]:
    """Admit as fast as possible for `seconds`; never reconcile, so leases stay held."""
    redis = aioredis.from_url(url)
    admission = Admission(redis)
    await redis.ping()
    barrier.wait(timeout=30)  # every replica connected: start together
    first = time.time()
    calls = admitted = 0

    async def loop() -> None:
        nonlocal calls, admitted
        while time.time() < first + seconds:
            decision = await admission.admit(tenant, limits, uuid.uuid4().hex, 10, 10, 0.0)
            calls += 1
            admitted += decision.admitted

    await asyncio.gather(*(loop() for _ in range(IN_FLIGHT)))
    last = time.time()
    await redis.aclose()
    return {"calls": calls, "admitted": admitted, "first": first, "last": last}


def run_replicas(url: str, tenant: str, limits: TenantLimits, seconds: float) -> list[dict[str, float]]:
    # spawn, not fork: the test process has a running event loop and open sockets.
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    results = context.Queue()
    processes = [context.Process(target=_replica, args=(url, tenant, limits, seconds, barrier, results))
                 for _ in range(PROCESSES)]
    for process in processes:
        process.start()
    try:
        outcomes = [results.get(timeout=60) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=10)
    assert all(process.exitcode == 0 for process in processes)
    return outcomes


def test_replicas_share_one_requests_per_minute_limit(redis_url: str) -> None:
    rpm = 100
    outcomes = run_replicas(redis_url, "mp-" + uuid.uuid4().hex[:8], TenantLimits(requests_per_minute=rpm), 3.0)
    admitted = sum(int(o["admitted"]) for o in outcomes)
    window = max(o["last"] for o in outcomes) - min(o["first"] for o in outcomes)
    # Every replica kept asking well past the limit, in the same window.
    assert all(o["calls"] > rpm for o in outcomes), outcomes
    assert sum(o["calls"] for o in outcomes) > 4 * admitted
    # The full burst and no more than what refilled during the window; per-replica state would
    # have admitted about PROCESSES times the limit.
    assert rpm <= admitted <= rpm + rpm / 60 * window, (admitted, window, outcomes)


def test_replicas_share_one_concurrency_limit(redis_url: str) -> None:
    outcomes = run_replicas(redis_url, "mp-" + uuid.uuid4().hex[:8], TenantLimits(max_concurrent=5), 0.5)
    assert sum(int(o["admitted"]) for o in outcomes) == 5
    assert all(o["calls"] > 5 for o in outcomes)
