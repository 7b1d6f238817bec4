"""Which reply subjects a service answers on: the pure check every request/reply responder runs.

NATS lets a requester name any reply subject, and a responder's answer is published there with
the responder's rights (`allow_responses` grants a publish to the reply subject of every request
received, whatever the responder's own allow and deny lists say). A request whose reply subject
is `$JS.API.STREAM.DELETE.USAGE` or `$KV.batches.<key>` would make the responder a confused
deputy, deleting a stream or overwriting a record. So a responder answers only into the inbox
namespace (`_INBOX.<identity>.<...>`): every identity may subscribe to its own inbox prefix only
(`bus_auth.inbox_prefix`), and no stream, bucket or API subject lies under `_INBOX.`.
"""

from __future__ import annotations

INBOX_ROOT = "_INBOX"
MAX_REPLY_LENGTH = 512  # nats-py's inboxes are under 100 characters; anything longer is not one


def reply_refusal(reply: str) -> str | None:
    """Why an answer must not be published on `reply`, or None when `reply` is an inbox subject:
    `_INBOX.<token>[.<more tokens>]`, literal (no wildcards). Replicas of one role may share an
    identity (and so an inbox prefix) and ask each other (a decode worker asks a prefill worker),
    so an answer into the answering identity's own prefix is one too."""
    if not reply:
        return "no reply subject"
    if len(reply) > MAX_REPLY_LENGTH:
        return "reply subject too long"
    tokens = reply.split(".")
    if tokens[0] != INBOX_ROOT:
        return "reply subject outside the inbox namespace"
    if len(tokens) < 2:
        return "reply subject names no caller's inbox"
    if any(not t or "*" in t or ">" in t or any(ch.isspace() for ch in t) for t in tokens):
        return "reply subject is not a literal subject"
    return None
