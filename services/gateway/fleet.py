"""The gateway's live view of the fleet for the overload policy: worker load reports and how
many requests wait in each band's shared queue."""

from __future__ import annotations

import asyncio

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from inferbus.bus import connection as bus
from inferbus.runtime import logs
from proto import bands, subjects
from proto import messages as m

from .overload import OverloadPolicy

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
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(subjects.metrics_wildcard(), cb=bus.taking_turns(self._on_load))
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
        if load.model == self.model and load.role != "prefill":  # prefill workers take no queued requests
            self.policy.on_load(load)

    async def _poll_queues(self) -> None:
        # Every consumer of the model's band subjects counts: the shared queue and each worker's
        # own (placed requests wait there, and are as far from a slot as the shared ones); each
        # worker's own also on its own, for placements (a placed request waits for that worker).
        prefixes = {
            band: subjects.request_filter(band, self.model, "").removesuffix(".*") for band in bands.INTERACTIVE
        }
        while True:
            depth = dict.fromkeys(bands.INTERACTIVE, 0)
            by_worker: dict[str, dict[str, int]] = {band: {} for band in bands.INTERACTIVE}
            try:
                for info in await self.js.consumers_info(subjects.REQUESTS_STREAM):
                    subject = info.config.filter_subject or ""
                    for band, prefix in prefixes.items():
                        if subject.startswith(prefix):
                            pending = info.num_pending or 0
                            depth[band] += pending
                            worker = subjects.worker_of_request_subject(subject)
                            if worker is not None:
                                by_worker[band][worker] = by_worker[band].get(worker, 0) + pending
            except Exception as error:  # keep the last view; the next poll tries again
                log.warning("queue_depth_poll_failed", error=repr(error))
            else:
                for band, queued in depth.items():
                    self.policy.on_queue_depth(band, queued, by_worker[band])
            await asyncio.sleep(self.queue_poll_s)
