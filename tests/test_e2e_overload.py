"""The overload scenario, scaled down: a fleet offered three times what it finishes sheds early
with 503 `overloaded` and a small `retry-after`, starts what it admits within the queue budget,
declares no healthy worker dead, keeps every usage event and bills exactly what was delivered."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from bench import overload as scenario

from .conftest import Platform, running_platform

pytestmark = pytest.mark.e2e

BUDGET_S = 3.0
SLOTS = 4


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    # Real engine speed: a few dozen streams stay light on the CPU, so TTFT measures the platform.
    with running_platform(
        tmp_path_factory.mktemp("overload"), workers=2, time_scale=1.0, log_level="info",  # the gateway's TTFTs
        extra_env={"INFERBUS_WORKER_MAX_RUNNING": str(SLOTS), "INFERBUS_QUEUE_BUDGET_STANDARD_S": str(BUDGET_S),
                   "INFERBUS_REQUEST_TIMEOUT_S": "120"},
    ) as running:
        yield running


def test_three_times_capacity_is_shed_early_and_billed_exactly(fleet: Platform) -> None:
    per_request = scenario.service_time(fleet.base_url, fleet.api_key, 200)
    rate = 3.0 * 2 * SLOTS / per_request
    outcomes = asyncio.run(scenario.offer(fleet.base_url, fleet.api_key, rate, 15.0, (180, 220)))
    ids = {o.request_id for o in outcomes if o.status == 200 and o.request_id}
    events = asyncio.run(scenario.ledger(fleet.stack.nats_url, "demo", ids, timeout=30))
    r = scenario.summarize(outcomes, events, scenario.gateway_metrics(fleet.stack.gateway_url), BUDGET_S,
                           scenario.gateway_ttfts(fleet.stack.get("gateway").log_path))

    # Shed early and say when to come back: a small, bounded delay, in both header forms.
    assert r["shed_share"] >= 0.2, r
    assert r["first_shed_after_s"] is not None and r["first_shed_after_s"] < 8.0, r
    assert 1 <= r["retry_after_s"]["min"] and r["retry_after_s"]["max"] <= 30, r
    assert r["retry_after_ms_present"], r
    assert r["other_refusals"] == 0, r
    # What was admitted finished, and started within (about) its budget once the fleet's rate was
    # measured (after the first completion); before that only a lower bound sheds, so a request
    # admitted then waits at most about one service time.
    assert r["admitted_errors"] == 0, r
    # Started within its budget, as the gateway measured it: from taking the request to its first
    # token (p90 within two budgets, for a machine that shares its two cores with every other test;
    # without shedding it grows with the queue, to ~30 s here). The client's own TTFT adds its and
    # the HTTP stack's stalls, seconds on a loaded machine (a CI run's p90 was 9.7 s).
    # bench/overload.py reports both, with the p99.
    assert r["steady_gateway_ttft_s"]["requests"] >= 5, r
    assert r["steady_gateway_ttft_s"]["p90"] <= 2 * BUDGET_S, r
    # The slowest admitted start at the gateway: one service time (admitted before the rate was
    # measured) and the budget, with a second budget of room for a loaded machine. The client saw
    # it later by its own stalls: within four budgets at p90 (without shedding, ~30 s).
    assert r["gateway_ttft_s"]["max"] <= per_request + 2 * BUDGET_S + 2.0, r
    assert r["steady_ttft_s"]["p90"] <= 4 * BUDGET_S, r
    # No worker died, so no death verdict and no migration.
    assert r["death_verdicts"]["dead"] == 0 and r["migrations"] == 0, r
    # Every usage event kept; the ledger bills what the clients received.
    assert r["dropped_usage_events"] == 0, r
    assert r["duplicate_usage_events"] == 0 and r["duplicate_usage_chunks"] == 0, r
    assert r["ledger_tokens"] == r["delivered_tokens"], r
