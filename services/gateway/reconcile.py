"""Reconcile admission reservations with what requests really used, from the usage ledger.

Every request the platform accepted ends in exactly one event on the `USAGE` stream (completed,
cancelled or failed), so consuming the ledger reconciles every outcome, including requests whose
client went away and whose gateway never saw the final usage. One durable consumer is shared by
all gateways; `Admission.reconcile` is idempotent by request id, so a redelivery or a crash
between reconciling and acking never counts twice.
"""

from __future__ import annotations

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from inferbus import logs
from proto import messages as m
from proto import subjects

from .admission import Admission
from .pricing import Prices

log = logs.get(__name__)
RECONCILER = "admission-reconciler"
_usage_decoder = msgspec.msgpack.Decoder(m.UsageEvent)


class UsageReconciler:
    def __init__(self, js: JetStreamContext, admission: Admission, prices: Prices) -> None:
        self.js = js
        self.admission = admission
        self.prices = prices
        self._subscription = None

    async def start(self) -> None:
        # A durable push consumer shared by every gateway through a queue group: events arrive as
        # soon as they are stored (a finished request's concurrency lease frees at once).
        self._subscription = await self.js.subscribe(
            subjects.usage_stream_subjects()[0], durable=RECONCILER, queue=RECONCILER, cb=self._reconcile,
            manual_ack=True, stream=subjects.USAGE_STREAM,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW, ack_policy=AckPolicy.EXPLICIT, ack_wait=30,
                                  max_ack_pending=10_000),
        )

    async def stop(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()

    async def _reconcile(self, msg: Msg) -> None:
        try:
            event = _usage_decoder.decode(msg.data)
        except msgspec.DecodeError:
            log.error("bad_usage_event", subject=msg.subject)
            await msg.term()
            return
        usage = event.usage
        cost = self.prices.cost(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        try:
            await self.admission.reconcile(event.tenant, event.request_id, usage.prompt_tokens,
                                           usage.completion_tokens, cost)
        except Exception as error:  # Redis away: try again shortly, the ledger keeps the event
            log.warning("reconcile_failed", request_id=event.request_id, error=repr(error))
            await msg.nak(delay=1.0)
            return
        await msg.ack()
