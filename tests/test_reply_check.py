"""The reply subjects a responder answers on: an inbox subject and nothing else."""

from __future__ import annotations

import pytest

from inferbus.bus_auth import inbox_prefix
from inferbus.reply_check import MAX_REPLY_LENGTH, reply_refusal


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
