"""The official openai SDK against a running platform: what a tenant's code sees."""

from __future__ import annotations

import http.client
import time

import httpx
import openai
import pytest

from .conftest import MODEL, Platform, on_both_topologies, read_usage
from .waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["aggregated", "disaggregated"])
def platform(request: pytest.FixtureRequest, platform: Platform) -> Platform:
    """Every test here runs on aggregated workers and on a prefill/decode pair (`--prefill 1 --decode 1`)."""
    return on_both_topologies(request, platform)

LONG_SYSTEM = "You are a meticulous assistant for the inferbus platform team. " * 40


def test_models_list_shows_the_base_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"


def test_chat_completion_non_streaming(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello"}], max_tokens=12, temperature=0, user="alice"
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert response.usage is not None
    assert response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12
    assert response.usage.prompt_tokens_details is not None
    assert response.usage.prompt_tokens_details.cached_tokens is not None
    assert response.id.startswith("chatcmpl-")


def test_streaming_matches_non_streaming_and_reports_usage_once(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me about NATS JetStream"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert chunks[-1].choices == []
    assert usage_chunks[0].usage.completion_tokens == 20
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]


def test_streaming_without_include_usage_has_no_empty_choices(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
    )
    chunks = list(stream)
    assert chunks and all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)


def test_completions_streaming_and_not(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert whole.object == "text_completion"
    assert whole.choices[0].text and whole.usage and whole.usage.completion_tokens == 8
    chunks = list(client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def run(seed: int) -> str:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Write a poem"}], max_tokens=16,
            temperature=0.9, top_p=0.95, seed=seed,
        )
        return r.choices[0].message.content or ""

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_stop_sequence_ends_generation_without_the_stop_text(client: openai.OpenAI) -> None:
    baseline = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Stop test"}], max_tokens=40, temperature=0
    ).choices[0].message.content or ""
    words = baseline.split()
    assert len(words) > 5
    stop_word = " " + words[4]
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Stop test"}], max_tokens=40, temperature=0, stop=[stop_word]
    )
    assert response.choices[0].finish_reason == "stop"
    content = response.choices[0].message.content or ""
    assert stop_word not in content
    assert baseline.startswith(content)


def test_repeated_prefix_reports_cached_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "first question"}]
    for _ in range(3):  # both workers may see it; the third is a hit on at least one of them
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    cached = []
    for i in range(4):
        messages[-1]["content"] = f"follow-up {i}"
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert r.usage and r.usage.prompt_tokens_details
        cached.append(r.usage.prompt_tokens_details.cached_tokens or 0)
    assert max(cached) > 0.8 * r.usage.prompt_tokens


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"", 400, "invalid_json"),
        (b'\xff\xfe{"model": 1}', 400, "invalid_encoding"),
        (b'{"model": "%s", "messages": "hello"}' % MODEL.encode(), 400, "invalid_value"),
        (b'{"model": "%s", "messages": []}' % MODEL.encode(), 400, "invalid_value"),
        (b'{"model": "%s", "messages": [{"role": "wizard", "content": "x"}]}' % MODEL.encode(), 400, "invalid_value"),
        (
            b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}' % MODEL.encode(),
            400,
            "invalid_value",
        ),
        (
            b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "max_tokens": "10"}' % MODEL.encode(),
            400,
            "invalid_value",
        ),
        (
            b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "max_tokens": 99999999}' % MODEL.encode(),
            400,
            "context_length_exceeded",
        ),
        (
            b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "temperature": 7}' % MODEL.encode(),
            400,
            "invalid_value",
        ),
        (
            b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "n": 0}' % MODEL.encode(),
            400,
            "invalid_value",
        ),
        (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "missing_required_parameter"),
        (b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found"),
    ],
)
def test_bad_requests_get_openai_errors(platform: Platform, body: bytes, status: int, code: str) -> None:
    response = httpx.post(
        f"{platform.base_url}/chat/completions", content=body,
        headers={"authorization": f"Bearer {platform.api_key}", "content-type": "application/json"},
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text
    assert response.headers["x-request-id"]


def test_huge_body_is_413(platform: Platform) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * 10_000_000 + b'"}]}'
    response = httpx.post(
        f"{platform.base_url}/chat/completions", content=body,
        headers={"authorization": f"Bearer {platform.api_key}", "content-type": "application/json"},
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_sdk_raises_typed_errors(platform: Platform) -> None:
    with pytest.raises(openai.NotFoundError):
        platform.client().chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=platform.base_url, api_key="ib-wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as raised:
        platform.client().chat.completions.create(model=MODEL, messages=[], max_tokens=3)
    assert raised.value.request_id


def test_unknown_endpoint_is_openai_404(platform: Platform) -> None:
    response = httpx.get(f"{platform.base_url}/nothing-here", headers={"authorization": f"Bearer {platform.api_key}"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "unknown_url"


def test_an_idle_connection_outlives_the_clients_own_keep_alive(platform: Platform) -> None:
    # httpx (so the openai SDK) drops idle connections after 5 s. Were the gateway to close them
    # first, a request sent on one just as it closes would fail with a connection error.
    url = httpx.URL(platform.base_url)
    connection = http.client.HTTPConnection(url.host, url.port, timeout=10)
    headers = {"authorization": f"Bearer {platform.api_key}"}
    try:
        connection.request("GET", "/v1/models", headers=headers)
        assert connection.getresponse().read()
        socket = connection.sock
        time.sleep(6)
        connection.request("GET", "/v1/models", headers=headers)
        response = connection.getresponse()
        assert response.status == 200 and response.read()
        assert connection.sock is socket
    finally:
        connection.close()


def _running_in_engines(platform: Platform) -> int:
    total = 0
    for i in (1, 2):
        loads = httpx.get(f"{platform.engine_url(i)}/v1/loads", params={"include": "all"}).json()["loads"]
        total += sum(entry["num_running_reqs"] + entry["num_waiting_reqs"] for entry in loads)
    return total


def _generated_in_engines(platform: Platform) -> float:
    """Tokens both engines have generated so far (their `sglang:generation_tokens_total`)."""
    total = 0.0
    for i in (1, 2):
        text = httpx.get(f"{platform.engine_url(i)}/metrics", timeout=10).text
        total += sum(
            float(line.split()[-1]) for line in text.splitlines() if line.startswith("sglang:generation_tokens_total")
        )
    return total


def test_client_disconnect_aborts_the_engine_request(platform: Platform) -> None:
    before = _generated_in_engines(platform)
    with platform.client(timeout=30).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a long essay"}], max_tokens=4000, stream=True
    ) as stream:
        for _ in zip(range(3), stream):
            pass
        assert _running_in_engines(platform) >= 1
    # Closing the stream closes the connection; the engine stops the request long before its
    # 4000 tokens (counted in tokens, not seconds: a busy machine slows the abort and the engine alike).
    wait_for(lambda: not _running_in_engines(platform), 120, what="the engines idle again")
    assert _generated_in_engines(platform) - before < 1000
    assert _running_in_engines(platform) == 0


def test_every_request_lands_once_in_the_usage_ledger(platform: Platform, client: openai.OpenAI) -> None:
    response = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "bill me"}], max_tokens=7
    )
    request_id = response.headers["x-request-id"]
    events = read_usage(platform, "demo", {request_id})
    assert len(events) == 1
    assert events[0].status == "completed"
    assert events[0].usage.completion_tokens == 7
    assert events[0].tenant == "demo"
