"""A decode worker's side of prefill/decode disaggregation: it holds the request (pulled from its
queue like any request), sends its prefill half to a prefill worker, and streams the decode
engine's tokens to the gateway.

One try of an attempt's prefill (SGLang's PD protocol, as its router drives it):

1. choose a prefill worker (`prefill_choice`: the router's, else the router asked now, else one
   from the heartbeats), draw a bootstrap room, and send it the request (`PrefillRequest` on
   `prefill_subject`, request/reply). It answers with its engine's bootstrap host and port, or
   refuses (every prefill slot taken, draining): then the next prefill worker.
2. send the same request with the bootstrap trio to this worker's decode engine, which reserves
   KV, waits in the room for the prefill engine's KV and then decodes. Tokens stream to the
   gateway as on any worker; cancels abort both engines (every worker hears them).
3. the prefill worker reports how its half ended (`PrefillDone` on `prefilled_subject`): the
   prompt tokens its cache held are what the usage bills as cached.

A prefill that fails before the decode engine's first token (its engine failed or aborted, its
worker died: heartbeat gone and no answer to a liveness probe) aborts the decode engine's request
and the try starts again on another prefill worker. After the first token the KV has arrived and
the prefill side no longer matters. A decode worker that dies is the gateway's to migrate, as on
an aggregated fleet (the next attempt gets a new pair).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.kv import KeyValue

from inferbus.bus import connection as bus
from inferbus.bus import patience
from inferbus.runtime import logs
from inferbus.runtime.records import decode_or_none
from inferbus.tokens.blocks import block_hashes
from proto import messages as m
from proto import subjects

from . import prefill_choice
from .engine import EngineError, EngineUpdate
from .metrics import PREFILL_TRIES
from .prefill_choice import PrefillPeer

if TYPE_CHECKING:
    from nats.aio.client import Client

    from inferbus.bus.replies import Replies

    from .engine import EngineClient
    from .settings import WorkerSettings
    from .tasks import Background

log = logs.get(__name__)

_heartbeat_decoder = msgspec.msgpack.Decoder(m.Heartbeat)
_accepted_decoder = msgspec.msgpack.Decoder(m.PrefillAccepted)
_done_decoder = msgspec.msgpack.Decoder(m.PrefillDone)
_placement_decoder = msgspec.msgpack.Decoder(m.PlacementReply)
_liveness_decoder = msgspec.msgpack.Decoder(m.LivenessReply)
_held_decoder = msgspec.msgpack.Decoder(m.PrefillHeld)

ROUTER_TIMEOUT_S = 0.05  # a prefill placement asked of the router (the gateways' placement budget)
# A try without its KV and without a report for this long is asked about (`PrefillStatus`); one its
# prefill worker no longer holds twice in a row (its report was lost on the bus) is failed.
STATUS_EVERY_S = 2.0


@dataclass
class PrefillTry:
    """One try of an attempt's prefill half, on one prefill worker."""

    request: m.InferenceRequest
    try_no: int
    worker_id: str
    rid: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: m.PrefillDone | None = None
    failed: str = ""  # why the prefill failed (its report, or its worker's death), "" while it has not
    got_token: bool = False  # the decode engine produced a token: the KV arrived, the prefill side is done with
    started: float = field(default_factory=time.monotonic)
    not_held: int = 0  # status answers in a row saying its prefill worker no longer holds it
    room: int = field(default_factory=lambda: random.getrandbits(63))  # SGLang's router draws 63 bits likewise
    asked_at: float = 0.0  # wall time of the attempt's first ask for a prefill (any try)


class Decoding(Protocol):
    """What a decode worker's side (and its view of the prefill workers) may touch of its worker:
    the bus, the engine and its settings; nothing of the other parts."""

    @property
    def settings(self) -> WorkerSettings: ...
    @property
    def engine(self) -> EngineClient: ...
    @property
    def nc(self) -> Client: ...
    @property
    def kv(self) -> KeyValue: ...  # the workers bucket: the prefill workers' heartbeats
    @property
    def replies(self) -> Replies: ...
    @property
    def background(self) -> Background: ...


class PrefillPeers:
    """The prefill workers of this worker's model, from the `workers` bucket; a prefill worker
    whose heartbeat lapsed and that does not answer a liveness probe is dead."""

    def __init__(self, worker: Decoding) -> None:
        self.worker = worker
        self.peers: dict[str, PrefillPeer] = {}
        self.on_dead: list[Any] = []  # callables taking the dead worker's id
        self._watcher: KeyValue.KeyWatcher | None = None
        self._task: asyncio.Task[None] | None = None
        self._probing: set[str] = set()

    async def start(self) -> None:
        self._watcher = await self.worker.kv.watchall()
        self._task = asyncio.create_task(bus.follow(self._watcher, self._on_put, self._on_delete), name="prefill-peers")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._watcher is not None:
            try:
                await self._watcher.stop()
            except Exception:
                pass

    def _on_put(self, entry: KeyValue.Entry) -> None:
        beat = decode_or_none(_heartbeat_decoder, entry.value or b"", store="workers", key=entry.key)
        if beat is None:
            return
        if beat.role == "prefill" and beat.model == self.worker.settings.model:
            known = self.peers.get(beat.worker_id)
            self.peers[beat.worker_id] = PrefillPeer.of(beat)
            if known is not None and known.started and beat.started and known.started != beat.started:
                # It restarted before its heartbeat lapsed: the halves it held died with the old process.
                log.warning("prefill_worker_restarted", prefill_worker=beat.worker_id)
                for callback in self.on_dead:
                    callback(beat.worker_id)

    def _on_delete(self, key: str) -> None:
        for worker_id in [w for w in self.peers if subjects.worker_key(w) == key]:
            if worker_id not in self._probing:
                self._probing.add(worker_id)
                self.worker.background.spawn(self._verdict(worker_id))

    async def _verdict(self, worker_id: str) -> None:
        """Its heartbeat lapsed: dead unless it answers (a busy worker's heartbeat thread does)."""
        try:
            probe = m.encode(m.LivenessProbe(worker_id=worker_id))
            try:
                reply = await self.worker.replies.request(subjects.liveness_subject(worker_id), probe,
                                                          self.worker.settings.liveness_timeout_s)
                alive = _liveness_decoder.decode(reply.data).worker_id == worker_id
            except (NoRespondersError, NatsTimeoutError, msgspec.DecodeError):
                alive = False
            except Exception as error:  # the bus failed: we cannot tell; its report or its return decides
                log.warning("prefill_liveness_probe_failed", worker_id=worker_id, error=repr(error))
                return
            if alive:
                return
            self.peers.pop(worker_id, None)
            log.warning("prefill_worker_gone", prefill_worker=worker_id)
            for callback in self.on_dead:
                callback(worker_id)
        finally:
            self._probing.discard(worker_id)

    def get(self, worker_id: str) -> PrefillPeer | None:
        return self.peers.get(worker_id)


class DecodeSide:
    def __init__(self, worker: Decoding) -> None:
        self.worker = worker
        self.peers = PrefillPeers(worker)
        self.peers.on_dead.append(self._peer_dead)
        self.tries: dict[tuple[str, int], PrefillTry] = {}  # (request id, attempt) → its current try
        self.rng = random.Random()
        # A slow router is waited for, as gateways wait for it (inferbus/bus/patience.py).
        self.patience = patience.PlacementPatience(ROUTER_TIMEOUT_S, worker.settings.placement_patience_ms / 1000,
                                                   time.monotonic)

    async def start(self) -> None:
        await self.worker.nc.subscribe(subjects.prefilled_subject(self.worker.settings.worker_id), cb=self._on_done)
        await self.peers.start()
        self._status_task = asyncio.create_task(self._status_loop(), name="prefill-status")

    async def stop(self) -> None:
        self._status_task.cancel()
        await self.peers.stop()

    async def _status_loop(self) -> None:
        """Ask about tries whose KV and report are both overdue: a report lost on the bus."""
        while True:
            await asyncio.sleep(STATUS_EVERY_S)
            now = time.monotonic()
            for current in list(self.tries.values()):
                if (not current.got_token and not current.done.is_set() and not current.failed
                        and now - current.started >= STATUS_EVERY_S):
                    self.worker.background.spawn(self._ask_status(current))

    async def _ask_status(self, current: PrefillTry) -> None:
        ask = m.PrefillStatus(request_id=current.request.request_id, attempt=current.request.attempt,
                              try_no=current.try_no)
        subject = subjects.prefill_subject(current.worker_id, self.worker.settings.worker_id)
        try:
            reply = await self.worker.replies.request(subject, m.encode(ask), self.worker.settings.liveness_timeout_s)
            held = _held_decoder.decode(reply.data).held
        except Exception:  # no answer: whether it is alive is its heartbeat's to say
            return
        if held or current.got_token or current.done.is_set():
            current.not_held = 0
            return
        current.not_held += 1
        if current.not_held >= 2:  # twice, seconds apart: not a report (or the KV) still on its way
            log.warning("prefill_report_lost", prefill_worker=current.worker_id)
            self._fail(current, "its prefill worker no longer holds it and its report was lost")
            current.done.set()

    def in_flight(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for current in self.tries.values():
            counts[current.worker_id] = counts.get(current.worker_id, 0) + 1
        return counts

    # ---- events ------------------------------------------------------------------------------

    async def _on_done(self, msg: Msg) -> None:
        try:
            done = _done_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        current = self.tries.get((done.request_id, done.attempt))
        if current is None or current.try_no != done.try_no or current.worker_id != done.worker_id:
            return  # a try given up already
        current.result = done
        if not done.ok:
            self._fail(current, f"{done.code}: {done.message}")
        current.done.set()

    def _peer_dead(self, worker_id: str) -> None:
        for current in list(self.tries.values()):
            if current.worker_id == worker_id and not current.done.is_set():
                self._fail(current, "prefill worker died")
                current.done.set()

    def _fail(self, current: PrefillTry, why: str) -> None:
        """The prefill of `current` failed: abort the decode engine's request, which waits for KV
        that will not come (its stream then ends, and `stream` starts the next try)."""
        if current.failed or current.got_token:
            return  # after the first token the KV is in the decode engine: the prefill side is done with
        current.failed = why
        self.worker.background.spawn(self.worker.engine.abort(current.rid))

    # ---- one attempt -------------------------------------------------------------------------

    async def stream(self, request: m.InferenceRequest, entry: Any,
                     headers: dict[str, str]) -> AsyncIterator[EngineUpdate]:
        """The decode engine's stream for `request`, its prefill half on a prefill worker, tried
        again elsewhere when the prefill fails before the first token."""
        worker = self.worker
        avoid: set[str] = set()
        refused_full = 0
        hint = request.prefill_worker
        try_no = 0
        asked_at = time.time()  # the prefill pool's TTFT starts here (prefill_timing), whatever try takes it
        while True:
            if entry.cancelled:  # the client left while its prefill was being arranged: billed as cancelled
                yield cancelled_update()
                return
            chosen = await self._choose(request, hint, avoid)
            hint = None
            if chosen is None:
                if refused_full and time.time() < request.deadline and not entry.cancelled:
                    # Every prefill worker was full: wait a little and ask them all again.
                    avoid.clear()
                    refused_full = 0
                    await asyncio.sleep(prefill_choice.FULL_BACKOFF_S)
                    continue
                raise EngineError("no prefill worker could take the request", code="no_prefill_worker",
                                  retryable=True, status=503)
            worker_id, placed = chosen
            current = PrefillTry(request, try_no, worker_id, m.prefill_rid(request, try_no), asked_at=asked_at)
            accepted = await self._send(current, placed, headers)
            if accepted is None or not accepted.accepted:
                reason = accepted.reason if accepted is not None else "no answer"
                PREFILL_TRIES.labels(f"refused_{reason}" if accepted is not None else "no_answer").inc()
                avoid.add(worker_id)
                refused_full += reason == "full"
                # Its gateway's cancel reached the prefill worker first.
                if accepted is not None and reason == "cancelled":
                    yield cancelled_update()
                    return
                continue
            entry.prefill_worker = worker_id
            key = (request.request_id, request.attempt)
            self.tries[key] = current
            bootstrap = {"bootstrap_host": accepted.bootstrap_host, "bootstrap_port": accepted.bootstrap_port,
                         "bootstrap_room": current.room}
            got_token = False
            try:
                async for update in worker.engine.generate(request, headers, bootstrap=bootstrap, rid=current.rid):
                    if current.failed and not got_token:
                        break  # aborted for a failed prefill: this update is the abort
                    if update.text or update.token_ids or (update.finish and update.completion_tokens):
                        got_token = current.got_token = True
                    self._fill_cached(current, update)
                    yield update
                    if update.finish is not None:
                        PREFILL_TRIES.labels("ok").inc()
                        return
            except EngineError as error:
                if not current.failed or got_token:
                    self._abort_prefill(current)
                    raise
                log.warning("decode_failed_after_prefill_failure", error=str(error))
            finally:
                self.tries.pop(key, None)
                if not current.done.is_set() and not current.failed:
                    self._abort_prefill(current)
            why = current.failed or "the decode stream ended early"
            PREFILL_TRIES.labels("prefill_failed").inc()
            try_no += 1
            code = current.result.code if current.result is not None else "prefill_lost"
            batch = request.batch_id is not None
            if not prefill_choice.retry(code=code, got_first_token=got_token, cancelled=entry.cancelled, tries=try_no,
                                        now=time.time(), deadline=request.deadline, batch=batch):
                if prefill_choice.handed_back(code=code, batch=batch) and not entry.cancelled:
                    # Its prefill gave way to interactive work: the line goes back to the batch
                    # queue, as a batch line preempted on this worker does (batch_lines).
                    entry.requeue = "preempted"
                    log.info("batch_prefill_preempted", request_id=request.request_id, prefill_worker=worker_id)
                    yield EngineUpdate(finish={"type": "abort", "message": "preempted"})
                    return
                if entry.cancelled:
                    yield cancelled_update()
                    return
                if code == "invalid_request":  # the request itself was refused: the client's 400, as one engine says it
                    raise EngineError(current.result.message if current.result is not None else why,
                                      code="invalid_request", retryable=False, status=400)
                raise EngineError(f"prefill failed on {worker_id}: {why}", code="prefill_failed", retryable=True,
                                  status=503)
            log.warning("prefill_retried", prefill_worker=worker_id, why=why, try_no=try_no)
            avoid.add(worker_id)

    async def _choose(self, request: m.InferenceRequest, hint: str | None, avoid: set[str]) -> tuple[str, bool] | None:
        """(prefill worker, whether a router placed the request there) for the next try."""
        peers = self.peers
        if hint and hint not in avoid and (not peers.peers or prefill_choice.usable(peers.get(hint), request, avoid)):
            return hint, True
        asked = await self._ask_router(request, avoid)
        if asked is not None:
            return asked, True
        chosen = prefill_choice.fallback(list(peers.peers.values()), request, self.worker.settings.zone, avoid,
                                         self.in_flight(), self.rng)
        return (chosen, False) if chosen is not None else None

    async def _ask_router(self, request: m.InferenceRequest, avoid: set[str]) -> str | None:
        s = self.worker.settings
        ids = request.input_ids + request.resumed_ids
        ask = m.PlacementRequest(
            request_id=request.request_id, model=request.model, adapter=request.adapter, band=request.band,
            prompt_tokens=len(ids) if ids else (request.prompt_tokens or 0) + request.resumed_tokens,
            block_hashes=block_hashes(ids, s.block_size, namespace=request.adapter or "") if ids else [],
            block_size=s.block_size if ids else 0, release=request.release, pinned=request.release_pinned,
            zone=s.zone, role="prefill", avoid=sorted(avoid),
        )
        try:
            reply = await patience.ask(self.worker.replies, subjects.placement_subject(request.model), m.encode(ask),
                                       self.patience)
            if reply is None:
                return None
            placement = _placement_decoder.decode(reply.data)
        except msgspec.DecodeError:
            return None
        except Exception as error:
            log.warning("prefill_placement_failed", error=repr(error))
            return None
        worker_id = placement.worker_id
        if worker_id is None or worker_id in avoid:
            return None
        return worker_id

    async def _send(self, current: PrefillTry, placed: bool, headers: dict[str, str]) -> m.PrefillAccepted | None:
        """The half to its prefill worker, with the request's trace context in the NATS headers."""
        s = self.worker.settings
        ask = m.PrefillRequest(request=current.request.on_wire(), bootstrap_room=current.room,
                               try_no=current.try_no, placed=placed, asked_at=current.asked_at)
        try:
            reply = await self.worker.replies.request(subjects.prefill_subject(current.worker_id, s.worker_id),
                                                      m.encode(ask), s.liveness_timeout_s, headers=headers or None)
            return _accepted_decoder.decode(reply.data)
        except (NoRespondersError, NatsTimeoutError, msgspec.DecodeError):
            # It may have taken it: tell it to drop it, whatever it did.
            self._abort_prefill(current)
            return None

    def _abort_prefill(self, current: PrefillTry) -> None:
        abort = m.PrefillAbort(request_id=current.request.request_id, attempt=current.request.attempt,
                               try_no=current.try_no)
        subject = subjects.prefill_subject(current.worker_id, self.worker.settings.worker_id)
        self.worker.background.spawn(self._publish(subject, m.encode(abort)))

    async def _publish(self, subject: str, data: bytes) -> None:
        try:
            await self.worker.nc.publish(subject, data)
        except Exception as error:
            log.warning("prefill_abort_failed", error=repr(error))

    @staticmethod
    def _fill_cached(current: PrefillTry, update: EngineUpdate) -> None:
        """The usage's cached tokens are the prefill engine's. SGLang's decode engine reports them
        already (they travel with the KV); the prefill worker's report, sent as the transfer ends,
        says the same and wins where both are known."""
        result = current.result
        if result is not None and result.ok and result.prompt_tokens:
            update.cached_tokens = result.cached_tokens


def cancelled_update() -> EngineUpdate:
    """How a request cancelled before its decode engine produced anything ends: as the engine's own
    abort does (usage `cancelled`, nothing generated)."""
    return EngineUpdate(finish={"type": "abort", "message": "cancelled"})
