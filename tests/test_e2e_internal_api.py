"""Internal producers call the OpenAI API over NATS (`inferbus.bus.client.BusClient`) and go through
the same admission as HTTP: the tenant's key (401), its quotas (429), streamed replies, and usage
billed to the tenant on the ledger."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
import pytest

from inferbus.bus.client import BusAPIError, BusClient, read_answer
from proto import subjects

from .conftest import MODEL, Platform, read_usage

pytestmark = pytest.mark.e2e

T = TypeVar("T")
MESSAGES = [{"role": "user", "content": "Say something about buses."}]


def on_bus(platform: Platform, key: str, work: Callable[[BusClient], Awaitable[T]]) -> T:
    async def run() -> T:
        # As an internal producer would: with the `producer` identity, which may only call the API.
        assert platform.stack.identities is not None
        producer = platform.stack.identities["producer"]
        nc = await nats.connect(platform.stack.nats_server_url, user=producer.user, password=producer.password,
                                inbox_prefix=producer.inbox_prefix())
        try:
            return await work(BusClient(nc, key, timeout=30))
        finally:
            await nc.close()

    return asyncio.run(run())


def request_id(object_id: str) -> str:
    return object_id.split("-", 1)[1]


def test_a_chat_completion_over_the_bus_is_billed_to_the_tenant_in_its_band(platform: Platform) -> None:
    tenant, key = platform.new_tenant(band="premium")
    answer = on_bus(platform, key, lambda api: api.chat_completion(model=MODEL, messages=MESSAGES, max_tokens=5))
    assert answer["object"] == "chat.completion" and answer["model"] == MODEL
    assert answer["choices"][0]["message"]["role"] == "assistant" and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 5
    completion = on_bus(platform, key, lambda api: api.completion(model=MODEL, prompt="Once upon", max_tokens=3))
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] == 3
    ids = {request_id(answer["id"]), request_id(completion["id"])}
    events = read_usage(platform, tenant, ids)
    assert {e.request_id for e in events} == ids
    assert all((e.tenant, e.status, e.band) == (tenant, "completed", "premium") for e in events)
    by_id = {e.request_id: e for e in events}
    assert by_id[request_id(answer["id"])].usage.completion_tokens == 5
    assert by_id[request_id(answer["id"])].usage.prompt_tokens == answer["usage"]["prompt_tokens"]


def test_a_streamed_reply_comes_as_openai_chunks_with_usage(platform: Platform) -> None:
    tenant, key = platform.new_tenant()

    async def work(api: BusClient) -> list[dict[str, Any]]:
        return [chunk async for chunk in api.stream_chat_completion(
            model=MODEL, messages=MESSAGES, max_tokens=8, stream_options={"include_usage": True})]

    chunks = on_bus(platform, key, work)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks) and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text
    (event,) = read_usage(platform, tenant, {request_id(chunks[0]["id"])})
    assert (event.tenant, event.usage.completion_tokens) == (tenant, 8)


def test_a_bad_key_is_a_401_and_a_missing_one_too(platform: Platform) -> None:
    for key in ("sk-not-a-key", ""):
        with pytest.raises(BusAPIError) as raised:
            on_bus(platform, key, lambda api: api.chat_completion(model=MODEL, messages=MESSAGES, max_tokens=2))
        assert raised.value.status == 401 and raised.value.error["type"] == "authentication_error"

    async def stream(api: BusClient) -> None:
        async for _ in api.stream_chat_completion(model=MODEL, messages=MESSAGES, max_tokens=2):
            pass

    with pytest.raises(BusAPIError) as raised:
        on_bus(platform, "sk-not-a-key", stream)
    assert raised.value.status == 401 and raised.value.code == "invalid_api_key"


def test_the_tenants_quota_is_a_429_over_the_bus(platform: Platform) -> None:
    _, key = platform.new_tenant(limits={"requests_per_minute": 1})

    async def twice(api: BusClient) -> BusAPIError:
        await api.chat_completion(model=MODEL, messages=MESSAGES, max_tokens=2)
        with pytest.raises(BusAPIError) as raised:
            await api.chat_completion(model=MODEL, messages=MESSAGES, max_tokens=2)
        return raised.value

    error = on_bus(platform, key, twice)
    assert error.status == 429 and error.code == "rate_limit_exceeded"
    assert int(error.headers["retry-after"]) >= 1 and "x-ratelimit-limit-requests" in error.headers


def test_bad_input_over_the_bus_is_a_400(platform: Platform) -> None:
    _, key = platform.new_tenant()
    with pytest.raises(BusAPIError) as raised:
        on_bus(platform, key, lambda api: api.chat_completion(model=MODEL, messages=[], max_tokens=2))
    assert raised.value.status == 400 and raised.value.error["param"] == "messages"

    async def raw(api: BusClient) -> tuple[int, dict[str, Any]]:
        msg = await api.nc.request(subjects.api_subject("chat"), b"{not json", timeout=10,
                                   headers={"Authorization": f"Bearer {key}"})
        return read_answer(msg)

    status, body = on_bus(platform, key, raw)
    assert status == 400 and body["error"]["code"] == "invalid_json"


def test_leaving_a_stream_early_cancels_the_request(platform: Platform) -> None:
    tenant, key = platform.new_tenant()

    async def three_chunks(api: BusClient) -> str:
        stream = api.stream_chat_completion(model=MODEL, messages=MESSAGES, max_tokens=2000)
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                break
        await stream.aclose()  # type: ignore[attr-defined]
        return request_id(chunks[0]["id"])

    rid = on_bus(platform, key, three_chunks)
    # The tenant's event (tokens the engine made after the client left are the platform's, if any).
    (event,) = [e for e in read_usage(platform, tenant, {rid}, timeout=15) if e.billed_to == "tenant"]
    assert event.status == "cancelled" and 3 <= event.usage.completion_tokens < 2000
