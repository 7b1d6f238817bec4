"""The engine's sampling parameters of an OpenAI request, as one pure function: the gateway and
the batch service build them alike, so a field is honoured (or refused) the same way in both."""

from __future__ import annotations

import json
from typing import Any

from inferbus.openai import schemas, tools
from proto import messages as m


def answer_schema(params: schemas.ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema a JSON `response_format` asks of the answer; None for free text."""
    response_format = params.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    assert response_format.json_schema is not None  # checked by schemas.check_response_format
    return response_format.json_schema.schema or {"type": "object"}


def json_constraint(params: schemas.ChatCompletionRequest | schemas.CompletionRequest) -> str | None:
    """The JSON schema (as text) the output must follow: a forced tool call's; with tools the
    model may call (`auto`) and a JSON response format, either calls or the answer; else the
    response format's."""
    if not isinstance(params, schemas.ChatCompletionRequest):
        return None
    parallel = params.parallel_tool_calls is not False
    if params.tools and params.tool_choice not in (None, "none", "auto"):
        schema = tools.constraint(params.tools, params.tool_choice, parallel)
        if schema is not None:
            return _compact(schema)
    answer = answer_schema(params)
    if answer is None:
        return None
    if params.tools and params.tool_choice in (None, "auto"):
        return _compact(tools.either_constraint(params.tools, parallel, answer))
    return _compact(answer)


def _compact(schema: dict[str, Any]) -> str:
    return json.dumps(schema, separators=(",", ":"))


def keeps_special_tokens(
    params: schemas.ChatCompletionRequest | schemas.CompletionRequest, tool_call_parser: str
) -> bool:
    """Whether the engine must keep special tokens in its text: the family's parser reads the
    model's calls (tools the model may call, no JSON constraint) and its markers are special tokens."""
    return (isinstance(params, schemas.ChatCompletionRequest) and bool(params.tools)
            and params.tool_choice in (None, "auto") and answer_schema(params) is None
            and tool_call_parser in tools.KEEPS_SPECIAL_TOKENS)


def sampling_params(params: schemas.ChatCompletionRequest | schemas.CompletionRequest,
                    max_new_tokens: int, tool_call_parser: str = "") -> m.SamplingParams:
    """`tool_call_parser`: the family the gateway reads tool calls with (the batch service reads none)."""
    if isinstance(params, schemas.ChatCompletionRequest):
        logprobs, top_logprobs = bool(params.logprobs), params.top_logprobs or 0
    else:
        logprobs, top_logprobs = params.logprobs is not None, params.logprobs or 0
    return m.SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=1.0 if params.temperature is None else params.temperature,
        top_p=1.0 if params.top_p is None else params.top_p,
        stop=schemas.stop_list(params.stop), seed=params.seed,
        presence_penalty=params.presence_penalty or 0.0, frequency_penalty=params.frequency_penalty or 0.0,
        top_k=-1 if params.top_k is None else params.top_k or -1,
        min_p=params.min_p or 0.0,
        repetition_penalty=1.0 if params.repetition_penalty is None else params.repetition_penalty,
        min_new_tokens=min(params.min_tokens or 0, max_new_tokens),
        ignore_eos=bool(params.ignore_eos), stop_token_ids=list(params.stop_token_ids or ()),
        json_schema=json_constraint(params),
        skip_special_tokens=not keeps_special_tokens(params, tool_call_parser),
        logprobs=logprobs, top_logprobs=top_logprobs,
    )
