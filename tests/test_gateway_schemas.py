import msgspec
import pytest

from inferbus.openai.errors import OpenAIError
from inferbus.openai.schemas import parse_chat, parse_completion


def test_chat_body_with_max_completion_tokens_and_text_parts() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 9, "stream": True, "stream_options": {"include_usage": True}}
    chat = parse_chat(msgspec.json.encode(body))
    assert chat.max_tokens == 9 and chat.stream_options and chat.stream_options.include_usage


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 33}, "stop"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
     "messages[0].content[0].type"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs.messages"),
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
    assert (plain.repetition_penalty, plain.min_new_tokens, plain.ignore_eos, plain.stop_token_ids) == (1.0, 0, False, [])
