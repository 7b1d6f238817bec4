"""The simulated engine's constrained output: schema-valid JSON and tool calls, deterministic."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from inferbus.openai.tools import ToolOutput
from inferbus.tokens import standin_render_chat as render_chat
from services.sim_engine.constrained import SchemaError, json_output, tool_call_output, value_from_schema

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                      "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
                                      "kind": {"enum": ["a", "b"]}, "score": {"type": "number"}},
     "required": ["name", "age", "tags", "kind"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                         "required": ["x", "y"]}},
     "type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 4},
    {"anyOf": [{"type": "string", "minLength": 30}, {"type": "null"}]},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}, "ok": {"type": "boolean"},
                                      "nested": {"type": "object", "properties": {"c": {"const": 3}}, "required": ["c"]}},
     "required": ["when", "ok", "nested"]},
]


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("seed", range(5))
def test_values_are_valid_against_the_schema(schema: dict, seed: int) -> None:
    text = json_output(json.dumps(schema), random.Random(seed))
    jsonschema.validate(json.loads(text), schema)
    assert text == json_output(json.dumps(schema), random.Random(seed))


@pytest.mark.parametrize("schema", ["not json", '{"type": "strange"}', '{"$ref": "#/nowhere"}',
                                    '{"type": "string", "pattern": "^a+$"}', '{"$ref": "#"}',
                                    '{"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}',
                                    '{"type": "array", "items": {"$ref": "#/$defs/a"}, "$defs": {"a": {"$ref": "#/$defs/a"}}}'])
def test_schemas_it_cannot_compile_are_errors(schema: str) -> None:
    with pytest.raises(SchemaError):
        json_output(schema, random.Random(0))


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}


@pytest.mark.parametrize("family", ["llama3", "hermes"])
def test_a_recognisable_ask_gets_a_call_the_gateway_parses(family: str) -> None:
    prompt = render_chat([{"role": "user", "content": "What's the weather in Paris?"}], [WEATHER])
    output = tool_call_output(prompt, family, random.Random(1))
    assert output is not None
    content, calls = ToolOutput(family, [WEATHER], "auto").whole(output)
    assert content is None and [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])


def test_no_call_without_an_ask_or_after_the_tool_ran() -> None:
    assert tool_call_output(render_chat([{"role": "user", "content": "Tell me a joke"}], [WEATHER]), "llama3",
                            random.Random(1)) is None
    answered = render_chat([
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ], [WEATHER])
    assert tool_call_output(answered, "llama3", random.Random(1)) is None
    assert tool_call_output(render_chat([{"role": "user", "content": "weather?"}]), "llama3", random.Random(1)) is None


def test_value_from_schema_respects_numeric_bounds() -> None:
    rng = random.Random(3)
    for _ in range(50):
        value = value_from_schema({"type": "integer", "exclusiveMinimum": 5, "maximum": 7}, rng)
        assert 5 < value <= 7


async def test_generate_follows_the_schema_and_returns_logprobs_in_sglang_shapes() -> None:
    from .test_sim_server import parse_events, running

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n", "s"]}
    body = {"text": "Give me JSON", "rid": "json1", "return_logprob": True, "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 200, "json_schema": json.dumps(schema), "sampling_seed": 4}}
    async with running() as (_, client):
        whole = (await client.post("/generate", json=body)).json()
        stream = await client.post("/generate", json={**body, "rid": "json2", "stream": True})
        bad = await client.post("/generate", json={"text": "x", "sampling_params": {
            "json_schema": '{"type": "string", "pattern": "a+"}'}})
        unknown = await client.post("/generate", json={"text": "x", "sampling_params": {"max_tokens": 3}})
    jsonschema.validate(json.loads(whole["text"]), schema)
    meta = whole["meta_info"]
    assert meta["finish_reason"]["type"] == "stop"
    tokens, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(tokens) == len(tops) == meta["completion_tokens"] == len(whole["output_ids"])
    assert "".join(text for _, _, text in tokens) == whole["text"]
    assert [token_id for _, token_id, _ in tokens] == whole["output_ids"]
    assert all(len(top) == 2 and top[0][2] == token[2] and top[0][0] >= top[1][0] for token, top in zip(tokens, tops))
    chunks = [json.loads(e) for e in parse_events(stream.text)[:-1]]
    assert chunks[-1]["text"] == whole["text"]  # deterministic under the seed
    assert all(len(c["meta_info"]["output_token_logprobs"]) == c["meta_info"]["completion_tokens"] for c in chunks)
    assert bad.status_code == 400 and "Invalid grammar request" in bad.json()["error"]["message"]
    assert unknown.status_code == 400
