"""A slow router is waited for, a hung one is not, and a backlog of one subscription does not hold
up the others: placement answers that come late must not turn into placement by chance. The
dispatcher and the subscriptions run against a real nats-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from nats.aio.msg import Msg

from inferbus.bus import connection as bus
from inferbus.bus.patience import PlacementPatience
from proto import messages as m
from proto import subjects
from services.gateway.dispatch import Dispatcher
from services.gateway.flight import Flight

from .nats_server import NatsServer

pytestmark = pytest.mark.slow


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_router_not_known_to_answer_is_waited_for_the_budget_and_one_that_answers_for_the_patience() -> None:
    clock = Clock()
    patience = PlacementPatience(budget_s=0.05, patience_s=1.0, clock=clock, answering_window_s=5.0)
    assert patience.wait_s() == 0.05  # nothing heard yet
    patience.answered()
    assert patience.wait_s() == 1.0
    clock.now += 4.9
    assert patience.wait_s() == 1.0  # answered within the window
    clock.now += 0.2
    assert patience.wait_s() == 0.05  # silent past the window: hung, not slow
    patience.answered()
    assert patience.wait_s() == 1.0


def test_patience_below_the_budget_never_shortens_the_wait() -> None:
    patience = PlacementPatience(budget_s=0.2, patience_s=0.0, clock=Clock())
    patience.answered()
    assert patience.wait_s() == 0.2


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    running = NatsServer(tmp_path_factory.mktemp("nats"))
    running.start()
    yield running
    running.stop()


def flight(request_id: str) -> Flight:
    request = m.InferenceRequest(
        request_id=request_id,
        tenant="t",
        model="m",
        prompt="P",
        reply_to="x",
        sampling=m.SamplingParams(max_new_tokens=10),
        deadline=1e12,
        created=0,
        prompt_tokens=64,
    )
    return Flight(request=request, block_hashes=[1, 2, 3, 4])


async def test_a_late_answer_makes_the_next_placements_wait_for_the_router_until_it_stops_answering(
    server: NatsServer,
) -> None:
    nc = await bus.connect(server.url, name="test-gateway")
    router = await bus.connect(server.url, name="test-router")
    kv = await bus.workers_bucket(nc.jetstream(), 3.0)
    dispatcher = Dispatcher(nc, kv, gateway_id="g", heartbeat_ttl_s=3.0, max_attempts=3,
                            placement_timeout_s=0.1, placement_patience_s=2.0)
    dispatcher.patience.answering_window_s = 1.0
    answer_after: dict[str, float | None] = {"s": 0.4}

    async def slow_router(msg: Msg) -> None:
        if answer_after["s"] is None:
            return  # hung: subscribed, never answers
        await asyncio.sleep(answer_after["s"])
        await msg.respond(
            m.encode(m.PlacementReply(target=subjects.worker_target("w1"), worker_id="w1", reason="affinity"))
        )

    await router.subscribe(subjects.placement_wildcard(), cb=slow_router)
    await router.flush()
    await kv.put(subjects.worker_key("w1"), m.encode(
        m.Heartbeat(worker_id="w1", model="m", engine_url="http://e", started=0.0, ts=time.time(), max_running=8)))
    await dispatcher.start()
    try:
        deadline = time.monotonic() + 5
        while "w1" not in dispatcher.live_workers and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        # Nothing heard from the router yet: the budget, then the shared queue.
        first = await dispatcher._place(flight("r1"))
        assert first.worker_id is None
        # Its answer comes after all: the router answers, only slowly. The next one waits for it.
        deadline = time.monotonic() + 5
        while not dispatcher.patience.answering() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        second = await dispatcher._place(flight("r2"))
        assert second.worker_id == "w1"
        # The router hangs (still subscribed, so NATS cannot say "no responders"): the next
        # question waits its patience and goes to the shared queue; once the router has been
        # silent for the window, questions wait only the budget.
        answer_after["s"] = None
        started = time.monotonic()
        third = await dispatcher._place(flight("r3"))
        assert third.worker_id is None and time.monotonic() - started >= 1.9
        await asyncio.sleep(1.1)
        started = time.monotonic()
        fourth = await dispatcher._place(flight("r4"))
        # The budget (0.1 s), not the patience (2 s): on a busy machine the budget can take a while.
        assert fourth.worker_id is None and time.monotonic() - started < 1.9
    finally:
        await dispatcher.stop()
        await router.close()
        await nc.close()


async def other_handled_after(server: NatsServer, wrap: bool) -> int:
    """Two subscriptions on one connection: 2,000 slow messages (0.2 ms each) on the first, then
    one message on the second. How many of the first were handled when the second was."""
    nc = await bus.connect(server.url, name="test-turns")
    sender = await bus.connect(server.url, name="test-sender")
    handled = {"backlog": 0, "seen_at": -1}
    done = asyncio.Event()

    async def slow(msg: Msg) -> None:
        until = time.perf_counter() + 0.0002
        while time.perf_counter() < until:
            pass
        handled["backlog"] += 1
        if handled["backlog"] == 2000:
            done.set()

    async def other(msg: Msg) -> None:
        handled["seen_at"] = handled["backlog"]

    try:
        await nc.subscribe("backlog", cb=bus.taking_turns(slow) if wrap else slow, pending_msgs_limit=100_000)
        await nc.subscribe("other", cb=other)
        await nc.flush()
        for _ in range(2000):
            await sender.publish("backlog", b"x")
        await sender.publish("other", b"y")
        await sender.flush()
        await asyncio.wait_for(done.wait(), 30)
        while handled["seen_at"] < 0:
            await asyncio.sleep(0.01)
        return handled["seen_at"]
    finally:
        await sender.close()
        await nc.close()


async def test_a_backlog_of_one_subscription_takes_turns_with_the_others(server: NatsServer) -> None:
    # The library's own behaviour, which the wrapper exists for: a backlog runs to its end first.
    assert await other_handled_after(server, wrap=False) > 1500
    # Taking turns, the other subscription's message is handled long before.
    assert await other_handled_after(server, wrap=True) < 500
