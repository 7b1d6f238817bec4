"""Continuing a request from what it already produced: one rule for the gateway's migration, the
worker's requeue of a batch line and the fleet simulator."""

from __future__ import annotations

from inferbus.tokens import continuation
from proto import messages as m


def _request(**fields: object) -> m.InferenceRequest:
    base: dict[str, object] = dict(request_id="r", tenant="t", model="m", prompt="P", reply_to="x", deadline=1e12,
                                   created=0, sampling=m.SamplingParams(max_new_tokens=10))
    base.update(fields)
    return m.InferenceRequest(**base)  # type: ignore[arg-type]


def test_the_next_attempt_carries_text_ids_and_totals() -> None:
    first = _request(input_ids=[1, 2, 3], expected_cached_tokens=64)
    second = continuation.next_attempt(first, text=" a b", token_ids=[40, 41], produced_tokens=2, prompt_tokens=3)
    assert (second.attempt, second.resumed_text, second.resumed_ids, second.resumed_tokens) == (1, " a b", [40, 41], 2)
    assert second.input_ids == [1, 2, 3] and second.prompt_tokens == 3
    assert second.expected_cached_tokens == 0  # placement finds the cache again for the new attempt
    third = continuation.next_attempt(second, text=" c", token_ids=[42], produced_tokens=3, prompt_tokens=3)
    assert (third.attempt, third.resumed_text, third.resumed_ids, third.resumed_tokens) == (
        2,
        " a b c",
        [40, 41, 42],
        3,
    )
    assert first.resumed_ids == [] and second.resumed_ids == [40, 41]  # nothing shared is mutated


def test_without_the_ids_of_everything_it_continues_from_text() -> None:
    first = _request(input_ids=[1, 2, 3])
    second = continuation.next_attempt(first, text=" a b", token_ids=[40], produced_tokens=2, prompt_tokens=3)
    assert second.input_ids == [] and second.resumed_ids == [] and second.resumed_text == " a b"
    assert second.resumed_tokens == 2


def test_constrained_output_starts_over() -> None:
    request = _request(sampling=m.SamplingParams(max_new_tokens=10, json_schema='{"type":"object"}'), input_ids=[1])
    again = continuation.next_attempt(request, text='{"a', token_ids=[7, 8], produced_tokens=2, prompt_tokens=1)
    assert (again.attempt, again.resumed_text, again.resumed_ids, again.resumed_tokens) == (1, "", [], 0)
    assert again.input_ids == [1] and again.prompt_tokens == 1


def test_engine_input_is_the_prompt_plus_the_output_so_far() -> None:
    assert continuation.engine_input([1, 2], [], 10) == ([1, 2], 10)
    assert continuation.engine_input([1, 2], [5, 6, 7], 10) == ([1, 2, 5, 6, 7], 7)
