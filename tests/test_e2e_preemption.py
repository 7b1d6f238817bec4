"""Batch lines on a worker: they fill the slots interactive work leaves, give way to it, and resume.

Batch lines are published straight onto the bus here, as the batch service would publish them
(this tests the worker, not the batch service); interactive requests go through the gateway
with the openai SDK. One worker with four slots: batch may hold three, one stays free.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats
import pytest

from inferbus.tokens.prompt import load_model, render_prompt
from proto import bands, subjects
from proto import messages as m

from .conftest import MODEL, Platform, read_usage, running_platform
from .waiting import await_for

pytestmark = pytest.mark.e2e

TENANT = "demo"
LINE_TOKENS = 3000
# Long enough that, without preemption, the second and third interactive requests would wait
# seconds for the first to finish (one slot is free; batch holds the other three): about 5 s at
# 600 tokens/s, as long as a batch line, against the 2.5 s their first tokens are allowed on a
# loaded machine.
INTERACTIVE_TOKENS = 3000
PREEMPTED_TTFT_S = 2.5


@pytest.fixture(scope="module")
def worker4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("preemption"), workers=1, time_scale=0.1,
                          extra_env={"INFERBUS_WORKER_MAX_RUNNING": "4", "INFERBUS_DRAIN_TIMEOUT_S": "30"}) as running:
        yield running


def generated_tokens(platform: Platform) -> float:
    """Tokens the (only) engine has generated so far: its `sglang:generation_tokens_total`."""
    text = httpx.get(platform.engine_url(1) + "/metrics", timeout=10).text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("sglang:generation_tokens_total")
    )


def line_request(batch_id: str, line: int, prompt: str, max_new_tokens: int, reply_to: str,
                 deadline: float | None = None) -> m.InferenceRequest:
    return m.InferenceRequest(
        request_id=m.batch_request_id(batch_id, line), tenant=TENANT, model=MODEL, prompt=prompt,
        sampling=m.SamplingParams(max_new_tokens=max_new_tokens, temperature=0), reply_to=reply_to,
        deadline=time.time() + 600 if deadline is None else deadline, created=time.time(), kind="completion",
        band="batch", priority=bands.ENGINE_PRIORITY["batch"], api_key_id="test",
        batch_id=batch_id, batch_line=line,
    )


class BatchFeed:
    """A stand-in for the batch service: publishes lines, sees `Accepted`, reads the results."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.owner = f"batch-test-{uuid.uuid4().hex[:8]}"
        self.reply_to = subjects.token_subject(self.owner)
        self.accepted: list[m.Accepted] = []
        self.other_events: list[object] = []
        self.handed_back: list[m.InferenceRequest] = []

    async def __aenter__(self) -> BatchFeed:
        self.nc = await nats.connect(self.platform.stack.nats_url)
        self.js = self.nc.jetstream()
        await self.nc.subscribe(subjects.event_filter(self.owner), cb=self._on_events)
        await self.nc.subscribe(subjects.requeue_subject(self.owner), cb=self._on_handed_back)
        return self

    async def _on_handed_back(self, msg: Any) -> None:
        """A line a worker hands back (preempted, draining): its next attempt queued, as the batch
        service queues it (services/batch/service.py, `_on_requeue`)."""
        request = msgspec.msgpack.decode(msg.data, type=m.InferenceRequest)
        await self.js.publish(subjects.request_subject("batch", MODEL, subjects.ANY_TARGET, request.reply_to), msg.data,
                              headers={"Nats-Msg-Id": f"{request.request_id}.{request.attempt}"})
        self.handed_back.append(request)
        await msg.respond(m.encode(m.RequeueReply(queued=True)))

    async def __aexit__(self, *_: object) -> None:
        await self.nc.close()

    async def _on_events(self, msg: object) -> None:
        for event in m.decode_stream_frame(msg.data).events:  # type: ignore[attr-defined]
            (self.accepted if isinstance(event, m.Accepted) else self.other_events).append(event)

    async def publish(self, request: m.InferenceRequest) -> None:
        # As the batch service does: the prompt as the served model's tokenizer encodes it, so a
        # preempted line continues from its ids (re-tokenized text may split differently).
        prompt = render_prompt(load_model(self.platform.stack.model_dir), prompt=request.prompt)
        request = msgspec.structs.replace(request, input_ids=prompt.ids, prompt_tokens=len(prompt.ids))
        await self.js.publish(subjects.request_subject("batch", MODEL, subjects.ANY_TARGET, request.reply_to),
                              m.encode(request),
                              headers={"Nats-Msg-Id": f"{request.request_id}.{request.attempt}"})

    async def cancel(self, request_id: str) -> None:
        await self.nc.publish(
            subjects.cancel_subject(self.owner, request_id), m.encode(m.Cancel(request_id=request_id, reason="admin"))
        )

    async def wait_accepted(self, n: int, timeout: float = 20) -> None:
        await await_for(lambda: len({a.request_id for a in self.accepted}) >= n, timeout, interval=0.02,
                        what=f"{n} lines accepted")

    async def results(self, batch_id: str, n: int, timeout: float = 60) -> list[m.BatchLineResult]:
        """Every result on the batch's subject once `n` lines have one (plus a moment for duplicates)."""
        deadline = time.monotonic() + timeout
        while True:
            found = await self.read_results(batch_id)
            if len({r.request_id for r in found}) >= n:
                await asyncio.sleep(0.5)
                return await self.read_results(batch_id)
            assert time.monotonic() < deadline, f"{len(found)} of {n} results"
            await asyncio.sleep(0.25)

    async def read_results(self, batch_id: str) -> list[m.BatchLineResult]:
        sub = await self.js.subscribe(subjects.batch_results_filter(batch_id), ordered_consumer=True)
        found: list[m.BatchLineResult] = []
        try:
            while True:
                msg = await sub.next_msg(timeout=0.3)
                found.append(msgspec.msgpack.decode(msg.data, type=m.BatchLineResult))
        except nats.errors.TimeoutError:
            pass
        finally:
            await sub.unsubscribe()
        return found


def worker_events(platform: Platform, event: str) -> list[dict]:
    """The worker's JSON log lines of one event (its metrics port is off in tests)."""
    lines = (Path(platform.stack.config.state_dir) / "logs" / "worker-1.log").read_text().splitlines()
    found = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == event:
            found.append(entry)
    return found


def reference(platform: Platform, prompt: str, max_new_tokens: int) -> str:
    """The uninterrupted output, straight from the (deterministic) engine."""
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    return httpx.post(platform.engine_url(1) + "/generate", json=body, timeout=60).json()["text"]


def interactive(platform: Platform, i: int, ttfts: dict[int, float], errors: list[BaseException]) -> None:
    """One streamed chat request; records its time to first token."""
    started = time.monotonic()
    try:
        stream = platform.client(timeout=60).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"interactive {i}"}], max_tokens=INTERACTIVE_TOKENS,
            temperature=0, stream=True, stream_options={"include_usage": True})
        usage = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and i not in ttfts:
                ttfts[i] = time.monotonic() - started
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == INTERACTIVE_TOKENS
    except BaseException as error:
        errors.append(error)


def test_interactive_requests_preempt_batch_lines_which_resume_and_finish_once(worker4: Platform) -> None:
    batch_id = f"batch_{uuid.uuid4().hex}"
    prompts = [f"Batch line {i}: write a long report about subject {i}." for i in range(4)]
    ids = [m.batch_request_id(batch_id, i) for i in range(4)]
    ttfts: dict[int, float] = {}
    errors: list[BaseException] = []

    async def scenario() -> list[m.BatchLineResult]:
        async with BatchFeed(worker4) as feed:
            for i, prompt in enumerate(prompts):
                await feed.publish(line_request(batch_id, i, prompt, LINE_TOKENS, feed.reply_to))
            await feed.wait_accepted(3)  # three run; the fourth waits: the last slot is interactive's
            await asyncio.sleep(0.5)
            assert len({a.request_id for a in feed.accepted}) == 3
            threads = [threading.Thread(target=interactive, args=(worker4, i, ttfts, errors)) for i in range(3)]
            for thread in threads:
                thread.start()
            while any(t.is_alive() for t in threads):
                await asyncio.sleep(0.05)
            results = await feed.results(batch_id, 4, timeout=120)
            assert not feed.other_events, "batch lines send no tokens to their reply subject"
            return results

    results = asyncio.run(scenario())
    assert not errors, errors
    # All three start at once: two batch lines made room within a load tick or so.
    assert len(ttfts) == 3 and max(ttfts.values()) < PREEMPTED_TTFT_S, ttfts

    # Each line ends with exactly one result, generated to its whole budget.
    assert sorted(r.request_id for r in results) == sorted(ids)
    by_id = {r.request_id: r for r in results}
    for i, request_id in enumerate(ids):
        result = by_id[request_id]
        assert result.ok and result.finish_reason == "length" and result.line == i
        assert result.usage is not None and result.usage.completion_tokens == LINE_TOKENS
        assert result.usage.prompt_tokens == len(
            render_prompt(load_model(worker4.stack.model_dir), prompt=prompts[i]).ids
        )
        # Resumed lines continue where they stopped: the text is what an uninterrupted run gives.
        assert result.text == reference(worker4, prompts[i], LINE_TOKENS)

    # Two interactive requests beyond the free slot: at least two lines were preempted, and
    # their results come from a later attempt that carried the earlier tokens over.
    resumed = [r for r in results if r.attempt > 0]
    assert len(resumed) >= 2
    preempted = [e for e in worker_events(worker4, "batch_preempted") if e["request_id"] in ids]
    assert len(preempted) >= 2 and {e["reason"] for e in preempted} == {"preempted"}
    assert all(e["tokens_carried"] > 0 for e in preempted)
    requeued = [e for e in worker_events(worker4, "batch_requeued") if e["request_id"] in ids]
    assert len(requeued) == len(preempted) and {e["reason"] for e in requeued} == {"preempted"}
    # The result is the last attempt's: every earlier one was requeued and reported nothing.
    for request_id in ids:
        assert by_id[request_id].attempt == sum(1 for e in requeued if e["request_id"] == request_id)

    # Billing: one usage event per line, with the batch id and the result's totals.
    usage = read_usage(worker4, TENANT, set(ids), timeout=10)
    assert sorted(e.request_id for e in usage) == sorted(ids)
    for event in usage:
        assert event.batch_id == batch_id and event.status == "completed"
        assert event.usage == by_id[event.request_id].usage
        assert event.attempts == by_id[event.request_id].attempt + 1


def test_a_cancelled_line_ends_with_one_error_result_and_bills_what_it_made(worker4: Platform) -> None:
    batch_id = f"batch_{uuid.uuid4().hex}"
    request_id = m.batch_request_id(batch_id, 0)

    async def scenario() -> list[m.BatchLineResult]:
        async with BatchFeed(worker4) as feed:
            made = generated_tokens(worker4)
            await feed.publish(line_request(batch_id, 0, "A line to cancel.", LINE_TOKENS, feed.reply_to))
            await feed.wait_accepted(1)
            await await_for(lambda: generated_tokens(worker4) >= made + 20, 30, what="some tokens made")
            await feed.cancel(request_id)
            return await feed.results(batch_id, 1)

    [result] = asyncio.run(scenario())
    assert not result.ok and result.error_code == "batch_cancelled"
    assert result.usage is not None and 0 < result.usage.completion_tokens < LINE_TOKENS
    [event] = read_usage(worker4, TENANT, {request_id})
    assert event.status == "cancelled" and event.batch_id == batch_id and event.usage == result.usage


def test_a_line_past_its_deadline_expires_without_running(worker4: Platform) -> None:
    batch_id = f"batch_{uuid.uuid4().hex}"
    request_id = m.batch_request_id(batch_id, 3)

    async def scenario() -> list[m.BatchLineResult]:
        async with BatchFeed(worker4) as feed:
            await feed.publish(line_request(batch_id, 3, "Too late.", 50, feed.reply_to, deadline=time.time() - 1))
            return await feed.results(batch_id, 1)

    [result] = asyncio.run(scenario())
    assert not result.ok and result.error_code == "batch_expired" and result.line == 3
    assert result.usage is not None and result.usage.completion_tokens == 0
    [event] = read_usage(worker4, TENANT, {request_id})
    assert event.status == "failed" and event.usage.completion_tokens == 0


def test_drain_puts_running_lines_back_on_the_queue_with_their_progress(worker4: Platform) -> None:
    """Last: it stops the module's only worker."""
    batch_id = f"batch_{uuid.uuid4().hex}"

    async def scenario() -> list[m.InferenceRequest]:
        async with BatchFeed(worker4) as feed:
            before = await asyncio.to_thread(generated_tokens, worker4)
            for i in range(2):
                await feed.publish(line_request(batch_id, i, f"Drained line {i}.", LINE_TOKENS, feed.reply_to))
            await feed.wait_accepted(2)

            async def progressed() -> bool:  # both lines have tokens to resume from
                return await asyncio.to_thread(generated_tokens, worker4) >= before + 200

            await await_for(progressed, 60, interval=0.1, what="200 tokens of the two lines generated")
            worker = worker4.stack.get("worker-1")
            worker.signal(signal.SIGTERM)
            # Waited for off the loop: the stand-in batch service answers the lines handed back meanwhile.
            assert await asyncio.to_thread(worker.wait, 15), \
                "a draining worker with batch lines must exit at once, not at the drain timeout"
            assert not await feed.read_results(batch_id)
            # The next attempts wait on the shared batch queue for another worker.
            sub = await feed.js.pull_subscribe_bind(subjects.request_consumer("batch", MODEL), subjects.REQUESTS_STREAM)
            msgs = await sub.fetch(10, timeout=2.0)
            found = [msgspec.msgpack.decode(msg.data, type=m.InferenceRequest) for msg in msgs]
            return [r for r in found if r.batch_id == batch_id]

    queued = asyncio.run(scenario())
    assert sorted((r.batch_line, r.attempt) for r in queued) == [(0, 1), (1, 1)]
    for request in queued:
        assert 0 < request.resumed_tokens < LINE_TOKENS and request.resumed_text
        assert request.priority == bands.ENGINE_PRIORITY["batch"] and request.prompt_tokens
    drained = [e for e in worker_events(worker4, "batch_requeued") if e["request_id"].startswith(batch_id)]
    assert sorted(e["reason"] for e in drained) == ["drain", "drain"]


@pytest.fixture(scope="module", params=["priority", "no-priority"])
def full_engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """One worker of four slots over an engine of three: three batch lines fill the engine while
    the worker still has a slot, so an interactive request waits inside the engine, not on the bus."""
    args = ["--max-running-requests", "3"] + (["--no-priority-scheduling"] if request.param == "no-priority" else [])
    with running_platform(tmp_path_factory.mktemp(f"engine-{request.param}"), workers=1, time_scale=0.1,
                          engine_args=args, extra_env={"INFERBUS_WORKER_MAX_RUNNING": "4"}) as running:
        yield running


def test_work_waiting_inside_the_engine_gets_room_from_engine_priority_or_from_an_abort(
        full_engine: Platform, request: pytest.FixtureRequest) -> None:
    # The worker read the engine's /server_info (INFERBUS_WORKER_ENGINE_PRIORITY=auto).
    priority = worker_events(full_engine, "worker_ready")[0]["engine_priority"]
    assert priority == (request.node.callspec.params["full_engine"] == "priority")
    batch_id = f"batch_{uuid.uuid4().hex}"
    prompts = [f"Batch line {i}: a long essay on topic {i}." for i in range(3)]
    ids = [m.batch_request_id(batch_id, i) for i in range(3)]
    ttfts: dict[int, float] = {}
    errors: list[BaseException] = []

    async def scenario() -> list[m.BatchLineResult]:
        async with BatchFeed(full_engine) as feed:
            for i, prompt in enumerate(prompts):
                await feed.publish(line_request(batch_id, i, prompt, LINE_TOKENS, feed.reply_to))
            await feed.wait_accepted(3)

            async def engine_full() -> bool:  # the three lines are inside the engine, not on their way
                loads = (await asyncio.to_thread(httpx.get, full_engine.engine_url(1) + "/v1/loads", timeout=10)).json()
                return sum(entry["num_running_reqs"] for entry in loads["loads"]) >= 3

            await await_for(engine_full, 60, interval=0.05, what="the engine running the three lines")
            thread = threading.Thread(target=interactive, args=(full_engine, 0, ttfts, errors))
            thread.start()
            while thread.is_alive():
                await asyncio.sleep(0.05)
            return await feed.results(batch_id, 3, timeout=120)

    results = asyncio.run(scenario())
    assert not errors, errors
    # The engine's retraction is immediate; the worker's abort within a check or two.
    assert ttfts[0] < PREEMPTED_TTFT_S, ttfts
    preempted = [e for e in worker_events(full_engine, "batch_preempted") if e["request_id"] in ids]
    if priority:
        # The engine retracted a line in place: nothing was aborted, every line ran in one attempt.
        assert not preempted and all(r.attempt == 0 for r in results)
    else:
        # No engine priority: the worker aborted a line for the stalled request and requeued it.
        assert preempted and {e["reason"] for e in preempted} == {"preempted"}
        assert any(r.attempt > 0 for r in results)
    assert sorted(r.request_id for r in results) == sorted(ids)
    for result in results:
        assert result.ok and result.usage is not None and result.usage.completion_tokens == LINE_TOKENS
        assert result.text == reference(full_engine, prompts[result.line], LINE_TOKENS)
