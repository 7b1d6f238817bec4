"""A worker's liveness thread against a real nats-server: heartbeats and probe answers that a
starved event loop cannot delay, and none once the loop has stalled for good."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import msgspec
import nats
import pytest

from proto import messages as m
from proto import subjects
from services.worker.liveness import LivenessThread, PauseDetector, loop_alive

from .nats_server import NatsServer
from .waiting import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    running = NatsServer(tmp_path_factory.mktemp("nats"))
    running.start()
    yield running
    running.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_gap_between_ticks_longer_than_the_threshold_is_a_pause() -> None:
    clock = Clock()
    detector = PauseDetector(clock, pause_after_s=3.0)
    for _ in range(10):
        clock.now += 0.25
        assert not detector.tick()
    clock.now += 10.0  # SIGSTOP ... SIGCONT
    assert detector.lag() == 10.0
    assert detector.tick() and detector.epoch == 1
    clock.now += 0.25
    assert not detector.tick() and detector.epoch == 1


def test_a_loop_is_alive_until_it_stalls_past_the_limit() -> None:
    assert loop_alive(29.9, 30.0)
    assert not loop_alive(30.1, 30.0)


def beat(worker: str) -> m.Heartbeat:
    return m.Heartbeat(worker_id=worker, model="m", engine_url="http://engine", started=0.0, ts=0.0, max_running=4)


def probe_and_watch(url: str, worker: str, seconds: float, results: dict[str, object]) -> threading.Thread:
    """From another thread: count heartbeat puts and probe the worker once, for `seconds`."""

    async def run() -> None:
        nc = await nats.connect(url)
        kv = await nc.jetstream().key_value(subjects.WORKERS_BUCKET)
        watcher = await kv.watch(subjects.worker_key(worker))
        puts = 0
        started = time.time()
        deadline = time.monotonic() + seconds
        probed = False
        while time.monotonic() < deadline:
            try:
                entry = await watcher.updates(timeout=0.2)
            except nats.errors.TimeoutError:
                entry = None
            # (the watch starts with the current value: count only heartbeats put from now on)
            if entry is not None and entry.value and msgspec.msgpack.decode(entry.value, type=m.Heartbeat).ts > started:
                puts += 1
            if not probed and time.monotonic() > deadline - seconds / 2:
                probed = True
                try:
                    reply = await nc.request(
                        subjects.liveness_subject(worker), m.encode(m.LivenessProbe(worker_id=worker)), 1.0
                    )
                    results["reply"] = msgspec.msgpack.decode(reply.data, type=m.LivenessReply)
                except Exception as error:
                    results["reply"] = error
        results["puts"] = puts
        await watcher.stop()
        await nc.close()

    thread = threading.Thread(target=lambda: asyncio.run(run()))
    thread.start()
    return thread


def test_heartbeats_and_probe_answers_continue_while_the_event_loop_is_starved(server: NatsServer) -> None:
    detector = PauseDetector(time.monotonic, pause_after_s=3.0)
    liveness = LivenessThread(server.url, "busy", interval_s=0.2, ttl_s=1.0, stall_after_s=30.0, loop_lag=detector.lag)
    liveness.start()
    try:
        liveness.set_beat(beat("busy"))
        wait_for(lambda: liveness.beats >= 1, 5, what="the first heartbeat")
        results: dict[str, object] = {}
        watcher = probe_and_watch(server.url, "busy", 4.0, results)
        # The worker's loop does 4 s of CPU-bound work without yielding (generation work that
        # starves it): the old in-loop heartbeat would have stopped for all of it.
        end = time.monotonic() + 4.0
        spin = 0
        while time.monotonic() < end:
            spin += 1
        watcher.join(10)
        assert results["puts"] >= 10  # ~every 0.2 s across the 4 s
        reply = results["reply"]
        assert isinstance(reply, m.LivenessReply), reply
        assert reply.worker_id == "busy" and reply.loop_lag_s > 1.0  # it answered for a starved loop
    finally:
        liveness.stop()


def test_a_stalled_loop_gets_no_heartbeat_and_no_answer(server: NatsServer) -> None:
    lag = {"s": 0.0}
    liveness = LivenessThread(
        server.url, "stuck", interval_s=0.2, ttl_s=1.0, stall_after_s=2.0, loop_lag=lambda: lag["s"]
    )
    liveness.start()
    try:
        liveness.set_beat(beat("stuck"))
        wait_for(lambda: liveness.beats >= 1, 5, what="the first heartbeat")
        lag["s"] = 60.0  # deadlocked for a minute
        time.sleep(0.3)
        results: dict[str, object] = {}
        probe_and_watch(server.url, "stuck", 2.0, results).join(10)
        assert results["puts"] == 0
        assert isinstance(results["reply"], Exception)  # no answer: the gateway declares it dead
    finally:
        liveness.stop()


def test_a_worker_that_is_not_serving_is_not_kept_alive(server: NatsServer) -> None:
    liveness = LivenessThread(server.url, "warm", interval_s=0.2, ttl_s=1.0, stall_after_s=30.0, loop_lag=lambda: 0.0)
    liveness.start()
    try:
        liveness.set_beat(None)
        results: dict[str, object] = {}
        probe_and_watch(server.url, "warm", 1.5, results).join(10)
        assert results["puts"] == 0 and isinstance(results["reply"], Exception)
    finally:
        liveness.stop()
