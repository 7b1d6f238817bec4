"""Billing audited against what the clients counted themselves, not against the usage the platform
told them.

Each request runs under an API key of its own (so the billing service's rollups by key are per
request). The client counts what it received: the completion tokens re-counted from the text of
every choice (segmented by the tokens its `logprobs` named, each re-encoded with the served model's
tokenizer, and the segments required to make up exactly the text received), and the prompt tokens
of the chat it sent, rendered and encoded with the served model's template and tokenizer. Every
delivery is counted as it came: a chunk sent twice adds its tokens twice, a second usage chunk or
finish reason is counted, never folded into a dict. Those counts are compared with the billing
service's per-request rollups, its total, and the ledger's events listed one by one (a duplicate
or a missing event both show).

The run mixes streams migrated mid-way (a worker is SIGKILLed while every long stream is running,
and the test requires migrations to have happened), streams the client cancels, `n` > 1 streamed
and not, and plain answers.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from inferbus.local.process import Process
from inferbus.tokens.prompt import load_model, render_prompt

from .conftest import MODEL, Platform, running_platform
from .ledger import ledger, new_tenant, outbox_pending, rollup_drained, rollups_by_key
from .waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("billing-audit"), workers=3, time_scale=0.1,
                          # A starved machine pauses workers now and then (each pause moves their
                          # streams): attempts enough that those never end a stream here.
                          extra_env={"INFERBUS_REQUEST_TIMEOUT_S": "120", "INFERBUS_MAX_ATTEMPTS": "8"}) as running:
        yield running


@dataclass
class Received:
    """What one request's client received, every delivery counted."""

    kind: str
    messages: list[dict[str, str]]
    n: int = 1
    request_id: str = ""
    text: dict[int, str] = field(default_factory=dict)  # choice index → its content, as delivered
    tokens: dict[int, list[str]] = field(default_factory=dict)  # choice index → its logprob tokens, as delivered
    finishes: list[tuple[int, str]] = field(default_factory=list)  # (choice, finish reason), each delivery
    usages: list[Any] = field(default_factory=list)  # every usage the client was told (streams: one chunk each)
    content_chunks: int = 0
    cancelled: bool = False
    error: BaseException | None = None

    def add(self, index: int, content: str | None, logprobs: Any) -> None:
        self.text[index] = self.text.get(index, "") + (content or "")
        self.tokens.setdefault(index, []).extend(entry.token for entry in (logprobs.content or [] if logprobs else []))


def run_request(client: openai.OpenAI, received: Received, max_tokens: int, cancel_after: int = 0) -> None:
    try:
        if received.kind == "plain":
            response = client.chat.completions.create(
                model=MODEL, messages=received.messages, max_tokens=max_tokens, n=received.n,  # type: ignore[arg-type]
                temperature=1.0, logprobs=True)
            received.request_id = response.id.removeprefix("chatcmpl-")
            for choice in response.choices:
                received.add(choice.index, choice.message.content, choice.logprobs)
                received.finishes.append((choice.index, choice.finish_reason))
            received.usages.append(response.usage)
            return
        stream = client.chat.completions.create(
            model=MODEL, messages=received.messages, max_tokens=max_tokens, n=received.n,  # type: ignore[arg-type]
            temperature=1.0, logprobs=True, stream=True, stream_options={"include_usage": True})
        received.request_id = stream.response.headers["x-request-id"]
        for chunk in stream:
            if chunk.usage is not None:
                received.usages.append(chunk.usage)
            for choice in chunk.choices:
                received.add(choice.index, choice.delta.content, choice.logprobs)
                if choice.delta.content:
                    received.content_chunks += 1
                if choice.finish_reason:
                    received.finishes.append((choice.index, choice.finish_reason))
            if cancel_after and received.content_chunks >= cancel_after:
                received.cancelled = True
                stream.close()  # the client goes away mid-stream
                return
    except BaseException as error:  # noqa: BLE001 - reported by the test
        received.error = error


def completion_count(received: Received, encode: Any, index: int) -> int:
    """The completion tokens of choice `index`, re-counted by the served model's tokenizer from the
    text received: the tokens the logprobs named must make up that text exactly."""
    tokens = received.tokens.get(index, [])
    assert "".join(tokens) == received.text.get(index, ""), "the logprobs' tokens are not the text received"
    return sum(len(encode(token)) for token in tokens)


def frozen_busy_worker(platform: Platform) -> Process | None:
    """A worker stopped (SIGSTOP) while its engine runs requests, so that killing it hits live
    streams (a stopped worker finishes none); None when no engine runs any now."""
    with httpx.Client(timeout=5) as http:
        for i in range(1, 4):
            worker = platform.stack.get(f"worker-{i}")
            if not worker.alive():
                continue
            worker.signal(signal.SIGSTOP)
            loads = http.get(f"{platform.engine_url(i)}/v1/loads").json()["loads"]
            if sum(entry["num_running_reqs"] for entry in loads):
                return worker
            worker.signal(signal.SIGCONT)
    return None


def migrations(platform: Platform) -> float:
    text = httpx.get(platform.stack.gateway_url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("inferbus_migrations_total "))


def test_billing_equals_what_clients_counted_through_migrations_cancels_and_n(platform: Platform) -> None:
    plan: list[tuple[str, int, int, int]] = (  # (kind, n, max_tokens, cancel after this many content chunks)
        [("stream", 1, 1200, 0)] * 4 + [("stream", 2, 60, 0)] * 2 + [("plain", 3, 40, 0)] * 2
        + [("plain", 1, 30, 0)] * 2 + [("stream", 1, 3000, 12)] * 2)
    tenant, keys = new_tenant(platform, keys=len(plan))
    started = time.time()
    requests = [Received(kind, [{"role": "user", "content": f"audit {i}: tell me a long story"}], n)
                for i, (kind, n, _, _) in enumerate(plan)]
    threads = [threading.Thread(target=run_request, daemon=True,
                                args=(openai.OpenAI(base_url=platform.base_url, api_key=secret, max_retries=0,
                                                    timeout=120), received, max_tokens, cancel))
               for (secret, _), received, (_, _, max_tokens, cancel) in zip(keys, requests, plan, strict=True)]
    before = migrations(platform)
    cancels = [thread for thread, (_, _, _, cancel) in zip(threads, plan, strict=True) if cancel]
    # First the cancels, on the ledger before the kill. Not yet proven here: a cancelled request
    # whose worker dies before writing its usage event is billed by nobody (the gateway bills a
    # client's disconnect only through that worker).
    for thread in cancels:
        thread.start()
    for thread in cancels:
        thread.join(timeout=120)
    cancelled_ids = {r.request_id for r in requests if r.cancelled}
    assert len(cancelled_ids) == 2, [r.error for r in requests if r.error]
    wait_for(lambda: cancelled_ids <= {e.request_id for e in ledger(platform, tenant)},
             timeout=60, what="the cancelled requests' usage on the ledger")
    for thread in threads:
        if thread not in cancels:
            thread.start()
    long_streams = requests[:4]
    wait_for(lambda: all(r.content_chunks >= 20 for r in long_streams), timeout=60,
             what="every long stream to be under way")
    victim = wait_for(lambda: frozen_busy_worker(platform), timeout=30, what="a worker stopped while its engine runs")
    victim.signal(signal.SIGKILL)
    assert victim.wait(10)
    for thread in threads:
        thread.join(timeout=120)
    assert all(not thread.is_alive() for thread in threads)
    assert [(r.kind, r.n, r.content_chunks, repr(r.error)) for r in requests if r.error] == []
    assert migrations(platform) > before, "the kill hit no live stream"

    # The killed worker comes back (as `inferbus up` restarts it) and delivers what its outbox holds.
    victim.start()
    outbox = platform.stack.config.state_dir / "state" / f"usage-outbox-{victim.name}.sqlite3"
    wait_for(lambda: outbox_pending(outbox) == 0, timeout=60, what="the killed worker's outbox to be delivered")
    served = load_model(platform.stack.model_dir)

    def encode(text: str) -> list[int]:
        return served.encode(text, add_special_tokens=False)

    expected: dict[str, dict[str, int]] = {}
    for (_, key_id), received in zip(keys, requests, strict=True):
        prompt = len(render_prompt(served, messages=received.messages).ids)
        output = sum(completion_count(received, encode, i) for i in range(received.n))
        expected[key_id] = {"requests": received.n, "input": prompt, "output": output}
        if not received.cancelled:
            # One answer per choice, one usage, each delivered once.
            assert sorted(i for i, _ in received.finishes) == list(range(received.n)), received.finishes
            assert len(received.usages) == 1, received.usages
    try:
        wait_for(
            lambda: (
                rollup_drained(platform)
                and set(rollups_by_key(platform, tenant, started, time.time())) >= set(expected)
            ),
            timeout=60,
            what="every request rolled up",
        )
    except TimeoutError:
        pass  # the comparisons below say which
    rollups = rollups_by_key(platform, tenant, started, time.time())
    assert set(rollups) == set(expected), [(r.kind, r.n, r.cancelled, r.request_id) for (_, k), r in zip(keys, requests)
                                           if k not in rollups]
    for (_, key_id), received in zip(keys, requests, strict=True):
        got, want = rollups[key_id], expected[key_id]
        assert (got["requests"], got["input"]) == (want["requests"], want["input"]), (received.kind, got, want)
        if received.cancelled:
            # The bill counts what the engine made before the cancel reached it: never less than
            # what the client received.
            assert want["output"] <= got["output"] < 3000, (got, want)
        else:
            assert got["output"] == want["output"], (received.kind, received.n, got, want)
    completed = [k for (_, k), r in zip(keys, requests, strict=True) if not r.cancelled]
    assert sum(rollups[k]["output"] for k in completed) == sum(expected[k]["output"] for k in completed)
    assert sum(r["input"] for r in rollups.values()) == sum(e["input"] for e in expected.values())

    # The ledger, event by event: each request's key (choice i > 0 of n: `<id>.c<i>`). A stream the
    # killed worker ran may be reported twice under its key, by that worker (its outbox, delivered
    # when it came back) and by the one that finished it; the rollups above counted each key once.
    billed = [e for e in ledger(platform, tenant) if e.billed_to == "tenant"]
    ids = Counter(e.request_id for e in billed)
    want_ids = {f"{r.request_id}.c{i}" if i else r.request_id for r in requests for i in range(r.n)}
    assert set(ids) == want_ids, (set(ids) - want_ids, want_ids - set(ids))
    for key in (k for k, count in ids.items() if count > 1):
        reporters = [e.worker_id for e in billed if e.request_id == key]
        assert len(reporters) == 2 and victim.name in reporters and len(set(reporters)) == 2, (key, reporters)
