"""Request bodies of the OpenAI endpoints, validated by msgspec (fast, and errors we control).

Unknown fields are ignored, as OpenAI-compatible servers commonly do, so SDK upgrades that add
parameters keep working; known fields are checked strictly.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from .errors import OpenAIError

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
MaxTokens = Annotated[int, Meta(ge=1)]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ContentPart(msgspec.Struct, forbid_unknown_fields=False):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool = False


class _Common(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    logprobs: bool | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[str | int]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None


_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_PATH = re.compile(r"at `\$((?:\.\w+|\[\d+\])*)`")


def _param(message: str) -> str | None:
    match = _PATH.search(message)
    return match.group(1).lstrip(".") or None if match else None


def _decode(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    if not body.strip():
        raise OpenAIError(400, "The request body is empty; send a JSON object.", code="invalid_json")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as error:
        text = str(error)
        if text.startswith("Object missing required field"):
            field = text.split("`")[1] if "`" in text else None
            raise OpenAIError(400, f"Missing required parameter: '{field}'.", param=field, code="missing_required_parameter") from None
        raise OpenAIError(400, f"Invalid request: {text}", param=_param(text), code="invalid_value") from None
    except RecursionError:  # callers check the depth first (json_body); this is the backstop
        raise OpenAIError(400, "The request body is nested too deeply.", code="json_too_deep") from None
    except msgspec.DecodeError as error:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            raise OpenAIError(400, "The request body is not valid UTF-8.", code="invalid_encoding") from None
        raise OpenAIError(400, f"The request body is not valid JSON: {error}", code="invalid_json") from None


def _check_common(body: _Common) -> None:
    if body.n != 1:
        raise OpenAIError(400, "Only n=1 is supported.", param="n", code="unsupported_value")
    if isinstance(body.stop, list):
        if len(body.stop) > 32:
            raise OpenAIError(400, "At most 32 stop sequences are allowed.", param="stop", code="invalid_value")
        if any(not s for s in body.stop):
            raise OpenAIError(400, "Stop sequences must not be empty.", param="stop", code="invalid_value")
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(400, "stream_options is only allowed when stream is true.", param="stream_options", code="invalid_value")


def parse_chat(body: bytes) -> ChatCompletionRequest:
    request: ChatCompletionRequest = _decode(_chat_decoder, body)
    _check_common(request)
    if not request.messages:
        raise OpenAIError(400, "messages must contain at least one message.", param="messages", code="invalid_value")
    for i, message in enumerate(request.messages):
        if isinstance(message.content, list):
            for part in message.content:
                if part.type != "text":
                    raise OpenAIError(
                        400, f"Content part type '{part.type}' is not supported by this model; use text parts.",
                        param=f"messages[{i}].content", code="unsupported_value",
                    )
        if message.content is None and not message.tool_calls and message.role != "assistant":
            raise OpenAIError(400, f"messages[{i}].content must not be null for role '{message.role}'.", param=f"messages[{i}].content", code="invalid_value")
    if request.logprobs:
        raise OpenAIError(400, "logprobs are not supported.", param="logprobs", code="unsupported_value")
    if request.max_completion_tokens is not None:
        request.max_tokens = request.max_completion_tokens
    return request


def parse_completion(body: bytes) -> CompletionRequest:
    request: CompletionRequest = _decode(_completion_decoder, body)
    _check_common(request)
    if isinstance(request.prompt, list):
        if len(request.prompt) != 1 or not isinstance(request.prompt[0], str):
            raise OpenAIError(400, "prompt must be a string or a list of exactly one string.", param="prompt", code="unsupported_value")
        request.prompt = request.prompt[0]
    if request.echo or request.suffix is not None or request.logprobs or (request.best_of or 1) != 1:
        raise OpenAIError(400, "echo, suffix, logprobs and best_of are not supported.", code="unsupported_value")
    return request


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
