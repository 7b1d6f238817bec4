"""Whether a worker whose heartbeat lapsed is dead: it is asked first (a liveness probe on its own
subject), since migrating the live streams of a busy but healthy worker costs more than a second's
wait. One question per worker at a time; the verdict goes to `on_verdict(worker_id, alive)`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from inferbus.bus.replies import Replies
from inferbus.runtime import logs
from proto import messages as m
from proto import subjects

from .metrics import DEATH_VERDICTS

log = logs.get(__name__)

_liveness_decoder = msgspec.msgpack.Decoder(m.LivenessReply)


class WorkerProbe:
    def __init__(self, replies: Replies, timeout_s: float, on_verdict: Callable[[str, bool], None]) -> None:
        self.replies = replies
        self.timeout_s = timeout_s
        self.on_verdict = on_verdict
        self._asking: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()

    def ask(self, worker_id: str) -> None:
        """Ask `worker_id` whether it is alive, unless a question to it is under way."""
        if worker_id in self._asking:
            return
        self._asking.add(worker_id)
        task = asyncio.ensure_future(self._verdict(worker_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _verdict(self, worker_id: str) -> None:
        try:
            alive = await self._answers(worker_id)
        finally:
            self._asking.discard(worker_id)
        DEATH_VERDICTS.labels("alive" if alive else "dead").inc()
        self.on_verdict(worker_id, alive)

    async def _answers(self, worker_id: str) -> bool:
        probe = m.encode(m.LivenessProbe(worker_id=worker_id))
        try:
            reply = await self.replies.request(subjects.liveness_subject(worker_id), probe, self.timeout_s)
            return _liveness_decoder.decode(reply.data).worker_id == worker_id
        except (NoRespondersError, NatsTimeoutError, msgspec.DecodeError):
            return False
        except Exception as error:  # the bus itself failed: we cannot tell, so do not kill anything
            log.warning("liveness_probe_failed", worker_id=worker_id, error=repr(error))
            return True
