"""The worker's reading of SGLang's /generate answers."""

from __future__ import annotations

from proto import messages as m
from services.worker.engine import new_logprobs, sampling_params


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
        "max_new_tokens": 7, "temperature": 1.0, "top_p": 1.0, "stop": ["."], "sampling_seed": 5,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "top_k": 40, "min_p": 0.1, "json_schema": '{"type":"object"}',
    }
