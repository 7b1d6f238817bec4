"""The worker's stream framing (services/worker/frames.py): what leaves together, merged, and when."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import nats
import pytest
from nats.aio.msg import Msg

from proto import messages as m
from services.worker.events_out import EventSender
from services.worker.frames import PendingFrames, merge, urgent
from services.worker.tasks import Background

from .nats_server import NatsServer

GATEWAY_A, GATEWAY_B = "tokens.gw-a", "tokens.gw-b"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def chunk(seq: int, text: str, *, rid: str = "r1", attempt: int = 0, ids: list[int] | None = None,
          completion: int = 0, prompt_tokens: int | None = None,
          logprobs: list[m.TokenLogprob] | None = None) -> m.TokenChunk:
    return m.TokenChunk(request_id=rid, attempt=attempt, seq=seq, text=text, completion_tokens=completion,
                        prompt_tokens=prompt_tokens, token_ids=ids or [], logprobs=logprobs)


def final(seq: int, text: str, *, rid: str = "r1", ids: list[int] | None = None) -> m.Final:
    return m.Final(request_id=rid, attempt=0, seq=seq, text=text, finish_reason="stop",
                   usage=m.Usage(prompt_tokens=5, completion_tokens=9), worker_id="w1", token_ids=ids or [],
                   matched_stop="</s>")


def test_first_output_errors_and_handoffs_do_not_wait_for_the_window() -> None:
    assert urgent(chunk(0, "a")) and urgent(final(0, "whole answer"))
    assert not urgent(chunk(1, "b")) and not urgent(final(3, ""))
    assert urgent(m.StreamError(request_id="r1", attempt=0, code="engine_error", message="boom"))
    assert urgent(m.Handoff(request_id="r1", attempt=0, worker_id="w1"))
    assert not urgent(m.Accepted(request_id="r1", attempt=0, worker_id="w1", queue_wait=0.0))


def test_later_tokens_wait_at_most_the_window_from_the_oldest_waiting_event() -> None:
    clock = Clock()
    frames = PendingFrames(0.001, clock)
    assert frames.due_in() is None
    frames.add(GATEWAY_A, chunk(3, "x"))
    clock.now += 0.0004
    frames.add(GATEWAY_B, chunk(4, "z", rid="r2"))
    assert abs(frames.due_in() - 0.0006) < 1e-9  # type: ignore[operator]
    clock.now += 0.002
    assert frames.due_in() == 0.0
    taken = frames.take()
    assert set(taken) == {GATEWAY_A, GATEWAY_B}
    assert frames.due_in() is None and len(frames) == 0


def test_a_first_token_makes_the_whole_frame_leave_now() -> None:
    frames = PendingFrames(0.001, Clock())
    frames.add(GATEWAY_A, chunk(5, "old", rid="r1"))
    frames.add(GATEWAY_A, chunk(0, "first", rid="r2"))
    assert frames.due_in() == 0.0
    frames.take()
    frames.add(GATEWAY_A, chunk(6, "next", rid="r1"))
    assert frames.due_in() > 0  # type: ignore[operator]


def accepted(rid: str = "r1") -> m.Accepted:
    return m.Accepted(request_id=rid, attempt=0, worker_id="w1", queue_wait=0.0)


def test_an_accepted_waits_for_its_first_token_up_to_its_own_wait() -> None:
    clock = Clock()
    frames = PendingFrames(0.001, clock, accepted_wait_s=0.02)
    frames.add(GATEWAY_A, accepted())
    assert abs(frames.due_in() - 0.02) < 1e-9  # type: ignore[operator]
    clock.now += 0.003  # past the window: still waiting for the first token
    assert abs(frames.due_in() - 0.017) < 1e-9  # type: ignore[operator]
    frames.add(GATEWAY_A, chunk(0, "Hi"))  # the first token: both leave at the end of this pass
    assert frames.due_in() == 0.0
    assert [type(e).__name__ for e in frames.take()[GATEWAY_A]] == ["Accepted", "TokenChunk"]
    # Without a first token it leaves on its own once its wait is over.
    frames.add(GATEWAY_A, accepted("r2"))
    clock.now += 0.02
    assert frames.due_in() == 0.0


def test_another_streams_tokens_take_a_waiting_accepted_along_within_their_window() -> None:
    clock = Clock()
    frames = PendingFrames(0.001, clock, accepted_wait_s=0.02)
    frames.add(GATEWAY_A, accepted("r1"))
    clock.now += 0.005
    frames.add(GATEWAY_A, chunk(7, "x", rid="r2"))
    assert abs(frames.due_in() - 0.001) < 1e-9  # type: ignore[operator]
    assert [e.request_id for e in frames.take()[GATEWAY_A]] == ["r1", "r2"]


def test_an_accepted_never_waits_less_than_the_window() -> None:
    frames = PendingFrames(0.005, Clock(), accepted_wait_s=0.001)
    frames.add(GATEWAY_A, accepted())
    assert abs(frames.due_in() - 0.005) < 1e-9  # type: ignore[operator]


def test_no_window_sends_every_loop_pass() -> None:
    frames = PendingFrames(0.0, Clock())
    frames.add(GATEWAY_A, chunk(2, "a"))
    assert frames.due_in() == 0.0


def test_a_streams_waiting_tokens_merge_into_one_chunk_that_keeps_its_seq() -> None:
    lp = [m.TokenLogprob(token="a", logprob=-0.1)]
    frames = PendingFrames(0.001, Clock())
    assert not frames.add(GATEWAY_A, chunk(0, "He", ids=[1], completion=1, prompt_tokens=7, logprobs=lp))
    assert not frames.add(GATEWAY_A, chunk(0, "x", rid="r2"))
    assert frames.add(GATEWAY_A, chunk(1, "llo", ids=[2, 3], completion=3,
                                       logprobs=[m.TokenLogprob(token="llo", logprob=-0.2)]))
    events = frames.take()[GATEWAY_A]
    assert [e.request_id for e in events] == ["r1", "r2"]
    merged = events[0]
    assert isinstance(merged, m.TokenChunk)
    assert (merged.seq, merged.text, merged.token_ids, merged.completion_tokens, merged.prompt_tokens) == (
        0, "Hello", [1, 2, 3], 3, 7)
    assert [lp.token for lp in merged.logprobs or []] == ["a", "llo"]


def test_a_final_merges_into_the_waiting_chunk_before_it() -> None:
    frames = PendingFrames(0.001, Clock())
    frames.add(GATEWAY_A, chunk(4, "the ", ids=[9]))
    assert frames.add(GATEWAY_A, final(5, "end", ids=[10]))
    [event] = frames.take()[GATEWAY_A]
    assert isinstance(event, m.Final)
    assert (event.seq, event.text, event.token_ids, event.finish_reason, event.matched_stop) == (
        4, "the end", [9, 10], "stop", "</s>")
    assert event.usage.completion_tokens == 9 and event.logprobs is None


def test_nothing_merges_across_attempts_other_events_or_sent_frames() -> None:
    frames = PendingFrames(0.001, Clock())
    frames.add(GATEWAY_A, chunk(3, "a"))
    assert not frames.add(GATEWAY_A, chunk(0, "b", attempt=1))  # a new attempt numbers from 0
    frames.take()
    frames.add(GATEWAY_A, chunk(4, "c"))
    frames.add(GATEWAY_A, m.StreamError(request_id="r1", attempt=0, code="engine_error", message="boom"))
    assert not frames.add(GATEWAY_A, final(5, ""))  # after the error, in order
    events = frames.take()[GATEWAY_A]
    assert [type(e).__name__ for e in events] == ["TokenChunk", "StreamError", "Final"]
    frames.add(GATEWAY_A, chunk(6, "d"))
    frames.take()
    assert not frames.add(GATEWAY_A, chunk(7, "e"))  # the earlier chunk has left


def test_merge_keeps_the_later_prompt_count_when_the_first_had_none() -> None:
    merged = merge(chunk(2, "a"), chunk(3, "b", prompt_tokens=4))
    assert isinstance(merged, m.TokenChunk) and merged.prompt_tokens == 4 and merged.logprobs is None


# ---- the shell: EventSender on a real nats-server ----------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    running = NatsServer(tmp_path_factory.mktemp("nats"))
    running.start()
    yield running
    running.stop()


def request_for(reply_to: str, rid: str = "r1") -> m.InferenceRequest:
    return m.InferenceRequest(request_id=rid, tenant="t", model="m", prompt="p",
                              sampling=m.SamplingParams(max_new_tokens=8), reply_to=reply_to, deadline=0, created=0)


@pytest.mark.slow
async def test_a_window_of_events_leaves_as_one_frame_and_a_first_token_without_waiting(server: NatsServer) -> None:
    nc = await nats.connect(server.url)
    frames: asyncio.Queue[tuple[float, m.StreamFrame]] = asyncio.Queue()

    async def on_frame(msg: Msg) -> None:
        frames.put_nowait((time.monotonic(), m.decode_stream_frame(msg.data)))

    await nc.subscribe(f"{GATEWAY_A}.w1", cb=on_frame)
    await nc.flush()
    sender = EventSender(nc, Background(), window_s=0.2, worker_id="w1")
    r1, r2 = request_for(GATEWAY_A), request_for(GATEWAY_A, "r2")
    try:
        # A first token leaves at the end of the loop pass, with what else was queued.
        sent_at = time.monotonic()
        assert not sender.send(r1, m.Accepted(request_id="r1", attempt=0, worker_id="w1", queue_wait=0.0))
        assert not sender.send(r1, chunk(0, "Hel", completion=1))
        assert sender.send(r1, chunk(1, "lo", completion=2))  # merged into the waiting first chunk
        arrived, frame = await asyncio.wait_for(frames.get(), 5)
        assert arrived - sent_at < 0.15  # well inside the 200 ms window
        assert [type(e).__name__ for e in frame.events] == ["Accepted", "TokenChunk"]
        first = frame.events[1]
        assert isinstance(first, m.TokenChunk) and (first.seq, first.text, first.completion_tokens) == (0, "Hello", 2)

        # Later tokens of two streams wait for the window, then leave as one message.
        sent_at = time.monotonic()
        sender.send(r1, chunk(1, " wor", completion=3))
        sender.send(r2, chunk(3, "x", rid="r2"))
        assert sender.send(r1, final(2, "ld"))
        arrived, frame = await asyncio.wait_for(frames.get(), 5)
        assert arrived - sent_at >= 0.15
        assert [(type(e).__name__, e.request_id) for e in frame.events] == [("Final", "r1"), ("TokenChunk", "r2")]
        assert isinstance(frame.events[0], m.Final) and frame.events[0].text == " world" and frame.events[0].seq == 1

        # An Accepted alone waits for its first token (here past the 200 ms window, within its own
        # wait); a later token of another stream brings the flush forward to its window.
        sender_wait = EventSender(nc, Background(), window_s=0.05, accepted_wait_s=5.0, worker_id="w1")
        sent_at = time.monotonic()
        sender_wait.send(r2, m.Accepted(request_id="r2", attempt=0, worker_id="w1", queue_wait=0.0))
        await asyncio.sleep(0.1)
        assert frames.empty()
        sender_wait.send(r1, chunk(2, "!", completion=4))
        arrived, frame = await asyncio.wait_for(frames.get(), 5)
        assert 0.1 <= arrived - sent_at < 1.0
        assert [(type(e).__name__, e.request_id) for e in frame.events] == [("Accepted", "r2"), ("TokenChunk", "r1")]

        # Stopping sends what waits at once.
        sent_at = time.monotonic()
        sender.send(r2, chunk(4, "y", rid="r2"))
        sender.flush()
        arrived, frame = await asyncio.wait_for(frames.get(), 5)
        assert arrived - sent_at < 0.15 and frame.events[0].request_id == "r2"
        assert frames.empty()
    finally:
        await nc.close()
