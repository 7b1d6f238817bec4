"""Stream events lost on the bus: the gateway's NATS connection is cut mid-stream (as when the node
it uses dies) and comes back a moment later. Core NATS drops what the worker published meanwhile;
the gateway notices (a gap, or the stream's silence) and the worker sends the events again, so the
client gets exactly the text it would have got, without the request running a second time.

Every service reaches the real nats-server through a TCP proxy that can cut one client.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from .conftest import MODEL, Platform, running_platform
from .nats_proxy import NatsProxy
from .nats_server import NatsServer

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
    took after the cut (or in all); with `cut`, the gateway's NATS connection is cut after the
    first token and stays away `hold_s`."""
    chunks = platform.client(timeout=60).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about the sea"}], max_tokens=max_tokens,
        temperature=0, seed=7, stream=True, stream_options={"include_usage": True},
    )
    text: list[str] = []
    finish, tokens, started = None, None, time.monotonic()
    for chunk in chunks:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
            if cut is not None and text[-1]:
                assert cut.cut("gateway", hold_s) >= 1
                cut, started = None, time.monotonic()
    return "".join(text), finish, tokens, time.monotonic() - started


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
    # Back after ~2.5 s, silent for SILENCE_S, asked at the next sweep: not the client's timeout.
    assert after_cut < 2.5 + SILENCE_S + 3
    resent = gateway_lines(platform, "stream_resent")[before:]
    assert len(resent) == 1 and resent[0]["state"] == "finished" and resent[0]["resent"] >= 1
    assert not gateway_lines(platform, "migrating")


def test_a_gap_in_the_middle_of_a_stream_is_filled_by_the_worker(proxied: tuple[Platform, NatsProxy]) -> None:
    platform, proxy = proxied
    expected = stream(platform, max_tokens=200)
    before = len(gateway_lines(platform, "stream_resent"))
    # The stream outlives the cut (200 tokens, ~3 s): the first chunk after it reveals the gap.
    text, finish, tokens, _ = stream(platform, max_tokens=200, cut=proxy, hold_s=0.3)
    assert (text, finish, tokens) == expected[:3]
    resent = gateway_lines(platform, "stream_resent")[before:]
    assert resent and resent[0]["why"].startswith("stream gap") and resent[0]["state"] == "running"
    assert not gateway_lines(platform, "migrating")
