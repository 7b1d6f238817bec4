import msgspec
import pytest

from inferbus.openai.errors import OpenAIError
from inferbus.openai.schemas import parse_chat, parse_completion


def test_chat_body_with_max_completion_tokens_and_text_parts() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 9, "stream": True, "stream_options": {"include_usage": True}, "future_param": 1}
    chat = parse_chat(msgspec.json.encode(body))
    assert chat.max_tokens == 9 and chat.stream_options and chat.stream_options.include_usage


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 33}, "stop"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "messages": [{"role": "tool", "content": "18 C"}]}, "messages[0].tool_call_id"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format.type"),
])
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
