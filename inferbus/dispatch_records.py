"""Who dispatched each request, for whom: the `dispatches` bucket.

A gateway (or the batch service) puts a request's record before it queues the request; only those
identities may write the bucket (`bus_auth`), and billing takes a worker's usage only for a
request whose record names the usage's tenant (`services/billing/attribution.py`), so a worker
cannot bill a request id it made up, nor a real request to another tenant.
"""

from __future__ import annotations

import time

from proto import messages as m
from proto import subjects

from .replies import Replies


def record(request: m.InferenceRequest, now: float) -> m.Dispatch:
    return m.Dispatch(request_id=request.request_id, tenant=request.tenant, reply_to=request.reply_to, created=now)


async def publish(replies: Replies, request: m.InferenceRequest) -> None:
    """The request's record, put before the request is queued (so its usage finds it); put again
    on every attempt (the same record), which keeps it from aging out while the request lives."""
    await replies.publish_durable(subjects.dispatch_put_subject(request.request_id),
                                  m.encode(record(request, time.time())),
                                  f"dispatch.{request.request_id}.{request.attempt}")
