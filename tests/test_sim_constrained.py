"""The simulated engine's constrained output: schema-valid JSON and tool calls, deterministic."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from inferbus.openai.tools import ToolOutput, constraint, either_constraint
from inferbus.tokens.blocks import standin_render_chat as render_chat
from services.sim_engine.constrained import SchemaError, json_output, tool_call_output, value_from_schema

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
            "kind": {"enum": ["a", "b"]},
            "score": {"type": "number"},
        },
        "required": ["name", "age", "tags", "kind"],
        "additionalProperties": False,
    },
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            }
        },
        "type": "array",
        "items": {"$ref": "#/$defs/point"},
        "maxItems": 4,
    },
    {"anyOf": [{"type": "string", "minLength": 30}, {"type": "null"}]},
    {
        "type": "object",
        "properties": {
            "when": {"type": "string", "format": "date"},
            "ok": {"type": "boolean"},
            "nested": {"type": "object", "properties": {"c": {"const": 3}}, "required": ["c"]},
        },
        "required": ["when", "ok", "nested"],
    },
    # What SGLang's grammar backend also compiles: patterns, recursive models (pydantic's shape for a
    # tree and a linked list), tuples.
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{2,4}$"},
            "slug": {"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$", "maxLength": 40},
            "hex": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"},
            "word": {"type": "string", "pattern": "\\w+@(foo|bar)\\.(com|org)"},
        },
        "required": ["code", "slug", "hex", "word"],
    },
    {
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
                },
                "required": ["name", "children"],
            }
        },
        "$ref": "#/$defs/Node",
    },
    {
        "$defs": {
            "Item": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer"},
                    "next": {"anyOf": [{"$ref": "#/$defs/Item"}, {"type": "null"}]},
                },
                "required": ["value", "next"],
            }
        },
        "$ref": "#/$defs/Item",
    },
    {"type": "object", "properties": {"self": {"$ref": "#"}, "n": {"type": "integer"}}, "required": ["n"]},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
]


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("seed", range(5))
def test_values_are_valid_against_the_schema(schema: dict, seed: int) -> None:
    text = json_output(json.dumps(schema), random.Random(seed))
    jsonschema.validate(json.loads(text), schema)
    assert text == json_output(json.dumps(schema), random.Random(seed))
    # One line, ", " and ": " and no other whitespace between tokens, as SGLang writes it with
    # --constrained-json-disable-any-whitespace (tests/sglang/test_engine_contract.py).
    assert text == json.dumps(json.loads(text), ensure_ascii=False, separators=(", ", ": "))


@pytest.mark.parametrize("schema", ["not json", '{"type": "strange"}', '{"$ref": "#/nowhere"}',
                                    '{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}',
                                    '{"type": "string", "pattern": "(a)\\\\1"}',
                                    '{"type": "string", "pattern": "(?=a)b"}',
                                    '{"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, '
                                    '"required": ["next"]}}, "$ref": "#/$defs/n"}'])
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


@pytest.mark.slow
async def test_generate_follows_the_schema_and_returns_logprobs_in_sglang_shapes() -> None:
    from .test_sim_server import parse_events, running

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
        "required": ["n", "s"],
    }
    body = {"text": "Give me JSON", "rid": "json1", "return_logprob": True, "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 200, "json_schema": json.dumps(schema), "sampling_seed": 4}}
    async with running() as (_, client):
        whole = (await client.post("/generate", json=body)).json()
        stream = await client.post("/generate", json={**body, "rid": "json2", "stream": True})
        bad = await client.post("/generate", json={"text": "x", "sampling_params": {
            "json_schema": '{"type": "string", "pattern": "(a)\\\\1"}'}})
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


def test_recursive_schemas_nest_and_end() -> None:
    tree = SCHEMAS[5]
    depths = set()
    for seed in range(30):
        value = json.loads(json_output(json.dumps(tree), random.Random(seed)))

        def depth(node: dict) -> int:
            return 1 + max((depth(child) for child in node["children"]), default=0)

        depths.add(depth(value))
    assert max(depths) > 2  # it does nest: not always the shortest value
    assert max(depths) <= 8


def test_json_object_follows_a_schema_written_in_the_prompt() -> None:
    schema = {"title": "User", "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    prompt = (
        "<|start_header_id|>system<|end_header_id|>\n\nAs a genius expert, your task is to understand the content "
        "and provide the parsed objects in json that match the following "
        f"json_schema:\n\n{json.dumps(schema, indent=2)}"
        "\n\nMake sure to return an instance of the JSON, not the schema itself<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nJason is 25<|eot_id|>"
    )
    for seed in range(5):
        value = json.loads(json_output('{"type":"object"}', random.Random(seed), prompt))
        jsonschema.validate(value, schema)
    plain = json.loads(json_output('{"type":"object"}', random.Random(0), "Tell me a joke as JSON."))
    assert isinstance(plain, dict) and plain  # an object with something in it, never {}
    # Tool definitions in the prompt are not the answer's schema.
    with_tools = render_chat([{"role": "user", "content": "Reply in JSON."}], [WEATHER])
    assert "city" not in json.loads(json_output('{"type":"object"}', random.Random(0), with_tools))


def test_a_forced_call_calls_the_tools_the_conversation_asks_for() -> None:
    time_tool = {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time in a zone",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    }
    stock = {
        "type": "function",
        "function": {
            "name": "stock_price",
            "description": "A share's price",
            "parameters": {"type": "object", "properties": {"ticker": {"type": "string"}}},
        },
    }
    tools = [WEATHER, time_tool, stock]
    schema = json.dumps(constraint(tools, "required", True))
    prompt = render_chat([{"role": "user", "content": "What's the weather in Oslo?"}], tools)
    for seed in range(10):
        calls = json.loads(json_output(schema, random.Random(seed), prompt))
        assert [c["name"] for c in calls] == ["get_weather"]
    both = render_chat([{"role": "user", "content": "The weather and the time in Oslo?"}], tools)
    assert [c["name"] for c in json.loads(json_output(schema, random.Random(0), both))] == ["get_weather", "get_time"]
    one = json.dumps(constraint(tools, "required", False))  # parallel_tool_calls false: at most one
    assert len(json.loads(json_output(one, random.Random(0), both))) == 1
    # Asked for none of them: still a valid call of some tool.
    idle = render_chat([{"role": "user", "content": "Hello"}], tools)
    jsonschema.validate(json.loads(json_output(schema, random.Random(0), idle)), json.loads(schema))


def test_tools_or_the_answer_the_conversation_asks_for() -> None:
    """Tools under `auto` with a JSON response format (the gateway's either-or schema): a call while
    the conversation asks for a tool that has not run, then the answer's value."""
    answer = {"type": "object", "properties": {"city": {"type": "string"}, "summary": {"type": "string"}},
              "required": ["city", "summary"]}
    schema = json.dumps(either_constraint([WEATHER], True, answer))
    ask = [{"role": "user", "content": "What's the weather in Oslo?"}]
    calls = json.loads(json_output(schema, random.Random(0), render_chat(ask, [WEATHER])))
    assert [c["name"] for c in calls] == ["get_weather"]
    ran = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "-3 C"}]
    jsonschema.validate(json.loads(json_output(schema, random.Random(0), render_chat(ran, [WEATHER]))), answer)
    chat = render_chat([{"role": "user", "content": "Say hello as JSON."}], [WEATHER])
    jsonschema.validate(json.loads(json_output(schema, random.Random(0), chat)), answer)
