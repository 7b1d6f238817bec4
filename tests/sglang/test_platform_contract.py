"""The platform in front of the contract engine: a real nats-server and Redis, gateway and router
from `inferbus.local.stack.Stack`, and our worker process driving the engine (real SGLang under
`make test-sglang`, the simulated engine otherwise), exercised with the official `openai` SDK."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator

import httpx
import msgspec
import nats
import openai
import pytest
from nats.aio.msg import Msg

from inferbus.local.ports import free_port
from inferbus.local.probes import logged
from inferbus.local.process import Process
from inferbus.local.stack import Stack, StackConfig
from inferbus.releases.record import directory_digest
from inferbus.tokens.blocks import DEFAULT_BLOCK_SIZE, block_hashes
from inferbus.tokens.prompt import load_model, render_prompt
from proto import messages as m
from proto import subjects
from services.router.index import PrefixIndex

from ..conftest import Platform, read_usage
from .conftest import Engine

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]  # the first engine start may take minutes

MODEL = "contract-model"
WORKER_ID = "worker-contract"


@pytest.fixture(scope="module")
def served(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """The platform with one worker, ours, on the contract engine."""
    from tools.commands.local_platform import demo_key
    from tools.commands.main import new_admin_key

    state = tmp_path_factory.mktemp("platform")
    stack = Stack(StackConfig(state_dir=state, workers=0, batch=False, model=MODEL, model_dir=engine.model_dir,
                              gateway_port=free_port(), admin_key=new_admin_key()))
    try:
        stack.start(timeout=90)
        log = state / "logs" / "worker.log"
        worker = Process(
            "worker", [sys.executable, "-m", "tools.commands.main", "worker"],
            stack._env(**stack.credentials(WORKER_ID), INFERBUS_WORKER_ID=WORKER_ID, INFERBUS_ENGINE_URL=engine.url,
                       INFERBUS_ENGINE_KV_EVENTS=engine.kv_events, INFERBUS_ENGINE_KV_EVENTS_BIND="false",
                       INFERBUS_METRICS_PORT="0",  # the engine binds its KV-event endpoint ("bind": true)
                       # Nothing here replaces a worker that gives its engine up, and real SGLang's
                       # restart in the last test takes minutes on a loaded machine: wait for it.
                       INFERBUS_WORKER_ENGINE_DEAD_AFTER_S="0"),
            log, lambda: logged(log, b'"worker_ready"'), engine.url,
        )
        stack.processes.append(worker)  # stopped first, with the rest
        worker.start()
        deadline = time.monotonic() + 120
        while not worker.ready():
            assert worker.alive(), log.read_text()[-3000:]
            assert time.monotonic() < deadline, "worker not ready:\n" + log.read_text()[-3000:]
            time.sleep(0.2)
        key = asyncio.run(demo_key(stack.redis_url))
        yield Platform(stack, key, stack.config.admin_key)
    finally:
        stack.stop()
        # The engine is the session's: the next module (in whatever order the runner picks) finds
        # it without the adapters this platform had it load.
        models = httpx.get(engine.url + "/v1/models", timeout=30).json()["data"]
        for adapter in [model["id"] for model in models if model.get("parent")]:
            httpx.post(engine.url + "/unload_lora_adapter", json={"lora_name": adapter}, timeout=30)


@pytest.fixture
def client(served: Platform) -> openai.OpenAI:
    return served.client(timeout=120)


def engine_running(engine: Engine) -> int:
    return sum(entry["num_running_reqs"] for entry in httpx.get(engine.url + "/v1/loads", timeout=10).json()["loads"])


def test_a_chat_completion_through_the_platform(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                            messages=[{"role": "user", "content": "Say something."}])
    assert answer.choices[0].finish_reason == "length"
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.completion_tokens == 8 and answer.usage.prompt_tokens > 0


def test_a_streamed_completion_through_the_platform(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    assert text
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_a_client_that_hangs_up_frees_the_engine(served: Platform, engine: Engine) -> None:
    client = served.client(timeout=120)
    stream = client.completions.create(model=MODEL, prompt="class Parser:\n", max_tokens=3000, temperature=1.0,
                                       stream=True)
    for _ in stream:
        if engine_running(engine) >= 1:
            break
    stream.close()
    deadline = time.monotonic() + 15
    while engine_running(engine) > 0:
        assert time.monotonic() < deadline, "the engine still runs the abandoned request"
        time.sleep(0.1)


def test_the_worker_offers_the_engines_effective_running_limit(served: Platform, engine: Engine) -> None:
    """Without --max-running-requests /server_info says null at the top: the worker must take the
    engine's effective limit (internal_states, /v1/loads), not a guess."""
    effective = httpx.get(engine.url + "/v1/loads", timeout=10).json()["loads"][0]["max_running_requests"]
    log = (served.stack.config.state_dir / "logs" / "worker.log").read_text()
    ready = next(line for line in log.splitlines() if '"worker_ready"' in line)
    assert f'"capacity": {effective}' in ready or f'"capacity":{effective}' in ready, ready


def test_the_worker_offers_the_engines_context_window(served: Platform, engine: Engine) -> None:
    """The heartbeat carries the window the engine enforces, read from its /server_info (no
    --context-length here: max_req_input_len + 6), so the gateway sizes max_tokens by it."""
    info = httpx.get(engine.url + "/server_info", timeout=30).json()

    async def heartbeat() -> m.Heartbeat:
        nc = await nats.connect(served.stack.nats_url)
        try:
            kv = await nc.jetstream().key_value(subjects.WORKERS_BUCKET)
            entry = await kv.get(subjects.worker_key(WORKER_ID))
            assert entry.value
            return msgspec.msgpack.decode(entry.value, type=m.Heartbeat)
        finally:
            await nc.close()

    beat = asyncio.run(heartbeat())
    assert beat.context_length == info["max_req_input_len"] + 6 == load_model(str(engine.model_dir)).context_length


def test_an_adapter_is_served_again_after_the_engine_forgot_it(served: Platform, engine: Engine,
                                                                client: openai.OpenAI) -> None:
    with served.admin() as admin:
        created = admin.post("/adapters", json={"name": "contract-bot", "version": directory_digest(engine.lora_path),
                                                 "path": engine.lora_path})
        assert created.status_code == 201, created.text
        engine_name = created.json()["engine_name"]
    first = client.completions.create(model="contract-bot", prompt="def main():\n", max_tokens=4, temperature=0)
    assert first.choices[0].text
    # The engine loses it (as after an engine restart); the worker still believes it is loaded.
    assert (
        httpx.post(engine.url + "/unload_lora_adapter", json={"lora_name": engine_name}, timeout=30).status_code == 200
    )
    again = client.completions.create(model="contract-bot", prompt="def main():\n", max_tokens=4, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    ids = {first.id.removeprefix("cmpl-"), again.id.removeprefix("cmpl-")}
    assert {event.adapter for event in read_usage(served, "demo", ids)} == {engine_name}


def test_usage_counts_what_the_engine_counted(served: Platform, engine: Engine, client: openai.OpenAI) -> None:
    """The prompt the engine computes on is the one billed: prompt_tokens equal the engine's own
    count of it, and a repeat reports the engine's cached prefix, not a capped estimate."""
    prompt = "import collections\n" * 40
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    engine_count = httpx.post(engine.url + "/generate", timeout=60, json={
        "text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).json()["meta_info"]
    assert first.usage is not None and first.usage.prompt_tokens == engine_count["prompt_tokens"]
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == engine_count["cached_tokens"]


def test_the_engine_computes_on_the_models_own_template(served: Platform, engine: Engine,
                                                         client: openai.OpenAI) -> None:
    """The prompt is the model's template (ChatML here), tokenized once: the engine counts the
    rendered text exactly as the gateway billed it."""
    model = load_model(str(engine.model_dir))
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
    prompt = render_prompt(model, messages=messages)
    assert prompt.text.startswith("<|im_start|>system\n")
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    counted = httpx.post(engine.url + "/generate", timeout=60, json={
        "text": prompt.text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    assert (
        reply.usage is not None
        and reply.usage.prompt_tokens == len(prompt.ids) == counted["meta_info"]["prompt_tokens"]
    )
    assert reply.choices[0].message.content == counted["text"]


def test_the_engines_cache_events_reach_the_router_index_as_the_gateways_blocks(
    served: Platform, engine: Engine
) -> None:
    """SGLang publishes one hash per token (page size 1 on CPU); the worker relays them rebuilt
    into the platform's blocks, so the router's index matches the blocks the gateway hashes."""
    model = load_model(str(engine.model_dir))
    messages = [{"role": "user", "content": "Relay check. " + "The manual explains one more setting. " * 60}]
    expected = block_hashes(render_prompt(model, messages=messages).ids, DEFAULT_BLOCK_SIZE)
    assert len(expected) >= 4

    async def relayed() -> list[m.CacheEvent]:
        nc = await nats.connect(served.stack.nats_url)
        events: list[m.CacheEvent] = []

        async def on_event(msg: Msg) -> None:
            events.append(msgspec.msgpack.decode(msg.data, type=m.CacheEvent))

        await nc.subscribe(subjects.cache_subject(WORKER_ID), cb=on_event)
        await nc.flush()
        client = openai.AsyncOpenAI(base_url=served.base_url, api_key=served.api_key, max_retries=0, timeout=120)
        await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)  # type: ignore[arg-type]
        for _ in range(100):
            if set(expected) <= {h for event in events for block in event.stored for h in block.block_hashes}:
                break
            await asyncio.sleep(0.1)
        await nc.close()
        return events

    events = asyncio.run(relayed())
    index = PrefixIndex()
    for event in events:
        assert {block.block_size for block in event.stored} <= {DEFAULT_BLOCK_SIZE}
        for block in event.stored:
            index.add(WORKER_ID, block.block_hashes, time.monotonic())
    assert index.matched_blocks(expected) == {WORKER_ID: len(expected)}


def test_logprobs_and_n_choices_through_the_platform(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=1.0, n=2, logprobs=True,
                                           top_logprobs=2, messages=[{"role": "user", "content": "Count to three."}])
    assert sorted(choice.index for choice in reply.choices) == [0, 1]
    for choice in reply.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        for token in choice.logprobs.content:
            assert token.logprob <= 0 and len(token.top_logprobs) == 2
        # The engine decodes each logprob token alone; the gateway decodes them in context.
        assert "".join(token.token for token in choice.logprobs.content) == choice.message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 8


def test_a_json_schema_response_through_the_platform(client: openai.OpenAI) -> None:
    """SGLang's constrained decoding holds even a random-weight model to the schema."""
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=MODEL, max_tokens=40, temperature=0, messages=[{"role": "user", "content": "Pick a colour."}],
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}})
    content = reply.choices[0].message.content or ""
    assert json.loads(content)["colour"] in ("red", "blue")
    assert content == json.dumps(json.loads(content), separators=(", ", ": "))  # no free whitespace


def _gateway_ready(served: Platform) -> int:
    return httpx.get(served.stack.gateway_url + "/ready", timeout=5).status_code


def _wait_gateway(served: Platform, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _gateway_ready(served) != status:
        assert time.monotonic() < deadline, f"the gateway's /ready never answered {status}"
        time.sleep(0.2)


def test_after_an_engine_restart_the_platform_waits_for_it_and_loads_the_adapter_again(
        served: Platform, engine: Engine, client: openai.OpenAI) -> None:
    """Last in the module: it restarts the session's engine. While the only engine is down the
    gateway is not ready; the restarted engine has never loaded the adapter (SGLang says "never
    been loaded"), and the worker loads it again instead of failing the request."""
    with served.admin() as admin:
        created = admin.post("/adapters", json={"name": "restart-bot", "version": directory_digest(engine.lora_path),
                                                "path": engine.lora_path})
        assert created.status_code == 201, created.text
    first = client.completions.create(model="restart-bot", prompt="def main():\n", max_tokens=4, temperature=0)
    engine.stop()
    _wait_gateway(served, 503, timeout=60)
    engine.start()
    _wait_gateway(served, 200, timeout=120)
    again = client.completions.create(model="restart-bot", prompt="def main():\n", max_tokens=4, temperature=0)
    assert again.choices[0].text == first.choices[0].text
