"""Usage events, the billing ledger's input: written to a local outbox on disk first, then
published to JetStream until it acknowledges them (what a previous run left is published at start).
Each event's message id is drawn when it enters the outbox (`m.usage_publish_id`) and kept for its
retries: JetStream drops those, and no other identity can have the event dropped.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec

from inferbus.bus.outbox import Outbox
from inferbus.bus.replies import Replies
from inferbus.runtime import logs
from proto import messages as m
from proto import subjects

log = logs.get(__name__)


class UsageReporter:
    def __init__(self, outbox: Outbox, worker_id: str) -> None:
        self.outbox = outbox
        self.worker_id = worker_id
        self.release = ""  # the release this worker verified it serves (set at start)
        self.reporter = f"{subjects.USAGE_FROM_WORKER}.{subjects.token(worker_id)}"  # as in its usage subject

    @classmethod
    async def open(cls, state_dir: str, worker_id: str, replies: Replies) -> UsageReporter:
        async def publish(subject: str, data: bytes, msg_id: str) -> None:
            subject = subjects.attributed_usage_subject(subject, subjects.USAGE_FROM_WORKER, worker_id)
            await replies.publish_durable(subject, data, msg_id)

        outbox = Outbox(Path(state_dir) / f"usage-outbox-{worker_id}.sqlite3", publish)
        await outbox.start()
        return cls(outbox, worker_id)

    async def publish(self, request: m.InferenceRequest, status: str, usage: m.Usage, finish: str | None,
                      billed_to: str = "tenant") -> None:
        if request.choice and billed_to == "tenant":  # n > 1: the first choice bills the prompt
            usage = m.Usage(prompt_tokens=0, completion_tokens=usage.completion_tokens)
        event = m.UsageEvent(
            request_id=request.request_id, tenant=request.tenant, model=request.model, adapter=request.adapter,
            band=request.band, status=status, usage=usage, started=request.created, finished=time.time(),  # type: ignore[arg-type]
            worker_id=self.worker_id, attempts=request.attempt + 1, finish_reason=finish,
            api_key_id=request.api_key_id, batch_id=request.batch_id, billed_to=billed_to,  # type: ignore[arg-type]
            attempt=request.attempt, release=self.release,
        )
        try:
            await self.outbox.add(subjects.usage_subject(request.tenant, subjects.USAGE_FROM_WORKER, self.worker_id),
                                  m.encode(event), m.usage_publish_id(event, self.reporter, m.new_usage_nonce()))
        except Exception as error:
            # The disk refused it: the ledger will miss this event, so say so loudly.
            log.error("usage_outbox_write_failed", request_id=request.request_id, error=repr(error),
                      usage=msgspec.to_builtins(usage))

    async def close(self) -> None:
        """Deliver what JetStream will take now; what it does not stays on disk for the next run."""
        if not await self.outbox.drained(timeout=5):
            log.warning("usage_outbox_pending_at_exit", path=str(self.outbox.path))
        await self.outbox.stop()
