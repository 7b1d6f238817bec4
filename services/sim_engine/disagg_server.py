"""The simulated engine's prefill/decode shell: SGLang 0.5.23's PD mode over the pure rooms of
`disagg.py` (docs/sim-engine.md, "Prefill/decode disaggregation").

- A prefill engine serves SGLang's bootstrap server (`bootstrap.py`) and binds a ZMQ PULL socket,
  its *rank endpoint*, which the bootstrap server hands to decode engines.
- A decode engine fetches the prefill's layout and rank endpoint from the bootstrap server,
  reserves KV, then sends `DEST` (where the KV goes) to the prefill rank; the prefill computes the
  prompt, queues each chunk's KV on its link (virtual time, `disagg.LinkQueue`), and once the last
  byte has landed answers its own client and sends `DONE` (the first token, the cached tokens) to
  the decode rank, which starts decoding. `ABORT` goes from decode to prefill, as in SGLang.
- The decode engine polls each prefill's `/health` (SGLang's heartbeat) and fails the rooms of one
  that stopped answering; both sides expire rooms by SGLang's timeouts.

The messages between the two engines are the simulator's own (`pd_wire.py`); what either role
reports beyond the aggregated engine is `pd_reports.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import msgspec
import zmq
import zmq.asyncio
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from inferbus.timing import LLAMA_70B, PRECISIONS, StepTimeModel, kv_link

from . import pd_reports, pd_wire
from .bootstrap import BootstrapServer, fetch_prefill_endpoint, local_ip
from .config import EngineConfig
from .disagg import (
    ABORTED,
    FAKE,
    FAKE_BOOTSTRAP_HOST,
    HANDSHAKE_RETRY_S,
    Bootstrap,
    DecodeRoom,
    DecodeRooms,
    KVPoll,
    LinkQueue,
    PrefillRoom,
    PrefillRooms,
    Timeouts,
    abort_reason,
    decode_failure,
    missing_room,
    preallocation_fits,
    prefill_failure,
)
from .metrics import PdMetrics
from .request import Request, RequestRejected, RequestUpdate
from .server import SimEngineServer
from .streams import Stream

logger = logging.getLogger("inferbus.sim_engine.disagg")

MAINTENANCE_INTERVAL_S = 0.25  # how often timeouts are checked
HEARTBEAT_TIMEOUT_S = 3.0  # SGLang's heartbeat request timeout (connect 2 s, read 3 s)
HANDSHAKE_TIMEOUT_S = 5.0


class DisaggEngineServer(SimEngineServer):
    """The simulated engine as one role of a prefill/decode pair."""

    def __init__(self, config: EngineConfig, step_model: StepTimeModel | None = None) -> None:
        super().__init__(config, step_model)
        self.mode = config.disaggregation_mode
        self.fake = config.disaggregation_transfer_backend == "fake"
        self.timeouts = Timeouts.from_env()
        model = replace(
            LLAMA_70B, kv_bytes_per_element=PRECISIONS["fp8" if config.kv_cache_dtype == "fp8_e4m3" else "bf16"]
        )
        link = kv_link(config.kv_transfer_link, config.kv_transfer_bandwidth_gb_s)
        self.prefill_rooms = PrefillRooms(self.timeouts, LinkQueue(link, config.tp, model))
        self.decode_rooms = DecodeRooms(self.timeouts)
        self._rooms: dict[str, int] = {}  # rid → room, for requests of this role still in a room
        self._rids: dict[int, str] = {}  # room → rid
        self._held_updates: dict[int, RequestUpdate] = {}  # prefill: finished, waiting for the KV to land
        self._held_blocks: dict[int, list[int]] = {}  # prefill: cache blocks locked during the transfer
        self._landing: dict[int, asyncio.TimerHandle] = {}
        self._fake_rooms = 0
        self._zmq: zmq.asyncio.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._pushes: dict[str, zmq.asyncio.Socket] = {}
        self.endpoint = ""  # this rank's ZMQ endpoint
        self.bootstrap_server: BootstrapServer | None = None
        self._http: httpx.AsyncClient | None = None
        self._handshaking: dict[str, asyncio.Task[None]] = {}  # bootstrap addr → its handshake
        self._preallocating = False
        self._tasks: list[asyncio.Task[None]] = []
        self.pd_metrics = PdMetrics(self.metrics.registry, config.model)

    # ------------------------------------------------------------------ lifecycle

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        config = self.config
        self._zmq = zmq.asyncio.Context()
        self._pull = self._zmq.socket(zmq.PULL)
        ip = local_ip(config.host)
        port = self._pull.bind_to_random_port(f"tcp://{ip}")
        self.endpoint = f"tcp://{ip}:{port}"
        if self.mode == "prefill":
            self.bootstrap_server = BootstrapServer(config.host, config.disaggregation_bootstrap_port,
                                                   pd_reports.prefill_layout(config))
            self.bootstrap_server.register({"attn_dp_rank": 0, "attn_cp_rank": 0, "attn_tp_rank": 0, "pp_rank": 0,
                                            "rank_ip": ip, "rank_port": port})
        else:
            self._http = httpx.AsyncClient(timeout=HANDSHAKE_TIMEOUT_S)
        self._tasks = [asyncio.create_task(self._receive(), name="pd-receive"),
                       asyncio.create_task(self._maintain(), name="pd-timeouts")]
        if self.mode == "decode":
            self._tasks.append(asyncio.create_task(self._heartbeats(), name="pd-heartbeats"))
        try:
            async with super()._lifespan(app):
                yield
        finally:
            tasks = [*self._tasks, *self._handshaking.values()]
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for timer in self._landing.values():
                timer.cancel()
            if self._http is not None:
                await self._http.aclose()
            if self.bootstrap_server is not None:
                self.bootstrap_server.close()
            for sock in [self._pull, *self._pushes.values()]:
                if sock is not None:
                    sock.close(linger=0)
            self._zmq.term()

    # ------------------------------------------------------------------ requests

    def submit(self, request: Request, stream_interval: int, internal: bool = False,
                bootstrap: Bootstrap | None = None) -> Stream:
        if internal:  # health checks: SGLang sends them with its fake bootstrap host, no peer involved
            return super().submit(request, stream_interval, internal)
        if (bootstrap is None and self.fake) or (bootstrap is not None and bootstrap.host == FAKE_BOOTSTRAP_HOST):
            # No peer: SGLang's fake sender or receiver. Its room numbers may repeat (SGLang's
            # warm-up sends 0), so the simulator keys these by a number of its own.
            self._fake_rooms += 1
            bootstrap = Bootstrap(FAKE_BOOTSTRAP_HOST, None, -self._fake_rooms)
        if bootstrap is None:
            return self._refused(request, stream_interval, missing_room(request.rid))
        if request.rid in self._streams:
            raise RequestRejected("Duplicate request ID detected")
        if self.mode == "prefill":
            # SGLang's prefill computes the prompt and samples one token.
            request.sampling = msgspec.structs.replace(request.sampling, max_new_tokens=1, min_new_tokens=0)
        self.catch_up()
        self.engine.add(request, held=True)
        stream = Stream(time.monotonic(), stream_interval, False)
        self._streams[request.rid] = stream
        self.metrics.prompt_tokens.inc(len(request.input_ids))
        now = time.monotonic()
        if self.mode == "prefill":
            self._open_prefill(request, bootstrap.room, now)
        else:
            self._open_decode(request, bootstrap, now)
        return stream

    def _refused(self, request: Request, stream_interval: int, message: str) -> Stream:
        """A request SGLang's scheduler refuses after accepting it: one abort with status 400."""
        stream = Stream(time.monotonic(), stream_interval, False)
        request.finish_reason = abort_reason(message, 400)
        stream.queue.put_nowait(RequestUpdate(request, "", 0, request.finish_reason))
        return stream

    def _track(self, rid: str, room: int) -> None:
        self._rooms[rid] = room
        self._rids[room] = rid

    def _untrack(self, room: int) -> None:
        rid = self._rids.pop(room, None)
        if rid is not None:
            self._rooms.pop(rid, None)

    def _fail_held(self, rid: str, message: str) -> None:
        """End a request this engine holds (not scheduled yet, or finished and waiting for its
        transfer) with SGLang's 500 abort."""
        reason = abort_reason(message, 500)
        request = self.engine.get(rid)
        if request is not None:
            self.engine.abort(rid, message, exact=True)
            request.finish_reason = reason
            self._deliver([RequestUpdate(request, request.text, len(request.output_ids), reason)])
            return
        for room, update in list(self._held_updates.items()):
            if update.request.rid == rid:
                del self._held_updates[room]
                update.request.finish_reason = reason
                self._deliver([RequestUpdate(update.request, update.text, update.num_output_tokens, reason)])

    # ------------------------------------------------------------------ prefill role

    def _open_prefill(self, request: Request, room: int, now: float) -> None:
        state = self.prefill_rooms.open(room, request.rid, now)
        if room < 0:  # SGLang's fake host: no decode side to wait for
            self.prefill_rooms.destination(room, FAKE, 0, now, self.config.tp)
        if state.status == KVPoll.FAILED:
            self._fail_held(request.rid, prefill_failure("bootstrap", request.rid, room, state.failure))
            return
        self._track(request.rid, room)
        if state.status == KVPoll.WAITING_FOR_INPUT:
            self._release(request.rid)

    def _release(self, rid: str) -> None:
        self.catch_up()
        self.engine.release(rid)
        self._wake.set()

    def _stepped(self) -> None:
        if self.mode != "prefill":
            return
        now = self.engine.now
        for room, state in self.prefill_rooms.rooms.items():
            if state.status != KVPoll.WAITING_FOR_INPUT:
                continue
            request = self.engine.get(state.rid)
            if request is not None:
                self.prefill_rooms.computed(room, min(request.computed, len(request.input_ids)), now)

    def _deliver(self, updates: list[RequestUpdate]) -> None:
        if self._rooms:
            updates = [u for u in updates if not self._intercepted(u)]
        super()._deliver(updates)
        if self.mode == "decode" and any(u.finish_reason is not None for u in updates):
            self._preallocate()  # KV was freed

    def _intercepted(self, update: RequestUpdate) -> bool:
        """A finishing update of a request in a room: the prefill holds its answer until the KV has
        landed; either role forgets the room once the request ends otherwise."""
        room = self._rooms.get(update.request.rid)
        if room is None or update.finish_reason is None:
            return False
        if self.mode == "prefill" and update.finish_reason.get("type") != "abort":
            return self._prefill_done(room, update)
        if self.mode == "prefill":
            self.prefill_rooms.fail(room, ABORTED)  # SGLang's sender.abort(): the decode side is not told
            self.prefill_rooms.close(room)
        else:
            self.decode_rooms.close(room)
        self._untrack(room)
        return False

    def _prefill_done(self, room: int, update: RequestUpdate) -> bool:
        request = update.request
        landed_at = self.prefill_rooms.finish(room, len(request.input_ids), self.engine.now)
        if landed_at is None:
            return False
        # The prompt's KV stays locked until it has landed (SGLang's inflight queue).
        cache, bs = self.engine.cache, self.config.block_size
        full = min(len(request.input_ids) // bs, len(request.hashes))
        held = request.hashes[: cache.match(request.hashes[:full])] if self.config.prefix_cache else []
        cache.lock(held)
        self._held_blocks[room] = held
        self._held_updates[room] = update
        delay = max(0.0, landed_at - self.engine.now) * self.time_scale
        self._landing[room] = asyncio.get_running_loop().call_later(delay, self._landed, room)
        return True

    def _unhold(self, room: int) -> None:
        timer = self._landing.pop(room, None)
        if timer is not None:
            timer.cancel()
        blocks = self._held_blocks.pop(room, None)
        if blocks:
            self.engine.cache.unlock(blocks)

    def _landed(self, room: int) -> None:
        """The last byte of a room's KV has landed: tell the decode rank, then answer the client
        with SGLang's finish reason for a prefill (`length` 0)."""
        self._landing.pop(room, None)
        state = self.prefill_rooms.succeed(room)
        if state is not None and self.prefill_rooms.last_transfer is not None:
            seconds, num_bytes = self.prefill_rooms.last_transfer
            self.pd_metrics.transfer_latency.observe(seconds * 1000)
            if seconds > 0:
                self.pd_metrics.transfer_speed.observe(num_bytes / seconds / 1e9)
        update = self._held_updates.pop(room, None)
        self._unhold(room)
        self._untrack(room)
        if state is None or update is None:
            return
        request = update.request
        assert state.destination is not None
        payload = {
            "output_id": request.output_ids[0], "text": request.text, "cached_tokens": request.cached_tokens,
            "prompt_tokens": len(request.input_ids),
        }
        if state.destination.endpoint != FAKE:
            self._send(state.destination.endpoint, pd_wire.done_frames(room, payload))
        finish = {"type": "length", "length": 0}
        request.finish_reason = finish
        self._deliver([RequestUpdate(request, update.text, update.num_output_tokens, finish)])

    def _fail_prefill(self, state: PrefillRoom, stage: str) -> None:
        self._unhold(state.room)
        self._untrack(state.room)
        self.prefill_rooms.close(state.room)
        self._fail_held(state.rid, prefill_failure(stage, state.rid, state.room, state.failure))

    def _prefill_abort(self, rid: str) -> bool:
        """Abort a prefill request still in a room; True if it was (else the engine aborts it)."""
        room = self._rooms.get(rid)
        if room is None:
            return False
        status = self.prefill_rooms.rooms[room].status if room in self.prefill_rooms.rooms else None
        if status == KVPoll.WAITING_FOR_INPUT:
            return False  # prefilling: an ordinary abort (the decode side is not told)
        state = self.prefill_rooms.fail(room, ABORTED)
        if state is None:
            return False
        self._fail_prefill(state, "bootstrap" if status == KVPoll.BOOTSTRAPPING else "transfer")
        return True

    def _on_destination(self, room: int, endpoint: str, prefix_len: int, tp: int) -> None:
        state = self.prefill_rooms.destination(room, endpoint, prefix_len, time.monotonic(), tp)
        if state is not None:
            self._release(state.rid)

    def _on_decode_abort(self, room: int, endpoint: str) -> None:
        """The decode side gave the room up: SGLang fails it with no reason of its own, and
        acknowledges the ABORT, known room or not, so the decode side can free the room's KV. (SGLang
        waits for chunks still on the wire to drain first; the simulated link moves no bytes.)"""
        self._send(endpoint, pd_wire.ack_frames(room))
        before = self.prefill_rooms.rooms.get(room)
        status = before.status if before is not None else None
        state = self.prefill_rooms.fail(room, None)
        if state is None:
            return  # finished already, or never seen: SGLang ignores it
        self._fail_prefill(state, "bootstrap" if status == KVPoll.BOOTSTRAPPING else "transfer")

    # ------------------------------------------------------------------ decode role

    def _open_decode(self, request: Request, bootstrap: Bootstrap, now: float) -> None:
        addr = FAKE if bootstrap.host == FAKE_BOOTSTRAP_HOST else bootstrap.addr
        state = self.decode_rooms.open(bootstrap.room, request.rid, addr, len(request.input_ids), now)
        if state.status == KVPoll.FAILED:
            self._fail_held(request.rid, decode_failure("handshake", request.rid, bootstrap.room, state.failure))
            return
        self._track(request.rid, bootstrap.room)
        if addr == FAKE:  # no prefill: the handshake is instant (SGLang's FakeKVReceiver)
            self.decode_rooms.handshake(addr, FAKE)
        elif state.status == KVPoll.BOOTSTRAPPING and addr not in self._handshaking:
            self._handshaking[addr] = asyncio.create_task(self._handshake(addr), name=f"pd-handshake-{addr}")
        self._preallocate()

    async def _handshake(self, addr: str) -> None:
        """Learn the prefill rank's endpoint from its bootstrap server, retrying as SGLang does."""
        assert self._http is not None
        try:
            while addr in self.decode_rooms.waiting_for_handshake():
                endpoint = await fetch_prefill_endpoint(self._http, addr, self.config.block_size)
                for state in self.decode_rooms.handshake(addr, endpoint):
                    if state.status == KVPoll.FAILED:
                        self._fail_decode(state)
                if endpoint is not None:
                    self._preallocate()
                    return
                await asyncio.sleep(HANDSHAKE_RETRY_S)
        finally:
            self._handshaking.pop(addr, None)

    def _preallocate(self) -> None:
        """Reserve KV for handshaken rooms, oldest first, while it fits; tell each prefill where to
        write (a fake transfer lands at once)."""
        if self.mode != "decode" or self._preallocating:
            return
        self._preallocating = True  # a fake transfer lands inside the loop, and landing frees nothing
        try:
            self._preallocate_queue()
        finally:
            self._preallocating = False

    def _preallocate_queue(self) -> None:
        engine, cache, bs = self.engine, self.engine.cache, self.config.block_size
        reserve = self.config.num_reserved_decode_tokens
        for state in self.decode_rooms.preallocation_queue():
            request = engine.get(state.rid)
            if request is None or state.status != KVPoll.WAITING_FOR_INPUT:
                continue
            matched = 0
            if self.config.prefix_cache:
                usable = min(len(request.hashes), (len(request.input_ids) - 1) // bs)
                matched = cache.match(request.hashes[:usable])
            active = len(engine.running) + self.decode_rooms.count(KVPoll.TRANSFERRING)
            if not preallocation_fits(cache.available_tokens(), state.prompt_tokens, matched * bs, active, reserve):
                return  # the head of the line waits for KV room, as in SGLang
            cache.lock(request.hashes[:matched])
            needed = state.prompt_tokens - matched * bs
            if not cache.allocate(needed):
                cache.unlock(request.hashes[:matched])
                return
            self.decode_rooms.sent(state.room, needed, matched, time.monotonic())
            if state.endpoint == FAKE:  # SGLang's FakeKVReceiver: "received" at once, from no one
                self._on_landed(state.room, None)
            else:
                assert state.endpoint is not None
                self._send(state.endpoint, pd_wire.dest_frames(state.room, self.endpoint, matched * bs, self.config.tp))

    def _on_landed(self, room: int, payload: dict[str, Any] | None) -> None:
        state = self.decode_rooms.landed(room)
        if state is None:
            return  # failed or aborted meanwhile
        self.catch_up()
        first = None if payload is None else (int(payload["output_id"]), str(payload["text"]))
        cached = 0 if payload is None else int(payload["cached_tokens"])
        update = self.engine.start_transferred(state.rid, first, cached, state.reserved_tokens, state.matched_blocks)
        self._untrack(room)
        self._deliver([update])
        self._wake.set()

    def _release_reservation(self, state: DecodeRoom) -> None:
        """Free a failed room's reservation now, or hold it for the prefill's acknowledgement."""
        if state.sent_at is None:
            return
        request = self.engine.get(state.rid)
        hashes = tuple(request.hashes[: state.matched_blocks]) if request is not None else ()
        if not self.decode_rooms.hold(state, hashes, time.monotonic()):
            self._free(state.reserved_tokens, hashes)
        state.reserved_tokens = state.matched_blocks = 0

    def _free(self, tokens: int, hashes: tuple[int, ...]) -> None:
        self.engine.cache.release(tokens)
        if hashes:
            self.engine.cache.unlock(list(hashes))
        self._preallocate()

    def _fail_decode(self, state: DecodeRoom, notify: bool = False) -> None:
        """A failed room's request ends with SGLang's 500; `notify`: tell the prefill rank (SGLang
        sends ABORT once the handshake gave it the rank's endpoint). A room whose KV is held for the
        prefill's acknowledgement sends it whatever failed it (SGLang's `force_arm`)."""
        stage = state.stage
        self._release_reservation(state)
        notify = notify or state.room in self.decode_rooms.held
        if notify and state.endpoint not in (None, FAKE):
            self._send(state.endpoint, pd_wire.abort_frames(state.room, self.endpoint))
        self._untrack(state.room)
        self.decode_rooms.close(state.room)
        self._fail_held(state.rid, decode_failure(stage, state.rid, state.room, state.failure))
        self._preallocate()

    def _decode_abort(self, rid: str) -> bool:
        room = self._rooms.get(rid)
        if room is None:
            return False
        state = self.decode_rooms.fail(room, ABORTED)
        if state is None:
            return False
        self._fail_decode(state, notify=True)
        return True

    async def _heartbeats(self) -> None:
        """SGLang's heartbeat checker: poll each prefill's /health; give up on one after the misses."""
        assert self._http is not None
        while True:
            await asyncio.sleep(self.timeouts.heartbeat_interval_s)
            for addr in self.decode_rooms.watched():
                try:
                    response = await self._http.get(f"http://{addr}/health", timeout=HEARTBEAT_TIMEOUT_S)
                    ok = response.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if not ok:
                    logger.info("Attempting to reconnect to %s...", addr)
                failed = self.decode_rooms.heartbeat(addr, ok)
                if failed:
                    logger.error("Lost connection with prefill instance (bootstrap_addr: %s), %d requests affected",
                                 addr, len(failed))
                for state in failed:
                    self._fail_decode(state)

    # ------------------------------------------------------------------ both roles

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(MAINTENANCE_INTERVAL_S)
            now = time.monotonic()
            for prefill in self.prefill_rooms.expired(now):
                self._fail_prefill(prefill, "bootstrap")
            for decode in self.decode_rooms.expired(now):
                self._fail_decode(decode, notify=True)
            for held in self.decode_rooms.overdue(now):
                logger.warning("Deferred KV release for room %s timed out after %ss without a full drain ack from "
                               "prefill; releasing anyway.", held.room, self.timeouts.deferred_release_s)
                self._free(held.tokens, held.hashes)

    async def _receive(self) -> None:
        assert self._pull is not None
        while True:
            frames = await self._pull.recv_multipart()
            try:
                message = pd_wire.parse(frames, self.mode)
                if isinstance(message, pd_wire.DestMessage):
                    self._on_destination(message.room, message.endpoint, message.prefix_len, message.tp)
                elif isinstance(message, pd_wire.AbortMessage):
                    self._on_decode_abort(message.room, message.endpoint)
                elif isinstance(message, pd_wire.AckMessage):
                    held = self.decode_rooms.acknowledged(message.room)
                    if held is not None:
                        self._free(held.tokens, held.hashes)
                elif isinstance(message, pd_wire.DoneMessage):
                    self._on_landed(message.room, message.payload)
                else:
                    logger.warning("unexpected PD message %r", frames[:1])
            except (IndexError, ValueError, KeyError) as exc:
                logger.warning("malformed PD message %r: %s", frames[:2], exc)

    def _send(self, endpoint: str, frames: list[bytes]) -> None:
        """Best effort, as SGLang's notifications: a peer that is gone loses the message."""
        assert self._zmq is not None
        sock = self._pushes.get(endpoint)
        if sock is None:
            sock = self._pushes[endpoint] = self._zmq.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("PD message to %s dropped: %s", endpoint, exc)

    def abort_if_running(self, rid: str) -> None:
        if (self._prefill_abort(rid) if self.mode == "prefill" else self._decode_abort(rid)):
            self._streams.pop(rid, None)
            return
        super().abort_if_running(rid)

    async def abort_request(self, http_request: HttpRequest) -> Response:
        body = await http_request.body()
        try:
            data = msgspec.json.decode(body or b"{}")
        except msgspec.DecodeError:
            data = {}
        if isinstance(data, dict) and (data.get("abort_all") or data.get("rid")):
            prefix = "" if data.get("abort_all") else str(data["rid"])
            for rid in [r for r in self._rooms if r.startswith(prefix)]:
                if self.mode == "prefill":
                    self._prefill_abort(rid)
                else:
                    self._decode_abort(rid)
        return await super().abort_request(http_request)

    # ------------------------------------------------------------------ reporting

    def server_info_payload(self) -> dict[str, Any]:
        bandwidth_gb_s = self.prefill_rooms.link.link.bandwidth / 1e9
        return {**super().server_info_payload(), **pd_reports.server_info(self.config, self.mode, bandwidth_gb_s)}

    async def prometheus_metrics(self, http_request: HttpRequest) -> Response:
        queues, metrics = pd_reports.pd_queues(self.prefill_rooms, self.decode_rooms), self.pd_metrics
        metrics.prefill_bootstrap.set(queues.prefill_bootstrap)
        metrics.prefill_inflight.set(queues.prefill_inflight)
        metrics.decode_prealloc.set(queues.decode_prealloc)
        metrics.decode_transfer.set(queues.decode_transfer)
        return await super().prometheus_metrics(http_request)

    def model_info_payload(self) -> dict[str, Any]:
        return {**super().model_info_payload(), "disaggregation_mode": self.mode}

    def loads_payload(self) -> dict[str, Any]:
        queues = pd_reports.pd_queues(self.prefill_rooms, self.decode_rooms)
        retracted = sum(r.backed_up for r in self.engine.waiting)
        return pd_reports.with_disaggregation(super().loads_payload(), self.mode, queues, retracted,
                                              self.prefill_rooms.last_transfer)
