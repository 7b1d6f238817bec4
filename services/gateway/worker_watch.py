"""Which workers are alive, and what becomes of this gateway's requests when one is not.

A watch on the `workers` KV bucket keeps `live_workers`. A lapsed heartbeat is a question (the
worker is probed, `worker_probe`), a failed probe a death; a heartbeat that comes back with another
start time is a restart. Either way the worker's started streams migrate, and the requests it may
have taken unstarted become orphans (`flight.not_started`). A sweep backs up missed delete markers,
moves requests no worker started in time and asks silent streams' workers for lost events.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

import msgspec
from nats.js.kv import KeyValue

from inferbus.bus import connection as bus
from inferbus.bus.replies import Replies
from inferbus.runtime import logs
from inferbus.runtime.records import decode_or_none
from proto import messages as m
from proto import subjects

from .flight import Flight, not_started, went_silent
from .metrics import NOT_STARTED
from .worker_probe import WorkerProbe

log = logs.get(__name__)

_heartbeat_decoder = msgspec.msgpack.Decoder(m.Heartbeat)


class Flights(Protocol):
    """What watching the fleet may touch of the dispatcher: its requests in flight, and asking a
    stream's worker for events it lost."""

    @property
    def flights(self) -> dict[str, Flight]: ...
    def recover(self, flight: Flight, why: str) -> None: ...


class WorkerWatch:
    def __init__(self, dispatcher: Flights, replies: Replies, *, heartbeat_ttl_s: float, accept_timeout_s: float,
                 liveness_timeout_s: float, silence_s: float, free_slots: Callable[[], int],
                 worker_free_slots: Callable[[str], int | None]) -> None:
        self.dispatcher = dispatcher
        self.live_workers: dict[str, tuple[float, m.Heartbeat]] = {}  # id → (last seen, beat)
        self.heartbeat_ttl_s = heartbeat_ttl_s
        # A request queued on a worker's own subject and not started by it within this long moves
        # to the shared queue (so does an orphan no worker started); a worker whose heartbeat
        # lapsed is asked (`liveness_timeout_s`) before it is dead.
        self.accept_timeout_s = accept_timeout_s
        self.probe = WorkerProbe(replies, liveness_timeout_s, self._verdict)
        # A started stream that hears nothing for this long asks its worker whether it sent events
        # that never came (a stream's last events lost on the bus would hold its client until its
        # timeout: nothing later reveals the gap).
        self.silence_s = silence_s
        self.free_slots = free_slots  # across the fleet, at the workers' last load reports
        self.worker_free_slots = worker_free_slots  # a worker's free slots at its last load report, if recent

    async def follow(self, watcher: KeyValue.KeyWatcher) -> None:
        """Follow the `workers` bucket: heartbeats, and their delete markers when one lapses."""
        await bus.follow(watcher, self.on_heartbeat, self._worker_gone)

    def on_heartbeat(self, entry: KeyValue.Entry) -> None:
        beat = decode_or_none(_heartbeat_decoder, entry.value or b"", store="workers", key=entry.key)
        if beat is None:
            return
        seen = self.live_workers.get(beat.worker_id)
        if seen is not None and seen[1].started != beat.started:
            # Killed and started again within its heartbeat's TTL: what the old process held died
            # with it. The new one heartbeats before it pulls, so nothing here is the new one's yet.
            log.warning("worker_restarted", worker_id=beat.worker_id)
            self._orphan_flights({beat.worker_id}, why="worker restarted")
        self.live_workers[beat.worker_id] = (time.monotonic(), beat)

    def _worker_gone(self, key: str) -> None:
        """A heartbeat lapsed: ask the worker before declaring it dead (`worker_probe`)."""
        for worker_id in [wid for wid in self.live_workers if subjects.worker_key(wid) == key]:
            self.probe.ask(worker_id)

    def _verdict(self, worker_id: str, alive: bool) -> None:
        if not alive:
            self.declare_dead(subjects.worker_key(worker_id))
            return
        seen = self.live_workers.get(worker_id)
        if seen is not None:  # its heartbeat will be back; until then the sweep waits again
            self.live_workers[worker_id] = (time.monotonic(), seen[1])
        log.warning("worker_heartbeat_late_but_alive", worker_id=worker_id)

    def declare_dead(self, key: str) -> None:
        gone = [wid for wid in self.live_workers if subjects.worker_key(wid) == key]
        for worker_id in gone:
            del self.live_workers[worker_id]
            log.warning("worker_gone", worker_id=worker_id)
        self._orphan_flights(set(gone), why="worker heartbeat ended")

    def _orphan_flights(self, workers: set[str], why: str) -> None:
        """The flights of worker processes that are gone: started ones migrate now. Queued ones
        wait for the router to move them to the shared queue (a second attempt published now would
        run twice) and move themselves if no worker starts them in time (`not_started`); so do
        those in the shared queue, which the gone process may have taken just before it died."""
        now = time.monotonic()
        for flight in list(self.dispatcher.flights.values()):
            if flight.state == "queued" and flight.worker_id is None:
                flight.orphaned_at = flight.orphaned_at or now
            elif flight.worker_id not in workers:
                continue
            elif flight.state == "queued":
                flight.worker_id = None
                flight.disrupted = True
                flight.orphaned_at = now
            else:
                self._fail_attempt(flight, why)

    def _fail_attempt(self, flight: Flight, why: str) -> None:
        # A synthetic retryable error on the flight's own queue: the reader migrates in order.
        flight.events.put_nowait(m.StreamError(
            request_id=flight.request.request_id, attempt=flight.request.attempt, code="worker_lost",
            message=f"worker {flight.worker_id} stopped responding ({why})", retryable=True, status=503,
        ))
        flight.worker_id = None

    async def sweep(self) -> None:
        # Backstop for expiries whose delete marker we missed (e.g. across a NATS reconnect).
        while True:
            await asyncio.sleep(min(0.5, self.heartbeat_ttl_s / 4))
            now = time.monotonic()
            dead = [wid for wid, (seen, _) in self.live_workers.items() if now - seen > self.heartbeat_ttl_s * 1.5]
            for worker_id in dead:
                self._worker_gone(subjects.worker_key(worker_id))
            self.move_unstarted(now)
            self._ask_silent(now)

    def _ask_silent(self, now: float) -> None:
        """Streams that went silent ask their workers whether events went missing (`flight.went_silent`)."""
        for flight in list(self.dispatcher.flights.values()):
            if went_silent(flight, now, self.silence_s):
                self.dispatcher.recover(flight, why=f"no event for {now - flight.heard_at:.1f} s")

    def move_unstarted(self, now: float) -> None:
        """A request its worker did not start in time (`flight.not_started`), or no worker after
        its own died, moves to the shared queue: a worker that pulls nothing (a zombie, a lost
        consumer) or died holding it must not hold its client until the deadline. The old attempt
        is superseded, so it never runs twice."""
        fleet_free_slots = self.free_slots()
        for flight in list(self.dispatcher.flights.values()):
            if not not_started(flight, now, self.accept_timeout_s, self.worker_free_slots, fleet_free_slots):
                continue
            NOT_STARTED.inc()
            log.warning("request_not_started", request_id=flight.request.request_id, worker_id=flight.worker_id,
                        waited_s=round(now - (flight.orphaned_at or flight.placed_at), 2))
            flight.avoid_worker = flight.worker_id
            flight.disrupted = True
            flight.placed_at = now  # one move per timeout, whatever the reader is doing
            flight.orphaned_at = None
            flight.events.put_nowait(m.StreamError(
                request_id=flight.request.request_id, attempt=flight.request.attempt, code="not_started",
                message=f"worker {flight.worker_id or '(gone)'} did not start the request", retryable=True,
                status=503,
            ))
