"""A decode worker's side of a disaggregated request (services/worker/decode_side.py) on a real
nats-server: stand-in prefill workers answer on the bus, a stand-in decode engine streams. What it
must do with them: wait out a full prefill pool, try a failed prefill on another worker before the
first token, and bill the cached tokens the prefill worker reports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from inferbus.bus import connection as bus
from inferbus.bus.replies import Replies
from proto import messages as m
from proto import subjects
from services.worker.decode_side import DecodeSide
from services.worker.engine import EngineUpdate
from services.worker.tasks import Background

from .waiting import await_for

pytestmark = pytest.mark.slow

COLLECT_S = 60  # a bound on a stream that ends in well under a second when the machine is not busy

MODEL = "m"


@dataclass
class Settings:
    worker_id: str = "d1"
    model: str = MODEL
    zone: str = ""
    block_size: int = 64
    liveness_timeout_s: float = 0.5
    placement_patience_ms: float = 2000.0


class Engine:
    """A decode engine: a request's tokens come once its room's KV has "landed" (`land`), an abort
    ends it as SGLang's does."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []  # (rid, bootstrap)
        self.landed: dict[str, asyncio.Event] = {}
        self.aborted: set[str] = set()

    async def generate(self, request: m.InferenceRequest, headers: dict[str, str], *, bootstrap: dict[str, Any],
                       rid: str) -> AsyncIterator[EngineUpdate]:
        self.requests.append((rid, bootstrap))
        event = self.landed.setdefault(rid, asyncio.Event())
        await event.wait()
        if rid in self.aborted:
            yield EngineUpdate(finish={"type": "abort"})
            return
        yield EngineUpdate(text="hi", token_ids=[1], completion_tokens=1, prompt_tokens=len(request.input_ids),
                           cached_tokens=0)
        yield EngineUpdate(text="!", token_ids=[2], completion_tokens=2, finish={"type": "length"})

    async def abort(self, rid: str) -> None:
        for known, event in self.landed.items():
            if known.startswith(rid):
                self.aborted.add(known)
                event.set()


@dataclass
class Worker:
    nc: Client
    replies: Replies
    kv: Any
    engine: Engine = field(default_factory=Engine)
    settings: Settings = field(default_factory=Settings)
    background: Background = field(default_factory=Background)


@dataclass
class Entry:
    cancelled: bool = False
    prefill_worker: str | None = None
    requeue: str | None = None


class PrefillWorker:
    """A stand-in prefill worker: answers each half with `answers` in turn (then accepts), and
    reports each accepted half as `report` says, after landing its KV in the decode engine."""

    def __init__(self, nc: Client, worker_id: str, engine: Engine, answers: list[str], report: str = "ok") -> None:
        self.nc, self.worker_id, self.engine = nc, worker_id, engine
        self.answers, self.report = list(answers), report
        self.asked: list[m.PrefillMessage] = []

    async def start(self) -> None:
        await self.nc.subscribe(subjects.prefill_subjects_to(self.worker_id), cb=self._on)
        beat = m.Heartbeat(worker_id=self.worker_id, model=MODEL, engine_url="", started=time.time(), ts=time.time(),
                           role="prefill", max_running=8)
        await (await bus.workers_bucket(self.nc.jetstream(), 30)).put(
            subjects.worker_key(self.worker_id), m.encode(beat)
        )

    async def _on(self, msg: Msg) -> None:
        ask = msgspec.msgpack.decode(msg.data, type=m.PrefillMessage)
        self.asked.append(ask)
        if isinstance(ask, m.PrefillStatus) and self.report == "lost":  # it ended; its report never arrived
            await msg.respond(m.encode(m.PrefillHeld(held=False, worker_id=self.worker_id)))
            return
        if not isinstance(ask, m.PrefillRequest):
            return
        answer = self.answers.pop(0) if self.answers else "accept"
        if answer != "accept":
            await msg.respond(m.encode(m.PrefillAccepted(accepted=False, worker_id=self.worker_id, reason=answer)))
            return
        await msg.respond(m.encode(m.PrefillAccepted(accepted=True, worker_id=self.worker_id, bootstrap_host="h",
                                                     bootstrap_port=1)))
        if self.report in ("never", "lost"):  # it dies holding the half, or its report is lost: no KV
            return
        await asyncio.sleep(0.05)
        ok = self.report == "ok"
        done = m.PrefillDone(request_id=ask.request.request_id, attempt=ask.request.attempt, try_no=ask.try_no,
                             worker_id=self.worker_id, ok=ok, prompt_tokens=len(ask.request.input_ids),
                             cached_tokens=128 if ok else 0,
                             code="" if ok else "invalid_request" if self.report == "refused"
                             else "preempted" if self.report == "preempted" else "prefill_aborted",
                             message="Invalid grammar request: backreference" if self.report == "refused" else "")
        await self.nc.publish(subjects.prefilled_subject(subjects.prefill_sender(msg.subject)), m.encode(done))
        await self.nc.flush()
        await asyncio.sleep(0.05)  # the report first: this stand-in's decode engine reports no cached tokens
        if ok:
            self.engine.landed.setdefault(m.prefill_rid(ask.request, ask.try_no), asyncio.Event()).set()


async def knows(side: DecodeSide, *workers: str) -> None:
    """Wait until the prefill workers' heartbeats have reached the decode side's view."""
    await await_for(lambda: set(workers) <= set(side.peers.peers), 30, interval=0.01,
                    what=f"the decode side knows {workers}")


def request(**fields: Any) -> m.InferenceRequest:
    base: dict[str, Any] = dict(request_id="r1", tenant="t", model=MODEL, prompt="", reply_to="inferbus.tok.g",
                                deadline=time.time() + 30, created=time.time(), input_ids=list(range(300)),
                                sampling=m.SamplingParams(max_new_tokens=2), prompt_tokens=300)
    base.update(fields)
    return m.InferenceRequest(**base)


async def decode_side(nc: Client) -> tuple[DecodeSide, Worker]:
    replies = Replies(nc)
    await replies.start()
    worker = Worker(nc, replies, await bus.workers_bucket(nc.jetstream(), 30))
    side = DecodeSide(worker)  # type: ignore[arg-type]
    await side.start()
    return side, worker


async def collect(side: DecodeSide, req: m.InferenceRequest, entry: Entry) -> list[EngineUpdate]:
    return [update async for update in side.stream(req, entry, {})]


@pytest.mark.asyncio
async def test_a_full_prefill_pool_is_waited_out_and_the_prefill_workers_cached_tokens_are_billed(nc: Client) -> None:
    side, worker = await decode_side(nc)
    prefill = PrefillWorker(nc, "p1", worker.engine, answers=["full", "full"])
    await prefill.start()
    started = time.monotonic()
    accepted_at = time.time() - 5  # the gateway took it 5 s before this decode worker did
    updates = await asyncio.wait_for(collect(side, request(prefill_worker="p1", created=accepted_at), Entry()),
                                     COLLECT_S)
    assert "".join(u.text for u in updates) == "hi!" and updates[-1].finish == {"type": "length"}
    assert len(prefill.asked) == 3 and time.monotonic() - started >= 0.2  # two 100 ms waits
    # Every ask of the attempt says when the first was made: the prefill pool's TTFT starts there,
    # refusals included (a full prefill pool's wait is its own), not at the gateway's accept.
    asked_at = {a.asked_at for a in prefill.asked}  # type: ignore[union-attr]
    assert len(asked_at) == 1 and accepted_at + 4 < asked_at.pop() <= time.time() - 0.2
    [(rid, bootstrap)] = worker.engine.requests  # the decode engine got the request once, with the room
    assert rid == "r1-00" and bootstrap["bootstrap_room"] == prefill.asked[-1].bootstrap_room  # type: ignore[union-attr]
    assert (bootstrap["bootstrap_host"], bootstrap["bootstrap_port"]) == ("h", 1)
    assert updates[-1].cached_tokens == 128  # what the prefill worker's engine held
    await side.stop()


@pytest.mark.asyncio
async def test_a_prefill_that_fails_before_the_first_token_is_tried_on_another_worker(nc: Client) -> None:
    side, worker = await decode_side(nc)
    failing = PrefillWorker(nc, "p1", worker.engine, answers=[], report="failed")
    healthy = PrefillWorker(nc, "p2", worker.engine, answers=[])
    await failing.start()
    await healthy.start()
    await knows(side, "p1", "p2")
    updates = await asyncio.wait_for(collect(side, request(prefill_worker="p1"), Entry()), COLLECT_S)
    assert "".join(u.text for u in updates) == "hi!"  # nothing of the failed try reached the client
    assert [rid for rid, _ in worker.engine.requests] == ["r1-00", "r1-00.1"]  # a new rid and room for the retry
    assert "r1-00" in worker.engine.aborted  # the decode engine's wait for the lost KV was aborted
    assert [type(a) for a in healthy.asked] == [m.PrefillRequest] and healthy.asked[0].try_no == 1  # type: ignore[union-attr]
    await side.stop()


@pytest.mark.asyncio
async def test_a_prefill_engine_refusing_the_request_is_the_clients_400_and_not_tried_again(nc: Client) -> None:
    """A refusal of the request itself (a schema no grammar compiles) would be refused everywhere:
    no second prefill worker is asked and the client gets the engine's 400, never a 5xx."""
    from services.worker.engine import EngineError

    side, worker = await decode_side(nc)
    refusing = PrefillWorker(nc, "p1", worker.engine, answers=[], report="refused")
    healthy = PrefillWorker(nc, "p2", worker.engine, answers=[])
    await refusing.start()
    await healthy.start()
    await knows(side, "p1", "p2")
    with pytest.raises(EngineError) as raised:
        await asyncio.wait_for(collect(side, request(prefill_worker="p1"), Entry()), COLLECT_S)
    assert (raised.value.status, raised.value.code, raised.value.retryable) == (400, "invalid_request", False)
    assert "grammar" in str(raised.value)
    assert healthy.asked == []
    await side.stop()


@pytest.mark.asyncio
async def test_a_request_cancelled_while_its_prefill_is_arranged_ends_as_an_abort(nc: Client) -> None:
    side, worker = await decode_side(nc)
    prefill = PrefillWorker(nc, "p1", worker.engine, answers=["cancelled"])
    await prefill.start()
    updates = await asyncio.wait_for(collect(side, request(prefill_worker="p1"), Entry()), COLLECT_S)
    assert [u.finish for u in updates] == [{"type": "abort", "message": "cancelled"}]  # billed as cancelled, once
    assert worker.engine.requests == []
    await side.stop()


@pytest.mark.asyncio
async def test_a_prefill_worker_that_restarted_before_its_heartbeat_lapsed_loses_its_halves(nc: Client) -> None:
    """Its new process puts its heartbeat under the same key before the old one expired, so no
    delete marker comes: the new start time says the halves it held are gone."""
    side, worker = await decode_side(nc)
    silent = PrefillWorker(nc, "p1", worker.engine, answers=[], report="never")  # takes the half, then "dies"
    healthy = PrefillWorker(nc, "p2", worker.engine, answers=[])
    await silent.start()
    await healthy.start()
    await knows(side, "p1", "p2")
    task = asyncio.ensure_future(collect(side, request(prefill_worker="p1"), Entry()))
    deadline = time.monotonic() + 5
    while not worker.engine.requests:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    beat = m.Heartbeat(worker_id="p1", model=MODEL, engine_url="", started=time.time() + 1, ts=time.time(),
                       role="prefill", max_running=8)
    await (await bus.workers_bucket(nc.jetstream(), 30)).put(subjects.worker_key("p1"), m.encode(beat))
    updates = await asyncio.wait_for(task, COLLECT_S)
    assert "".join(u.text for u in updates) == "hi!"
    assert [rid for rid, _ in worker.engine.requests] == ["r1-00", "r1-00.1"] and len(healthy.asked) == 1
    await side.stop()


@pytest.mark.asyncio
async def test_a_lost_prefill_report_is_found_out_by_asking_and_the_half_tried_elsewhere(
        nc: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    import services.worker.decode_side as decode_side_module

    monkeypatch.setattr(decode_side_module, "STATUS_EVERY_S", 0.2)
    side, worker = await decode_side(nc)
    lost = PrefillWorker(nc, "p1", worker.engine, answers=[], report="lost")
    healthy = PrefillWorker(nc, "p2", worker.engine, answers=[])
    await lost.start()
    await healthy.start()
    await knows(side, "p1", "p2")
    updates = await asyncio.wait_for(collect(side, request(prefill_worker="p1"), Entry()), COLLECT_S)
    assert "".join(u.text for u in updates) == "hi!"
    assert [rid for rid, _ in worker.engine.requests] == ["r1-00", "r1-00.1"]
    asked = [type(a) for a in lost.asked]
    assert asked[0] is m.PrefillRequest and asked.count(m.PrefillStatus) >= 2  # asked twice before giving up
    await side.stop()


@pytest.mark.asyncio
async def test_a_slow_router_is_waited_for_once_it_is_known_to_answer(nc: Client) -> None:
    """The router answers prefill placements, but 300 ms late: the first question (the router not
    yet heard from) gives up after 50 ms and the worker chooses itself; its late answer shows the
    router answers, and the next question waits for it and takes the router's choice."""
    side, worker = await decode_side(nc)
    prefill = PrefillWorker(nc, "p1", worker.engine, answers=[])
    await prefill.start()

    async def slow_router(msg: Msg) -> None:
        await asyncio.sleep(0.3)
        await msg.respond(m.encode(m.PlacementReply(target=subjects.worker_target("p1"), worker_id="p1")))

    await nc.subscribe(subjects.placement_wildcard(), cb=slow_router)
    await knows(side, "p1")
    await asyncio.wait_for(collect(side, request(request_id="r1"), Entry()), COLLECT_S)
    first = [a for a in prefill.asked if isinstance(a, m.PrefillRequest)][-1]
    assert not first.placed  # chosen by the worker: the router's answer came too late
    deadline = time.monotonic() + 5
    while not side.patience.answering() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.wait_for(collect(side, request(request_id="r2"), Entry()), COLLECT_S)
    second = [a for a in prefill.asked if isinstance(a, m.PrefillRequest)][-1]
    assert second.request.request_id == "r2" and second.placed  # the router's choice, waited for
    await side.stop()


@pytest.mark.asyncio
async def test_a_batch_line_whose_prefill_gave_way_goes_back_to_the_batch_queue(nc: Client) -> None:
    # Its prefill worker preempted the half for an interactive prompt: the line is handed back as a
    # preempted line (its attempt ends with an abort, `requeue` "preempted": batch_lines requeues
    # it), not tried at once on another prefill worker.
    side, worker = await decode_side(nc)
    busy = PrefillWorker(nc, "p1", worker.engine, answers=[], report="preempted")
    spare = PrefillWorker(nc, "p2", worker.engine, answers=[])
    await busy.start()
    await spare.start()
    await asyncio.sleep(0.3)  # the heartbeats reach the decode side's view
    entry = Entry()
    line = request(prefill_worker="p1", batch_id="b1", band="batch")
    updates = await asyncio.wait_for(collect(side, line, entry), 10)
    assert updates[-1].finish is not None and updates[-1].finish["type"] == "abort" and not updates[-1].text
    assert entry.requeue == "preempted"
    assert "r1-00" in worker.engine.aborted  # the decode engine's wait for the KV was aborted
    assert spare.asked == []
    # An interactive request whose half failed the same way is tried elsewhere.
    interactive = await asyncio.wait_for(collect(side, request(request_id="r2", prefill_worker="p1"), Entry()), 10)
    assert "".join(u.text for u in interactive) == "hi!" and [type(a) for a in spare.asked] == [m.PrefillRequest]
    await side.stop()
