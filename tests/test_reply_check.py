"""The reply subjects a responder answers on: an inbox subject and nothing else."""

from __future__ import annotations

import pytest

from inferbus.bus.auth import inbox_prefix
from inferbus.bus.reply_check import MAX_REPLY_LENGTH, reply_refusal


@pytest.mark.parametrize("reply", [
    f"{inbox_prefix('producer')}.Abc123.7",  # nats-py's request inbox of an identity
    f"{inbox_prefix('gateway-7d9f-x2')}.x",  # a pod's, under auth callout
    "_INBOX.Kq1Lx0d5Zt6",  # nats-py's default inbox on an open bus
])
def test_an_inbox_is_answered(reply: str) -> None:
    assert reply_refusal(reply) is None


@pytest.mark.parametrize(("reply", "why"), [
    ("", "no reply subject"),
    ("$JS.API.STREAM.DELETE.USAGE", "outside the inbox namespace"),
    ("$KV.batches.acme.batch_1", "outside the inbox namespace"),
    ("inferbus.usage.acme", "outside the inbox namespace"),
    ("$JS.ACK.REQUESTS.c.1.1.1.1.0", "outside the inbox namespace"),
    ("_inbox.producer.x", "outside the inbox namespace"),  # subjects are case-sensitive
    ("_INBOXES.producer.x", "outside the inbox namespace"),
    ("_INBOX", "names no caller's inbox"),
    ("_INBOX.producer.*", "not a literal subject"),
    ("_INBOX.>", "not a literal subject"),
    ("_INBOX..x", "not a literal subject"),
    ("_INBOX.producer.", "not a literal subject"),
    ("_INBOX.pro ducer.x", "not a literal subject"),
    ("_INBOX.producer." + "x" * MAX_REPLY_LENGTH, "too long"),
])
def test_anything_else_is_refused(reply: str, why: str) -> None:
    refusal = reply_refusal(reply)
    assert refusal is not None and why in refusal


def test_response_permissions_are_as_narrow_as_the_answers() -> None:
    """Workers and the router answer once per request, the batch service once per line handed
    back to it, within a minute; the gateway once per streamed chunk; no other identity answers
    at all (docs/security.md)."""
    from inferbus.bus.auth import PROMPT_REPLY_EXPIRE, STREAMED_REPLIES_MAX, permissions

    for role, owner in (("worker", None), ("router", None), ("batch", "main")):
        p = permissions(role, role, owner)  # type: ignore[arg-type]
        assert (p.allow_responses, p.responses_max, p.responses_expire) == (True, 1, PROMPT_REPLY_EXPIRE) == (
            True, 1, "1m")
    gateway = permissions("gateway", "gateway")
    assert (gateway.allow_responses, gateway.responses_max) == (True, STREAMED_REPLIES_MAX)
    for role in ("billing", "autoscaler", "producer"):
        assert not permissions(role, role).allow_responses  # type: ignore[arg-type]
