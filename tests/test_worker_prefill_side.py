"""A prefill worker's side of a disaggregated request (services/worker/prefill_side.py) on a real
nats-server: a stand-in decode worker sends it prefill halves over the bus, a stand-in prefill
engine holds each prompt until released or aborted. An interactive half on a full worker takes
the slot of the batch half sent to its engine first, whose decode worker hears `preempted` (and hands the line
back to the batch queue, test_worker_decode_side.py); batch halves never preempt. The batch half is
aborted only once the interactive prompt is past its bootstrap handshake in the engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client

from inferbus.bus.replies import Replies
from proto import messages as m
from proto import subjects
from services.worker.engine import EngineError, EngineLoad, PrefillResult
from services.worker.prefill_side import PrefillSide
from services.worker.reporting import ServingStats
from services.worker.tasks import Background

pytestmark = pytest.mark.slow


@dataclass
class Settings:
    worker_id: str = "p1"
    batch_max_prefilling: int = 2


class Engine:
    """A prefill engine: a prompt ends when the test releases it, or aborted, with the error the
    simulated engine (as SGLang) ends an aborted prompt with. Its load counts the prompts it holds,
    those in `bootstrapping` as waiting for their decode engine's handshake."""

    def __init__(self) -> None:
        self.held: dict[str, asyncio.Event] = {}
        self.aborted: list[str] = []
        self.bootstrapping: set[str] = set()

    async def loads(self) -> EngineLoad:
        live = {rid for rid, done in self.held.items() if not done.is_set()}
        return EngineLoad(waiting=len(live), bootstrapping=len(live & self.bootstrapping))

    async def prefill(self, request: m.InferenceRequest, headers: dict[str, str], *, bootstrap: dict[str, Any],
                      rid: str) -> PrefillResult:
        await self.held.setdefault(rid, asyncio.Event()).wait()
        if rid in self.aborted:
            raise EngineError("Abort by abort_request.", code="prefill_aborted", status=500)
        return PrefillResult(prompt_tokens=10, cached_tokens=0)

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        self.held.setdefault(rid, asyncio.Event()).set()


class Cancels:
    def reason(self, owner: str, request_id: str) -> str | None:
        return None

    def superseded(self, request_id: str, attempt: int) -> bool:
        return False


class Up:
    up = True

    def progress(self) -> None:
        pass


@dataclass
class Worker:
    nc: Client
    engine: Engine = field(default_factory=Engine)
    settings: Settings = field(default_factory=Settings)
    stats: ServingStats = field(default_factory=ServingStats)
    cancels: Cancels = field(default_factory=Cancels)
    health: Up = field(default_factory=Up)
    gpu: Up = field(default_factory=Up)
    background: Background = field(default_factory=Background)
    load_changed: asyncio.Event = field(default_factory=asyncio.Event)
    draining: bool = False
    phase: str = "serving"


def half(request_id: str, band: str) -> m.PrefillRequest:
    request = m.InferenceRequest(request_id=request_id, tenant="t", model="m", prompt="", reply_to="inferbus.tok.g",
                                 deadline=time.time() + 30, created=time.time(), input_ids=list(range(10)),
                                 sampling=m.SamplingParams(max_new_tokens=2), band=band,
                                 batch_id="b" if band == "batch" else None)
    return m.PrefillRequest(request=request, bootstrap_room=hash(request_id) & 0xFFFF)


Send = Callable[[m.PrefillRequest], Awaitable[m.PrefillAccepted]]


async def prefill_worker(nc: Client, capacity: int) -> tuple[Worker, PrefillSide, Send]:
    """A prefill side (worker p1) on the bus, and how decode worker d1 sends it a half."""
    worker = Worker(nc)
    side = PrefillSide(worker, capacity=capacity, bootstrap=("h", 1))  # type: ignore[arg-type]
    await side.start()
    replies = Replies(nc)
    await replies.start()

    async def send(ask: m.PrefillRequest) -> m.PrefillAccepted:
        reply = await replies.request(subjects.prefill_subject("p1", "d1"), m.encode(ask), 2.0)
        return msgspec.msgpack.decode(reply.data, type=m.PrefillAccepted)

    return worker, side, send


@pytest.mark.asyncio
async def test_an_interactive_half_on_a_full_prefill_worker_preempts_the_batch_half_taken_first(nc: Client) -> None:
    worker, side, send = await prefill_worker(nc, capacity=3)
    reports: list[m.PrefillDone] = []

    async def on_report(msg: Any) -> None:
        reports.append(msgspec.msgpack.decode(msg.data, type=m.PrefillDone))

    await nc.subscribe(subjects.prefilled_subject("d1"), cb=on_report)

    for request_id, band in (("b1", "batch"), ("i1", "standard"), ("b2", "batch")):
        assert (await send(half(request_id, band))).accepted
        await asyncio.sleep(0.01)  # taken one after another: b1 first (the one its engine computes)
    assert not (await send(half("b3", "batch"))).accepted  # full: a batch half preempts nothing
    taken = await send(half("i2", "standard"))
    assert taken.accepted and taken.bootstrap_host == "h"
    deadline = time.monotonic() + 5
    while not reports and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert worker.engine.aborted == [m.prefill_rid(half("b1", "batch").request, 0)]
    [report] = reports
    assert (report.request_id, report.ok, report.code) == ("b1", False, "preempted")
    # b1's slot went to i2: a third interactive half now preempts b2, the last batch half here.
    assert (await send(half("i3", "standard"))).accepted
    deadline = time.monotonic() + 5
    while len(reports) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert [(r.request_id, r.code) for r in reports] == [("b1", "preempted"), ("b2", "preempted")]
    # Only interactive halves left, every slot taken: the next interactive half is refused.
    refused = await send(half("i4", "standard"))
    assert not refused.accepted and refused.reason == "full"
    for event in worker.engine.held.values():
        event.set()
    while side.halves:
        await asyncio.sleep(0.02)
    assert {r.request_id for r in reports if r.ok} == {"i1", "i2", "i3"}


@pytest.mark.asyncio
async def test_the_batch_half_is_aborted_once_the_interactive_prompt_is_past_its_handshake(nc: Client) -> None:
    # An engine that drops its chunked prompt starts the next one waiting at once: aborted while
    # the interactive prompt still waits for its decode engine's handshake, the batch half would
    # hand the engine to the next batch prompt, not to the interactive one.
    worker, side, send = await prefill_worker(nc, capacity=2)
    for request_id in ("b1", "b2"):
        assert (await send(half(request_id, "batch"))).accepted
        await asyncio.sleep(0.01)
    interactive = half("i1", "standard")
    worker.engine.bootstrapping.add(m.prefill_rid(interactive.request, 0))
    assert (await send(interactive)).accepted
    await asyncio.sleep(0.3)
    assert worker.engine.aborted == []  # its prompt still waits for the handshake
    worker.engine.bootstrapping.clear()
    deadline = time.monotonic() + 2
    while not worker.engine.aborted and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert worker.engine.aborted == [m.prefill_rid(half("b1", "batch").request, 0)]
    for event in worker.engine.held.values():
        event.set()
    while side.halves:
        await asyncio.sleep(0.02)
