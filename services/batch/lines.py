"""One line of a batch: its body → the request a worker runs, and its result → an output or error
line in OpenAI's format. Pure: no I/O.

Requests are built the way the gateway builds them (same schemas, same prompt rendering, same
max_tokens rule), and response bodies with the gateway's own `responses` functions, so a batch
line returns what the same call to `/v1/chat/completions` or `/v1/completions` would.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from inferbus.openai import carry, responses, schemas
from inferbus.openai.errors import OpenAIError
from inferbus.openai.sampling import sampling_params
from inferbus.tokens.prompt import PromptError, ServedModel, render_prompt
from proto import bands
from proto import messages as m

ENDPOINT_KINDS: dict[str, Literal["chat", "completion"]] = {
    "/v1/chat/completions": "chat", "/v1/completions": "completion",
}
CANCELLED = "batch_cancelled"
EXPIRED = "batch_expired"
_json = msgspec.json.Encoder()


class InputLine(msgspec.Struct, forbid_unknown_fields=False):
    """One line of an input file, loosely typed so validation can say what is wrong with it."""

    custom_id: str | None = None
    method: str | None = None
    url: str | None = None
    body: msgspec.Raw = msgspec.Raw()  # empty when absent

    def body_bytes(self) -> bytes | None:
        raw = bytes(self.body)
        return None if not raw or raw == b"null" else raw


_line_decoder = msgspec.json.Decoder(InputLine)


def decode_line(raw: bytes) -> InputLine:
    """Raises msgspec.DecodeError (not JSON) or msgspec.ValidationError (fields of the wrong type)."""
    return _line_decoder.decode(raw)


def parse_body(endpoint: str, body: bytes) -> schemas.ChatCompletionRequest | schemas.CompletionRequest:
    """The body as the endpoint's request, checked as the gateway checks it; OpenAIError if not."""
    kind = ENDPOINT_KINDS.get(endpoint)
    if kind is None:
        raise OpenAIError(400, f"Unsupported endpoint `{endpoint}`.", param="endpoint", code="invalid_value")
    request = schemas.parse_chat(body) if kind == "chat" else schemas.parse_completion(body)
    if request.stream:
        raise OpenAIError(400, "stream is not supported in a batch.", param="stream", code="unsupported_value")
    # Output lines carry text only: what needs more of the response is refused, not dropped.
    if request.n != 1:
        raise OpenAIError(400, "n greater than 1 is not supported in a batch.", param="n", code="unsupported_value")
    if isinstance(request, schemas.ChatCompletionRequest):
        if request.tools and request.tool_choice != "none":
            raise OpenAIError(400, "tools are not supported in a batch.", param="tools", code="unsupported_value")
        if request.logprobs:
            raise OpenAIError(400, "logprobs are not supported in a batch.", param="logprobs", code="unsupported_value")
    elif request.logprobs is not None:
        raise OpenAIError(400, "logprobs are not supported in a batch.", param="logprobs", code="unsupported_value")
    return request


@dataclass(frozen=True)
class LinePlan:
    """What a line asks for, independent of attempt and time."""

    kind: Literal["chat", "completion"]
    model: str  # as the line names it (a base model or an adapter)
    prompt: str
    prompt_tokens: int
    sampling: m.SamplingParams
    user: str | None = None
    input_ids: list[int] = field(default_factory=list)  # the prompt as the served model's tokenizer encodes it


def plan_line(endpoint: str, body: bytes, *, model: ServedModel, max_model_len: int,
              default_max_tokens: int) -> LinePlan:
    """Render a line's body with the served model's template and tokenizer, as the gateway does;
    OpenAIError when the request itself is invalid (a per-line error)."""
    params = parse_body(endpoint, body)
    try:
        if isinstance(params, schemas.ChatCompletionRequest):
            # Tools are refused in a batch unless tool_choice is `none`, which renders none.
            prompt = render_prompt(model, messages=msgspec.to_builtins(params.messages),
                                   **(params.chat_template_kwargs or {}))
        else:
            assert isinstance(params.prompt, str)
            prompt = render_prompt(model, prompt=params.prompt)
    except PromptError as error:
        raise OpenAIError(400, str(error), code="invalid_prompt") from None
    prompt_tokens = len(prompt.ids)
    sampling = line_sampling(
        params, responses.max_new_tokens(params.max_tokens, prompt_tokens, max_model_len, default_max_tokens))
    return LinePlan(kind=ENDPOINT_KINDS[endpoint], model=params.model, prompt=prompt.text, prompt_tokens=prompt_tokens,
                    sampling=sampling, input_ids=prompt.ids,
                    user=params.user or (params.safety_identifier
                                         if isinstance(params, schemas.ChatCompletionRequest) else None))


def line_sampling(params: schemas.ChatCompletionRequest | schemas.CompletionRequest,
                  max_new_tokens: int) -> m.SamplingParams:
    """A line's sampling parameters, built by the gateway's own builder; OpenAIError 400 when the
    bus cannot carry them (the line could never be published)."""
    sampling = sampling_params(params, max_new_tokens)
    carry.check_sampling(sampling)
    return sampling


def encode_request(request: m.InferenceRequest) -> bytes:
    """The request as published; OpenAIError 400 when it cannot be encoded, which no retry mends."""
    try:
        return m.encode(request.on_wire())
    except carry.UNENCODABLE as error:
        raise OpenAIError(400, f"The request cannot be carried to the engine: {error}.", code="invalid_value") from None


def line_request(plan: LinePlan, *, batch_id: str, line: int, tenant: str, api_key_id: str, base_model: str,
                 adapter: str | None, deadline: float, now: float, reply_to: str,
                 attempt: int = 0) -> m.InferenceRequest:
    """The request of one attempt at a line (the batch band, below every interactive band)."""
    return m.InferenceRequest(
        request_id=m.batch_request_id(batch_id, line), tenant=tenant, model=base_model, prompt=plan.prompt,
        sampling=plan.sampling, reply_to=reply_to, deadline=deadline, created=now, kind=plan.kind, adapter=adapter,
        band="batch", priority=bands.ENGINE_PRIORITY["batch"], attempt=attempt, prompt_tokens=plan.prompt_tokens,
        user=plan.user, api_key_id=api_key_id, batch_id=batch_id, batch_line=line, input_ids=plan.input_ids,
    )


def output_id(request_id: str) -> str:
    """`batch_req_<hex>`, derived from the line's request id: the same when files are rewritten."""
    return "batch_req_" + hashlib.sha256(request_id.encode()).hexdigest()[:32]


def object_id(kind: str, request_id: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + hashlib.sha256(b"obj:" + request_id.encode()).hexdigest()[:32]


def error_result(batch_id: str, line: int, code: str, message: str, status: int, now: float) -> m.BatchLineResult:
    """A line that ended without running (refused, expired or cancelled before any worker ran it)."""
    return m.BatchLineResult(batch_id=batch_id, line=line, request_id=m.batch_request_id(batch_id, line), attempt=0,
                             finished=now, ok=False, error_code=code, error_message=message, status=status)


def output_line(result: m.BatchLineResult, custom_id: str, kind: str, model: str) -> bytes:
    """The line of the output file (a success) or of the error file (anything else), newline included."""
    entry: dict[str, Any] = {"id": output_id(result.request_id), "custom_id": custom_id}
    if result.ok:
        body = responses.completion_body(kind, object_id(kind, result.request_id), int(result.finished), model,
                                         result.text, result.finish_reason,
                                         result.usage or m.Usage(prompt_tokens=0, completion_tokens=0))
        entry["response"] = {"status_code": 200, "request_id": result.request_id, "body": body}
        entry["error"] = None
    elif result.error_code in (CANCELLED, EXPIRED):
        entry["response"] = None
        message = result.error_message or _default_message(result.error_code)
        entry["error"] = {"code": result.error_code, "message": message}
    else:
        status = result.status if result.status >= 400 else 500
        error = OpenAIError(status, result.error_message or "The request failed.", code=result.error_code)
        entry["response"] = {"status_code": status, "request_id": result.request_id, "body": error.body()}
        entry["error"] = None
    return _json.encode(entry) + b"\n"


@dataclass(frozen=True)
class FinalLines:
    """What a batch that ended leaves: its output and error files' lines, in input order, and the
    usage its results add up to."""

    outputs: list[bytes]  # successes
    errors: list[bytes]  # failed lines, and lines without a result
    usage: m.BatchUsage


def final_lines(record: m.BatchRecord, custom_ids: list[str], results: dict[int, m.BatchLineResult], *,
                expired: bool) -> FinalLines:
    """The lines of the files of a batch (`record`, one custom id per line) that ended with
    `results` (each line's first): a line without a result is `batch_expired` when the batch
    `expired`, else `batch_cancelled`; so is a line cancelled because it expired."""
    unfinished = EXPIRED if expired else CANCELLED
    kind = ENDPOINT_KINDS.get(record.endpoint, "chat")
    outputs: list[bytes] = []
    errors: list[bytes] = []
    usage = m.BatchUsage()
    for line, custom_id in enumerate(custom_ids):
        result = results.get(line)
        if result is None:
            errors.append(unfinished_line(m.batch_request_id(record.id, line), custom_id, unfinished))
            continue
        if result.usage is not None:
            usage = m.BatchUsage(input_tokens=usage.input_tokens + result.usage.prompt_tokens,
                                 cached_tokens=usage.cached_tokens + result.usage.cached_tokens,
                                 output_tokens=usage.output_tokens + result.usage.completion_tokens)
        if expired and not result.ok and result.error_code == CANCELLED:
            result = msgspec.structs.replace(result, error_code=EXPIRED, error_message=None)
        (outputs if result.ok else errors).append(output_line(result, custom_id, kind, record.model))
    return FinalLines(outputs=outputs, errors=errors, usage=usage)


def unfinished_line(request_id: str, custom_id: str, code: str) -> bytes:
    """The error-file line of a line that has no result when its batch ends (expired or cancelled)."""
    entry = {"id": output_id(request_id), "custom_id": custom_id, "response": None,
             "error": {"code": code, "message": _default_message(code)}}
    return _json.encode(entry) + b"\n"


def _default_message(code: str) -> str:
    if code == EXPIRED:
        return "This request could not be executed before the completion window expired."
    if code == CANCELLED:
        return "This request was not executed because the batch was cancelled."
    return "This request was not executed."
