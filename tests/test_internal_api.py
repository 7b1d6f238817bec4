"""The pure parts of the internal producers' API: an HTTP call's ASGI form and its replies."""

from __future__ import annotations

from typing import Any

from proto import messages as m
from proto import subjects
from services.gateway.internal_api import BusReply, request_scope, split_events


def test_subjects_name_the_endpoints_and_nothing_else() -> None:
    assert subjects.api_subject("chat") == "inferbus.api.v1.chat.completions"
    assert subjects.api_endpoint(subjects.api_subject("completion")) == "completion"
    assert subjects.api_endpoint("inferbus.api.v1.embeddings") is None
    assert subjects.api_cancel_subject("gw-1", "abc").startswith(subjects.api_cancel_wildcard("gw-1")[:-1])


def test_the_scope_forwards_the_key_and_trace_and_nothing_else() -> None:
    scope = request_scope("chat", b'{"a": 1}', {"Authorization": "Bearer sk-x", "traceparent": "00-ab", "X-Other": "y"})
    assert (scope["method"], scope["path"]) == ("POST", "/v1/chat/completions")
    assert dict(scope["headers"]) == {b"content-length": b"8", b"content-type": b"application/json",
                                      b"authorization": b"Bearer sk-x", b"traceparent": b"00-ab"}
    assert dict(request_scope("completion", b"", None)["headers"])[b"content-length"] == b"0"


def test_split_events_keeps_partial_frames_and_drops_done() -> None:
    events, rest = split_events(b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\ndata: {"c"')
    assert (events, rest) == ([b'{"a":1}', b'{"b":2}'], b'data: {"c"')
    assert split_events(rest + b":3}\n\n") == ([b'{"c":3}'], b"")


class Published:
    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes, dict[str, str]]] = []

    async def __call__(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        self.messages.append((subject, data, headers))


async def test_a_json_answer_is_one_reply_with_status_id_and_rate_headers() -> None:
    published = Published()
    reply = BusReply(published, "_INBOX.1", "inferbus.api.cancel.gw.c1")
    start: dict[str, Any] = {"type": "http.response.start", "status": 429, "headers": [
        (b"content-type", b"application/json"), (b"x-request-id", b"r1"), (b"retry-after", b"3"),
        (b"x-ratelimit-limit-requests", b"1"), (b"server", b"x")]}
    await reply.send(start)
    await reply.send({"type": "http.response.body", "body": b'{"error":', "more_body": True})
    await reply.send({"type": "http.response.body", "body": b"{}}"})
    ((subject, data, headers),) = published.messages
    assert (subject, data) == ("_INBOX.1", b'{"error":{}}')
    assert headers == {m.API_HEADER_VERSION: m.API_VERSION, m.API_HEADER_STATUS: "429", m.API_HEADER_REQUEST_ID: "r1",
                       "retry-after": "3", "x-ratelimit-limit-requests": "1"}


async def test_a_stream_is_one_reply_per_event_then_done_and_names_its_cancel_subject() -> None:
    published = Published()
    reply = BusReply(published, "_INBOX.2", "inferbus.api.cancel.gw.c2")
    await reply.send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"text/event-stream; charset=utf-8"), (b"x-request-id", b"r2")]})
    await reply.send({"type": "http.response.body", "body": b'data: {"n":1}\n\ndata: {"n"', "more_body": True})
    await reply.send({"type": "http.response.body", "body": b':2}\n\ndata: [DONE]\n\n', "more_body": False})
    assert [(data, h[m.API_HEADER_STREAM]) for _, data, h in published.messages] == [
        (b'{"n":1}', "chunk"), (b'{"n":2}', "chunk"), (b"", "done")]
    assert [h.get(m.API_HEADER_CANCEL) for _, _, h in published.messages] == ["inferbus.api.cancel.gw.c2", None, None]
    assert all(h[m.API_HEADER_STATUS] == "200" for _, _, h in published.messages)
