"""A worker's liveness, kept apart from its generation work.

Heartbeats used to be a task on the worker's event loop: a worker busy streaming tokens for every
slot could delay them past the registry's TTL, be declared dead while healthy, and have its live
streams migrated. Here they run on a thread of their own, with their own event loop and their own
NATS connection, which no amount of generation work on the main loop can delay. The same thread
answers the gateways' liveness probes (`liveness_subject`), so a missed heartbeat is double-checked
before anything migrates.

The thread vouches for the main loop too: it stops heartbeating and answering when the main loop
has not ticked for `stall_after_s` (a deadlock or a runaway callback is a dead worker).

`PauseDetector` is the pure part: a gap in the main loop's ticks longer than `pause_after_s` means
the process was stopped (SIGSTOP, a frozen VM) or starved; the worker then verifies its engine and
its consumers before it pulls again.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from nats.aio.msg import Msg

from inferbus.bus import connection as bus
from inferbus.bus.security_events import answerable
from inferbus.runtime import logs
from proto import messages as m
from proto import subjects

log = logs.get(__name__)
_probe_decoder = msgspec.msgpack.Decoder(m.LivenessProbe)


@dataclass
class PauseDetector:
    """Counts pauses of a loop from the gaps between its ticks (pure; injected clock)."""

    clock: Callable[[], float]
    pause_after_s: float
    last_tick: float = 0.0
    epoch: int = 0  # pauses seen so far

    def __post_init__(self) -> None:
        self.last_tick = self.clock()

    def tick(self) -> bool:
        """Record that the loop ran now; True if it had been paused since the last tick."""
        now = self.clock()
        paused = now - self.last_tick > self.pause_after_s
        if paused:
            self.epoch += 1
        self.last_tick = now
        return paused

    def lag(self) -> float:
        return self.clock() - self.last_tick


def loop_alive(lag_s: float, stall_after_s: float) -> bool:
    """Whether a loop that last ticked `lag_s` ago still counts as alive."""
    return lag_s <= stall_after_s


class LivenessThread:
    """Puts the worker's heartbeat every `interval_s` and answers liveness probes, from its own thread."""

    def __init__(self, nats_url: str, worker_id: str, *, interval_s: float, ttl_s: float,
                 stall_after_s: float, loop_lag: Callable[[], float]) -> None:
        self.nats_url = nats_url
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.stall_after_s = stall_after_s
        self._loop_lag = loop_lag  # read from this thread: a float the main loop updates
        self._beat: bytes | None = None  # encoded Heartbeat; None: not registered (warm, leaving)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.beats = 0

    def set_beat(self, beat: m.Heartbeat | None) -> None:
        """The heartbeat to keep alive from now on (its `ts` is refreshed at every put), or None."""
        with self._lock:
            self._beat = None if beat is None else m.encode(beat)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="liveness", daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._error is not None:
            raise RuntimeError(f"liveness thread failed to start: {self._error!r}")

    def stop(self) -> None:
        """Stop heartbeating and answering (idempotent)."""
        self.set_beat(None)
        if self._thread is None or not self._thread.is_alive():
            return
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as error:  # reported to start(), or logged when it dies later
            self._error = error
            self._started.set()
            log.error("liveness_thread_died", error=repr(error))

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        nc = await bus.connect(self.nats_url, name=f"worker-{self.worker_id}-liveness")
        try:
            kv = await bus.workers_bucket(nc.jetstream(), self.ttl_s)
            await nc.subscribe(subjects.liveness_subject(self.worker_id), cb=self._on_probe)
            self._started.set()
            key = subjects.worker_key(self.worker_id)
            while not self._stop.is_set():
                with self._lock:
                    beat = self._beat
                if beat is not None and loop_alive(self._loop_lag(), self.stall_after_s):
                    try:
                        fresh = msgspec.structs.replace(msgspec.msgpack.decode(beat, type=m.Heartbeat), ts=time.time())
                        await kv.put(key, m.encode(fresh))
                        self.beats += 1
                    except Exception as error:
                        log.warning("heartbeat_failed", error=repr(error))
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=self.interval_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            await nc.close()

    async def _on_probe(self, msg: Msg) -> None:
        try:
            _probe_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        lag = self._loop_lag()
        with self._lock:
            registered = self._beat is not None
        if not msg.reply or not registered or not loop_alive(lag, self.stall_after_s):
            return  # no answer is the answer: dead, or not serving
        if not answerable(msg):
            return
        await msg.respond(m.encode(m.LivenessReply(worker_id=self.worker_id, loop_lag_s=lag)))
