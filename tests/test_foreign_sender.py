"""Which stream events the gateway refuses as spoken for another worker's attempt (`foreign_sender`,
by the worker an event names; `foreign_publisher`, by the worker whose subject it came on)."""

from __future__ import annotations

from proto import messages as m
from services.gateway.flight import Flight, foreign_publisher, foreign_sender


def a_flight(state: str, holder: str | None) -> Flight:
    request = m.InferenceRequest(request_id="r", tenant="t", model="m", prompt="", reply_to="inferbus.tok.g",
                                 sampling=m.SamplingParams(max_new_tokens=4), deadline=0.0, created=0.0)
    return Flight(request=request, state=state, worker_id=holder)


def test_an_event_naming_another_worker_than_the_holder_is_foreign() -> None:
    flight = a_flight("accepted", "w1")
    for event in (m.Accepted(request_id="r", attempt=0, worker_id="w2", queue_wait=0.0),
                  m.Handoff(request_id="r", attempt=0, worker_id="w2"),
                  m.TokenChunk(request_id="r", attempt=0, seq=0, text="x", completion_tokens=1, worker_id="w2"),
                  m.Final(request_id="r", attempt=0, seq=1, text="", finish_reason="stop",
                          usage=m.Usage(prompt_tokens=1, completion_tokens=1), worker_id="w2")):
        assert foreign_sender(flight, event) == "w2"
    # The holder's own events, and events that name no worker, pass.
    assert foreign_sender(flight, m.Handoff(request_id="r", attempt=0, worker_id="w1")) is None
    assert foreign_sender(flight, m.TokenChunk(request_id="r", attempt=0, seq=1, text="x", completion_tokens=2)) is None
    assert foreign_sender(flight, m.StreamError(request_id="r", attempt=0, code="c", message="m")) is None


def test_before_a_worker_holds_the_attempt_any_worker_may_report_starting_it() -> None:
    """Queued (possibly placed on a worker, then moved to the shared queue): whoever takes it."""
    accepted = m.Accepted(request_id="r", attempt=0, worker_id="w2", queue_wait=0.0)
    assert foreign_sender(a_flight("queued", "w1"), accepted) is None
    assert foreign_sender(a_flight("queued", None), accepted) is None


CHUNK = m.TokenChunk(request_id="r", attempt=0, seq=1, text="x", completion_tokens=2)
ERROR = m.StreamError(request_id="r", attempt=0, code="content_filter", message="m")


def test_an_event_published_by_another_worker_than_the_holder_is_refused() -> None:
    """Events that name no worker (a later chunk, an error) are caught by their subject's publisher."""
    flight = a_flight("accepted", "w1")
    for event in (CHUNK, ERROR):
        assert foreign_publisher(flight, event, "w2") == "not_the_holder"
        assert foreign_publisher(flight, event, "w1") is None  # the control: the holder's own
    # An event naming the holder, published by another worker; naming itself, by another.
    named_holder = m.Final(request_id="r", attempt=0, seq=1, text="", finish_reason="stop",
                           usage=m.Usage(prompt_tokens=1, completion_tokens=1), worker_id="w1")
    assert foreign_publisher(flight, named_holder, "w2") == "names_another_worker"
    assert foreign_publisher(flight, named_holder, "w1") is None
    # A late event of an attempt given up may come from its old worker.
    assert foreign_publisher(flight, m.TokenChunk(request_id="r", attempt=1, seq=1, text="x", completion_tokens=1),
                             "w2") is None


def test_before_a_worker_holds_the_attempt_its_first_publisher_does() -> None:
    flight = a_flight("queued", None)
    assert foreign_publisher(flight, CHUNK, "w2") is None
    flight.publisher = (0, "w2")
    assert foreign_publisher(flight, ERROR, "w3") == "not_the_first_publisher"
    assert foreign_publisher(flight, ERROR, "w2") is None
    flight.publisher = (1, "w2")  # another attempt's first publisher: no bearing on this one
    assert foreign_publisher(flight, ERROR, "w3") is None
