"""What the operator's pages show live, kept by each gateway from the bus.

- Workers: the `workers` KV bucket (each worker's heartbeat, the registry the router and the
  dispatchers read), followed by a watch; a worker whose key expires or is deleted stays listed as
  gone for `gone_keep_s`, so a killed worker is seen leaving and coming back.
- Load: each worker's latest `WorkerLoad` (`inferbus.metrics.<worker>`, what the router, the
  overload policy and the autoscaler read).
- Decisions: the autoscaler's `ScaleDecision`s (`inferbus.scale.<pool>`, one per pool per tick)
  and the canary controller's `ReleaseDecision`s (`inferbus.release.<model>`), the latest
  `keep` of each, since this gateway started (they are core NATS messages, kept nowhere else; the
  autoscaler sends one per pool every tick, so the current ones are never more than a tick away).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from inferbus.bus import connection as bus
from inferbus.runtime import logs
from proto import messages as m
from proto import subjects

log = logs.get(__name__)
_heartbeat = msgspec.msgpack.Decoder(m.Heartbeat)
_load = msgspec.msgpack.Decoder(m.WorkerLoad)
_scale = msgspec.msgpack.Decoder(m.ScaleDecision)
_release = msgspec.msgpack.Decoder(m.ReleaseDecision)


@dataclass
class WorkerSeen:
    heartbeat: m.Heartbeat
    updated: float  # wall time of its last heartbeat put
    gone_at: float | None = None  # its key expired or was deleted (wall time)
    restarts_seen: int = 0  # heartbeats with a newer `started` than the first one seen


class Live:
    def __init__(self, nc: Client, js: JetStreamContext, heartbeat_ttl_s: float, *, keep: int = 200,
                 gone_keep_s: float = 3600.0, clock: Callable[[], float] = time.time) -> None:
        self.nc = nc
        self.js = js
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.gone_keep_s = gone_keep_s
        self.clock = clock
        self.workers: dict[str, WorkerSeen] = {}
        # Subject token of a worker → (received, its latest report, undecoded): decoded only when a
        # page asks, so a gateway pays nothing per report for the console.
        self.loads: dict[str, tuple[float, bytes]] = {}
        self.scale: deque[m.ScaleDecision] = deque(maxlen=keep)
        self.releases: deque[m.ReleaseDecision] = deque(maxlen=keep)
        self._keys: dict[str, str] = {}  # KV key → worker id
        self._subs: list[Subscription] = []
        self._watcher: KeyValue.KeyWatcher | None = None
        self._task: asyncio.Task[None] | None = None
        self.kv: KeyValue | None = None

    async def start(self) -> None:
        self.kv = await bus.workers_bucket(self.js, self.heartbeat_ttl_s)
        self._watcher = await self.kv.watch(">")
        self._task = asyncio.create_task(
            bus.follow(self._watcher, self._on_put, self._on_delete), name="console-workers"
        )
        self._subs = [
            await self.nc.subscribe(subjects.metrics_wildcard(), cb=self._on_load),
            await self.nc.subscribe(subjects.scale_wildcard(), cb=self._on_scale),
            await self.nc.subscribe(subjects.release_wildcard(), cb=self._on_release),
        ]

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._watcher is not None:
            try:
                await self._watcher.stop()
            except Exception:  # the connection may be closing already
                pass
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass

    # ---- the bus ---------------------------------------------------------------------------------

    def _on_put(self, entry: KeyValue.Entry) -> None:
        try:
            beat = _heartbeat.decode(entry.value or b"")
        except msgspec.DecodeError:
            return
        now = self.clock()
        seen = self.workers.get(beat.worker_id)
        if seen is None:
            self.workers[beat.worker_id] = WorkerSeen(beat, now)
        else:
            if beat.started > seen.heartbeat.started:
                seen.restarts_seen += 1
            seen.heartbeat, seen.updated, seen.gone_at = beat, now, None
        self._keys[entry.key] = beat.worker_id
        self._forget_old(now)

    def _on_delete(self, key: str) -> None:
        worker_id = self._keys.get(key)
        if worker_id is not None and worker_id in self.workers and self.workers[worker_id].gone_at is None:
            self.workers[worker_id].gone_at = self.clock()

    def _forget_old(self, now: float) -> None:
        for worker_id in [w for w, seen in self.workers.items()
                          if seen.gone_at is not None and now - seen.gone_at > self.gone_keep_s]:
            del self.workers[worker_id]
            self.loads.pop(subjects.token(worker_id), None)

    async def _on_load(self, msg: Msg) -> None:
        self.loads[msg.subject.rsplit(".", 1)[-1]] = (self.clock(), msg.data)

    async def _on_scale(self, msg: Msg) -> None:
        try:
            self.scale.append(_scale.decode(msg.data))
        except msgspec.DecodeError:
            return

    async def _on_release(self, msg: Msg) -> None:
        try:
            self.releases.append(_release.decode(msg.data))
        except msgspec.DecodeError:
            return

    # ---- what the pages read ---------------------------------------------------------------------

    def worker_state(self, seen: WorkerSeen, now: float) -> str:
        """ready / starting / draining as the worker says; `silent` past its heartbeat TTL; `gone`."""
        if seen.gone_at is not None:
            return "gone"
        if now - seen.heartbeat.ts > self.heartbeat_ttl_s:
            return "silent"
        return seen.heartbeat.state

    def load_of(self, worker_id: str, fresh_s: float = 10.0) -> m.WorkerLoad | None:
        """The worker's latest load report, if it sent one in the last `fresh_s`."""
        found = self.loads.get(subjects.token(worker_id))
        if found is None or self.clock() - found[0] > fresh_s:
            return None
        try:
            load = _load.decode(found[1])
        except msgspec.DecodeError:
            return None
        return load if load.worker_id == worker_id else None
