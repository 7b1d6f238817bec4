"""The gateway's live view of the fleet for the overload policy: worker load reports and how
many requests wait in each band's shared queue."""

from __future__ import annotations

import asyncio

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from inferbus import logs
from proto import messages as m
from proto import subjects

from .overload import BANDS, OverloadPolicy

log = logs.get(__name__)
_load_decoder = msgspec.msgpack.Decoder(m.WorkerLoad)


class FleetMonitor:
    def __init__(self, nc: Client, js: JetStreamContext, model: str, policy: OverloadPolicy,
                 queue_poll_s: float = 0.5) -> None:
        self.nc = nc
        self.js = js
        self.model = model
        self.policy = policy
        self.queue_poll_s = queue_poll_s
        self._sub = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(subjects.metrics_wildcard(), cb=self._on_load)
        self._task = asyncio.create_task(self._poll_queues(), name="queue-depth")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_load(self, msg: Msg) -> None:
        try:
            load = _load_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if load.model == self.model:
            self.policy.on_load(load)

    async def _poll_queues(self) -> None:
        while True:
            for band in BANDS:
                try:
                    info = await self.js.consumer_info(subjects.REQUESTS_STREAM, subjects.request_consumer(band, self.model))
                    self.policy.on_queue_depth(band, info.num_pending or 0)
                except Exception:  # no worker has created the band's consumer yet: nothing queued there
                    self.policy.on_queue_depth(band, 0)
            await asyncio.sleep(self.queue_poll_s)
