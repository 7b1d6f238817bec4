"""What a worker can send again to a gateway that missed stream events (`services/worker/replay.py`)."""

from __future__ import annotations

from proto import messages as m
from proto import subjects
from services.worker.replay import ReplayLog

SUBJECT = subjects.token_subject("g1")
OWNER = subjects.reply_owner(SUBJECT)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def chunk(seq: int, text: str, attempt: int = 0, request_id: str = "r") -> m.TokenChunk:
    return m.TokenChunk(request_id=request_id, attempt=attempt, seq=seq, text=text, completion_tokens=seq + 1)


def final(seq: int, attempt: int = 0, request_id: str = "r") -> m.Final:
    return m.Final(request_id=request_id, attempt=attempt, seq=seq, text="", finish_reason="stop",
                   usage=m.Usage(prompt_tokens=3, completion_tokens=seq))


def texts(events: list[m.StreamEvent]) -> list[str]:
    return [getattr(e, "text", type(e).__name__) for e in events]


def test_a_running_stream_resends_from_the_first_chunk_asked_for() -> None:
    log = ReplayLog(Clock())
    log.record(
        SUBJECT, [m.Accepted(request_id="r", attempt=0, worker_id="w", queue_wait=0.0), chunk(0, "a"), chunk(1, "b")]
    )
    log.record(SUBJECT, [chunk(2, "c")])
    state, subject, events = log.since("r", 0, 1, owner=OWNER, running=True)
    assert (state, subject, texts(events)) == ("running", SUBJECT, ["b", "c"])
    assert log.since("r", 0, 3, owner=OWNER, running=True)[2] == []  # nothing missed: nothing resent


def test_a_finished_stream_resends_its_last_events_until_it_expires() -> None:
    clock = Clock()
    log = ReplayLog(clock, keep_s=10)
    log.record(SUBJECT, [chunk(0, "a"), chunk(1, "b"), final(2)])
    log.ended("r", 0)
    state, _, events = log.since("r", 0, 2, owner=OWNER, running=False)
    assert state == "finished" and [type(e) for e in events] == [m.Final]
    clock.now += 9
    assert log.since("r", 0, 1, owner=OWNER, running=False)[0] == "finished"
    clock.now += 2
    assert log.since("r", 0, 1, owner=OWNER, running=False)[0] == "unknown"
    assert len(log) == 0


def test_an_error_without_seq_is_resent_after_the_chunks() -> None:
    log = ReplayLog(Clock())
    log.record(SUBJECT, [chunk(0, "a"), m.StreamError(request_id="r", attempt=0, code="engine_error", message="x",
                                                      retryable=True, status=503)])
    state, _, events = log.since("r", 0, 1, owner=OWNER, running=False)
    assert state == "finished" and [type(e) for e in events] == [m.StreamError]


def test_chunks_that_fell_out_of_the_log_are_unknown() -> None:
    log = ReplayLog(Clock(), depth=4)
    log.record(SUBJECT, [chunk(i, str(i)) for i in range(10)])
    assert log.since("r", 0, 5, owner=OWNER, running=True)[0] == "unknown"
    state, _, events = log.since("r", 0, 6, owner=OWNER, running=True)
    assert state == "running" and texts(events) == ["6", "7", "8", "9"]


def test_another_attempt_another_gateway_or_nothing_kept_is_unknown() -> None:
    log = ReplayLog(Clock())
    log.record(SUBJECT, [chunk(0, "a", attempt=1)])
    assert log.since("r", 0, 0, owner=OWNER, running=False)[0] == "unknown"  # an older attempt
    assert log.since("r", 1, 0, owner="g2", running=True)[0] == "unknown"  # not that gateway's stream
    assert log.since("other", 0, 0, owner=OWNER, running=False)[0] == "unknown"
    # Running, its events all still waiting for their frame: nothing lost yet.
    assert log.since("other", 0, 0, owner=OWNER, running=True) == ("running", "", [])


def test_an_attempt_that_ended_without_a_last_event_is_forgotten_too() -> None:
    clock = Clock()
    log = ReplayLog(clock, keep_s=5)
    log.ended("r", 0)  # superseded: its last chunks had not left yet
    log.record(SUBJECT, [chunk(0, "a")])
    log.record(SUBJECT, [chunk(0, "x", request_id="s")])
    log.ended("s", 0)
    clock.now += 6
    log.expire()
    assert len(log) == 0
    # A newer attempt of the same request is not forgotten with the old one.
    log.record(SUBJECT, [chunk(0, "a", attempt=2)])
    log.ended("r", 1)
    clock.now += 6
    log.expire()
    assert log.since("r", 2, 0, owner=OWNER, running=True)[0] == "running" and len(log) == 1
