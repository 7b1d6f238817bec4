"""A prefill worker's side of prefill/decode disaggregation: it pulls no requests; decode workers
send it the prefill halves of theirs (`PrefillRequest` on `prefill_subject(self, decode)`).

It takes a half while it has a slot (its engine's max_running_requests: beyond that a prefill
waits in the engine's queue while another prefill worker may be free, so it refuses, `full`, and
the decode worker asks the next one), and a batch line's half only while it computes fewer batch
prompts than INFERBUS_WORKER_BATCH_MAX_PREFILLING (batch runs on spare capacity on this side too);
an interactive half that finds every slot taken preempts the batch half sent to its engine first
(`prefill_admission`: it is aborted and reported `preempted`, and its decode worker hands the line
back to the batch queue). It answers with its engine's bootstrap address, and sends the
request with the bootstrap trio to its engine, which computes the prompt, sends the KV to the
decode engine waiting in the room, and answers once the transfer is done. It then tells the decode
worker how the half ended (`PrefillDone`), with the cached tokens its engine reported: those are
what the request's usage bills as cached. Usage itself is the decode worker's (the request's
holder): one event per request.

Cancels reach it as every worker (the gateway's cancel subjects): a half of a cancelled request,
or of an attempt the gateway gave up, is aborted in its engine, and one that arrives after its
cancel is refused. A decode worker that gives a half up says so (`PrefillAbort`).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec
import structlog
from nats.aio.msg import Msg

from inferbus.bus.security_events import answerable
from inferbus.runtime import logs, tracing
from proto import messages as m
from proto import subjects

from .engine import EngineError
from .metrics import PREEMPTIONS, PREFILL_HALVES
from .prefill_admission import HeldHalf, admit, may_abort_victim
from .prefill_timing import prefill_ttft

if TYPE_CHECKING:
    from nats.aio.client import Client

    from .adapters import Adapters
    from .cancels import CancelMemory
    from .engine import EngineClient
    from .engine_health import EngineHealth
    from .gpu_death import GpuDeathDetector
    from .reporting import ServingStats
    from .settings import WorkerSettings
    from .tasks import Background

log = logs.get(__name__)
tracer = tracing.tracer("inferbus.worker")

_message_decoder = msgspec.msgpack.Decoder(m.PrefillMessage)

# How long an interactive half waits to be queued in its engine before its victim is aborted
# anyway (the bootstrap handshake takes milliseconds), and how often it asks the engine meanwhile.
PREEMPT_WAIT_S = 2.0
PREEMPT_POLL_S = 0.01


@dataclass
class Half:
    """A prefill half this worker runs."""

    ask: m.PrefillRequest
    decode_token: str  # the decode worker's subject token
    headers: dict[str, str] | None = None  # the request's trace context, from the decode worker
    task: asyncio.Task[None] | None = None
    aborted: bool = False
    preempted: bool = False  # a batch half aborted for an interactive one: its line goes back to the batch queue
    # When it was sent to the engine (monotonic; inf until then): the engine computes prompts in the
    # order they reach it, so the batch half sent first is the one it is computing.
    sent_at: float = math.inf
    victim: Half | None = None  # the batch half this interactive one preempts, aborted once it is queued

    @property
    def request(self) -> m.InferenceRequest:
        return self.ask.request

    @property
    def rid(self) -> str:
        return m.prefill_rid(self.ask.request, self.ask.try_no)


class Prefilling(Protocol):
    """What a prefill worker's side may touch of its worker, and what it tells it (its engine
    looks down)."""

    @property
    def settings(self) -> WorkerSettings: ...
    @property
    def engine(self) -> EngineClient: ...
    @property
    def nc(self) -> Client: ...
    @property
    def health(self) -> EngineHealth: ...
    @property
    def gpu(self) -> GpuDeathDetector: ...
    @property
    def adapters(self) -> Adapters: ...
    @property
    def cancels(self) -> CancelMemory: ...
    @property
    def stats(self) -> ServingStats: ...
    @property
    def background(self) -> Background: ...
    @property
    def load_changed(self) -> asyncio.Event: ...
    @property
    def phase(self) -> str: ...
    @property
    def draining(self) -> bool: ...

    def engine_down(self, why: str) -> None: ...


class PrefillSide:
    def __init__(self, worker: Prefilling, capacity: int, bootstrap: tuple[str, int]) -> None:
        self.worker = worker
        self.capacity = capacity
        self.bootstrap_host, self.bootstrap_port = bootstrap
        self.halves: dict[tuple[str, int], Half] = {}  # (request id, attempt) → the half running here
        self.finished = 0

    async def start(self) -> None:
        subject = subjects.prefill_subjects_to(self.worker.settings.worker_id)
        await self.worker.nc.subscribe(subject, cb=self._on_message)

    def batch_halves(self) -> int:
        """Halves of batch lines running here: filler, reported as batch (never demand to scale on)."""
        return sum(1 for h in self.halves.values() if h.request.band == "batch")

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens taken and not computed yet, less those the router expected cached here."""
        return sum(max(0, len(h.request.input_ids) + len(h.request.resumed_ids) - h.request.prefill_cached_tokens)
                   if h.request.input_ids else (h.request.prompt_tokens or 0) for h in self.halves.values())

    # ---- messages ----------------------------------------------------------------------------

    async def _on_message(self, msg: Msg) -> None:
        try:
            message = _message_decoder.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("bad_prefill_message", subject=msg.subject)
            return
        sender = subjects.prefill_sender(msg.subject)
        if isinstance(message, m.PrefillStatus):
            half = self.halves.get((message.request_id, message.attempt))
            held = half is not None and half.ask.try_no == message.try_no and half.decode_token == sender
            if answerable(msg):
                await msg.respond(m.encode(m.PrefillHeld(held=held, worker_id=self.worker.settings.worker_id)))
            return
        if isinstance(message, m.PrefillAbort):
            half = self.halves.get((message.request_id, message.attempt))
            if half is not None and half.ask.try_no == message.try_no and half.decode_token == sender:
                await self._abort(half, "decode worker gave it up")
            return
        if msg.reply and not answerable(msg):
            return  # a reply subject no decode worker owns: neither take the half nor answer
        answer = self._admit(message, sender, msg.headers)
        if msg.reply:
            await msg.respond(m.encode(answer))

    def _admit(self, ask: m.PrefillRequest, sender: str, headers: dict[str, str] | None = None) -> m.PrefillAccepted:
        worker, request = self.worker, ask.request
        me = worker.settings.worker_id
        if ask.placed:
            worker.stats.pulled_own += 1  # what routers placed here arrived (accepted or not)
        refusal, victim = "", None
        owner = subjects.reply_owner(request.reply_to)
        if worker.draining or worker.phase != "serving" or not worker.health.up:
            refusal = "draining"
        elif worker.cancels.reason(owner, request.request_id) is not None or worker.cancels.superseded(
                request.request_id, request.attempt):
            refusal = "cancelled"
        else:
            # Every slot taken: refused, unless it is interactive and a batch half gives way for it.
            # Batch prompts take chunked-prefill budget from interactive ones, here as on a decode
            # worker's engine: as many at once as a worker lets batch lines prefill.
            admission = admit(batch=request.band == "batch", capacity=self.capacity,
                              batch_max_prefilling=worker.settings.batch_max_prefilling,
                              held=[HeldHalf(key, h.request.band == "batch", h.sent_at, h.aborted or h.preempted)
                                    for key, h in self.halves.items()])
            refusal = admission.reason
            victim = next((h for key, h in self.halves.items() if key == admission.victim), None)
            if victim is not None:
                victim.preempted = True  # gives way from now on; aborted once this half is queued (_preempt)
                PREEMPTIONS.inc()
        if refusal:
            PREFILL_HALVES.labels("refused").inc()
            return m.PrefillAccepted(accepted=False, worker_id=me, reason=refusal)
        key = (request.request_id, request.attempt)
        previous = self.halves.get(key)
        if previous is not None:  # an earlier try of the same attempt the decode worker gave up
            self.worker.background.spawn(self._abort(previous, "superseded by a new try"))
        half = self.halves[key] = Half(ask, sender, headers, victim=victim)
        half.task = asyncio.ensure_future(self._run(half))
        worker.load_changed.set()
        return m.PrefillAccepted(accepted=True, worker_id=me, bootstrap_host=self.bootstrap_host,
                                 bootstrap_port=self.bootstrap_port)

    async def _run(self, half: Half) -> None:
        worker, request = self.worker, half.request
        structlog.contextvars.bind_contextvars(request_id=request.request_id, tenant=request.tenant)
        bootstrap = {"bootstrap_host": self.bootstrap_host, "bootstrap_port": self.bootstrap_port,
                     "bootstrap_room": half.ask.bootstrap_room}
        done = m.PrefillDone(request_id=request.request_id, attempt=request.attempt, try_no=half.ask.try_no,
                             worker_id=worker.settings.worker_id, ok=False)
        try:
            with tracing.span(tracer, "worker.prefill", half.headers) as headers:
                if request.adapter:
                    await worker.adapters.ensure(request.adapter)
                half.sent_at = time.monotonic()
                prompt = asyncio.ensure_future(worker.engine.prefill(request, headers, bootstrap=bootstrap,
                                                                     rid=half.rid))
                if half.victim is not None:
                    await self._preempt(half, half.victim)
                result = await prompt
            done = msgspec.structs.replace(done, ok=not half.aborted, prompt_tokens=result.prompt_tokens,
                                           cached_tokens=result.cached_tokens,
                                           code="" if not half.aborted else "preempted" if half.preempted
                                           else "prefill_aborted")
            worker.gpu.progress()
            if request.band != "batch" and request.attempt == 0 and not request.pinned:
                # The prefill pool's own TTFT (its load report's ttft_hist, role "prefill"): the
                # decode worker's first ask to the prompt's KV sent (prefill_timing). The autoscaler
                # sizes the prefill pool on it; the client's TTFT is the decode worker's (the
                # canaries' gates read only that).
                worker.stats.observe_ttft(prefill_ttft(half.ask, time.time()))
        except EngineError as error:
            if error.code == "engine_unavailable":
                worker.engine_down(str(error))
            # An engine ends an aborted prompt with an error: one preempted here is reported as such,
            # so that its decode worker hands the batch line back rather than retrying it.
            done = msgspec.structs.replace(done, code="preempted" if half.preempted else error.code, message=str(error))
        except Exception as error:  # never leave a decode worker waiting on a bug
            log.exception("prefill_half_failed")
            done = msgspec.structs.replace(done, code="internal_error", message=type(error).__name__)
        finally:
            if self.halves.get((request.request_id, request.attempt)) is half:
                del self.halves[(request.request_id, request.attempt)]
            self.finished += 1
            worker.stats.completed += 1
            if request.band == "batch":  # as a decode or aggregated worker counts its batch lines
                worker.stats.completed_batch += 1
            worker.load_changed.set()
            structlog.contextvars.unbind_contextvars("request_id", "tenant")
        PREFILL_HALVES.labels("ok" if done.ok else "preempted" if half.preempted else "aborted" if half.aborted
                              else "failed").inc()
        if not done.ok and not half.aborted:
            log.warning("prefill_half_failed", code=done.code, error=done.message)
        try:
            await worker.nc.publish(subjects.prefilled_subject_of_token(half.decode_token), m.encode(done))
        except Exception as error:  # the decode worker's own checks (our liveness) decide then
            log.warning("prefill_report_failed", error=repr(error))

    async def _preempt(self, half: Half, victim: Half) -> None:
        """Abort `victim` once `half` is queued in the engine past its bootstrap handshake
        (`may_abort_victim`), or after PREEMPT_WAIT_S whatever the engine says."""
        deadline = time.monotonic() + PREEMPT_WAIT_S
        while time.monotonic() < deadline and not victim.aborted:
            sent = sum(1 for h in self.halves.values() if h.sent_at < math.inf)
            try:
                load = await self.worker.engine.loads()
            except Exception as error:  # an engine that cannot say: abort now, as before it could
                log.warning("prefill_loads_failed", error=repr(error))
                break
            ready = load.running + load.waiting - load.bootstrapping + load.transferring
            if may_abort_victim(sent=sent, engine_ready=ready):
                break
            await asyncio.sleep(PREEMPT_POLL_S)
        await self._abort(victim, f"preempted for interactive {half.request.request_id}")

    async def _abort(self, half: Half, why: str) -> None:
        if half.aborted:
            return
        half.aborted = True
        log.info("prefill_half_aborted", request_id=half.request.request_id, why=why)
        await self.worker.engine.abort(half.rid)

    # ---- cancels -------------------------------------------------------------------------------

    async def on_cancel(self, cancel: m.Cancel, owner: str) -> None:
        """A gateway's cancel (every attempt, or the one it gave up): abort the half of it running
        here. Only the gateway holding the client may cancel its request."""
        for (request_id, attempt), half in list(self.halves.items()):
            if request_id != cancel.request_id or subjects.reply_owner(half.request.reply_to) != owner:
                continue
            if cancel.attempt < 0 or cancel.attempt == attempt:
                await self._abort(half, f"cancelled ({cancel.reason})")

    async def finish(self, timeout_s: float) -> None:
        """Drain: let the halves running here end (their decode engines wait for the KV), then abort
        what is left."""
        deadline = time.monotonic() + timeout_s
        while self.halves and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for half in list(self.halves.values()):
            await self._abort(half, "drain")
        while self.halves:
            await asyncio.sleep(0.01)
