"""Which stream events the gateway refuses as spoken for another worker's attempt (`foreign_sender`)."""

from __future__ import annotations

from proto import messages as m
from services.gateway.dispatch import Flight, foreign_sender


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
