"""Stream events to gateways: one bus message per gateway per frame (`frames` decides what goes
together and when), published from the event loop without a round trip per event."""

from __future__ import annotations

import asyncio
import math
import time

from nats.aio.client import Client

from inferbus.runtime import logs
from proto import messages as m
from proto import subjects

from .frames import PendingFrames
from .metrics import STREAM_EVENTS, STREAM_FRAMES
from .replay import ReplayLog
from .tasks import Background

log = logs.get(__name__)


class EventSender:
    def __init__(self, nc: Client, background: Background, window_s: float = 0.001,
                 accepted_wait_s: float | None = None, replay_keep_s: float = 10.0, *, worker_id: str) -> None:
        self.nc = nc
        self.worker_id = worker_id  # the last token of every subject it publishes on (its permissions')
        self.background = background
        self.pending = PendingFrames(window_s, time.monotonic, accepted_wait_s)
        self.replay = ReplayLog(time.monotonic, keep_s=replay_keep_s)  # what left, for gateways that missed some
        self._timer: asyncio.TimerHandle | asyncio.Handle | None = None
        self._timer_at = math.inf  # when the scheduled flush runs (-inf: this loop pass)
        self._loop: asyncio.AbstractEventLoop | None = None

    def send(self, request: m.InferenceRequest, event: m.StreamEvent) -> bool:
        """Queue `event` for the gateway of `request`. True when it was merged into the request's
        chunk still waiting to leave (which keeps its `seq`)."""
        merged = self.pending.add(request.reply_to, event)
        due_at = self.pending.due_at()
        if due_at is not None and due_at < self._timer_at:  # sooner than the flush scheduled, if any
            self._schedule(due_at)
        return merged

    def _schedule(self, due_at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._loop is None:
            self._loop = asyncio.get_running_loop()  # once: on Python 3.11 every lookup is a getpid() call
        loop = self._loop
        due_in = due_at - time.monotonic()
        self._timer_at = due_at
        self._timer = loop.call_soon(self._flush) if due_in <= 0 else loop.call_later(due_in, self._flush)

    def flush(self) -> None:
        """Send what waits now, without waiting for the window (the worker is stopping)."""
        if self._timer is not None:
            self._timer.cancel()
        self._flush()

    def _flush(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        frames = self.pending.take()
        if frames:
            for subject, events in frames.items():
                self.replay.record(subject, events)
            self.background.spawn(self._publish(frames))

    def resend(self, subject: str, events: list[m.StreamEvent]) -> None:
        """Publish `events` again, as one frame (after the frames already taken: tasks start in order)."""
        self.background.spawn(self._publish({subject: events}))

    async def _publish(self, frames: dict[str, list[m.StreamEvent]]) -> None:
        # nats-py queues each publish and writes them all to the socket in one go after this pass.
        for subject, events in frames.items():
            STREAM_FRAMES.inc()
            STREAM_EVENTS.inc(len(events))
            try:
                await self.nc.publish(subjects.event_subject(subject, self.worker_id),
                                      m.encode(m.StreamFrame(events=events)))
            except Exception as error:  # a gateway's events must not be lost to another's failure
                log.error("stream_publish_failed", subject=subject, error=repr(error))
