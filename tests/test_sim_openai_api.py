"""The simulated engine's OpenAI endpoints, driven by the official openai SDK (as a bare SGLang)."""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest
import uvicorn

from services.sim_engine.app import create_app
from services.sim_engine.config import EngineConfig


@pytest.fixture
async def engine_url():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    app = create_app(EngineConfig(time_scale=0.0, fixed_step_ms=5.0, model="sim-model", answer_length_median=0))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.005)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    await task


async def test_chat_stream_with_usage_and_forced_length(engine_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=engine_url, api_key="none", max_retries=0)
    stream = await client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "hello there"}], max_tokens=7, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(chunk.usage is None for chunk in chunks[:-1])
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks[:-1])
    assert text


async def test_completions_models_and_errors(engine_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=engine_url, api_key="none", max_retries=0)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["sim-model"]
    completion = await client.completions.create(model="sim-model", prompt="one two three", max_tokens=3,
                                                 extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 3 and completion.usage.prompt_tokens > 0
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="sim-model", messages=[], max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="sim-model", prompt="x", max_tokens=-1)
