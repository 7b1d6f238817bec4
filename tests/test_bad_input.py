"""Bad input is the client's 4xx: JSON depth and size limits, and requests the bus cannot carry."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from inferbus.openai import carry
from inferbus.openai.errors import OpenAIError
from inferbus.openai.json_body import JsonLimits, check_depth, decode, json_depth
from inferbus.tokens.prompt import load_model
from proto import messages as m
from services.batch import lines
from services.batch.validate import Limits, Validated, validate

MODEL = "meta-llama/Llama-3.3-70B-Instruct"
CHAT = "/v1/chat/completions"


def chat_line(custom_id: str, **body: object) -> bytes:
    item = {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}}
    return json.dumps(item).encode() + b"\n"


@pytest.mark.parametrize("body, depth", [
    (b"1", 0), (b"[]", 1), (b'{"a": [1, {"b": []}]}', 4),
    (b'{"a": "[[[[{{{{"}', 1),  # brackets inside strings do not nest
    (b'{"a": "\\"[[[", "b": ["\\\\"]}', 2),  # nor after escaped quotes and backslashes
    (b"[" * 100_000 + b"]" * 100_000, 100_000),
    (b'"unterminated [[[', 3), (b"]]]]", 0),  # invalid JSON: a bound all the same (the decoder refuses it)
])
def test_json_depth(body: bytes, depth: int) -> None:
    assert json_depth(body) == depth


def test_a_body_nested_100000_levels_is_a_400() -> None:
    body = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(OpenAIError) as raised:
        check_depth(body, 128)
    assert raised.value.status == 400 and raised.value.code == "json_too_deep"
    assert "100001 levels" in raised.value.message and "128" in raised.value.message
    check_depth(b"[" * 128 + b"]" * 128, 128)  # at the limit: fine


def test_decode_refuses_size_depth_and_garbage_with_4xx() -> None:
    limits = JsonLimits(max_depth=4, max_bytes=64)
    assert decode(b'{"a": [[1]]}', limits) == {"a": [[1]]}
    for body, status, code in ((b"[" * 5 + b"]" * 5, 400, "json_too_deep"), (b" " * 65, 413, "request_too_large"),
                               (b"{nope", 400, "invalid_json"), (b"", 400, "invalid_json")):
        with pytest.raises(OpenAIError) as raised:
            decode(body, limits)
        assert (raised.value.status, raised.value.code) == (status, code)


def test_the_schema_decoder_turns_a_recursion_error_into_a_400() -> None:
    from inferbus.openai.schemas import parse_chat

    with pytest.raises(OpenAIError) as raised:
        parse_chat(b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert raised.value.status == 400


@pytest.mark.parametrize("field, value, param", [("seed", 2**70, "seed"), ("seed", -(2**64), "seed"),
                                                 ("max_new_tokens", 2**65, "max_tokens")])
def test_sampling_the_bus_cannot_carry_is_a_400_naming_the_parameter(field: str, value: int, param: str) -> None:
    sampling = msgspec.structs.replace(m.SamplingParams(max_new_tokens=16), **{field: value})
    with pytest.raises(OpenAIError) as raised:
        carry.check_sampling(sampling)
    assert (raised.value.status, raised.value.param) == (400, param)
    carry.check_sampling(m.SamplingParams(max_new_tokens=16, seed=2**63))  # 64-bit: carried


def test_a_batch_line_with_a_seed_the_bus_cannot_carry_is_refused_at_validation() -> None:
    verdict = validate([chat_line("a"), chat_line("b", seed=2**70), chat_line("c")], CHAT)
    assert isinstance(verdict, list) and [(e.line, e.param) for e in verdict] == [(2, "body.seed")]
    assert "Line 2" in verdict[0].message


def test_a_batch_line_nested_too_deeply_or_too_large_is_refused_at_validation() -> None:
    deep = b'{"custom_id": "d", "method": "POST", "url": "/v1/chat/completions", "body": ' + b"[" * 100_000 \
        + b"]" * 100_000 + b"}\n"
    verdict = validate([chat_line("a"), deep, chat_line("b", user="x" * 2000)], CHAT,
                       Limits(max_line_bytes=1024, max_json_depth=128))
    assert isinstance(verdict, list)
    assert [(e.code, e.line) for e in verdict] == [("line_too_large", 2), ("line_too_large", 3)]
    verdict = validate([chat_line("a"), deep], CHAT, Limits(max_line_bytes=10**6, max_json_depth=128))
    assert isinstance(verdict, list) and [(e.code, e.line) for e in verdict] == [("json_too_deep", 2)]
    assert isinstance(validate([chat_line("a", chat_template_kwargs={"x": [[[[1]]]]})], CHAT), Validated)


@pytest.mark.slow
def test_a_line_planned_with_a_seed_the_bus_cannot_carry_fails_as_a_line_error(llama3_model_dir: Path) -> None:
    # The runner's path for a line validated before this check existed: planning refuses it (a
    # per-line result), and a request that still cannot be encoded is a 400, not a retry.
    model = load_model(str(llama3_model_dir))
    body = json.loads(chat_line("a", seed=2**70))["body"]
    with pytest.raises(OpenAIError) as raised:
        lines.plan_line(CHAT, json.dumps(body).encode(), model=model, max_model_len=4096, default_max_tokens=16)
    assert (raised.value.status, raised.value.param) == (400, "seed")
    good = json.dumps(json.loads(chat_line("a"))["body"]).encode()
    plan = lines.plan_line(CHAT, good, model=model, max_model_len=4096, default_max_tokens=16)
    request = lines.line_request(plan, batch_id="batch_x", line=0, tenant="t", api_key_id="k", base_model=MODEL,
                                 adapter=None, deadline=0.0, now=0.0, reply_to="r")
    assert lines.encode_request(request) == m.encode(request.on_wire())  # the ids cross the bus, not the text too
    unencodable = msgspec.structs.replace(request, sampling=msgspec.structs.replace(request.sampling, seed=2**70))
    with pytest.raises(OpenAIError) as raised:
        lines.encode_request(unencodable)
    assert raised.value.status == 400
