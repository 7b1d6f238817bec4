"""Tool calls, structured output, logprobs and refused fields, with the official openai SDK against
a running platform (simulated engines writing Llama-3 JSON tool calls)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pydantic
import pytest

from .conftest import MODEL, Platform, on_both_topologies, read_usage
from .spm import sentencepiece_style

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["aggregated", "disaggregated"])
def platform(request: pytest.FixtureRequest, platform: Platform) -> Platform:
    """Every test here runs on aggregated workers and on a prefill/decode pair (`--prefill 1 --decode 1`)."""
    return on_both_topologies(request, platform)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What's the weather in Paris right now?"}]


def _check_calls(calls: list, names: list[str], nine_character_ids: bool = False) -> None:
    assert [c.function.name for c in calls] == names
    for call in calls:
        assert call.type == "function"
        assert (len(call.id) == 9 and call.id.isalnum()) if nine_character_ids else call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=200, seed=1)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    _check_calls(choice.message.tool_calls, ["get_weather"])
    call = choice.message.tool_calls[0]
    followup = client.chat.completions.create(model=MODEL, tools=TOOLS, max_tokens=10, messages=[
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "clear"})},
    ])
    answer = followup.choices[0]
    assert answer.finish_reason == "length" and answer.message.content and not answer.message.tool_calls
    assert followup.usage.prompt_tokens > first.usage.prompt_tokens


def test_parallel_calls_and_parallel_tool_calls_false(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me the weather in Oslo and the time there."}]
    both = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=200)
    _check_calls(both.choices[0].message.tool_calls, ["get_weather", "get_time"])
    one = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=200,
                                         parallel_tool_calls=False)
    _check_calls(one.choices[0].message.tool_calls, ["get_weather"])


def test_tool_choice_none_required_and_named(client: openai.OpenAI) -> None:
    none = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"
    chat = [{"role": "user", "content": "Hello there"}]  # no ask: only the constraint makes these calls
    required = client.chat.completions.create(model=MODEL, messages=chat, tools=TOOLS, tool_choice="required",
                                              max_tokens=300, parallel_tool_calls=False)
    assert required.choices[0].finish_reason == "tool_calls"
    assert len(required.choices[0].message.tool_calls) == 1
    _check_calls(required.choices[0].message.tool_calls, [required.choices[0].message.tool_calls[0].function.name])
    named = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=300,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    _check_calls(named.choices[0].message.tool_calls, ["get_time"])


def test_streamed_tool_call_deltas(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=200,
                                                 seed=1, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    head = deltas[0][0]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    arguments = "".join(d[0].function.arguments or "" for d in deltas[1:])
    jsonschema.validate(json.loads(arguments), SCHEMAS["get_weather"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # The SDK's own accumulation agrees with the non-streamed response.
    whole = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=200, seed=1)
    with client.chat.completions.stream(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=200, seed=1
    ) as stream:
        final = stream.get_final_completion()
    streamed_call = final.choices[0].message.tool_calls[0]
    whole_call = whole.choices[0].message.tool_calls[0]
    assert (streamed_call.function.name, json.loads(streamed_call.function.arguments)) == \
        (whole_call.function.name, json.loads(whole_call.function.arguments))


def test_output_that_is_not_a_call_comes_back_as_content(client: openai.OpenAI) -> None:
    # JSON mode makes the model start with "{", as a Llama-3 call does, but it names no tool.
    for stream in (False, True):
        response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                                  tools=TOOLS, response_format={"type": "json_object"},
                                                  max_tokens=50, stream=stream)
        if stream:
            chunks = list(response)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            content = response.choices[0].message.content
            assert response.choices[0].message.tool_calls is None
            finish = [response.choices[0].finish_reason]
        assert isinstance(json.loads(content), dict) and finish == ["stop"]


def test_a_call_cut_short_comes_back_as_content(client: openai.OpenAI) -> None:
    for stream in (False, True):
        response = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=12,
                                                  seed=1, stream=stream)
        if stream:
            chunks = list(response)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            content, finish = response.choices[0].message.content, [response.choices[0].finish_reason]
            assert response.choices[0].message.tool_calls is None
        assert content.startswith('{"name": "get') and finish == ["length"]


def test_parallel_required_calls_cut_short_keep_the_complete_ones(client: openai.OpenAI) -> None:
    ask_both = [{"role": "user", "content": "What's the weather in Paris, and the time there?"}]
    whole = client.chat.completions.create(model=MODEL, messages=ask_both, tools=TOOLS, tool_choice="required",
                                           max_tokens=300, seed=3)
    _check_calls(whole.choices[0].message.tool_calls, ["get_weather", "get_time"])
    assert whole.usage is not None
    cut = client.chat.completions.create(model=MODEL, messages=ask_both, tools=TOOLS, tool_choice="required",
                                         max_tokens=whole.usage.completion_tokens - 3, seed=3)
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    _check_calls(choice.message.tool_calls, ["get_weather"])
    assert choice.message.tool_calls[0].function.arguments == whole.choices[0].message.tool_calls[0].function.arguments


class Trip(pydantic.BaseModel):
    city: str
    nights: int
    companions: list[str]
    budget: float | None


def test_structured_output_parsed_by_the_sdk(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Plan a trip"}],
                                               response_format=Trip, max_tokens=300)
    trip = completion.choices[0].message.parsed
    assert isinstance(trip, Trip) and completion.choices[0].finish_reason == "stop"
    # No free whitespace between JSON tokens (--constrained-json-disable-any-whitespace on the
    # platform's engines): one line, ", " and ": " as SGLang's grammar then writes it.
    content = completion.choices[0].message.content or ""
    assert content == json.dumps(json.loads(content), ensure_ascii=False, separators=(", ", ": "))
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["answer"]}
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick a digit"}], max_tokens=100, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "digit", "schema": schema, "strict": True}}))
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), schema)


def test_tools_beside_a_response_format_are_called_when_needed(client: openai.OpenAI) -> None:
    """The agent pattern (tools and an output type): under `auto` the model calls a tool the
    conversation needs and otherwise answers with the schema's JSON, parsed by the SDK."""

    class Forecast(pydantic.BaseModel):
        city: str
        summary: str

    strict_tools = [
        {**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS
    ]  # the SDK's parse needs them

    needs_tool = client.chat.completions.parse(
        model=MODEL, messages=ASK_WEATHER, tools=strict_tools, response_format=Forecast, max_tokens=300
    )
    choice = needs_tool.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls, ["get_weather"])
    call = choice.message.tool_calls[0]
    answered = client.chat.completions.parse(
        model=MODEL,
        tools=strict_tools,
        response_format=Forecast,
        max_tokens=300,
        messages=[
            *ASK_WEATHER,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C and clear"},
        ],
    )
    assert answered.choices[0].finish_reason == "stop" and isinstance(answered.choices[0].message.parsed, Forecast)
    no_tool = client.chat.completions.parse(model=MODEL, tools=strict_tools, response_format=Forecast, max_tokens=300,
                                            messages=[{"role": "user", "content": "Describe a sunny day."}])
    assert isinstance(no_tool.choices[0].message.parsed, Forecast) and not no_tool.choices[0].message.tool_calls
    streamed = list(client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=300,
                                                   stream=True, response_format={"type": "json_object"}))
    deltas = [d for c in streamed if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert [d.function.name for d in deltas if d.function and d.function.name] == ["get_weather"]


def test_bad_schemas_are_400s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert raised.value.body["param"] == "response_format.json_schema.schema"
    # Valid JSON Schema the engine's grammar backend cannot compile (a backreference): the engine's 400, passed on
    # (in a stream, whose 200 went out at once, as its error event: never a retry or a 5xx).
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a)\\1"}}}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=5, response_format=bad)
    assert "grammar" in raised.value.message
    with pytest.raises(openai.APIError) as streamed:
        list(client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=5, response_format=bad,
                                            stream=True))
    assert "grammar" in streamed.value.message
    assert streamed.value.body["type"] == "invalid_request_error" and streamed.value.body["code"] == "invalid_request"


def test_chat_logprobs_plain_and_streamed(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Describe the sea"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=3)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens == 12
    assert "".join(e.token for e in entries) == whole.choices[0].message.content
    for entry in entries:
        assert entry.logprob < 0 and bytes(entry.bytes) == entry.token.encode()
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=6, temperature=0, logprobs=2)
    logprobs = whole.choices[0].logprobs
    assert "".join(logprobs.tokens) == whole.choices[0].text and len(logprobs.token_logprobs) == 6
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[1] == len(logprobs.tokens[0])
    chunks = list(client.completions.create(model=MODEL, prompt="The sea is", max_tokens=6, temperature=0,
                                            logprobs=2, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == logprobs.tokens


def test_sampling_extensions_pass_through(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=7, max_completion_tokens=4,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05, "min_tokens": 2, "ignore_eos": True,
                    "chat_template_kwargs": {"enable_thinking": False}, "prompt_cache_key": "k"})
    assert response.usage.completion_tokens == 4
    streamed = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False}))  # type: ignore[typeddict-unknown-key]
    assert streamed[-1].usage is not None and streamed[-1].usage.completion_tokens <= 4


def test_roles_and_message_shapes_as_openai_accepts_them(client: openai.OpenAI) -> None:
    """developer messages, several and later system messages, content parts and an earlier refusal."""
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "system", "content": [{"type": "text", "text": "Answer in English."}]},
        {"role": "developer", "content": [{"type": "text", "text": "Never "}, {"type": "text", "text": "apologise."}]},
        {"role": "user", "content": [{"type": "text", "text": "Say something rude."}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I won't."}]},
        {"role": "system", "content": "Be kind now."},
        {"role": "user", "content": "Then say hi."},
    ]
    alone = client.chat.completions.create(model=MODEL, messages=messages[-1:], max_tokens=1)
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert response.choices[0].message.content is not None
    # Every message reached the prompt.
    assert response.usage.prompt_tokens > alone.usage.prompt_tokens + 20
    reply = client.responses.create(model=MODEL, instructions="You are terse.", max_output_tokens=16, input=[
        {"role": "system", "content": "Answer in English."}, {"role": "developer", "content": "Never apologise."},
        {"role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}])
    assert reply.status in ("completed", "incomplete") and reply.output_text


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "x", "max_tokens": 4}


@pytest.mark.parametrize("endpoint, extra, param", [
    ("chat", {"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat", {"web_search_options": {}}, "web_search_options"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("chat", {"verbosity": "low"}, "verbosity"),
    ("chat", {"store": True}, "store"),
    ("chat", {"metadata": {"a": "b"}}, "metadata"),
    ("chat", {"service_tier": "flex"}, "service_tier"),
    ("chat", {"logit_bias": {"50256": -100}}, "logit_bias"),
    ("chat", {"n": 129}, "n"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"seed": 2**70}, "seed"),
    ("chat", {"max_tokens": 2**40}, "max_tokens"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"top_k": -5}, "top_k"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("completion", {"echo": True}, "echo"),
    ("completion", {"suffix": "y"}, "suffix"),
    ("completion", {"best_of": 2}, "best_of"),
    ("completion", {"logprobs": 6}, "logprobs"),
    ("completion", {"logit_bias": {"1": 5}}, "logit_bias"),
    ("completion", {"seed": -(2**64)}, "seed"),
    ("chat", {"response_fromat": {"type": "json_object"}}, "response_fromat"),
    ("chat", {"repetition_penalty": 3}, "repetition_penalty"),
    ("completion", {"max_token": 4}, "max_token"),
])
def test_each_refused_field_is_a_400_naming_it(platform: Platform, endpoint: str, extra: dict, param: str) -> None:
    body = {**(CHAT if endpoint == "chat" else COMPLETION), **extra}
    path = "/chat/completions" if endpoint == "chat" else "/completions"
    response = httpx.post(platform.base_url + path, json=body, headers={"authorization": f"Bearer {platform.api_key}"},
                          timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_n_choices_plain_and_streamed(platform: Platform, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Write a line about the sea"}]
    one = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, seed=3)
    three = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, seed=3, n=3, logprobs=True)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].message.content == one.choices[0].message.content
    assert len({c.message.content for c in three.choices}) > 1  # each choice samples with its own seed
    assert all(len(c.logprobs.content) == 6 for c in three.choices)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 18 and three.usage.total_tokens == three.usage.prompt_tokens + 18
    # The ledger bills the prompt once too.
    request_id = three.id.removeprefix("chatcmpl-")
    events = read_usage(platform, "demo", {request_id, f"{request_id}.c1", f"{request_id}.c2"})
    assert sorted(e.usage.prompt_tokens for e in events) == [0, 0, one.usage.prompt_tokens]
    assert sum(e.usage.completion_tokens for e in events) == 18
    # A prompt of several prefix blocks: the choices are placed together, on the engine that has it.
    long = [{"role": "user", "content": "Summarise the shipping log: " + "crate bound for Oslo, " * 60}]
    many = client.chat.completions.create(model=MODEL, messages=long, max_tokens=4, n=4)
    request_id = many.id.removeprefix("chatcmpl-")
    events = read_usage(platform, "demo", {request_id, *(f"{request_id}.c{i}" for i in range(1, 4))})
    assert len(events) == 4 and len({e.worker_id for e in events}) == 1

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, seed=3, n=2,
                                                 stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
    assert texts[0] == three.choices[0].message.content and texts[1] == three.choices[1].message.content
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(roles) == [0, 1] and sorted(finishes) == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == one.usage.prompt_tokens
    completions = client.completions.create(model=MODEL, prompt="The sea", max_tokens=4, n=2)
    assert [c.index for c in completions.choices] == [0, 1] and completions.usage.completion_tokens == 8


def test_sdk_seed_out_of_range(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=4, seed=2**70)


@pytest.fixture(scope="module", params=["hermes", "mistral", "pythonic", "gpt-oss"])
def family_platform(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A platform serving a model of another family: the engine writes that family's calls
    (Hermes/Qwen <tool_call> blocks, Mistral [TOOL_CALLS] arrays, pythonic lists, gpt-oss harmony
    messages) and the gateway
    is configured to read them."""
    from .conftest import running_platform

    family = request.param
    with running_platform(tmp_path_factory.mktemp(family), workers=1, time_scale=0.1,
                          engine_args=["--tool-call-parser", family],
                          extra_env={"INFERBUS_TOOL_CALL_PARSER": family}) as running:
        yield running


def test_other_families_tool_calls(family_platform: Platform, request: pytest.FixtureRequest) -> None:
    client = family_platform.client()
    messages = [{"role": "user", "content": "What's the weather in Rome, and the time?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=300, seed=2)
    assert whole.choices[0].finish_reason == "tool_calls"
    _check_calls(whole.choices[0].message.tool_calls, ["get_weather", "get_time"],
                 nine_character_ids=request.node.callspec.params["family_platform"] == "mistral")
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=TOOLS, max_tokens=300, seed=2) as stream:
        final = stream.get_final_completion()
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.choices[0].message.tool_calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]


def _sentencepiece_model_dir(path: Path) -> Path:
    """A Llama-3-shaped model directory whose tokenizer is SentencePiece-style (Llama-2's and
    Mistral's shape: `▁` marks a word's leading space, which decoding a token alone drops), with
    the chat format's special tokens at the ids the directory's configuration names."""
    from inferbus.tokens.modeldir import FORMATS, build_model_dir
    from services.sim_engine.output import OUTPUT_PIECES

    directory = build_model_dir(path, "llama3")
    special = list(FORMATS["llama3"].special_tokens)
    corpus = ["".join(OUTPUT_PIECES)] * 4 + ["Describe the sea, the weather and the sky."] * 4
    tokenizer = sentencepiece_style(corpus, 2000, [*special, "<unk>"])
    tokenizer.add_special_tokens(special)
    original = json.loads((directory / "tokenizer.json").read_text())["added_tokens"]
    assert {t["content"]: t["id"] for t in original if t["content"] in special} == \
        {token: tokenizer.token_to_id(token) for token in special}
    (directory / "tokenizer.json").write_text(tokenizer.to_str())
    return directory


@pytest.fixture(scope="module")
def sentencepiece_platform(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A platform serving a model with a SentencePiece-style tokenizer; its engine reports each
    logprob token decoded alone, as SGLang does."""
    from .conftest import running_platform

    directory = _sentencepiece_model_dir(tmp_path_factory.mktemp("spm-model") / "model")
    with running_platform(tmp_path_factory.mktemp("spm"), workers=1, time_scale=0.1, model_dir=directory) as running:
        yield running


def test_logprob_tokens_join_up_to_the_content_with_a_sentencepiece_tokenizer(sentencepiece_platform: Platform) -> None:
    client = sentencepiece_platform.client()
    messages = [{"role": "user", "content": "Describe the sea"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                           logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = whole.choices[0].message.content
    entries = whole.choices[0].logprobs.content
    assert content.count(" ") >= 8  # words with their spaces, which the engine's token texts lack
    assert "".join(e.token for e in entries) == content
    assert all(bytes(e.bytes) == e.token.encode() for e in entries)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert "".join(streamed) == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    completion = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=8, temperature=0, logprobs=1,
                                           extra_body={"ignore_eos": True})
    assert "".join(completion.choices[0].logprobs.tokens) == completion.choices[0].text
    assert completion.choices[0].text.count(" ") >= 4
