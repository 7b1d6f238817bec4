"""A model whose chat template is not Llama-3's (ChatML, no BOS token), served end to end with its
own tokenizer: prompts rendered by its template, token ids from the gateway to the engine, usage
as the engine counts it, and the engine's KV events (page size 1, as SGLang on CPU) reaching the
router as the very blocks the gateway hashes."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import openai
import pytest

from inferbus.tokens.blocks import block_hashes
from inferbus.tokens.prompt import load_model, render_prompt
from proto import messages as m
from proto import subjects

from .conftest import MODEL, Platform, running_platform

pytestmark = pytest.mark.e2e

LONG = " ".join(f"Paragraph {i} of the reference manual explains one more setting in detail." for i in range(120))


CONTEXT = 4096  # the served model's context length (its config.json), which gateway and engine read


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    from inferbus.tokens.modeldir import build_model_dir

    # The tokenizer and template of `chatml_model_dir`, with a 4,096-token context.
    model_dir = build_model_dir(tmp_path_factory.mktemp("model") / "chatml-4k", "chatml", model_max_length=CONTEXT)
    with running_platform(tmp_path_factory.mktemp("chatml"), workers=1, time_scale=0.1, model_dir=model_dir,
                          engine_args=["--block-size", "1"]) as running:
        yield running


def _engine_generate(platform: Platform, body: dict) -> dict:
    request = urllib.request.Request(platform.engine_url(1) + "/generate", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def test_a_chatml_model_is_served_with_its_own_template(chatml: Platform, chatml_model_dir: Path) -> None:
    model = load_model(str(chatml_model_dir))
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
    prompt = render_prompt(model, messages=messages)
    assert prompt.text.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n")
    reply = chatml.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.choices[0].message.content
    assert reply.usage.prompt_tokens == len(prompt.ids)
    # The engine counts the same prompt the same way: what is billed is what it computes on.
    engine = _engine_generate(chatml, {"text": prompt.text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert engine["meta_info"]["prompt_tokens"] == reply.usage.prompt_tokens
    assert engine["text"] == reply.choices[0].message.content
    # The output is token ids of the model's vocabulary: they decode to the text streamed.
    assert model.decode(engine["output_ids"]) == engine["text"]
    stream = chatml.client().chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(prompt.ids)


def test_completions_use_the_tokenizers_special_tokens(chatml: Platform, chatml_model_dir: Path) -> None:
    model = load_model(str(chatml_model_dir))
    reply = chatml.client().completions.create(model=MODEL, prompt="def main():", max_tokens=3, temperature=0)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(
        model.encode("def main():", add_special_tokens=True)
    )


def test_a_message_the_template_refuses_is_a_400_naming_it(chatml: Platform) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        chatml.client().chat.completions.create(model=MODEL, max_tokens=2, messages=[  # type: ignore[arg-type]
            {"role": "user", "content": "hi"}, {"role": "function", "name": "f", "content": "late"}])
    assert "Unknown message role: function" in str(error.value)


def test_the_context_length_is_the_models(chatml: Platform, chatml_model_dir: Path) -> None:
    info = json.load(urllib.request.urlopen(chatml.engine_url(1) + "/server_info", timeout=10))
    # The engine read the model's config.json too; as SGLang, it reports the window through its
    # scheduler's longest prompt (the --context-length flag, not given, is null).
    assert info["context_length"] is None and info["max_req_input_len"] + 6 == CONTEXT
    client = chatml.client()
    model = load_model(str(chatml_model_dir))
    prompt_tokens = len(render_prompt(model, messages=[{"role": "user", "content": LONG}]).ids)
    # Without max_tokens the answer may take the rest of the window (the default, 4,096, is capped).
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}], temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens == CONTEXT - prompt_tokens
    too_long = [{"role": "user", "content": LONG + LONG + LONG}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL, messages=too_long, stream=stream)  # type: ignore[call-overload]
        assert error.value.code == "context_length_exceeded" and f"maximum context length is {CONTEXT}" in str(
            error.value
        )
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=CONTEXT)
    assert error.value.param == "max_tokens"


def test_a_repeated_long_prompt_reports_the_engines_cached_tokens(chatml: Platform) -> None:
    messages = [{"role": "user", "content": LONG}]
    first = chatml.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)  # type: ignore[arg-type]
    second = chatml.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)  # type: ignore[arg-type]
    assert first.usage and second.usage and second.usage.prompt_tokens == first.usage.prompt_tokens > 1000
    details = second.usage.prompt_tokens_details
    # Page size 1: the engine reuses every prompt token but the last, and the response says so.
    assert details is not None and details.cached_tokens == second.usage.prompt_tokens - 1


def test_the_engines_cache_events_reach_the_router_as_the_gateways_blocks(
    chatml: Platform, chatml_model_dir: Path
) -> None:
    model = load_model(str(chatml_model_dir))
    messages = [{"role": "user", "content": "Relay check. " + LONG[:3000]}]
    expected = block_hashes(render_prompt(model, messages=messages).ids, 64)
    assert len(expected) >= 5

    async def relayed() -> set[int]:
        nc = await nats.connect(chatml.stack.nats_url)
        stored: set[int] = set()
        sizes: set[int] = set()

        async def on_event(msg: object) -> None:
            event = msgspec.msgpack.decode(msg.data, type=m.CacheEvent)  # type: ignore[attr-defined]
            for block in event.stored:
                stored.update(block.block_hashes)
                sizes.add(block.block_size)

        await nc.subscribe(subjects.cache_wildcard(), cb=on_event)
        await nc.flush()
        client = openai.AsyncOpenAI(base_url=chatml.base_url, api_key=chatml.api_key, max_retries=0)
        await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)  # type: ignore[arg-type]
        for _ in range(300):
            if set(expected) <= stored:
                break
            await asyncio.sleep(0.1)
        await nc.close()
        assert sizes == {64}
        return stored

    assert set(expected) <= asyncio.run(relayed())


def test_tools_and_tool_results_are_rendered_by_the_template(chatml: Platform, chatml_model_dir: Path) -> None:
    model = load_model(str(chatml_model_dir))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C and dry"},
    ]
    reply = chatml.client().chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=4)  # type: ignore[arg-type]
    prompt = render_prompt(model, messages=messages, tools=tools)
    assert (
        "<tools>\n" in prompt.text
        and '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt.text
    )
    assert "<tool_response>\n12 C and dry\n</tool_response>" in prompt.text
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt.ids)


NARROW = 1536  # the engine's --context-length, under the model's 4,096
HALF = " ".join(f"Paragraph {i} of the reference manual explains one more setting in detail." for i in range(60))


@pytest.fixture(scope="module")
def narrow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    from inferbus.tokens.modeldir import build_model_dir

    model_dir = build_model_dir(tmp_path_factory.mktemp("model") / "chatml-4k", "chatml", model_max_length=CONTEXT)
    # Its engine writes Hermes/Qwen calls, as a ChatML model does; the gateway is left to find that out.
    with running_platform(tmp_path_factory.mktemp("narrow"), workers=1, time_scale=0.1, model_dir=model_dir,
                          engine_args=["--context-length", str(NARROW), "--tool-call-parser", "hermes"],
                          extra_env={"INFERBUS_TOOL_CALL_PARSER": "auto"}) as running:
        yield running


def test_the_context_length_is_the_engines_when_it_is_started_with_one(narrow: Platform, tmp_path: Path) -> None:
    """INFERBUS_MAX_MODEL_LEN unset: an engine started with --context-length narrower than the
    model's config.json sets the window, learnt from its /server_info through its worker."""
    info = json.load(urllib.request.urlopen(narrow.engine_url(1) + "/server_info", timeout=10))
    assert info["context_length"] == NARROW and info["max_req_input_len"] + 6 == NARROW
    client = narrow.client()
    model = load_model(str(narrow.stack.model_dir))
    prompt_tokens = len(render_prompt(model, messages=[{"role": "user", "content": HALF}]).ids)
    assert prompt_tokens < NARROW < 2 * prompt_tokens < CONTEXT
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": HALF}], temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.completion_tokens == NARROW - prompt_tokens
    for stream in (False, True):  # refused up front, never inside a 200 stream
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": HALF + HALF}],  # type: ignore[call-overload]
                stream=stream,
            )
        assert error.value.code == "context_length_exceeded" and f"maximum context length is {NARROW}" in str(
            error.value
        )


def test_the_tool_call_parser_is_the_one_the_models_template_writes(narrow: Platform) -> None:
    """INFERBUS_TOOL_CALL_PARSER=auto: a ChatML template writes `<tool_call>` blocks, so the
    gateway reads the model's calls as Hermes/Qwen ones."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    reply = narrow.client().chat.completions.create(model=MODEL, tools=tools, max_tokens=100,  # type: ignore[arg-type]
                                                    messages=[{"role": "user", "content": "The weather in Oslo?"}])
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    [call] = reply.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
