"""The gateway's relay logic: what a migration sends, and what a lost event does."""

from collections.abc import Callable

import msgspec

from proto import messages as m
from proto import subjects
from services.gateway.flight import Flight, next_attempt, shows_loss
from services.gateway.worker_watch import WorkerWatch


def test_migration_continues_from_what_the_client_already_has() -> None:
    request = m.InferenceRequest(request_id="r", tenant="t", model="m", prompt="P", reply_to="x",
                                 sampling=m.SamplingParams(max_new_tokens=10), deadline=1e12, created=0)
    flight = Flight(request=request, sent_text=[" a", " b"], sent_tokens=2, prompt_tokens=4)
    second = next_attempt(flight, max_attempts=3, now=0)
    assert second is not None
    assert (second.attempt, second.resumed_text, second.resumed_tokens, second.prompt_tokens) == (1, " a b", 2, 4)
    flight.request, flight.sent_text, flight.sent_tokens = second, [" c"], 3
    third = next_attempt(flight, max_attempts=3, now=0)
    assert third is not None and third.resumed_text == " a b c" and third.resumed_tokens == 3
    flight.request = third
    assert next_attempt(flight, max_attempts=3, now=0) is None
    assert next_attempt(Flight(request=request), max_attempts=3, now=2e12) is None


def test_migration_continues_from_token_ids_not_retokenized_text() -> None:
    request = m.InferenceRequest(request_id="r", tenant="t", model="m", prompt="P", reply_to="x", input_ids=[1, 2, 3],
                                 sampling=m.SamplingParams(max_new_tokens=10), deadline=1e12, created=0)
    flight = Flight(request=request, sent_text=[" a", "b"], sent_ids=[40, 41], sent_tokens=2, prompt_tokens=3)
    second = next_attempt(flight, max_attempts=4, now=0)
    assert second is not None
    assert (second.input_ids, second.resumed_ids, second.resumed_tokens) == ([1, 2, 3], [40, 41], 2)
    flight.request, flight.sent_text, flight.sent_ids, flight.sent_tokens = second, [" c"], [42], 3
    third = next_attempt(flight, max_attempts=4, now=0)
    assert third is not None and third.resumed_ids == [40, 41, 42] and third.resumed_text == " ab c"
    # A worker that did not report the ids of everything it sent: continue from the text instead.
    flight.request, flight.sent_text, flight.sent_ids, flight.sent_tokens = third, [" d", " e"], [43], 5
    fourth = next_attempt(flight, max_attempts=4, now=0)
    assert fourth is not None and fourth.input_ids == [] and fourth.resumed_ids == []
    assert fourth.resumed_text == " ab c d e" and fourth.resumed_tokens == 5


def test_constrained_output_is_not_continued_from_its_text() -> None:
    request = m.InferenceRequest(
        request_id="r",
        tenant="t",
        model="m",
        prompt="P",
        reply_to="x",
        deadline=1e12,
        created=0,
        sampling=m.SamplingParams(max_new_tokens=10, json_schema='{"type":"object"}'),
    )
    assert next_attempt(Flight(request=request, sent_text=['{"a'], sent_tokens=2), max_attempts=3, now=0) is None
    fresh = next_attempt(Flight(request=request), max_attempts=3, now=0)  # nothing sent yet: start over
    assert fresh is not None and fresh.attempt == 1 and fresh.resumed_text == ""


async def test_a_gap_asks_the_worker_to_resend_and_resent_duplicates_are_skipped() -> None:
    import asyncio

    from services.gateway.dispatch import Dispatcher

    request = m.InferenceRequest(request_id="r", tenant="t", model="m", prompt="P", reply_to="x",
                                 sampling=m.SamplingParams(max_new_tokens=10), deadline=1e12, created=0)
    dispatcher = Dispatcher.__new__(Dispatcher)  # the relay logic only, no connections
    started: list[tuple[str, float]] = []
    dispatcher.on_started = lambda band, seconds: started.append((band, seconds))
    asked: list[tuple[int, str]] = []
    dispatcher.recover = lambda flight, why: asked.append((flight.next_seq, why))  # type: ignore[method-assign]
    flight = Flight(request=request, events=asyncio.Queue())
    chunk = lambda seq, text: m.TokenChunk(request_id="r", attempt=0, seq=seq, text=text, completion_tokens=seq + 1)  # noqa: E731
    # Chunk 1 was lost: chunk 2 is set aside and the worker asked; its resend brings 1 and 2, and
    # chunk 2's late original arrives after them.
    for event in (chunk(0, " a"), chunk(2, " c"), chunk(1, " b"), chunk(2, " c"), chunk(2, " c"),
                  m.Final(request_id="r", attempt=0, seq=3, text="", finish_reason="length",
                          usage=m.Usage(prompt_tokens=1, completion_tokens=3))):
        flight.events.put_nowait(event)
    seen = [e async for e in dispatcher.events(flight)]
    assert [getattr(e, "text", None) for e in seen] == [" a", " b", " c", ""]
    assert asked == [(1, "stream gap: chunk 2, expected 1")]
    assert [band for band, _ in started] == ["standard"]  # its first token, once: the overload policy's start lag


async def test_first_copies_of_resent_chunks_arriving_after_the_answer_are_no_new_gap() -> None:
    """The worker publishes the chunks asked for after their first copies, and answers after
    both; a gateway that reads the answer before the first copies (each subscription has its own
    task) must not take those copies for a new loss and ask a second time."""
    import asyncio
    from types import SimpleNamespace

    from services.gateway.dispatch import Dispatcher

    request = m.InferenceRequest(request_id="r", tenant="t", model="m", prompt="P", reply_to="x",
                                 sampling=m.SamplingParams(max_new_tokens=10), deadline=1e12, created=0)
    answer = m.encode(m.ResendReply(state="running", resent=3, worker_id="w"))
    asks: list[bytes] = []

    class Answering:  # the worker's answer, as the gateway's reply mux hands it over
        async def request(self, subject: str, data: bytes, timeout_s: float) -> SimpleNamespace:
            asks.append(data)
            return SimpleNamespace(data=answer)

    dispatcher = Dispatcher.__new__(Dispatcher)  # the relay logic only, no connections
    dispatcher.on_started = lambda band, seconds: None
    dispatcher.replies, dispatcher.gateway_id, dispatcher.liveness_timeout_s = Answering(), "g", 1.0  # type: ignore[assignment]
    dispatcher.live_workers, dispatcher._background = {"w": None}, set()  # type: ignore[dict-item]
    flight = Flight(request=request, events=asyncio.Queue(), worker_id="w", state="accepted")
    dispatcher.flights = {"r": flight}
    chunk = lambda seq, text: m.TokenChunk(request_id="r", attempt=0, seq=seq, text=text, completion_tokens=seq + 1)  # noqa: E731
    seen: list[str] = []

    async def read() -> None:
        async for event in dispatcher.events(flight):
            seen.append(getattr(event, "text", ""))

    reader = asyncio.ensure_future(read())
    for event in (chunk(0, " a"), chunk(2, " c")):  # chunk 1 lost: chunk 2 asks from 1
        flight.events.put_nowait(event)
    while not asks or dispatcher._background:
        await asyncio.sleep(0)  # the ask goes out and its answer is read
    assert not flight.resending and flight.resent_until == 4
    # Chunk 3's first copy, then the copies sent again (1, 2, 3), then the rest.
    for event in (chunk(3, " d"), chunk(1, " b"), chunk(2, " c"), chunk(3, " d"), chunk(4, " e"),
                  m.Final(request_id="r", attempt=0, seq=5, text="", finish_reason="length",
                          usage=m.Usage(prompt_tokens=1, completion_tokens=5))):
        flight.events.put_nowait(event)
    await asyncio.wait_for(reader, 5)
    assert "".join(seen) == " a b c d e" and len(asks) == 1
    # A chunk past those sent again still shows a loss (their copies were lost too).
    assert shows_loss(Flight(request=request, next_seq=1, resent_until=4), 4)
    assert not shows_loss(Flight(request=request, next_seq=1, resent_until=4), 3)


async def test_a_stream_its_worker_cannot_resend_continues_elsewhere() -> None:
    import asyncio

    from services.gateway.dispatch import Dispatcher

    request = m.InferenceRequest(request_id="r", tenant="t", model="m", prompt="P", reply_to="x",
                                 sampling=m.SamplingParams(max_new_tokens=10), deadline=1e12, created=0)
    dispatcher = Dispatcher.__new__(Dispatcher)
    dispatcher.on_started = lambda band, seconds: None
    migrations: list[str] = []

    async def migrate(flight: Flight, why: str) -> bool:
        migrations.append(why)
        flight.request = msgspec.structs.replace(flight.request, attempt=flight.request.attempt + 1)
        flight.next_seq = 0
        return True

    dispatcher.migrate = migrate  # type: ignore[method-assign]
    flight = Flight(request=request, events=asyncio.Queue())
    chunk = lambda attempt, seq, text: m.TokenChunk(  # noqa: E731
        request_id="r", attempt=attempt, seq=seq, text=text, completion_tokens=seq + 1
    )
    for event in (chunk(0, 0, " a"),
                  m.StreamError(request_id="r", attempt=0, code="stream_lost", retryable=True, status=503,
                                message="no event for 2.1 s; worker w cannot send the missing events again"),
                  chunk(1, 0, " b"), chunk(0, 3, " late"),
                  m.Final(request_id="r", attempt=1, seq=1, text="", finish_reason="length",
                          usage=m.Usage(prompt_tokens=1, completion_tokens=2))):
        flight.events.put_nowait(event)
    seen = [e async for e in dispatcher.events(flight)]
    assert [getattr(e, "text", None) for e in seen] == [" a", " b", ""]
    assert len(migrations) == 1 and "cannot send" in migrations[0]


def test_the_shared_queue_window_is_free_slots_and_a_few_per_worker() -> None:
    from services.gateway.queue_window import QueueWindow

    window = QueueWindow(per_worker=2)
    assert window.size(live_workers=0, free_slots=0) == 2  # no worker known yet: still a couple
    assert window.size(live_workers=3, free_slots=0) == 6
    assert window.size(live_workers=3, free_slots=40) == 40  # idle capacity is never withheld
    for band in ("standard", "standard", "premium"):
        window.entered(band)
    assert window.in_queue == 3 and window.queued("standard") == 2 and window.queued("batch") == 0
    assert window.room(live_workers=1, free_slots=0) == 0 and window.room(live_workers=3, free_slots=0) == 3
    window.left("standard")
    assert window.in_queue == 2 and window.queued("standard") == 1


def test_requests_without_a_first_token_are_the_unstarted_ones() -> None:
    from services.gateway.dispatch import Dispatcher

    dispatcher = Dispatcher.__new__(Dispatcher)
    dispatcher.flights, dispatcher.live_workers, dispatcher.heartbeat_ttl_s = {}, {}, 2.0
    for rid, band, started in (("a", "standard", False), ("b", "premium", False), ("c", "standard", True)):
        request = m.InferenceRequest(request_id=rid, tenant="t", model="m", prompt="P", reply_to="x", band=band,
                                     sampling=m.SamplingParams(max_new_tokens=10), deadline=1e12, created=0)
        dispatcher.flights[rid] = Flight(request=request, started=started, opened_at=0.0)
    assert len(dispatcher.unstarted_ages(("premium", "standard"))) == 2
    [age] = dispatcher.unstarted_ages(("premium",))
    assert age > 0


def test_the_oldest_request_waiting_for_a_worker() -> None:
    from services.gateway.dispatch import Dispatcher

    dispatcher = Dispatcher.__new__(Dispatcher)
    dispatcher.flights, dispatcher.live_workers, dispatcher.heartbeat_ttl_s = {}, {}, 2.0
    for rid, state, since in (("a", "held", 0.0), ("b", "queued", 5.0), ("c", "accepted", -100.0)):
        request = m.InferenceRequest(request_id=rid, tenant="t", model="m", prompt="P", reply_to="x",
                                     sampling=m.SamplingParams(max_new_tokens=10), deadline=1e12, created=0)
        dispatcher.flights[rid] = Flight(request=request, state=state, waiting_since=since)
    import time

    age = dispatcher.oldest_waiting_s(("standard",))
    assert abs(age - time.monotonic()) < 1.0  # "a", waiting since 0.0; accepted "c" does not count
    assert dispatcher.oldest_waiting_s(("premium",)) == 0.0


def watch(dispatcher: object, heartbeat_ttl_s: float, accept_timeout_s: float,
          free_slots: Callable[[], int] = lambda: 0) -> WorkerWatch:
    """A fleet watch on no bus (nothing here probes a worker)."""
    return WorkerWatch(dispatcher, None, heartbeat_ttl_s=heartbeat_ttl_s,  # type: ignore[arg-type]
                      accept_timeout_s=accept_timeout_s, liveness_timeout_s=1.0, silence_s=2.0,
                      free_slots=free_slots, worker_free_slots=lambda worker_id: None)


def test_a_request_retried_after_a_worker_failed_is_no_sign_of_overload() -> None:
    """Its wait is the failure's: counted, a dead worker's streams would shed the next requests."""
    from services.gateway.dispatch import Dispatcher

    dispatcher = Dispatcher.__new__(Dispatcher)
    dispatcher.flights, dispatcher.live_workers, dispatcher.heartbeat_ttl_s = {}, {}, 2.0
    for rid, attempt in (("first", 0), ("retried", 1)):
        request = m.InferenceRequest(request_id=rid, tenant="t", model="m", prompt="P", reply_to="x", attempt=attempt,
                                     sampling=m.SamplingParams(max_new_tokens=10), deadline=1e12, created=0)
        dispatcher.flights[rid] = Flight(request=request, state="queued", opened_at=0.0, waiting_since=0.0)
    assert len(dispatcher.unstarted_ages(("standard",))) == 1
    del dispatcher.flights["first"]
    assert dispatcher.unstarted_ages(("standard",)) == [] and dispatcher.oldest_waiting_s(("standard",)) == 0.0


async def test_a_request_queued_on_a_worker_that_is_gone_or_silent_is_no_sign_of_overload() -> None:
    """It waits for its worker to be found dead, not for capacity: counted, one stopped worker would
    shed new requests the others could take. Once found dead (or moved for not being started) it
    stays out, even queued anew; a later first token is no start-lag sample either."""
    import time

    from services.gateway.dispatch import Dispatcher
    from services.gateway.queue_window import QueueWindow

    dispatcher = Dispatcher.__new__(Dispatcher)
    dispatcher.flights, dispatcher.heartbeat_ttl_s = {}, 2.0
    dispatcher.window = QueueWindow(per_worker=2)
    dispatcher.free_slots = lambda: 0
    fleet = dispatcher.watch = watch(dispatcher, heartbeat_ttl_s=2.0, accept_timeout_s=3.0)
    dispatcher.live_workers = fleet.live_workers
    now = time.monotonic()

    def beat(worker_id: str, state: str = "ready") -> m.Heartbeat:
        return m.Heartbeat(worker_id=worker_id, model="m", engine_url="", started=0, ts=0,
                           state=state)  # type: ignore[arg-type]

    fleet.live_workers.update({"fresh": (now, beat("fresh")), "silent": (now - 1.5, beat("silent")),
                               "draining": (now, beat("draining", "draining"))})
    for worker_id in ("fresh", "silent", "draining", "gone"):
        request = m.InferenceRequest(request_id=worker_id, tenant="t", model="m", prompt="P", reply_to="x",
                                     sampling=m.SamplingParams(max_new_tokens=10), deadline=1e12, created=0)
        dispatcher.flights[worker_id] = Flight(request=request, state="queued", worker_id=worker_id,
                                               opened_at=now - 5, waiting_since=now - 5, placed_at=now - 5)
    assert len(dispatcher.unstarted_ages(("standard",))) == 1  # only the one on a ready worker heard from
    assert dispatcher.oldest_waiting_s(("standard",)) >= 5

    fleet.declare_dead(subjects.worker_key("fresh"))  # its requests go to the shared queue
    fresh = dispatcher.flights["fresh"]
    assert fresh.worker_id is None and fresh.state == "queued"
    assert dispatcher.unstarted_ages(("standard",)) == [] and dispatcher.oldest_waiting_s(("standard",)) == 0.0

    started: list[tuple[str, float]] = []
    dispatcher.on_started = lambda band, seconds: started.append((band, seconds))
    fresh.events.put_nowait(m.TokenChunk(request_id="fresh", attempt=0, seq=0, text=" a", completion_tokens=1))
    fresh.state, fresh.worker_id = "accepted", "other"
    async for _ in dispatcher.events(fresh):
        break
    assert fresh.started and started == []

    # Moved for not being started by a worker with room: out of the signals as well.
    dispatcher.live_workers["idle"] = (now, beat("idle"))
    request = m.InferenceRequest(request_id="late", tenant="t", model="m", prompt="P", reply_to="x",
                                 sampling=m.SamplingParams(max_new_tokens=10), deadline=1e12, created=0)
    late = dispatcher.flights["late"] = Flight(request=request, state="queued", worker_id="idle",
                                               opened_at=now - 4, waiting_since=now - 4, placed_at=now - 4)
    assert dispatcher.measures_load(late, now)
    fleet.move_unstarted(now)
    assert late.disrupted and not dispatcher.measures_load(late, now)


def test_a_dead_or_restarted_workers_queued_requests_move_if_no_worker_starts_them() -> None:
    """A worker killed after it took a request from its queue and before its `Accepted` arrived
    leaves nothing for the router to move: the gateway moves the request itself once the fleet has
    had time and room to start it. A worker started again under its id within its heartbeat's TTL
    is such a death too: its started streams migrate at once."""
    import time
    from types import SimpleNamespace

    dispatcher = SimpleNamespace(flights={}, recover=lambda flight, why: None)
    free = [0]
    fleet = watch(dispatcher, heartbeat_ttl_s=2.0, accept_timeout_s=3.0, free_slots=lambda: free[0])
    now = time.monotonic()

    def beat(worker_id: str, started: float) -> SimpleNamespace:
        value = m.encode(m.Heartbeat(worker_id=worker_id, model="m", engine_url="", started=started, ts=0))
        return SimpleNamespace(key=subjects.worker_key(worker_id), value=value)

    def flight_on(request_id: str, worker_id: str, state: str) -> Flight:
        request = m.InferenceRequest(request_id=request_id, tenant="t", model="m", prompt="P", reply_to="x",
                                     sampling=m.SamplingParams(max_new_tokens=10), deadline=1e12, created=0)
        dispatcher.flights[request_id] = Flight(request=request, state=state, worker_id=worker_id, placed_at=now)
        return dispatcher.flights[request_id]

    fleet.on_heartbeat(beat("w1", started=100.0))
    taken, running, elsewhere = flight_on("taken", "w1", "queued"), flight_on("running", "w1", "accepted"), \
        flight_on("elsewhere", "w2", "queued")
    shared, waiting = flight_on("shared", "", "queued"), flight_on("waiting", "", "held")
    shared.worker_id = waiting.worker_id = None
    fleet.on_heartbeat(beat("w1", started=100.0))  # the same process: nothing happens
    assert taken.worker_id == "w1" and running.events.empty()

    fleet.on_heartbeat(beat("w1", started=200.0))  # killed and started again
    assert taken.worker_id is None and taken.orphaned_at is not None and taken.disrupted
    [lost] = [running.events.get_nowait()]
    assert isinstance(lost, m.StreamError) and lost.code == "worker_lost" and lost.retryable
    assert elsewhere.worker_id == "w2" and elsewhere.orphaned_at is None
    # In the shared queue, it may be the one the old process had taken; in the fair queue, not yet out.
    assert shared.orphaned_at is not None and not shared.disrupted and waiting.orphaned_at is None

    fleet.move_unstarted(now + 3.1)  # in time, but no room anywhere: it waits
    assert taken.events.empty()
    free[0] = 2
    fleet.move_unstarted(now + 3.1)
    for orphan in (taken, shared):
        [moved] = [orphan.events.get_nowait()]
        assert isinstance(moved, m.StreamError) and moved.code == "not_started" and moved.retryable
    fleet.move_unstarted(now + 9.0)  # once per orphaning
    assert taken.events.empty() and taken.orphaned_at is None

    fleet.on_heartbeat(beat("w2", started=1.0))
    fleet.declare_dead(subjects.worker_key("w2"))  # a worker found dead: the same for its queued ones
    assert elsewhere.worker_id is None and elsewhere.orphaned_at is not None
    fleet.move_unstarted(elsewhere.orphaned_at + 3.1)
    assert elsewhere.events.get_nowait().code == "not_started"  # type: ignore[union-attr]


async def test_the_gateways_usage_reports_carry_its_name_and_a_fresh_nonce() -> None:
    """A gateway's report of what a failed request's client received is published under an id
    that names the gateway and carries a nonce: another identity that knows the request id cannot
    publish first under it and have this report dropped as a JetStream duplicate."""
    from services.gateway.dispatch import Dispatcher

    class Outbox:  # the gateway's durable outbox, as far as publish_usage uses it
        def __init__(self) -> None:
            self.added: list[tuple[str, bytes, str]] = []

        async def add(self, subject: str, data: bytes, msg_id: str) -> None:
            self.added.append((subject, data, msg_id))

    dispatcher = Dispatcher.__new__(Dispatcher)
    dispatcher.gateway_id, dispatcher.outbox = "gw-1", Outbox()
    request = m.InferenceRequest(request_id="r", tenant="t", model="m", prompt="P", reply_to="x",
                                 sampling=m.SamplingParams(max_new_tokens=10), deadline=1e12, created=0)
    flight = Flight(request=request, prompt_tokens=4, worker_id="w-1")
    await dispatcher.publish_usage(flight, "failed", "error", delivered_tokens=3)
    await dispatcher.publish_usage(flight, "failed", "error", delivered_tokens=3)
    [(subject, data, first), (_, _, second)] = dispatcher.outbox.added
    assert subject == subjects.usage_subject("t", subjects.USAGE_FROM_OWNER, "gw-1")
    assert m.decoder(m.UsageEvent).decode(data).usage.completion_tokens == 3
    key, reporter, nonce = "r", f"{subjects.USAGE_FROM_OWNER}.gw-1", first.rsplit(".", 1)[1]
    assert first == f"{key}.{reporter}.{nonce}" and len(nonce) == 24
    assert second != first and second.startswith(f"{key}.{reporter}.")  # a new event, a new nonce
