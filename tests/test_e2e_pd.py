"""Prefill/decode disaggregation end to end (`inferbus up --prefill 1 --decode 1`): what only a
disaggregated fleet does. The OpenAI SDK suites (test_e2e_openai*.py, test_e2e_responses.py) run
on this platform too; here, where each half ran, what is billed, and a cancel on both engines."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import signal
import time

import httpx
import msgspec
import nats
import openai
import pytest

from proto import messages as m
from proto import subjects

from .conftest import MODEL, Platform, read_usage
from .service_logs import log_events

pytestmark = pytest.mark.e2e

PREFILL, DECODE = 1, 2  # engine-1 is the prefill engine, engine-2 the decode engine
_COUNTER = re.compile(rb"^(sglang:(?:prompt|generation)_tokens_total)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


def counters(platform: Platform, engine: int) -> dict[str, float]:
    text = httpx.get(platform.engine_url(engine) + "/metrics").content
    found: dict[str, float] = {}
    for match in _COUNTER.finditer(text):
        name = match.group(1).decode()
        found[name] = found.get(name, 0.0) + float(match.group(2))
    return found


def busy(platform: Platform, engine: int) -> int:
    loads = httpx.get(platform.engine_url(engine) + "/v1/loads", params={"include": "all"}).json()["loads"]
    return sum(entry["num_running_reqs"] + entry["num_waiting_reqs"] for entry in loads)


def server_info(platform: Platform, engine: int) -> dict:
    return httpx.get(platform.engine_url(engine) + "/server_info").json()


def test_the_fleet_is_one_prefill_and_one_decode_engine(pd_platform: Platform) -> None:
    assert server_info(pd_platform, PREFILL)["disaggregation_mode"] == "prefill"
    assert server_info(pd_platform, DECODE)["disaggregation_mode"] == "decode"
    ready = httpx.get(pd_platform.stack.gateway_url + "/ready").json()
    assert ready["workers"] == 2


def test_the_prompt_is_computed_on_the_prefill_engine_and_the_answer_on_the_decode_engine(
    pd_platform: Platform,
) -> None:
    client = pd_platform.client()
    prefill_before, decode_before = counters(pd_platform, PREFILL), counters(pd_platform, DECODE)
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Where does this prompt run? " * 20}], max_tokens=9)
    assert response.usage is not None and response.usage.completion_tokens == 9
    prefill_after, decode_after = counters(pd_platform, PREFILL), counters(pd_platform, DECODE)
    prompt = response.usage.prompt_tokens
    prefilled = prefill_after["sglang:prompt_tokens_total"] - prefill_before["sglang:prompt_tokens_total"]
    assert prefilled == prompt  # the whole prompt went through the prefill engine, once
    # The prefill engine made one token (the first, which travels with the KV); the decode engine the rest.
    assert prefill_after["sglang:generation_tokens_total"] - prefill_before["sglang:generation_tokens_total"] == 1
    assert decode_after["sglang:generation_tokens_total"] - decode_before["sglang:generation_tokens_total"] >= 8


def test_a_client_trace_reaches_both_engines(pd_platform: Platform) -> None:
    """The trace context crosses the prefill hop too (decode worker → prefill worker, in NATS headers)."""
    trace_id = secrets.token_hex(16)
    pd_platform.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "trace me"}], max_tokens=2,
        extra_headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    for engine in ("engine-1", "engine-2"):
        log = pd_platform.stack.get(engine).log_path
        deadline = time.monotonic() + 30
        while trace_id not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline, f"the trace never reached {engine}"
            time.sleep(0.05)


def test_usage_is_billed_once_with_the_cached_tokens_the_prefill_engine_saw(pd_platform: Platform) -> None:
    client = pd_platform.client()
    assert server_info(pd_platform, DECODE).get("disable_radix_cache") is True  # a decode engine caches nothing
    system = "You are the inferbus platform team's careful assistant. " * 30
    client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": system},
                                                          {"role": "user", "content": "warm the cache"}], max_tokens=2)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "system", "content": system}, {"role": "user", "content": "a follow-up"}],
        max_tokens=5)
    response = raw.parse()
    assert response.usage and response.usage.prompt_tokens_details
    cached = response.usage.prompt_tokens_details.cached_tokens or 0
    assert cached > 0.8 * response.usage.prompt_tokens  # the prefill engine's prefix cache
    [event] = read_usage(pd_platform, "demo", {raw.headers["x-request-id"]})
    assert event.status == "completed" and event.billed_to == "tenant"
    assert (event.usage.prompt_tokens, event.usage.completion_tokens, event.usage.cached_tokens) == (
        response.usage.prompt_tokens, 5, cached)


def test_a_client_that_leaves_during_the_prefill_aborts_both_engines(pd_platform: Platform) -> None:
    # Long enough that its prefill (and the decode engine's wait for its KV) is seen under way:
    # ~50k tokens, a few hundred ms of wall time at the platform's time scale.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 50_000}], "max_tokens": 50,
            "stream": True}
    headers = {"authorization": f"Bearer {pd_platform.api_key}"}
    generated = counters(pd_platform, DECODE).get("sglang:generation_tokens_total", 0.0)
    with httpx.Client(timeout=30) as http, http.stream("POST", pd_platform.base_url + "/chat/completions", json=body,
                                                       headers=headers) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        # Leave while the prompt is computed: polling for both engines busy at once could miss the
        # moment on a busy machine (two requests per look). The decode engine gets its half as soon
        # as the prefill worker accepts, and waits there for the KV while the prompt is computed.
        deadline = time.monotonic() + 10
        while not busy(pd_platform, PREFILL):
            assert time.monotonic() < deadline, "the request never reached the prefill engine"
            time.sleep(0.005)
        # Frozen there (a GPU busy with a long prompt), so that the client leaves before its first
        # token however slow this machine is to notice.
        prefill_engine = pd_platform.stack.get(f"engine-{PREFILL}")
        prefill_engine.signal(signal.SIGSTOP)
    try:
        # The client has gone: its decode half stops while the prefill engine is still frozen.
        deadline = time.monotonic() + 10
        while busy(pd_platform, DECODE) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        prefill_engine.signal(signal.SIGCONT)
    # Both halves must stop, not only the decode engine's.
    deadline = time.monotonic() + 10
    while (busy(pd_platform, PREFILL) or busy(pd_platform, DECODE)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert busy(pd_platform, PREFILL) == 0 and busy(pd_platform, DECODE) == 0
    [event] = [e for e in read_usage(pd_platform, "demo", {request_id}, timeout=10) if e.billed_to == "tenant"]
    assert event.status == "cancelled" and event.usage.completion_tokens == 0
    # The decode engine stopped too: it did not go on to write the 50 tokens nobody would read.
    assert counters(pd_platform, DECODE).get("sglang:generation_tokens_total", 0.0) - generated < 50
    # The prefill half was aborted (by the client's cancel, or its decode worker giving it up,
    # whichever reached the prefill worker first), not left to finish its prompt.
    aborted = [e for e in log_events(pd_platform.stack.get(f"worker-{PREFILL}").log_path, "prefill_half_aborted")
               if e.get("request_id") == request_id]
    assert len(aborted) == 1 and aborted[0]["why"] in ("cancelled (client_disconnect)", "decode worker gave it up"), (
        aborted)


def test_n_choices_share_the_prefill_worker(pd_platform: Platform) -> None:
    client = pd_platform.client()
    before = counters(pd_platform, PREFILL)["sglang:prompt_tokens_total"]
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "three ways " * 50}],
                                              max_tokens=4, n=3)
    assert len(response.choices) == 3 and response.usage is not None
    # Every choice's prompt went through the one prefill engine, the decode worker of choice 0 asking it.
    assert counters(pd_platform, PREFILL)["sglang:prompt_tokens_total"] - before == 3 * response.usage.prompt_tokens


async def _loads_of(platform: Platform, worker_id: str, reports: list[m.WorkerLoad], stop: asyncio.Event) -> None:
    nc = await nats.connect(platform.stack.nats_url)
    decoder = msgspec.msgpack.Decoder(m.WorkerLoad)

    async def on_load(msg) -> None:  # type: ignore[no-untyped-def]
        reports.append(decoder.decode(msg.data))

    await nc.subscribe(subjects.metrics_subject(worker_id), cb=on_load)
    await stop.wait()
    await nc.close()


def test_a_batch_runs_on_the_disaggregated_fleet(pd_platform: Platform) -> None:
    """Batch lines are pulled by the decode worker like any request; their prompts run on the prefill
    worker, which reports them as batch (the autoscaler sizes the prefill pool on interactive
    demand only: batch lines are filler, in both pools)."""
    client = pd_platform.client(timeout=30)
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Batch question {i}?"}],
                "max_tokens": 5,
            },
        }
        for i in range(6)
    ]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    file_id = client.files.create(file=("input.jsonl", data), purpose="batch").id
    before = counters(pd_platform, PREFILL)["sglang:prompt_tokens_total"]
    reports: list[m.WorkerLoad] = []

    async def run():  # type: ignore[no-untyped-def]
        stop = asyncio.Event()
        listening = asyncio.ensure_future(_loads_of(pd_platform, f"worker-{PREFILL}", reports, stop))
        while not reports:  # a report from before the batch: the baseline
            await asyncio.sleep(0.05)
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 90
        while (batch := await asyncio.to_thread(client.batches.retrieve, batch.id)).status not in (
                "completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, f"batch stuck in {batch.status}: {batch.request_counts}"
            await asyncio.sleep(0.2)
        count = len(reports)
        while len(reports) <= count + 1:  # a report after the last half ended
            await asyncio.sleep(0.05)
        stop.set()
        await listening
        return batch

    batch = asyncio.run(run())
    first, last = reports[0], reports[-1]
    assert last.role == "prefill" and last.completed - first.completed == 6
    assert last.completed_batch - first.completed_batch == 6, "the prefill worker counted batch halves as interactive"
    assert last.batch_in_flight == 0
    # Nothing interactive ran meanwhile: every half in flight in a report was a batch line's.
    assert all(r.in_flight == r.batch_in_flight for r in reports), [(r.in_flight, r.batch_in_flight) for r in reports]
    assert batch.status == "completed" and batch.request_counts is not None and batch.request_counts.completed == 6
    assert batch.output_file_id is not None
    output = [
        json.loads(line) for line in client.files.content(batch.output_file_id).content.splitlines() if line.strip()
    ]
    assert sorted(o["custom_id"] for o in output) == [f"line-{i}" for i in range(6)]
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 5 for o in output)
    assert counters(pd_platform, PREFILL)["sglang:prompt_tokens_total"] - before == sum(
        o["response"]["body"]["usage"]["prompt_tokens"] for o in output)


def test_a_lora_adapters_request_runs_with_the_adapter_on_both_engines(pd_platform: Platform) -> None:
    digest = "sha256:" + "cd" * 32
    tenant = "t-" + secrets.token_hex(4)  # a private adapter of a tenant of its own: other tests never see it
    with pd_platform.admin() as admin:
        assert admin.post("/tenants", json={"id": tenant}).status_code in (200, 201)
        secret = admin.post(f"/tenants/{tenant}/keys", json={"name": "test"}).json()["secret"]
        created = admin.post("/adapters", json={"name": "pd-bot", "version": digest, "path": "s3://ok/pd-bot",
                                                "owner": tenant})
        assert created.status_code == 201, created.text
    client = openai.OpenAI(base_url=pd_platform.base_url, api_key=secret, max_retries=0, timeout=60)
    deadline = time.monotonic() + 10
    while "pd-bot" not in {card.id for card in client.models.list().data}:
        assert time.monotonic() < deadline, "the adapter was never listed"
        time.sleep(0.1)
    raw = client.completions.with_raw_response.create(model="pd-bot", prompt="hello adapter " * 30, max_tokens=4)
    assert raw.parse().choices[0].text
    engine_name = "pd-bot@" + "cd" * 6
    for engine in (PREFILL, DECODE):  # each half ran with it: each engine has it loaded
        listed = {entry["id"] for entry in httpx.get(pd_platform.engine_url(engine) + "/v1/models").json()["data"]}
        assert engine_name in listed, (engine, listed)
    [event] = read_usage(pd_platform, tenant, {raw.headers["x-request-id"]})
    assert event.adapter == engine_name and event.usage.completion_tokens == 4


def test_a_prefill_fleet_alone_serves_nothing(pd_platform: Platform) -> None:
    """Only decode (and aggregated) workers take requests: without them the gateway is not ready."""
    decode = pd_platform.stack.get("worker-2")
    decode.signal(15)  # a drain: it leaves the registry
    try:
        deadline = time.monotonic() + 20
        while httpx.get(pd_platform.stack.gateway_url + "/ready").status_code == 200:
            assert time.monotonic() < deadline, "the gateway stayed ready with a prefill worker alone"
            time.sleep(0.1)
        with pytest.raises(openai.APIStatusError) as raised:
            pd_platform.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                         max_tokens=2)
        assert raised.value.status_code == 503
    finally:
        decode.wait(30)
        decode.start()
        deadline = time.monotonic() + 30
        while httpx.get(pd_platform.stack.gateway_url + "/ready").json().get("workers", 0) < 2:
            assert time.monotonic() < deadline, "the decode worker did not come back"
            time.sleep(0.1)


def _half(request_id: str, tokens: int) -> m.PrefillRequest:
    request = m.InferenceRequest(
        request_id=request_id,
        tenant="demo",
        model=MODEL,
        prompt="",
        reply_to="inferbus.tok.gateway",
        deadline=time.time() + 60,
        created=time.time(),
        input_ids=list(range(10, 10 + tokens)),
        sampling=m.SamplingParams(max_new_tokens=4),
        prompt_tokens=tokens,
    )
    return m.PrefillRequest(request=request, bootstrap_room=int.from_bytes(request_id.encode()[:7], "big"))


async def _ask_prefill(platform: Platform, half: m.PrefillRequest, then: bytes | None = None,
                       then_subject: str = "") -> tuple[m.PrefillAccepted, m.PrefillDone | None, int]:
    """Send a prefill half to worker-1 as decode worker `test-decode` would (no decode engine joins
    its room, so the prefill engine waits for one), optionally publish `then`; the prefill
    worker's answer, its report (if any within 5 s) and the prefill engine's load after it."""
    nc = await nats.connect(platform.stack.nats_url)
    try:
        reports = await nc.subscribe(subjects.prefilled_subject("test-decode"))
        reply = await nc.request(subjects.prefill_subject("worker-1", "test-decode"), m.encode(half), timeout=5)
        accepted = msgspec.msgpack.decode(reply.data, type=m.PrefillAccepted)
        done = None
        if accepted.accepted:
            deadline = time.monotonic() + 5
            while not busy(platform, PREFILL):
                assert time.monotonic() < deadline, "the half never reached the prefill engine"
                await asyncio.sleep(0.01)
            if then is not None:
                await nc.publish(then_subject, then)
            try:
                done = msgspec.msgpack.decode((await reports.next_msg(timeout=5)).data, type=m.PrefillDone)
            except nats.errors.TimeoutError:
                done = None
        return accepted, done, busy(platform, PREFILL)
    finally:
        await nc.close()


def test_a_gateways_cancel_aborts_a_prefill_half_whatever_its_decode_side_does(pd_platform: Platform) -> None:
    """The prefill worker hears the gateway's cancel itself: a half whose decode worker is gone (no
    decode engine in its room here) stops at once instead of waiting SGLang's bootstrap timeout."""
    request_id = "pd-cancel-" + secrets.token_hex(4)
    half = _half(request_id, 2_000)
    cancel = m.encode(m.Cancel(request_id=request_id))
    accepted, done, load = asyncio.run(
        _ask_prefill(pd_platform, half, cancel, subjects.cancel_subject("gateway", request_id))
    )
    assert accepted.accepted and accepted.worker_id == "worker-1" and accepted.bootstrap_port > 0
    assert done is not None and not done.ok and done.worker_id == "worker-1" and done.request_id == request_id
    assert load == 0
    # Asked again after its cancel (a decode worker that pulled it late): refused, nothing computed.
    again, _, load = asyncio.run(_ask_prefill(pd_platform, half))
    assert (again.accepted, again.reason, load) == (False, "cancelled", 0)


def test_a_decode_worker_gives_a_prefill_half_up(pd_platform: Platform) -> None:
    request_id = "pd-abort-" + secrets.token_hex(4)
    abort = m.encode(m.PrefillAbort(request_id=request_id, attempt=0))
    accepted, done, load = asyncio.run(_ask_prefill(pd_platform, _half(request_id, 2_000), abort,
                                                    subjects.prefill_subject("worker-1", "test-decode")))
    assert accepted.accepted and done is not None and not done.ok and load == 0


def test_a_prefill_worker_takes_one_batch_prompt_at_a_time_and_interactive_ones_beside_it(
    pd_platform: Platform,
) -> None:
    """Batch lines' prompts use the prefill side's spare capacity: beyond
    INFERBUS_WORKER_BATCH_MAX_PREFILLING (1) at once a batch half is refused `full`, an interactive
    one is still taken. No decode engine joins the rooms here, so a taken half stays held."""
    def half(kind: str, band: str) -> m.PrefillRequest:
        ask = _half(f"pd-{kind}-" + secrets.token_hex(4), 2_000)
        return msgspec.structs.replace(ask, request=msgspec.structs.replace(ask.request, band=band))

    async def run() -> list[tuple[bool, str]]:
        subject = subjects.prefill_subject("worker-1", "test-decode")
        nc = await nats.connect(pd_platform.stack.nats_url)
        taken: list[m.PrefillRequest] = []
        answers = []
        try:
            for ask in (half("batch", "batch"), half("batch", "batch"), half("chat", "standard"), None,
                        half("batch", "batch")):
                if ask is None:  # the first batch half ends: another one may start
                    first = taken.pop(0)
                    await nc.publish(subject, m.encode(m.PrefillAbort(request_id=first.request.request_id, attempt=0)))
                    deadline = time.monotonic() + 5
                    status = m.encode(m.PrefillStatus(request_id=first.request.request_id, attempt=0))
                    while msgspec.msgpack.decode((await nc.request(subject, status, timeout=5)).data,
                                                 type=m.PrefillHeld).held:
                        assert time.monotonic() < deadline, "the aborted batch half stayed"
                        await asyncio.sleep(0.05)
                    continue
                answer = msgspec.msgpack.decode((await nc.request(subject, m.encode(ask), timeout=5)).data,
                                                type=m.PrefillAccepted)
                answers.append((answer.accepted, answer.reason))
                if answer.accepted:
                    taken.append(ask)
        finally:
            for ask in taken:
                await nc.publish(subject, m.encode(m.PrefillAbort(request_id=ask.request.request_id, attempt=0)))
            await nc.flush()
            await nc.close()
        return answers

    assert asyncio.run(run()) == [(True, ""), (False, "full"), (True, ""), (True, "")]
    deadline = time.monotonic() + 10
    while busy(pd_platform, PREFILL):  # what it took is aborted: later tests find the engine idle
        assert time.monotonic() < deadline, "aborted halves stayed in the prefill engine"
        time.sleep(0.05)


def test_a_prefill_worker_says_whether_it_still_holds_a_half(pd_platform: Platform) -> None:
    async def run() -> tuple[bool, bool]:
        request_id = "pd-status-" + secrets.token_hex(4)
        half = _half(request_id, 2_000)
        subject = subjects.prefill_subject("worker-1", "test-decode")
        status = m.encode(m.PrefillStatus(request_id=request_id, attempt=0))
        nc = await nats.connect(pd_platform.stack.nats_url)
        try:
            reports = await nc.subscribe(subjects.prefilled_subject("test-decode"))
            accepted = msgspec.msgpack.decode((await nc.request(subject, m.encode(half), timeout=5)).data,
                                              type=m.PrefillAccepted)
            assert accepted.accepted
            while_running = msgspec.msgpack.decode(
                (await nc.request(subject, status, timeout=5)).data, type=m.PrefillHeld
            )
            await nc.publish(subject, m.encode(m.PrefillAbort(request_id=request_id, attempt=0)))
            await reports.next_msg(timeout=5)  # its report: the half has ended
            after = msgspec.msgpack.decode((await nc.request(subject, status, timeout=5)).data, type=m.PrefillHeld)
            return while_running.held, after.held
        finally:
            await nc.close()

    assert asyncio.run(run()) == (True, False)
