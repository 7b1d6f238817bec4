"""The worker's reading of SGLang's /generate answers."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from proto import messages as m
from services.worker.engine import EngineError, StreamReader, new_logprobs, sampling_params


def test_engine_logprobs_cumulative_or_incremental() -> None:
    entries = [[-0.1, 1, " a"], [-0.2, 2, " b"], [-0.3, 3, " c"]]
    tops = [[[-0.1, 1, " a"], [-1.0, 9, " z"]]] * 3
    cumulative = {"output_token_logprobs": entries, "output_top_logprobs": tops, "completion_tokens": 3}
    fresh = new_logprobs(cumulative, 1)
    assert [(e.token, e.logprob) for e in fresh] == [(" b", -0.2), (" c", -0.3)]
    assert fresh[0].top == [(" a", -0.1), (" z", -1.0)]
    incremental = {"output_token_logprobs": entries[1:], "output_top_logprobs": tops[1:], "completion_tokens": 3}
    assert [e.token for e in new_logprobs(incremental, 1)] == [" b", " c"]
    assert new_logprobs({"output_token_logprobs": [[-0.5, 7, None]], "completion_tokens": 1}, 0)[0].token == "<7>"


def test_sampling_params_carry_every_field_sglang_knows() -> None:
    request = m.InferenceRequest(
        request_id="r", tenant="t", model="m", prompt="P", reply_to="x", deadline=1e12, created=0,
        sampling=m.SamplingParams(max_new_tokens=10, seed=5, top_k=40, min_p=0.1, stop=["."],
                                  json_schema='{"type":"object"}', presence_penalty=0.5, frequency_penalty=-0.5),
        resumed_tokens=3)
    assert sampling_params(request) == {
        "max_new_tokens": 7,
        "temperature": 1.0,
        "top_p": 1.0,
        "stop": ["."],
        "sampling_seed": 5,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "top_k": 40,
        "min_p": 0.1,
        "json_schema": '{"type":"object"}',
    }
    extras = m.SamplingParams(max_new_tokens=10, repetition_penalty=1.2, min_new_tokens=5, ignore_eos=True,
                              stop_token_ids=[2])
    resumed = msgspec.structs.replace(request, sampling=extras)
    # Tokens generated before the request moved count towards min_new_tokens.
    assert sampling_params(resumed) == {
        "max_new_tokens": 7, "temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.2, "min_new_tokens": 2,
        "ignore_eos": True, "stop_token_ids": [2],
    }


def sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def cumulative(n: int, words: list[str], finish: dict[str, Any] | None = None) -> bytes:
    meta = {"id": "r", "prompt_tokens": 12, "completion_tokens": n, "cached_tokens": 4, "finish_reason": finish,
            "e2e_latency": 0.1, "weight_version": "default"}  # fields the reader does not use are skipped
    return sse({"text": "".join(words[:n]), "output_ids": list(range(100, 100 + n)), "meta_info": meta})


def test_the_chunks_of_one_read_make_one_update_with_only_what_is_new() -> None:
    words = ["Hel", "lo", ",", " wor", "ld"]
    reader = StreamReader()
    update = reader.feed(cumulative(1, words) + cumulative(2, words) + cumulative(3, words)[:20])  # the third in part
    assert update is not None and (update.text, update.token_ids) == ("Hello", [100, 101])
    assert (update.completion_tokens, update.prompt_tokens, update.cached_tokens, update.finish) == (2, 12, 4, None)
    assert reader.feed(b"") is None  # nothing whole yet
    rest = cumulative(3, words)[20:] + cumulative(5, words, {"type": "length", "length": 5}) + b"data: [DONE]\n\n"
    update = reader.feed(rest)
    assert update is not None and (update.text, update.token_ids) == (", world", [102, 103, 104])
    assert update.finish == {"type": "length", "length": 5} and update.completion_tokens == 5 and reader.done


def test_incremental_output_ids_and_logprobs_are_placed_by_completion_tokens() -> None:
    reader = StreamReader()
    first = {"text": "a", "output_ids": [7], "meta_info": {
        "completion_tokens": 1, "output_token_logprobs": [[-0.1, 7, "a"]], "output_top_logprobs": [None]}}
    second = {"text": "ab", "output_ids": [8], "meta_info": {
        "completion_tokens": 2, "output_token_logprobs": [[-0.2, 8, "b"]], "output_top_logprobs": [None],
        "finish_reason": {"type": "stop", "matched": "."}}}
    update = reader.feed(sse(first) + sse(second))
    assert update is not None and update.text == "ab" and update.token_ids == [7, 8]
    assert [(lp.token, lp.logprob) for lp in update.logprobs or []] == [("a", -0.1), ("b", -0.2)]
    assert update.finish == {"type": "stop", "matched": "."} and reader.done


def test_an_in_band_error_is_the_engines_refusal_and_done_without_finish_ends_the_read() -> None:
    error = {"error": {"message": "Input too long", "type": "invalid_request_error", "code": 400}}
    with pytest.raises(EngineError) as refused:
        StreamReader().feed(sse(error))
    assert refused.value.status == 400 and refused.value.code == "invalid_request"
    reader = StreamReader()
    assert reader.feed(b": keep-alive\n\ndata: [DONE]\n\n") is None and reader.done


def test_the_engines_context_window_from_its_server_info() -> None:
    from services.worker.reporting import engine_context_length

    # SGLang: --context-length echoed when given, else null; the scheduler's longest prompt is
    # min(context length, KV pool) - 6 either way.
    assert engine_context_length({"context_length": None, "max_req_input_len": 4090}) == 4096
    assert engine_context_length({"context_length": 2048, "max_req_input_len": 2042}) == 2048
    assert engine_context_length({"context_length": None}) == 0 == engine_context_length({})


def test_the_context_window_precedence(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from inferbus.tokens.modeldir import build_model_dir
    from inferbus.tokens.prompt import DEFAULT_CONTEXT_LENGTH, ServedModel, context_window

    model = ServedModel.load(build_model_dir(tmp_path / "m", "chatml", model_max_length=4096))
    assert context_window(0, model) == 4096  # the model's config.json
    assert context_window(0, model, engines=2048) == 2048  # an engine started with --context-length
    assert context_window(1000, model, engines=2048) == 1000  # INFERBUS_MAX_MODEL_LEN wins
    bare = ServedModel(model.tokenizer, None, {}, [], context_length=None)
    assert context_window(0, bare) == DEFAULT_CONTEXT_LENGTH
