"""How the worker's engine client classifies SGLang's refusals inside a stream: SGLang 0.5.23 answers
a streaming request it refuses with HTTP 200 and an error event
`{"error": {"message", "type": "invalid_request_error", "code": 400, "retryable": false}}`."""

from services.worker.engine import _stream_error


def refusal(message: str, code: int = 400) -> dict:
    return {"message": message, "type": "invalid_request_error", "code": code, "retryable": False}


def test_an_in_band_refusal_is_classified_as_the_same_answer_before_the_stream() -> None:
    missing = _stream_error(
        refusal("Got LoRA adapter that has never been loaded: bot@1\nAll loaded adapters: dict_keys([]).")
    )
    assert missing.code == "adapter_not_loaded" and not missing.retryable  # the worker loads it and resends
    too_long = _stream_error(refusal("The input (9000 tokens) is longer than the model's context length"))
    assert too_long.code == "invalid_request" and too_long.status == 400 and not too_long.retryable


def test_an_internal_failure_in_the_stream_stays_a_server_error() -> None:
    failed = _stream_error({"message": "boom", "type": "InternalServerError", "code": 500, "retryable": True})
    assert failed.status == 500 and failed.retryable
