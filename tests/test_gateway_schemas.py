import msgspec
import pytest

from inferbus.openai.errors import OpenAIError
from inferbus.openai.schemas import parse_chat, parse_completion


def test_chat_body_with_max_completion_tokens_and_text_parts() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 9, "stream": True, "stream_options": {"include_usage": True}}
    chat = parse_chat(msgspec.json.encode(body))
    assert chat.max_tokens == 9 and chat.stream_options and chat.stream_options.include_usage


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 33}, "stop"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
            "messages[0].content[0].type",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}, "repetition_penalty"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}},
            "chat_template_kwargs.messages",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ({"model": "m", "messages": [{"role": "tool", "content": "18 C"}]}, "messages[0].tool_call_id"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
            "response_format.json_schema",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            "response_format.type",
        ),
    ],
)
def test_bad_chat_bodies_name_the_parameter(body: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as raised:
        parse_chat(msgspec.json.encode(body))
    assert raised.value.status == 400 and raised.value.param == param


def test_completion_prompt_forms() -> None:
    assert parse_completion(b'{"model": "m", "prompt": ["one"]}').prompt == "one"
    with pytest.raises(OpenAIError):
        parse_completion(b'{"model": "m", "prompt": ["one", "two"]}')
    with pytest.raises(OpenAIError):
        parse_completion(b'{"model": "m", "prompt": "x", "echo": true}')


def _tool(i: int, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": f"tool_{i}", "parameters": parameters or {"type": "object"}}}


def test_tools_and_messages_over_their_limits_are_refused_before_each_is_checked() -> None:
    user = [{"role": "user", "content": "x"}]
    # Every tool's schema is invalid: a 400 naming `tools` (not `tools[0]...`) shows none was checked.
    bad = {"type": "function", "function": {"name": "t", "parameters": {"type": 5}}}
    with pytest.raises(OpenAIError) as raised:
        parse_chat(msgspec.json.encode({"model": "m", "messages": user, "tools": [bad] * 129}))
    assert (raised.value.status, raised.value.param) == (400, "tools") and "at most 128" in raised.value.message
    with pytest.raises(OpenAIError) as raised:
        parse_chat(
            msgspec.json.encode({"model": "m", "messages": [{"role": "tool", "content": "x"}] * 5}), max_messages=4
        )
    assert (raised.value.status, raised.value.param) == (400, "messages") and "at most 4" in raised.value.message
    accepted = parse_chat(
        msgspec.json.encode({"model": "m", "messages": user * 4, "tools": [_tool(i) for i in range(3)]}),
        max_tools=3,
        max_messages=4,
    )
    assert accepted.tools is not None and len(accepted.tools) == 3


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
         "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}
RECURSIVE = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
             "$ref": "#/$defs/node"}


@pytest.mark.parametrize("schema, why", [
    (CYCLE, "reference cycle"),
    ({"$ref": "#"}, "reference cycle"),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}, "does not name"),
    ({"type": "object", "properties": {"x": {"$ref": "https://example.com/schema.json"}}}, "does not name"),
])
def test_a_schema_no_decoder_can_compile_is_a_400(schema: dict, why: str) -> None:
    user = [{"role": "user", "content": "x"}]
    response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    with pytest.raises(OpenAIError) as raised:
        parse_chat(msgspec.json.encode({"model": "m", "messages": user, "response_format": response_format}))
    assert raised.value.param == "response_format.json_schema.schema" and why in raised.value.message
    with pytest.raises(OpenAIError) as raised:
        parse_chat(msgspec.json.encode({"model": "m", "messages": user, "tools": [_tool(0, schema)]}))
    assert raised.value.param == "tools[0].function.parameters" and why in raised.value.message


def test_recursion_through_a_property_and_data_that_looks_like_a_ref_are_accepted() -> None:
    user = [{"role": "user", "content": "x"}]
    for schema in (RECURSIVE, {"const": {"$ref": "#/nowhere"}}, {"$defs": {"s": {"type": "string"}},
                                                                  "properties": {"a": {"$ref": "#/$defs/s"}}}):
        response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        parse_chat(msgspec.json.encode({"model": "m", "messages": user, "response_format": response_format}))


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_fromat": {"type": "json_object"}},
     "response_fromat"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
      "stream_options": {"include_usage": True, "incude_usage": True}}, "stream_options.incude_usage"),
])
def test_an_unknown_field_is_a_400_naming_it(body: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as raised:
        parse_chat(msgspec.json.encode(body))
    error = raised.value.body()["error"]
    assert raised.value.status == 400
    assert error == {"message": f"Unknown parameter: '{param}'.", "type": "invalid_request_error", "param": param,
                     "code": "unknown_parameter"}
    with pytest.raises(OpenAIError, match="Unknown parameter: 'best_of_n'"):
        parse_completion(b'{"model": "m", "prompt": "x", "best_of_n": 2}')


def test_the_extensions_clients_send_are_known_and_reach_the_engine() -> None:
    from inferbus.openai.sampling import sampling_params

    body = {"model": "m", "messages": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}],
                                         "refusal": "no", "annotations": [], "audio": None},
                                        {"role": "user", "content": "x"}],
            "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4, "ignore_eos": True,
            "stop_token_ids": [7], "chat_template_kwargs": {"enable_thinking": False},
            "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False},
            "prompt_cache_key": "k", "prompt_cache_retention": "24h"}
    chat = parse_chat(msgspec.json.encode(body))
    sampling = sampling_params(chat, max_new_tokens=64)
    assert (sampling.top_k, sampling.min_p, sampling.repetition_penalty) == (20, 0.05, 1.1)
    assert (sampling.min_new_tokens, sampling.ignore_eos, sampling.stop_token_ids) == (4, True, [7])
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    # min_tokens never exceeds what may be generated.
    assert sampling_params(chat, max_new_tokens=2).min_new_tokens == 2
    plain = sampling_params(parse_chat(b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'), 8)
    assert (plain.repetition_penalty, plain.min_new_tokens, plain.ignore_eos, plain.stop_token_ids) == (
        1.0,
        0,
        False,
        [],
    )
