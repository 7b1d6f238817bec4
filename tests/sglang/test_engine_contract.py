"""The engine API our worker relies on, through our own client (`services.worker.engine`), against
real SGLang 0.5.23 or the simulated engine (see conftest.py): whatever holds here holds for both."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from inferbus.tokens.prompt import load_model
from proto import messages as m
from services.worker.engine import EngineClient, EngineError, EngineUpdate
from services.worker.reporting import engine_context_length

from .conftest import MAX_TOTAL_TOKENS, SGLANG_VERSION, Engine

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]  # the first engine start may take minutes

PROMPT = "def fibonacci(n):\n    # Return the n-th Fibonacci number, computed iteratively.\n"


def request(prompt: str = PROMPT, max_new_tokens: int = 8, adapter: str | None = None,
            temperature: float = 0.0, **fields: object) -> m.InferenceRequest:
    now = time.time()
    return m.InferenceRequest(
        request_id=uuid.uuid4().hex[:16], tenant="contract", model="contract", prompt=prompt,
        sampling=m.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature),
        reply_to="unused", deadline=now + 300, created=now, adapter=adapter, **fields,  # type: ignore[arg-type]
    )


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[EngineClient]:
    client = EngineClient(engine.url)
    await client.start()
    yield client
    await client.close()


async def collect(client: EngineClient, req: m.InferenceRequest) -> list[EngineUpdate]:
    return [update async for update in client.generate(req, {})]


async def text_of(client: EngineClient, req: m.InferenceRequest) -> str:
    return "".join(update.text for update in await collect(client, req))


async def until(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(interval)
    return False


async def test_a_stream_reports_usage_and_ends_with_length(client: EngineClient) -> None:
    updates = await collect(client, request(max_new_tokens=12))
    final = updates[-1]
    assert final.finish is not None and final.finish["type"] == "length"
    assert final.completion_tokens == 12
    prompt_tokens = [u.prompt_tokens for u in updates if u.prompt_tokens is not None]
    assert prompt_tokens and prompt_tokens[-1] > 10
    # Deltas, not the engine's cumulative text: no update repeats what an earlier one sent.
    assert "".join(u.text for u in updates)


async def test_greedy_generation_is_deterministic(client: EngineClient) -> None:
    first = await text_of(client, request(max_new_tokens=10))
    second = await text_of(client, request(max_new_tokens=10))
    assert first == second


async def test_a_repeated_prompt_reports_its_cached_prefix(client: EngineClient) -> None:
    prompt = PROMPT * 12  # long enough for whole cache blocks at any page size we run
    first = await collect(client, request(prompt, max_new_tokens=2))
    second = await collect(client, request(prompt, max_new_tokens=2))
    prompt_tokens = first[-1].prompt_tokens or 0
    assert first[-1].cached_tokens < prompt_tokens / 2
    assert second[-1].cached_tokens >= prompt_tokens / 2


async def test_plain_generation_answers_one_json_object(engine: Engine) -> None:
    answer = httpx.post(engine.url + "/generate", timeout=60,
                        json={"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert answer.status_code == 200
    body = answer.json()
    assert isinstance(body["text"], str) and len(body["output_ids"]) == 4
    meta = body["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 4
    assert meta["prompt_tokens"] > 10 and "e2e_latency" in meta


async def test_the_probe_passes_on_the_base_model(client: EngineClient) -> None:
    await client.probe()


async def test_abort_ends_the_stream_with_abort_and_frees_the_slot(client: EngineClient) -> None:
    req = request(max_new_tokens=3000, temperature=1.0)
    updates: list[EngineUpdate] = []

    async def consume() -> None:
        async for update in client.generate(req, {}):
            updates.append(update)

    stream = asyncio.create_task(consume())
    assert await until(lambda: _true(bool(updates)), timeout=60), "no token before the abort"
    assert (await client.loads()).running >= 1
    await client.abort(req.engine_rid())
    await asyncio.wait_for(stream, 30)  # ends normally: no EngineError
    assert updates[-1].finish is not None and updates[-1].finish["type"] == "abort"
    assert updates[-1].completion_tokens < 3000

    async def idle() -> bool:
        return (await client.loads()).running == 0

    assert await until(idle, timeout=10), "the engine still counts the aborted request as running"


async def test_aborting_an_unknown_request_is_harmless(engine: Engine) -> None:
    assert httpx.post(engine.url + "/abort_request", json={"rid": "no-such-request"}, timeout=10).status_code == 200


async def _true(value: bool) -> bool:
    return value


async def test_server_info_and_loads_give_the_effective_running_limit(engine: Engine, client: EngineClient) -> None:
    info = await client.server_info()
    assert info["version"] == SGLANG_VERSION
    assert info["max_total_num_tokens"] > 0
    # Started without --max-running-requests: null at the top, the effective value inside.
    assert info["max_running_requests"] is None
    effective = info["internal_states"][0]["effective_max_running_requests_per_dp"]
    assert isinstance(effective, int) and effective > 0
    loads = httpx.get(engine.url + "/v1/loads", timeout=10).json()["loads"]
    assert loads[0]["max_running_requests"] == effective
    assert {"num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens"} <= set(loads[0])
    load = await client.loads()
    assert load.capacity_tokens == info["max_total_num_tokens"]
    assert httpx.get(engine.url + "/get_load", timeout=10).status_code == 404


async def test_server_info_gives_the_context_window_the_engine_enforces(engine: Engine, client: EngineClient) -> None:
    """The worker's heartbeat carries the window read here: started without --context-length,
    `context_length` is null at the top and `max_req_input_len` is min(model's window, KV pool) - 6;
    a prompt as long as that window is refused, one token less is not."""
    info = await client.server_info()
    assert info["context_length"] is None
    window = engine_context_length(info)
    assert window == load_model(str(engine.model_dir)).context_length == MAX_TOTAL_TOKENS
    with pytest.raises(EngineError) as refused:
        await collect(client, request(max_new_tokens=1, input_ids=[7] * window))
    assert refused.value.status == 400 and not refused.value.retryable
    plain = httpx.post(engine.url + "/generate", timeout=60, json={
        "input_ids": [7] * (info["max_req_input_len"] - 1), "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert plain.status_code == 200 and plain.json()["meta_info"]["finish_reason"]["type"] == "length", plain.text


async def test_forced_json_has_no_free_whitespace_between_tokens(client: EngineClient) -> None:
    """Launched with --constrained-json-disable-any-whitespace, even a random-weight model writes
    the schema's JSON on one line with ", " and ": " between tokens (XGrammar's separators, not
    compact): the grammar leaves it no room for other spaces or newlines."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["alpha", "beta"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "minItems": 2, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "count", "tags", "ok"],
        "additionalProperties": False,
    }
    for temperature in (0.0, 1.0):
        req = request(max_new_tokens=120, temperature=temperature)
        req.sampling.json_schema = json.dumps(schema)
        text = "".join(update.text for update in await collect(client, req))
        assert text == json.dumps(json.loads(text), ensure_ascii=False, separators=(", ", ": ")), text


async def test_an_adapter_loads_verifies_serves_and_unloads(engine: Engine, client: EngineClient) -> None:
    name = f"contract-{uuid.uuid4().hex[:6]}"
    result = await client.load_lora(name, engine.lora_path)
    assert result["success"] is True and name in result["loaded_adapters"]
    try:
        await client.probe(name)
        again = await client.load_lora(name, engine.lora_path)
        assert again["success"] is False and again.get("error_message")
        base = await text_of(client, request(max_new_tokens=6))
        assert await text_of(client, request(max_new_tokens=6, adapter=name)) != base  # its weights change the output
        models = httpx.get(engine.url + "/v1/models", timeout=10).json()["data"]
        assert any(model["id"] == name and model.get("parent") for model in models)
    finally:
        await client.unload_lora(name)
    listed = httpx.get(engine.url + "/v1/models", timeout=10).json()["data"]
    assert name not in {model["id"] for model in listed}
    # SGLang remembers every adapter it loaded since start: a request for an unloaded one loads it
    # again by itself (only an engine restart makes it "never loaded").
    assert await text_of(client, request(max_new_tokens=6, adapter=name))
    await client.unload_lora(name)


async def test_a_load_holds_up_the_running_batch(engine: Engine, client: EngineClient) -> None:
    """SGLang reads an adapter from disk inside its scheduler's loop: a stream already running gets
    no token until the read is done. The router prices this (`AdapterSlots.stall`)."""
    arrivals: list[float] = []
    body = {"text": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}}

    async def stream() -> None:
        async with (
            httpx.AsyncClient(timeout=300) as http,
            http.stream("POST", engine.url + "/generate", json=body) as answer,
        ):
            assert answer.status_code == 200
            async for line in answer.aiter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    arrivals.append(time.monotonic())

    running = asyncio.create_task(stream())
    assert await until(lambda: asyncio.sleep(0, len(arrivals) >= 20), timeout=120)
    name = f"slow-{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    result = await client.load_lora(name, engine.slow_lora_path)
    took = time.monotonic() - started
    try:
        assert result["success"] is True, result
        await running
    finally:
        await client.unload_lora(name)
    gaps = [(b - a, a, b) for a, b in zip(arrivals, arrivals[1:])]
    longest, before, after = max(gaps)
    usual = sorted(gap for gap, _, _ in gaps)[len(gaps) // 2]
    assert before < started + took and after > started, "the longest pause was not during the load"
    assert longest >= 0.5 * took and longest > 5 * usual, (longest, took, usual)


async def test_an_adapter_that_cannot_load_is_a_400(engine: Engine, client: EngineClient) -> None:
    for path in (engine.bad_lora_path, engine.missing_lora_path):
        name = f"bad-{uuid.uuid4().hex[:6]}"
        raw = httpx.post(engine.url + "/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=120)
        assert raw.status_code == 400, raw.text
        assert raw.json()["success"] is False
        assert name not in (raw.json().get("loaded_adapters") or {})


async def test_a_request_for_an_adapter_the_engine_never_loaded_is_refused_and_recognised(engine: Engine,
                                                                                          client: EngineClient) -> None:
    """SGLang refuses it before a plain answer (400) and inside a stream (200, then an error event);
    our client recognises both as the adapter missing on the engine, which the worker repairs."""
    plain = httpx.post(engine.url + "/generate", timeout=30,
                       json={"text": "x", "lora_path": "never-loaded", "sampling_params": {"max_new_tokens": 1}})
    assert plain.status_code == 400 and "never been loaded: never-loaded" in plain.json()["error"]["message"]
    with pytest.raises(EngineError) as streamed:
        await collect(client, request(adapter="never-loaded"))
    with pytest.raises(EngineError) as probed:
        await client.probe("never-loaded")
    for refused in (streamed.value, probed.value):
        assert refused.code == "adapter_not_loaded" and not refused.retryable
        assert "never been loaded" in str(refused)


async def test_a_migrated_stream_continues_from_token_ids(engine: Engine, client: EngineClient) -> None:
    """A second attempt sends the prompt's ids plus the ids already generated: the engine
    computes on exactly those (no re-tokenized text), reuses their cache and generates the rest."""
    ids = load_model(str(engine.model_dir)).encode(PROMPT, add_special_tokens=True)
    first = await collect(client, request(max_new_tokens=5, input_ids=ids))
    generated = [token for update in first for token in update.token_ids]
    assert len(generated) == 5 and first[-1].prompt_tokens == len(ids)
    resumed = await collect(client, request(max_new_tokens=12, input_ids=ids, resumed_ids=generated,
                                            resumed_tokens=5, attempt=1))
    final = resumed[-1]
    assert final.finish is not None and final.finish["type"] == "length"
    assert final.prompt_tokens == len(ids) + len(generated)
    assert final.completion_tokens == 12 - 5
    assert len([token for update in resumed for token in update.token_ids]) == 12 - 5
    assert final.cached_tokens >= len(ids) - 1
