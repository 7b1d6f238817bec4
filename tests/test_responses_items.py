"""The Responses API's translation onto chat completions (pure functions, no platform)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from inferbus.openai.errors import OpenAIError
from inferbus.tokens.blocks import block_hashes
from inferbus.tokens.prompt import load_model, render_prompt
from services.gateway import responses_items as items


def parse(**body: Any) -> items.ResponsesRequest:
    return items.parse_request(json.dumps({"model": "m", **body}).encode())


def refused(**body: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        items.input_items(parse(**body), "item")
    assert caught.value.status == 400
    return caught.value


def test_string_input_is_one_user_message() -> None:
    request = parse(input="hi", instructions="Be brief.", max_output_tokens=9, temperature=0.5)
    conversation = items.input_items(request, "x")
    assert conversation == [{"id": "msg_x_0", "type": "message", "role": "user",
                             "content": [{"type": "input_text", "text": "hi"}], "status": "completed"}]
    chat = items.chat_request(request, items.chat_messages(request.instructions, conversation))
    assert chat == {"model": "m", "stream": False, "max_completion_tokens": 9, "temperature": 0.5,
                    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}
    assert request.store is True  # OpenAI's default


def test_items_become_chat_messages_with_tool_calls_in_the_assistant_turn() -> None:
    request = parse(input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call", "call_id": "call_2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "-3 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
    ])
    messages = items.chat_messages(None, items.input_items(request, "i"))
    assert messages == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]


def test_tools_tool_choice_and_text_format_translate_to_their_chat_forms() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    request = parse(input="x", tools=[{"type": "function", "name": "weather", "description": "d", "parameters": schema,
                                       "strict": True}],
                    tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False,
                    text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
                    stream=True)
    chat = items.chat_request(request, [])
    assert chat["tools"] == [{"type": "function", "function": {"name": "weather", "description": "d",
                                                               "parameters": schema, "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "city", "schema": schema, "strict": True}}
    assert chat["stream_options"] == {"include_usage": True}
    assert items.chat_request(parse(input="x", text={"format": {"type": "json_object"}}), [])["response_format"] == \
        {"type": "json_object"}
    assert "response_format" not in items.chat_request(parse(input="x", text={"format": {"type": "text"}}), [])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"include": ["file_search_call.results"]}, "include[0]"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ],
)
def test_what_is_not_built_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    error = refused(**{"input": "x", **body})
    assert error.param == param and error.code == "unsupported_value"


def test_options_that_ask_for_nothing_are_accepted() -> None:
    parse(input="x", reasoning={"effort": None, "summary": None}, include=[], truncation="disabled", background=False,
          service_tier="auto", prompt_cache_key="k", text={"format": {"type": "text"}, "verbosity": None})


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "objekt"}}}},
     "text.format.schema"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": 3}}]}, "tools[0].parameters"),
    ({"input": "x", "response_fromat": {}}, "response_fromat"),
    ({"input": "x", "stream": True, "stream_options": {"include_usage": True}}, "stream_options.include_usage"),
])
def test_bad_input_is_a_400_naming_the_parameter(body: dict[str, Any], param: str) -> None:
    error = refused(**body)
    assert error.param == param
    assert "response_format" not in error.message  # said in the Responses API's own terms
    if error.code == "unknown_parameter":
        assert error.message == f"Unknown parameter: '{param}'."
    if param == "text.format.schema":
        assert error.message.startswith("Invalid schema for text.format.schema")


def test_instructions_and_system_items_are_all_system_messages() -> None:
    request = parse(instructions="Be brief.", input=[{"role": "system", "content": "Answer in JSON."},
                                                     {"role": "developer", "content": "No prose."},
                                                     {"role": "user", "content": "hi"}])
    messages = items.chat_messages(request.instructions, items.input_items(request, "i"))
    assert [m["role"] for m in messages] == ["system", "system", "developer", "user"]


def _shell(**body: Any) -> items.Shell:
    return items.Shell(id="resp_abc", created_at=1, model="m", request=parse(input="x", **body))


def test_a_chat_completion_becomes_a_response_object() -> None:
    usage = {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    completion = {
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
                        }
                    ],
                },
            }
        ],
        "usage": usage,
    }
    response = items.response_from_chat(_shell(), completion)
    assert response["status"] == "completed" and response["object"] == "response" and response["id"] == "resp_abc"
    assert response["output"] == [
        {
            "id": "fc_abc_0",
            "type": "function_call",
            "status": "completed",
            "call_id": "call_9",
            "name": "weather",
            "arguments": '{"city":"Oslo"}',
        }
    ]
    assert response["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 5,
                                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}
    cut = items.response_from_chat(_shell(), {"choices": [{"finish_reason": "length", "message": {"content": "abc"}}],
                                              "usage": usage})
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["content"][0]["text"] == "abc"


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_a_chat_stream_becomes_the_typed_events_in_order() -> None:
    t = items.StreamTranslator(_shell())
    events = t.start()
    events += t.chunk(_chunk({"role": "assistant", "content": "Hel"}))
    events += t.chunk(_chunk({"content": "lo"}))
    events += t.chunk(_chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                              "function": {"name": "f", "arguments": ""}}]}))
    events += t.chunk(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}))
    events += t.chunk(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}, "tool_calls"))
    events += t.chunk({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})
    events += t.end()
    assert [kind for kind, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["output"][1]["arguments"] == '{"a":1}' and final["output"][1]["call_id"] == "call_1"
    assert final["usage"]["total_tokens"] == 7 and final["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []


def test_an_error_in_the_chat_stream_fails_the_response() -> None:
    t = items.StreamTranslator(_shell())
    t.start()
    t.chunk(_chunk({"content": "partial"}))
    events = t.chunk(
        {"error": {"message": "worker lost", "type": "server_error", "code": "worker_lost", "param": None}}
    )
    assert [kind for kind, _ in events] == ["error", "response.failed"]
    assert events[1][1]["response"]["error"] == {"code": "worker_lost", "message": "worker lost"}
    assert t.end() == []


def test_an_empty_generation_still_has_one_message() -> None:
    t = items.StreamTranslator(_shell())
    t.start()
    events = t.chunk(_chunk({}, "stop")) + t.end()
    assert [kind for kind, _ in events] == ["response.output_item.added", "response.content_part.added",
                                            "response.output_text.done", "response.content_part.done",
                                            "response.output_item.done", "response.completed"]


@pytest.mark.parametrize("family", ["llama3", "chatml"])
def test_a_follow_up_extends_the_previous_prompt_so_it_lands_on_the_same_prefix(
    family: str, request: pytest.FixtureRequest
) -> None:
    """previous_response_id: the previous conversation plus its output, then the new input. The
    rendered follow-up starts with the previous rendered prompt, so its prefix blocks hash the same
    and the router places it on the worker that holds them."""
    tools = [{"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}]
    first = parse(input="Long question about the weather in Oslo. " * 30, instructions="Be brief.", tools=tools)
    conversation = items.input_items(first, "a")
    first_chat = items.chat_request(first, items.chat_messages(first.instructions, conversation))
    output = items.response_from_chat(_shell(), {"choices": [{"finish_reason": "tool_calls", "message": {
        "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                         "function": {"name": "weather", "arguments": "{}"}}]}}]})["output"]
    second = parse(input=[{"type": "function_call_output", "call_id": "call_1", "output": "-3 C"}],
                   instructions="Be brief.", tools=tools, previous_response_id="resp_abc")
    second_chat = items.chat_request(second, items.chat_messages(
        second.instructions, conversation + output + items.input_items(second, "b")))
    model = load_model(str(request.getfixturevalue(f"{family}_model_dir")))  # the served model's own template
    before = render_prompt(model, messages=first_chat["messages"], tools=first_chat["tools"])
    after = render_prompt(model, messages=second_chat["messages"], tools=second_chat["tools"])
    assert after.text.startswith(before.text) and len(after.text) > len(before.text)
    first_hashes = block_hashes(before.ids, 16)
    assert len(first_hashes) > 10
    assert block_hashes(after.ids, 16)[:len(first_hashes)] == first_hashes


@pytest.mark.parametrize(("chat", "responses"), [
    ("max_tokens", "max_output_tokens"), ("max_completion_tokens", "max_output_tokens"),
    ("messages[3].content", "input"), ("response_format.json_schema.schema", "text.format.schema"),
    ("tools[1].function.parameters", "tools[1].parameters"), ("tool_choice.function.name", "tool_choice.name"),
    ("temperature", "temperature"), (None, None),
])
def test_chat_errors_name_the_responses_parameter(chat: str | None, responses: str | None) -> None:
    assert items.responses_param(chat) == responses


def test_a_function_call_output_must_answer_an_earlier_call() -> None:
    call = {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}",
            "status": "completed"}
    answer = items.input_items(parse(input=[{"type": "function_call_output", "call_id": "call_1", "output": "x"}]), "i")
    items.check_call_outputs([call, *answer], 1)
    with pytest.raises(OpenAIError) as caught:
        items.check_call_outputs(answer, 0)
    assert caught.value.param == "input[0].call_id"
