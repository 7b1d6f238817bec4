"""Who dispatched each request, for whom: the `dispatches` bucket.

A gateway (or the batch service) puts a request's record before it queues the request; only those
identities may write the bucket (`bus_auth`), and billing takes a worker's usage only for a
request whose record names the usage's tenant (`services/billing/attribution.py`), so a worker
cannot bill a request id it made up, nor a real request to another tenant. A worker runs an
interactive request only when its record names the request's tenant and reply subject
(`request_refusal`), so an identity that may move requests on the queue (the router's recovery)
cannot have work run for another tenant or owner.
"""

from __future__ import annotations

import time

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError

from inferbus.bus.replies import Replies
from inferbus.runtime.records import decode_or_none
from proto import messages as m
from proto import subjects

_decoder = m.decoder(m.Dispatch)


def record(request: m.InferenceRequest, now: float) -> m.Dispatch:
    return m.Dispatch(request_id=request.request_id, tenant=request.tenant, reply_to=request.reply_to, created=now)


async def publish(replies: Replies, request: m.InferenceRequest) -> None:
    """The request's record, put before the request is queued (so its usage finds it); put again
    on every attempt (the same record), which keeps it from aging out while the request lives."""
    await replies.publish_durable(subjects.dispatch_put_subject(request.request_id),
                                  m.encode(record(request, time.time())),
                                  f"dispatch.{request.request_id}.{request.attempt}")


UNDISPATCHED_REQUEST = "undispatched_request"  # the security event's kind (a worker refusing a request)


def request_refusal(request: m.InferenceRequest, dispatched: m.Dispatch | None) -> str | None:
    """Why a worker refuses to run the interactive `request` whose dispatch record is `dispatched`
    (None: there is none); None when it runs."""
    if dispatched is None:
        return "not_dispatched"
    if dispatched.request_id != request.request_id or dispatched.tenant != request.tenant:
        return "dispatched_for_another_tenant"
    if dispatched.reply_to != request.reply_to:
        return "dispatched_to_another_owner"
    return None


async def lookup(js: JetStreamContext, request_id: str) -> m.Dispatch | None:
    """The request's record from the stream's leader (a replica answering a direct get may not
    have applied a record put just before its request was queued); None when there is none, the
    bucket is missing or the record does not decode."""
    try:
        found = await js.get_last_msg(f"KV_{subjects.DISPATCHES_BUCKET}", subjects.dispatch_put_subject(request_id))
    except (NotFoundError, KeyNotFoundError, BucketNotFoundError):
        return None
    return decode_or_none(_decoder, found.data or b"", store="dispatches", key=request_id)
