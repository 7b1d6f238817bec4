"""Stream events lost on the bus: the gateway's NATS connection is cut mid-stream (as when the node
it uses dies) and comes back a moment later. Core NATS drops what the worker published meanwhile;
the gateway asks the worker to send it again (at once when its connection is back; otherwise at a
gap or after the stream's silence), so the client gets exactly the text it would have got,
without the request running a second time.

Every service reaches the real nats-server through a TCP proxy that can cut one client.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
from nats.aio.msg import Msg

from inferbus.bus import connection as bus
from proto import messages as m
from proto import subjects
from services.gateway.dispatch import Dispatcher
from services.gateway.flight import Flight

from .conftest import MODEL, Platform, running_platform
from .nats_proxy import NatsProxy
from .nats_server import NatsServer
from .waiting import wait_for

pytestmark = pytest.mark.e2e

SILENCE_S = 1.0


@pytest.fixture(scope="module")
def proxied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Platform, NatsProxy]]:
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    proxy = NatsProxy("127.0.0.1", server.port)
    proxy.start()
    try:
        # Engines at real speed (about 60 tokens/s per stream here): a cut of a second loses tens
        # of events, as on a GPU.
        with running_platform(tmp_path_factory.mktemp("lost"), workers=1, time_scale=1.0, router=False,
                              nats_url=f"nats://127.0.0.1:{proxy.port}",
                              extra_env={"INFERBUS_STREAM_SILENCE_S": str(SILENCE_S),
                                         "INFERBUS_REQUEST_TIMEOUT_S": "60"}) as platform:
            yield platform, proxy
    finally:
        proxy.stop()
        server.stop()


def stream(platform: Platform, max_tokens: int, cut: NatsProxy | None = None, hold_s: float = 0.0
           ) -> tuple[str, str | None, int | None, float]:
    """The text, finish reason and completion tokens of one chat stream, and how long the stream
    took after the cut (or in all); with `cut`, the gateway's NATS connection is cut right after
    the first chunk with a token reached it, and stays away `hold_s`."""
    if cut is not None:
        cut.arm("gateway", hold_s, carries_a_token)
    started = time.monotonic()
    chunks = platform.client(timeout=60).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about the sea"}], max_tokens=max_tokens,
        temperature=0, seed=7, stream=True, stream_options={"include_usage": True},
    )
    text: list[str] = []
    finish, tokens = None, None
    for chunk in chunks:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    if cut is not None:
        assert cut.cut_at is not None and cut.cut_at > started, "the gateway was not cut"
        started = cut.cut_at
    return "".join(text), finish, tokens, time.monotonic() - started


def carries_a_token(subject: str, payload: bytes) -> bool:
    """Whether a message to the gateway is stream events holding a token (the cut's trigger)."""
    if not subject.startswith(f"{subjects.PREFIX}.tok."):
        return False
    try:
        return any(isinstance(event, m.TokenChunk) for event in m.decode_stream_frame(payload).events)
    except msgspec.DecodeError:
        return False


def gateway_lines(platform: Platform, event: str) -> list[dict]:
    path = platform.stack.config.state_dir / "logs" / "gateway.log"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == event]


def test_a_stream_whose_last_events_were_lost_ends_complete_without_a_second_run(
        proxied: tuple[Platform, NatsProxy]) -> None:
    platform, proxy = proxied
    expected = stream(platform, max_tokens=40)
    assert expected[1] == "length" and expected[2] == 40
    before = len(gateway_lines(platform, "stream_resent"))
    # 40 tokens take well under the 2 s the gateway stays away: its Final is lost with the rest.
    text, finish, tokens, after_cut = stream(platform, max_tokens=40, cut=proxy, hold_s=2.0)
    assert (text, finish, tokens) == expected[:3]
    # Asked when the connection came back (~2.5 s; or by the silence check, whose question waited
    # for the connection), not at the client's timeout.
    assert after_cut < 2.5 + SILENCE_S + 3
    # The copies sent again (the Final among them) can reach the client before the gateway has read
    # the worker's answer and logged it: wait for the line, then make sure it is the only one.
    wait_for(lambda: gateway_lines(platform, "stream_resent")[before:], 10, what="the gateway's stream_resent")
    time.sleep(0.5)
    resent = gateway_lines(platform, "stream_resent")[before:]
    assert len(resent) == 1 and resent[0]["state"] == "finished" and resent[0]["resent"] >= 1
    assert not gateway_lines(platform, "migrating")


def test_a_gap_in_the_middle_of_a_stream_is_filled_by_the_worker(proxied: tuple[Platform, NatsProxy]) -> None:
    platform, proxy = proxied
    expected = stream(platform, max_tokens=200)
    before = len(gateway_lines(platform, "stream_resent"))
    # The stream outlives the cut (200 tokens, ~3 s): the worker still runs it when asked.
    text, finish, tokens, _ = stream(platform, max_tokens=200, cut=proxy, hold_s=0.3)
    assert (text, finish, tokens) == expected[:3]
    resent = wait_for(lambda: gateway_lines(platform, "stream_resent")[before:], 10, what="the gateway's stream_resent")
    assert resent[0]["state"] == "running"
    assert not gateway_lines(platform, "migrating")


async def relay(platform: Platform, request_id: str, lose: Callable[[int, bool], bool], lose_accepted: bool = False,
                reconnect_after_s: float | None = None) -> tuple[str, int, list[str]]:
    """One request through a dispatcher in this process, on the platform's bus, that loses the
    first copy of each chunk `lose(seq, is_final)` picks on arrival (and the `Accepted`, with
    `lose_accepted`), and is told its connection came back after `reconnect_after_s`: the text,
    the attempt that finished it and why the worker was asked to resend (each question asked,
    not the later signs of a loss already being asked about)."""
    nc = await bus.connect(platform.stack.nats_url, name="test-dispatcher")
    kv = await bus.workers_bucket(nc.jetstream(), 3.0)
    dispatcher = Dispatcher(nc, kv, gateway_id="test-gateway", heartbeat_ttl_s=3.0, max_attempts=3,
                            placement_timeout_s=0, silence_s=SILENCE_S)
    dropped: set[int] = set()
    deliver, recover = dispatcher._on_events, dispatcher.recover
    asked: list[str] = []

    async def lossy(msg: Msg) -> None:
        kept = []
        for event in m.decode_stream_frame(msg.data).events:
            if (
                isinstance(event, (m.TokenChunk, m.Final))
                and event.seq not in dropped
                and lose(event.seq, isinstance(event, m.Final))
            ):
                dropped.add(event.seq)
            elif not (lose_accepted and isinstance(event, m.Accepted)):
                kept.append(event)
        msg.data = m.encode(m.StreamFrame(events=kept))
        await deliver(msg)

    def asking(flight: Flight, why: str) -> None:
        if not flight.resending:  # else the question already asked stands (a later chunk of the same gap)
            asked.append(why)
        recover(flight, why)

    dispatcher._on_events = lossy  # type: ignore[method-assign]
    dispatcher.recover = asking  # type: ignore[method-assign]
    await dispatcher.start()
    try:
        now = time.time()
        request = m.InferenceRequest(request_id=request_id, tenant="demo", model=MODEL, prompt="Tell me about the sea",
                                     reply_to=subjects.token_subject("test-gateway"), created=now, deadline=now + 60,
                                     sampling=m.SamplingParams(max_new_tokens=120, temperature=0, seed=7))
        flight = await dispatcher.open(request)
        if reconnect_after_s is not None:
            asyncio.get_running_loop().call_later(reconnect_after_s, dispatcher.reconnected)
        text = []
        async for event in dispatcher.events(flight):
            assert isinstance(event, (m.TokenChunk, m.Final)), event
            text.append(event.text)
        return "".join(text), flight.request.attempt, asked
    finally:
        await dispatcher.stop()
        await nc.close()


def test_events_lost_without_a_reconnect_are_found_by_the_gap_or_the_silence(
        proxied: tuple[Platform, NatsProxy]) -> None:
    """Events lost on their way while the gateway's connection stays up (say a node between the
    two dies): nothing tells the gateway but the chunks' numbers, or, for a stream's last events,
    the stream's silence. The platform's worker sends them again."""
    platform, _ = proxied
    expected, attempt, asked = asyncio.run(relay(platform, "whole", lambda seq, final: False))
    assert attempt == 0 and asked == [] and expected
    middle = asyncio.run(relay(platform, "middle", lambda seq, final: 5 <= seq < 10))
    # A machine busy enough to stall the stream for SILENCE_S adds a silence question or two.
    assert middle[:2] == (expected, 0) and middle[2][0] == "stream gap: chunk 10, expected 5"
    assert all(why.startswith("no event for") for why in middle[2][1:])
    started = time.monotonic()
    tail = asyncio.run(relay(platform, "tail", lambda seq, final: seq >= 20 or final))
    # Every chunk from 20 on is lost the first time, those after the first question too: asked again.
    assert tail[:2] == (expected, 0) and tail[2] and all(why.startswith("no event for") for why in tail[2])
    assert time.monotonic() - started < 2 + SILENCE_S + 3


def test_a_stream_lost_whole_while_the_gateway_was_away_is_found_by_asking_every_worker(
        proxied: tuple[Platform, NatsProxy]) -> None:
    """A request taken from the shared queue while the gateway's connection was away: its
    `Accepted` and all its chunks are lost, so the gateway does not know which worker took it.
    When the connection is back it asks every worker; the holder sends the whole stream."""
    platform, _ = proxied
    expected = asyncio.run(relay(platform, "whole-2", lambda seq, final: False))[0]
    text, attempt, asked = asyncio.run(relay(platform, "all-lost", lambda seq, final: True, lose_accepted=True,
                                             reconnect_after_s=3.0))
    # Still running when asked on a slow machine: its later chunks are lost too, and silence asks again.
    assert (text, attempt) == (expected, 0) and asked[0] == "gateway reconnected"
    assert all(why.startswith("no event for") for why in asked[1:])

