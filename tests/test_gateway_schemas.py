import msgspec
import pytest

from proto import messages as m
from services.gateway.dispatch import Flight, next_attempt
from services.gateway.errors import OpenAIError
from services.gateway.schemas import parse_chat, parse_completion


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


def test_migration_continues_from_what_the_client_already_has() -> None:
    request = m.InferenceRequest(request_id="r", tenant="t", model="m", prompt="P", reply_to="x",
                                 sampling=m.SamplingParams(max_new_tokens=10), deadline=1e12, created=0)
    flight = Flight(request=request, sent_text=[" a", " b"], sent_tokens=2, prompt_tokens=4)
    second = next_attempt(flight, max_attempts=3, now=0)
    assert second is not None
    assert (second.attempt, second.resumed_text, second.resumed_tokens, second.prompt_tokens) == (1, " a b", 2, 4)
    flight.request, flight.sent_text, flight.sent_tokens = second, [" c"], 3
    third = next_attempt(flight, max_attempts=3, now=0)
    assert third is not None and third.resumed_text == " a b c" and third.resumed_tokens == 3
    flight.request = third
    assert next_attempt(flight, max_attempts=3, now=0) is None
    assert next_attempt(Flight(request=request), max_attempts=3, now=2e12) is None
