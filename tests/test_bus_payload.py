"""What a long prompt costs on the bus: the request carries the prompt once (ids when the gateway
tokenized it), and the largest message the server takes is read from the server itself."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.errors import MaxPayloadError
from nats.errors import TimeoutError as NatsTimeoutError

from inferbus.bus import connection as bus
from inferbus.bus.replies import HEADER_ROOM, PublishError, Replies
from inferbus.local.ports import free_port
from inferbus.local.servers import nats_server_binary
from proto import messages as m

from .waiting import wait_for

pytestmark = pytest.mark.slow

MIB = 1024 * 1024


def long_request(tokens: int) -> m.InferenceRequest:
    # Word-level text (6 characters a token) and ids past 65,535 (5 bytes each in msgpack), as a
    # 128k-vocabulary tokenizer gives.
    return m.InferenceRequest(request_id="r", tenant="t", model="m", prompt="abcdef" * tokens, reply_to="x",
                              sampling=m.SamplingParams(max_new_tokens=16), deadline=1e12, created=0,
                              input_ids=[70_000 + i % 50_000 for i in range(tokens)])


def test_a_long_prompt_is_carried_once_and_its_text_stays_with_the_sender() -> None:
    request = long_request(120_000)
    assert len(m.encode(request)) > MIB  # text and ids: over NATS's default max_payload
    wire = request.on_wire()
    assert len(m.encode(wire)) < MIB and wire.prompt == "" and wire.input_ids == request.input_ids
    assert request.prompt  # the sender keeps the text, to continue from it if it must
    text_only = m.InferenceRequest(request_id="r", tenant="t", model="m", prompt="abc", reply_to="x",
                                   sampling=m.SamplingParams(max_new_tokens=1), deadline=1e12, created=0)
    assert text_only.on_wire() is text_only


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


@pytest.fixture
def small_payload_server(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(f'listen: "127.0.0.1:{port}"\nmax_payload: 65536\njetstream {{ store_dir: "{tmp_path}" }}\n')
    process = subprocess.Popen([nats_server_binary(), "-c", str(config)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: _listening(port), what="nats-server listening")
        yield f"nats://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


async def test_the_limit_is_the_servers_less_room_for_headers(small_payload_server: str) -> None:
    nc = await bus.connect(small_payload_server, name="test")
    try:
        replies = Replies(nc)
        await replies.start()
        assert replies.max_payload == 65536 - HEADER_ROOM
        # Past it nats.py refuses the publish, which the gateway would have answered with a 503.
        with pytest.raises(MaxPayloadError):
            await replies.publish_durable("anything", b"x" * 70_000, "id-1", timeout=0.5)
        await replies.stop()
    finally:
        await nc.close()


async def test_a_publish_whose_earlier_copy_is_still_being_stored_is_asked_again(small_payload_server: str) -> None:
    # A publish retried after a timeout can reach a clustered stream while the first copy is still
    # going through its consensus; the server answers 409 "duplicate message id is in process".
    # Played here by a subscriber in the stream's place, so the answers are exactly the server's.
    nc = await bus.connect(small_payload_server, name="test")
    try:
        answers = [b'{"error":{"code":409,"err_code":10158,"description":"duplicate message id is in process"}}'] * 2
        answers.append(b'{"stream":"S","seq":7,"duplicate":true}')
        seen: list[str] = []

        async def leader(msg) -> None:  # type: ignore[no-untyped-def]
            seen.append(msg.headers["Nats-Msg-Id"])
            await msg.respond(answers[len(seen) - 1] if len(seen) <= len(answers) else answers[-1])

        await nc.subscribe("events.x", cb=leader)
        replies = Replies(nc)
        await replies.start()
        assert await replies.publish_durable("events.x", b"e", "id-1", timeout=5) is False  # stored by the first copy
        assert seen == ["id-1"] * 3
        answers[:] = [b'{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}']
        seen.clear()
        with pytest.raises(PublishError, match="maximum messages exceeded"):  # other errors are the caller's
            await replies.publish_durable("events.x", b"e", "id-2", timeout=5)
        assert seen == ["id-2"]
        await replies.stop()
    finally:
        await nc.close()


async def test_a_publish_lost_with_a_leader_or_refused_between_leaders_is_asked_again(
    small_payload_server: str,
) -> None:
    # A stream's leader dies with the request (no answer at all), then the stream answers
    # "temporarily unavailable" while it elects another, then stores it: one publish, no error.
    nc = await bus.connect(small_payload_server, name="test")
    try:
        answers = [
            None,
            b'{"error":{"code":503,"err_code":10008,"description":"JetStream system temporarily unavailable"}}',
            b'{"stream":"S","seq":8}',
        ]
        seen: list[str] = []

        async def leader(msg) -> None:  # type: ignore[no-untyped-def]
            seen.append(msg.headers["Nats-Msg-Id"])
            answer = answers[min(len(seen), len(answers)) - 1]
            if answer is not None:
                await msg.respond(answer)

        await nc.subscribe("events.y", cb=leader)
        replies = Replies(nc)
        await replies.start()
        assert await replies.publish_durable("events.y", b"e", "id-3", timeout=5) is True
        assert seen == ["id-3"] * 3
        answers[:] = [None]  # nobody ever answers: the caller's timeout still holds
        with pytest.raises(NatsTimeoutError):
            await replies.publish_durable("events.y", b"e", "id-4", timeout=1.5)
        await replies.stop()
    finally:
        await nc.close()
