"""What the services make of a JetStream answer aimed at them. Any identity with a `$JS.API` right
can name a core subject as the reply of its API call; JetStream's JSON answer is then delivered
there in the services' account (docs/security.md, "JetStream in an account of its own"). Aimed at
every core subject a service listens on, in the middle of a live stream, the answers are ignored:
the stream ends whole and billed to its length, every process lives on, no handler fails, and the
platform serves the next request."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import nats
import pytest

from inferbus.bus.connection import BusSettings
from inferbus.local.stack import GATEWAY_ID
from proto import subjects

from .conftest import MODEL, Platform
from .waiting import wait_for

pytestmark = pytest.mark.e2e

API_CALL = f"$JS.API.STREAM.INFO.{subjects.REQUESTS_STREAM}"  # a call every worker identity may make


def targets(request_id: str) -> dict[str, str]:
    """A concrete subject of every kind of core subject a service subscribes to."""
    reply_to = subjects.token_subject(GATEWAY_ID)
    return {
        "the stream's token events (gateway)": subjects.event_subject(reply_to, "worker-2"),
        "its token events from worker-1 (gateway)": subjects.event_subject(reply_to, "worker-1"),
        "its cancel (workers)": subjects.cancel_subject(GATEWAY_ID, request_id),
        "a resend (gateway)": subjects.resend_subject("worker-2", GATEWAY_ID),
        "a holder question (gateway)": subjects.holder_subject(GATEWAY_ID),
        "a load report (router, gateway)": subjects.metrics_subject("worker-2"),
        "a cache event (router)": subjects.cache_subject("worker-2"),
        "a placement question (router)": subjects.placement_subject(MODEL),
        "a placement notice (router)": subjects.placed_subject(MODEL),
        "a control message (worker)": subjects.control_subject("worker-2"),
        "a liveness probe (worker)": subjects.liveness_subject("worker-2"),
        "a requeue (batch)": subjects.requeue_subject(GATEWAY_ID),
    }


def failures(platform: Platform) -> dict[str, list[str]]:
    """Each service's log lines that say a handler failed: an exception nats.py caught in a
    subscription's callback (`nats_error`), or a traceback."""
    found: dict[str, list[str]] = {}
    for process in platform.stack.processes:
        if process.name in ("nats", "redis") or not process.log_path.exists():
            continue
        lines = [line for line in process.log_path.read_text(errors="replace").splitlines()
                 if '"nats_error"' in line or "Traceback" in line]
        found[process.name] = lines
    return found


def test_jetstream_answers_aimed_at_every_service_are_ignored(platform: Platform) -> None:
    stack = platform.stack
    assert stack.identities is not None
    pids = {p.name: p.pid for p in stack.processes}
    before = failures(platform)
    result: dict[str, object] = {}

    def stream() -> None:
        try:
            chunks = platform.client(timeout=60).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "a long answer"}], max_tokens=300, stream=True,
                stream_options={"include_usage": True})
            text = []
            for chunk in chunks:
                result.setdefault("request_id", chunk.id.removeprefix("chatcmpl-"))
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                if chunk.usage is not None:
                    result["usage"] = chunk.usage
            result["text"] = "".join(text)
        except Exception as error:
            result["error"] = error

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    wait_for(lambda: "request_id" in result or not reader.is_alive(), 30, what="the stream's first chunk")
    assert "request_id" in result, result

    async def aim() -> dict[str, int]:
        worker = stack.identities["worker-1"]  # type: ignore[index]
        options = BusSettings(user=worker.user, password=worker.password).options("nats://")
        attacker = await nats.connect(stack.nats_server_url, allow_reconnect=False, **options)  # type: ignore[arg-type]
        ops = stack.identities["ops"]  # type: ignore[index]
        watcher = await nats.connect(stack.nats_server_url, allow_reconnect=False,
                                     **BusSettings(user=ops.user, password=ops.password).options("nats://"))  # type: ignore[arg-type]
        seen: dict[str, int] = {}
        try:
            for name, subject in targets(str(result["request_id"])).items():
                seen[name] = 0

                async def count(msg: nats.aio.msg.Msg, name: str = name) -> None:
                    if msg.data.startswith(b"{"):  # JetStream's JSON, not a proto message
                        seen[name] += 1

                sub = await watcher.subscribe(subject, cb=count)
                await watcher.flush()
                # Until an answer is seen: on a starved machine JetStream may take seconds to answer
                # (asked again every 5 s; each call's answer goes to the same subject).
                deadline, asked = time.monotonic() + 60, 0.0
                while not seen[name] and time.monotonic() < deadline:
                    if time.monotonic() - asked > 5:
                        for _ in range(3):
                            await attacker.publish(API_CALL, b"", reply=subject)
                        await attacker.flush()
                        asked = time.monotonic()
                    await asyncio.sleep(0.02)
                await sub.unsubscribe()
        finally:
            await attacker.close()
            await watcher.close()
        return seen

    seen = asyncio.run(aim())
    # Each answer really went out on the subject aimed at (what the services received).
    assert all(seen.values()), seen

    reader.join(timeout=60)
    assert "error" not in result, result["error"]
    usage = result["usage"]
    assert usage.completion_tokens == 300, usage  # type: ignore[attr-defined]
    assert len(result["text"]) > 0  # type: ignore[arg-type]
    reply = platform.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "next"}],
                                                      max_tokens=4)
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    assert {p.name: p.pid for p in stack.processes} == pids and all(p.alive() for p in stack.processes)
    after = failures(platform)
    new = {name: lines[len(before.get(name, [])):] for name, lines in after.items()}
    assert not any(new.values()), json.dumps(new, indent=1)[:4000]
