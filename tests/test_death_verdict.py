"""A lapsed heartbeat is a question, not a verdict: the gateway's dispatcher probes the worker and
migrates its streams only when nothing answers. Against a real nats-server."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from nats.aio.msg import Msg

from inferbus.bus import connection as bus
from proto import messages as m
from proto import subjects
from services.gateway.dispatch import Dispatcher
from services.gateway.flight import Flight
from services.worker.liveness import LivenessThread

from .nats_server import NatsServer
from .waiting import await_for

pytestmark = pytest.mark.slow

TTL_S = 1.0


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    running = NatsServer(tmp_path_factory.mktemp("nats"))
    running.start()
    yield running
    running.stop()


def beat(worker: str) -> m.Heartbeat:
    return m.Heartbeat(
        worker_id=worker, model="m", engine_url="http://engine", started=0.0, ts=time.time(), max_running=4
    )


async def test_a_worker_that_answers_keeps_its_streams_and_one_that_does_not_loses_them(server: NatsServer) -> None:
    nc = await bus.connect(server.url, name="test-gateway")
    kv = await bus.workers_bucket(nc.jetstream(), TTL_S)
    dispatcher = Dispatcher(nc, kv, gateway_id="g", heartbeat_ttl_s=TTL_S, max_attempts=3, placement_timeout_s=0,
                            liveness_timeout_s=0.5)
    await dispatcher.start()
    # A busy worker: its heartbeat was put once and lapses (as if its puts were delayed), but its
    # liveness thread answers probes.
    busy = LivenessThread(server.url, "busy", interval_s=3600, ttl_s=TTL_S, stall_after_s=30, loop_lag=lambda: 0.5)
    busy.start()
    busy.set_beat(beat("busy"))
    await kv.put("busy", m.encode(beat("busy")))
    request = m.InferenceRequest(request_id="r", tenant="t", model="m", prompt="P", reply_to="x",
                                 sampling=m.SamplingParams(max_new_tokens=10), deadline=1e12, created=0)
    flight = Flight(request=request, worker_id="busy", state="accepted")
    dispatcher.flights["r"] = flight
    probes: list[Msg] = []

    async def seen(msg: Msg) -> None:
        probes.append(msg)

    await nc.subscribe(subjects.liveness_subject("busy"), cb=seen)  # beside the worker's own answerer
    try:
        await await_for(lambda: "busy" in dispatcher.live_workers, 30, what="the busy worker seen")
        # Expired and probed three times: the verdicts on the first two (answered) are in.
        await await_for(lambda: len(probes) >= 3, 60, what="three liveness probes of the busy worker")
        assert flight.events.empty() and flight.worker_id == "busy"
        assert "busy" in dispatcher.live_workers

        busy.stop()  # now it is gone: the next probe goes unanswered
        await await_for(lambda: not flight.events.empty(), 30, what="the lost worker's stream given up")
        event = flight.events.get_nowait()
        assert isinstance(event, m.StreamError) and event.code == "worker_lost" and event.retryable
        assert "busy" not in dispatcher.live_workers
    finally:
        busy.stop()
        await dispatcher.stop()
        await nc.close()
