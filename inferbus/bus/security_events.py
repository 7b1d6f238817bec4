"""Security events: a request the platform refused because it could only have been forged (a
reply subject outside the caller's inbox, ...). Each is a warning log line `security_event` with
its `kind` and a count in `inferbus_security_events_total{kind}`, so an alert can fire on any."""

from __future__ import annotations

from nats.aio.msg import Msg
from prometheus_client import Counter

from inferbus.runtime import logs

from .reply_check import reply_refusal

log = logs.get(__name__)

SECURITY_EVENTS = Counter("inferbus_security_events_total",
                          "Requests refused as forgeries (a reply subject that is no caller's inbox, ...), by kind",
                          ["kind"])

UNTRUSTED_REPLY = "untrusted_reply"


def record(kind: str, **fields: object) -> None:
    SECURITY_EVENTS.labels(kind).inc()
    log.warning("security_event", kind=kind, **fields)


def answerable(msg: Msg) -> bool:
    """Whether `msg` may be answered on its reply subject (`reply_check.reply_refusal`); a refused
    reply subject is recorded as a security event. A message without a reply subject is not
    answerable and is no event (fire and forget)."""
    if not msg.reply:
        return False
    why = reply_refusal(msg.reply)
    if why is None:
        return True
    record(UNTRUSTED_REPLY, subject=msg.subject, reply=msg.reply[:200], why=why)
    return False
