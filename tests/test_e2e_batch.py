"""The Batch API end to end with the official openai SDK: upload, create, poll, download; validation
failures, cancel, expiry, and a batch that survives the batch service and a worker being killed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import openai
import pytest
from openai.types import Batch, Completion
from openai.types.chat import ChatCompletion

from inferbus.local.process import Process
from proto import bands, subjects
from proto import messages as m

from .conftest import MODEL, Platform, read_usage, running_platform
from .waiting import wait_for as wait_until

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """Two simulated workers at 10x speed, with the batch service `inferbus up` starts."""
    with running_platform(tmp_path_factory.mktemp("batch"), workers=2, time_scale=0.1,
                          extra_env={"INFERBUS_BATCH_LINE_LEASE_S": "60"}) as running:
        yield running


@pytest.fixture(scope="module")
def client(platform: Platform) -> openai.OpenAI:
    return platform.client(timeout=30)


def chat_lines(n: int, max_tokens: int | list[int] = 8, prefix: str = "req") -> list[dict]:
    tokens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n
    return [{"custom_id": f"{prefix}-{i}", "method": "POST", "url": CHAT,
             "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Question number {i}?"}],
                      "max_tokens": tokens[i], "temperature": 0}} for i in range(n)]


def upload(client: openai.OpenAI, items: list[dict] | bytes) -> str:
    data = items if isinstance(items, bytes) else b"".join(json.dumps(i).encode() + b"\n" for i in items)
    return client.files.create(file=("input.jsonl", data), purpose="batch").id


def wait_for_completed(client: openai.OpenAI, batch_id: str, lines: int, timeout: float = 60.0) -> Batch:
    """The batch once at least `lines` of its lines have completed (it must still be running)."""
    deadline = time.monotonic() + timeout
    while True:
        current = client.batches.retrieve(batch_id)
        if current.request_counts and current.request_counts.completed >= lines:
            return current
        assert time.monotonic() < deadline and current.status in ("validating", "in_progress"), current
        time.sleep(0.1)


def wait_for(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 90.0) -> Batch:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}: {batch.request_counts}"
        time.sleep(0.2)


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines() if line.strip()]


def restart_batch_service(platform: Platform, kill: bool = False, env: dict[str, str | None] | None = None) -> None:
    """Stop the batch service (SIGTERM, or SIGKILL) and start it again, with `env` changes."""
    process = platform.stack.get("batch")
    process.signal(signal.SIGKILL if kill else signal.SIGTERM)
    assert process.wait(15)
    for name, value in (env or {}).items():
        if value is None:
            process.env.pop(name, None)
        else:
            process.env[name] = value
    ready = process.log_path.read_bytes().count(b'"batch_ready"')
    process.start()
    deadline = time.monotonic() + 30
    while process.log_path.read_bytes().count(b'"batch_ready"') <= ready:
        assert process.alive(), process.tail()
        assert time.monotonic() < deadline, "batch service did not come back"
        time.sleep(0.1)


def test_chat_and_completions_batches_complete(platform: Platform, client: openai.OpenAI) -> None:
    chat_items = chat_lines(40, max_tokens=[4 + i % 7 for i in range(40)])
    chat = client.batches.create(input_file_id=upload(client, chat_items), endpoint=CHAT, completion_window="24h",
                                 metadata={"purpose": "e2e"})
    completion_items = [{"custom_id": f"p{i}", "method": "POST", "url": COMPLETIONS,
                         "body": {"model": MODEL, "prompt": f"Once upon a time {i}", "max_tokens": 6}}
                        for i in range(12)]
    text = client.batches.create(input_file_id=upload(client, completion_items), endpoint=COMPLETIONS,
                                 completion_window="24h")
    assert chat.status == "validating"

    done = wait_for(client, chat.id, {"completed", "failed", "expired", "cancelled"})
    assert done.status == "completed", done.errors
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (40, 40, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
    out = file_lines(client, done.output_file_id)
    # Input order, every custom_id once, bodies the SDK parses as what the endpoint returns.
    assert [line["custom_id"] for line in out] == [item["custom_id"] for item in chat_items]
    prompt = output = 0
    for line, item in zip(out, chat_items):
        assert line["error"] is None and line["id"].startswith("batch_req_")
        assert line["response"]["status_code"] == 200
        completion = ChatCompletion.model_validate(line["response"]["body"])
        assert completion.choices[0].message.content
        assert completion.usage is not None and completion.usage.completion_tokens == item["body"]["max_tokens"]
        assert completion.choices[0].finish_reason == "length" and completion.model == MODEL
        prompt += completion.usage.prompt_tokens
        output += completion.usage.completion_tokens
    assert done.usage is not None
    assert (done.usage.input_tokens, done.usage.output_tokens) == (prompt, output)

    # Billed once per line, at the batch rate: usage events carry the batch id.
    ids = {m.batch_request_id(chat.id, i) for i in range(40)}
    events = read_usage(platform, "demo", ids, timeout=15)
    assert sorted(e.request_id for e in events) == sorted(ids)
    assert all(e.batch_id == chat.id and e.band == "batch" and e.status == "completed" for e in events)

    finished = wait_for(client, text.id, {"completed", "failed", "expired", "cancelled"})
    assert finished.status == "completed" and finished.request_counts and finished.request_counts.completed == 12
    for line in file_lines(client, finished.output_file_id):
        body = Completion.model_validate(line["response"]["body"])
        assert body.object == "text_completion" and body.choices[0].text
        assert body.usage and body.usage.completion_tokens == 6
    listed = client.batches.list(limit=100)
    assert {chat.id, text.id} <= {b.id for b in listed.data}


@pytest.mark.parametrize("case", ["duplicate", "two_models", "bad_json", "wrong_url"])
def test_invalid_input_fails_the_batch_with_errors(client: openai.OpenAI, case: str) -> None:
    items = chat_lines(5)
    data: bytes | list[dict] = items
    if case == "duplicate":
        items[3]["custom_id"] = items[1]["custom_id"]
        expected = ("duplicate_custom_id", 4)
    elif case == "two_models":
        items[2]["body"]["model"] = "some-other-model"
        expected = ("mismatched_model", 3)
    elif case == "wrong_url":
        items[4]["url"] = COMPLETIONS
        expected = ("invalid_url", 5)
    else:
        raw = [json.dumps(i).encode() for i in items]
        raw[2] = raw[2][:-7]  # line 3 cut short
        data = b"\n".join(raw) + b"\n"
        expected = ("invalid_json_line", 3)
    batch = client.batches.create(input_file_id=upload(client, data), endpoint=CHAT, completion_window="24h")
    failed = wait_for(client, batch.id, {"failed", "completed", "in_progress"}, timeout=30)
    assert failed.status == "failed" and failed.failed_at
    assert failed.errors is not None and failed.errors.data
    first = failed.errors.data[0]
    assert (first.code, first.line) == expected
    assert f"Line {expected[1]}" in (first.message or "")
    assert failed.output_file_id is None


def test_cancel_mid_batch_keeps_what_finished(client: openai.OpenAI) -> None:
    items = chat_lines(40, max_tokens=[3] * 6 + [3000] * 34, prefix="cancel")
    batch = client.batches.create(input_file_id=upload(client, items), endpoint=CHAT, completion_window="24h")
    wait_for_completed(client, batch.id, 6)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    cancelled = wait_for(client, batch.id, {"cancelled", "completed", "failed", "expired"}, timeout=30)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at
    out = file_lines(client, cancelled.output_file_id)
    errors = file_lines(client, cancelled.error_file_id)
    assert sorted(line["custom_id"] for line in out + errors) == sorted(i["custom_id"] for i in items)
    assert {f"cancel-{i}" for i in range(6)} <= {line["custom_id"] for line in out}
    assert errors and all(line["response"] is None and line["error"]["code"] == "batch_cancelled" for line in errors)
    assert cancelled.request_counts is not None
    assert (cancelled.request_counts.completed, cancelled.request_counts.failed) == (len(out), len(errors))


def test_a_batch_past_its_window_expires_with_the_part_that_completed(platform: Platform,
                                                                       client: openai.OpenAI) -> None:
    # 24 h × 0.0001 ≈ 9 s for batches validated by this batch service.
    restart_batch_service(platform, env={"INFERBUS_BATCH_WINDOW_SCALE": "0.0001"})
    try:
        items = chat_lines(30, max_tokens=[3] * 8 + [60000] * 22, prefix="late")
        batch = client.batches.create(input_file_id=upload(client, items), endpoint=CHAT, completion_window="24h")
        expired = wait_for(client, batch.id, {"expired", "completed", "failed", "cancelled"}, timeout=60)
        assert expired.status == "expired" and expired.expired_at
        assert expired.expires_at - expired.created_at < 60
        out = file_lines(client, expired.output_file_id)
        errors = file_lines(client, expired.error_file_id)
        assert {line["custom_id"] for line in out} == {f"late-{i}" for i in range(8)}
        assert sorted(line["custom_id"] for line in errors) == sorted(f"late-{i}" for i in range(8, 30))
        assert all(line["response"] is None and line["error"]["code"] == "batch_expired" for line in errors)
    finally:
        restart_batch_service(platform, env={"INFERBUS_BATCH_WINDOW_SCALE": None})


def test_lines_of_a_dead_worker_run_again(platform: Platform, client: openai.OpenAI) -> None:
    """The owner of a line dies (its heartbeat ends): the line goes out again, nothing is lost."""
    items = chat_lines(60, max_tokens=[300] * 60, prefix="dead")
    batch = client.batches.create(input_file_id=upload(client, items), endpoint=CHAT, completion_window="24h")
    wait_for_completed(client, batch.id, 10)
    log = platform.stack.get("batch").log_path
    seen = len(_worker_gone_events(log))
    worker = platform.stack.get("worker-2")
    ready = next(json.loads(line) for line in Path(log).read_text().splitlines() if '"batch_ready"' in line)
    # Killed while it holds lines, or the test tests nothing: frozen first, and killed only if the
    # batch service has heard it accept lines it has not finished (a frozen worker finishes none;
    # its engine may run a line whose acceptance is still in the frozen worker's send buffer, which
    # only the line's lease brings back); else let go, try again.
    with LineWatch(platform.stack.nats_url, subjects.reply_owner(ready["reply_subject"]), batch.id) as lines:
        held = wait_until(lambda: _frozen_while_holding(worker, lines, "worker-2"), timeout=60,
                          what="worker-2 frozen while it holds batch lines")
    worker.signal(signal.SIGKILL)
    assert worker.wait(5)
    try:
        done = wait_for(client, batch.id, {"completed", "failed", "expired", "cancelled"}, timeout=120)
        assert done.status == "completed" and done.error_file_id is None, done
        out = file_lines(client, done.output_file_id)
        assert [line["custom_id"] for line in out] == [i["custom_id"] for i in items]
        # The batch service's verdict comes a grace period after the heartbeat ended, which on a
        # busy machine may be after the batch completed (its lines ran again by then or not).
        gone = wait_until(lambda: [e for e in _worker_gone_events(log)[seen:] if e["worker_id"] == "worker-2"],
                          timeout=60, what="the batch service's worker_gone for worker-2")
        assert gone[0]["lines_to_republish"] >= len(held), (gone, held)
        ids = {m.batch_request_id(batch.id, i) for i in range(60)}
        assert once_per_line(read_usage(platform, "demo", ids, timeout=20)) == ids
    finally:
        worker.start()
        wait_until(platform.stack.gateway_serving, timeout=30, what=f"worker-2 back: {worker.tail()}")


def once_per_line(events: list[m.UsageEvent]) -> set[str]:
    """The ledger keys of a batch's usage events, each line's billed to its tenant. A worker reports
    a line's usage before its result, so a line whose worker died between the two runs again and is
    reported twice under one key, which the rollups count once (`m.usage_msg_id`)."""
    assert all(e.billed_to == "tenant" for e in events), [e for e in events if e.billed_to != "tenant"][:3]
    return {m.usage_msg_id(e) for e in events}


def _worker_gone_events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_bytes().splitlines() if b'"worker_gone"' in line]


class LineWatch:
    """The lines of a batch each worker has accepted and not yet ended, as its batch service hears
    them: the events on its reply subject and the workers' results, read on a connection of its
    own in a thread of its own."""

    def __init__(self, nats_url: str, owner: str, batch_id: str) -> None:
        self.nats_url, self.owner, self.batch_id = nats_url, owner, batch_id
        self.holders: dict[str, str] = {}  # request id → the worker that accepted its current attempt
        self._subscribed = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._watch()), daemon=True)

    def held_by(self, worker_id: str) -> set[str]:
        return {request_id for request_id, holder in list(self.holders.items()) if holder == worker_id}

    async def _watch(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        nc = await nats.connect(self.nats_url)

        async def on_frame(msg: nats.aio.msg.Msg) -> None:
            for event in msgspec.msgpack.decode(msg.data, type=m.StreamFrame).events:
                if isinstance(event, m.Accepted):
                    self.holders[event.request_id] = event.worker_id
                elif isinstance(event, (m.Final, m.StreamError)):
                    self.holders.pop(event.request_id, None)

        async def on_result(msg: nats.aio.msg.Msg) -> None:
            self.holders.pop(m.decoder(m.BatchLineResult).decode(msg.data).request_id, None)

        await nc.subscribe(subjects.event_filter(self.owner), cb=on_frame)
        await nc.subscribe(subjects.batch_results_filter(self.batch_id), cb=on_result)
        await nc.flush()
        self._subscribed.set()
        await self._stop.wait()
        await nc.close()

    def __enter__(self) -> LineWatch:
        self._thread.start()
        assert self._subscribed.wait(10), "the line watch did not subscribe"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def _frozen_while_holding(worker: Process, lines: LineWatch, worker_id: str) -> set[str]:
    """SIGSTOP `worker`; the lines it holds once what it sent before has arrived (some: it stays
    stopped; none: SIGCONT)."""
    worker.signal(signal.SIGSTOP)
    time.sleep(0.5)
    held = lines.held_by(worker_id)
    if not held:
        worker.signal(signal.SIGCONT)
    return held


def restart_nats(platform: Platform) -> None:
    nats = platform.stack.get("nats")
    nats.signal(signal.SIGKILL)
    assert nats.wait(5)
    nats.start()  # same port, same data directory
    deadline = time.monotonic() + 15
    while not nats.ready():
        assert time.monotonic() < deadline, "nats did not come back"
        time.sleep(0.05)


def test_batch_survives_a_nats_restart(platform: Platform, client: openai.OpenAI) -> None:
    items = chat_lines(120, max_tokens=[30 + i % 40 for i in range(120)], prefix="natsdown")
    batch = client.batches.create(input_file_id=upload(client, items), endpoint=CHAT, completion_window="24h")
    wait_for_completed(client, batch.id, 20)
    restart_nats(platform)
    deadline = time.monotonic() + 120
    while True:  # the gateway answers 5xx for a moment while it reconnects
        try:
            done = wait_for(client, batch.id, {"completed", "failed", "expired", "cancelled"}, timeout=120)
            break
        except (openai.APIStatusError, openai.APIConnectionError, openai.APITimeoutError):
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert done.status == "completed", done
    out = file_lines(client, done.output_file_id)
    assert [line["custom_id"] for line in out] == [i["custom_id"] for i in items] and done.error_file_id is None
    ids = {m.batch_request_id(batch.id, i) for i in range(120)}
    # A line the service was in doubt about across the restart ran again: two reports, one bill.
    assert once_per_line(read_usage(platform, "demo", ids, timeout=20)) == ids


def test_batch_survives_killing_the_batch_service_and_a_worker(platform: Platform, client: openai.OpenAI) -> None:
    """FAULT TEST (last in the module: worker-1 stays dead). SIGKILL the batch service and a worker
    mid-batch, start the batch service again: every line is in the output or error file exactly
    once, and billed once."""
    items = chat_lines(200, max_tokens=[40 + (i * 7) % 60 for i in range(200)], prefix="fault")
    batch = client.batches.create(input_file_id=upload(client, items), endpoint=CHAT, completion_window="24h")
    current = wait_for_completed(client, batch.id, 30)
    assert current.request_counts is not None and current.request_counts.completed < 200
    worker = platform.stack.get("worker-1")
    worker.signal(signal.SIGKILL)
    restart_batch_service(platform, kill=True)
    assert worker.wait(5)

    done = wait_for(client, batch.id, {"completed", "failed", "expired", "cancelled"}, timeout=120)
    assert done.status == "completed", done
    out = file_lines(client, done.output_file_id)
    errors = file_lines(client, done.error_file_id)
    seen = [line["custom_id"] for line in out + errors]
    assert sorted(seen) == sorted(i["custom_id"] for i in items)  # each exactly once
    assert not errors, errors[:3]
    assert [line["custom_id"] for line in out] == [i["custom_id"] for i in items]  # in input order
    for line in out:
        assert ChatCompletion.model_validate(line["response"]["body"]).usage is not None
    ids = {m.batch_request_id(batch.id, i) for i in range(200)}
    events = read_usage(platform, "demo", ids, timeout=20)
    assert once_per_line(events) == ids
    assert all(e.batch_id == batch.id for e in events)


def test_logs_name_the_batch(platform: Platform) -> None:
    log = Path(platform.stack.get("batch").log_path).read_text()
    assert '"batch_in_progress"' in log and '"batch_finished"' in log and '"batch_id"' in log


def test_a_line_is_handed_back_to_its_batch_service_which_queues_only_its_own(platform: Platform,
                                                                              client: openai.OpenAI) -> None:
    """A worker may not queue batch work; it hands a line back (preempted, draining) to the batch
    service, which queues the next attempt. Handing back a running batch's line billed to another
    tenant, or streaming to another owner, is refused (a `foreign_requeue` security event, nothing
    queued); control: the line's own next attempt is queued and the batch ends with each line once."""
    items = chat_lines(3, max_tokens=3000, prefix="handback")
    batch = client.batches.create(input_file_id=upload(client, items), endpoint=CHAT, completion_window="24h")
    wait_for(client, batch.id, {"in_progress"})
    batch_log = Path(platform.stack.get("batch").log_path)
    ready = next(json.loads(line) for line in batch_log.read_text().splitlines() if '"batch_ready"' in line)
    owner = subjects.reply_owner(ready["reply_subject"])

    async def hand_back() -> list[m.RequeueReply]:
        nc = await nats.connect(platform.stack.nats_url)
        try:
            kv = await nc.jetstream().key_value(subjects.BATCHES_BUCKET)
            record = m.decoder(m.BatchRecord).decode((await kv.get(subjects.batch_key("demo", batch.id))).value)
            now = time.time()
            line = m.InferenceRequest(
                request_id=m.batch_request_id(batch.id, 0), tenant=record.tenant, api_key_id=record.api_key_id,
                model=MODEL, prompt="Question number 0?", sampling=m.SamplingParams(max_new_tokens=3000),
                reply_to=ready["reply_subject"], deadline=now + 600, created=now, band="batch", attempt=7,
                batch_id=batch.id, batch_line=0, priority=bands.ENGINE_PRIORITY["batch"])
            answers = []
            for forged in (msgspec.structs.replace(line, tenant="another-tenant"),
                           msgspec.structs.replace(line, reply_to=subjects.token_subject("gateway")), line):
                reply = await nc.request(subjects.requeue_subject(owner), m.encode(forged), timeout=10)
                answers.append(m.decoder(m.RequeueReply).decode(reply.data))
            return answers
        finally:
            await nc.close()

    answers = asyncio.run(hand_back())
    assert [(a.queued, a.why) for a in answers] == [(False, "another_tenant"), (False, "another_owner"), (True, "")]
    refused = [json.loads(line) for line in batch_log.read_text().splitlines() if '"foreign_requeue"' in line]
    assert sorted(e["why"] for e in refused if batch.id in e["request_id"]) == ["another_owner", "another_tenant"]
    done = wait_for(client, batch.id, {"completed", "failed", "expired", "cancelled"}, timeout=120)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 0)
    assert sorted(line["custom_id"] for line in file_lines(client, done.output_file_id)) == [
        f"handback-{i}" for i in range(3)]


def test_only_the_holder_of_a_lines_attempt_gives_its_result(platform: Platform, client: openai.OpenAI) -> None:
    """While line 0 of a batch runs, a worker that does not run it (worker-9) publishes results of
    it first, under its own name: naming itself, with the message id a result used to have (the
    request id), and naming each real worker, with the id naming that worker. JetStream stores them
    all and the batch service refuses them all (`foreign_batch_result` security events:
    `attempt_held_by_another`, `names_another_worker` twice), as it refuses worker-9's `Accepted`
    of the attempt naming each real worker (to become its holder). The holder's own result (control) is
    stored, not dropped as a duplicate, and is the line's result: the batch completes with its
    attempt 0 and no forged text.

    Mutations caught: the worker's message id back to the request id (the holder's result dropped:
    the line runs again after its lease, as attempt 1); no holder check (the forgery is the line's
    result); readers counting workers' results rather than the batch service's records; an
    `Accepted`'s holder taken from the event rather than from its subject."""
    items = chat_lines(2, max_tokens=3000, prefix="holder")
    batch = client.batches.create(input_file_id=upload(client, items), endpoint=CHAT, completion_window="24h")
    wait_for(client, batch.id, {"in_progress"})
    rid = m.batch_request_id(batch.id, 0)
    forger, workers = "worker-9", ("worker-1", "worker-2")

    async def forge() -> None:
        nc = await nats.connect(platform.stack.nats_url)
        try:
            js = nc.jetstream()
            forged = m.BatchLineResult(batch_id=batch.id, line=0, request_id=rid, attempt=0, finished=time.time(),
                                       worker_id=forger, text="FORGED", finish_reason="stop",
                                       usage=m.Usage(prompt_tokens=1, completion_tokens=1))
            subject = subjects.batch_result_subject(batch.id, subjects.RESULT_FROM_WORKER, forger)
            as_workers = ((msgspec.structs.replace(forged, worker_id=worker), f"{rid}.w.{worker}")
                          for worker in workers)
            for result, msg_id in ((forged, rid), *as_workers):
                ack = await js.publish(subject, m.encode(result), headers={"Nats-Msg-Id": msg_id})
                assert not ack.duplicate
            # And an `Accepted` of the attempt naming each real worker, on worker-9's event subject.
            events = subjects.event_subject(subjects.token_subject("batch-main"), forger)
            for worker in workers:
                accepted = m.Accepted(request_id=rid, attempt=0, worker_id=worker, queue_wait=0.0)
                await nc.publish(events, m.encode(m.StreamFrame(events=[accepted])))
            await nc.flush()
        finally:
            await nc.close()

    asyncio.run(forge())
    done = wait_for(client, batch.id, {"completed", "failed", "expired", "cancelled"}, timeout=120)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 0)
    outputs = file_lines(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in outputs) == ["holder-0", "holder-1"]
    assert not any("FORGED" in json.dumps(line) for line in outputs)
    batch_log = Path(platform.stack.get("batch").log_path)
    refused = [json.loads(line) for line in batch_log.read_text().splitlines() if '"foreign_batch_result"' in line]
    assert sorted((e["seen_in"], e["why"], e["publisher"]) for e in refused if e.get("request_id") == rid) == [
        ("accepted", "names_another_worker", forger), ("accepted", "names_another_worker", forger),
        ("result", "attempt_held_by_another", forger), ("result", "names_another_worker", forger),
        ("result", "names_another_worker", forger)]

    async def records() -> tuple[list[m.BatchLineResult], list[m.BatchLineResult]]:
        """Line 0's results as the batch service recorded them, and as the real workers published them."""
        nc = await nats.connect(platform.stack.nats_url)
        found: tuple[list[m.BatchLineResult], list[m.BatchLineResult]] = ([], [])
        try:
            for filters, into in (([subjects.batch_results_kept_filter(batch.id)], found[0]),
                                  ([subjects.batch_result_subject(batch.id, subjects.RESULT_FROM_WORKER, worker)
                                    for worker in workers], found[1])):
                for filter_subject in filters:
                    sub = await nc.jetstream().subscribe(filter_subject, ordered_consumer=True)
                    with contextlib.suppress(nats.errors.TimeoutError):
                        while True:
                            result = m.decoder(m.BatchLineResult).decode((await sub.next_msg(timeout=1.0)).data)
                            if result.line == 0:
                                into.append(result)
                    await sub.unsubscribe()
        finally:
            await nc.close()
        return found

    kept, published = asyncio.run(records())
    assert [(r.attempt, r.text != "FORGED") for r in kept] == [(0, True)] and kept[0].worker_id in workers
    assert [(r.worker_id, r.attempt) for r in published] == [(kept[0].worker_id, 0)]
