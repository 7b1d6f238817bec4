"""Request bodies of the OpenAI endpoints, validated by msgspec (fast, and errors we control).

An unknown top-level field is a 400 naming it, as OpenAI answers (`Unknown parameter`): a misspelt
`response_fromat` must not quietly give free text. Every field OpenAI documents is known (the ones
not built here are refused by name), and so are the sampling extensions of SGLang and vLLM that
benchmark tools and agent frameworks send. Inside messages and tools unknown keys are ignored:
clients send earlier answers back whole (`refusal`, `annotations`, `audio`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from inferbus.openai import tools
from inferbus.openai.errors import OpenAIError
from inferbus.openai.jsonschemas import check_json_schema

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
# Integers the bus (msgpack int64) and the engine (torch's int64 seed) carry.
MaxTokens = Annotated[int, Meta(ge=1, le=2**31 - 1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
N = Annotated[int, Meta(ge=1, le=128)]  # OpenAI's bounds
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
CompletionLogprobs = Annotated[int, Meta(ge=0, le=5)]
TopK = Annotated[int, Meta(ge=-1, le=2**31 - 1)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]  # SGLang's range; 1 is none
MinTokens = Annotated[int, Meta(ge=0, le=2**31 - 1)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ContentPart(msgspec.Struct, forbid_unknown_fields=False):
    type: str
    text: str | None = None
    refusal: str | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    # OpenAI's padding of stream events against length side channels; never added here, so
    # either value is accepted and the events are the same.
    include_obfuscation: bool | None = None


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=False):
    name: str
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=False):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: N = 1
    stop: str | list[str] | None = None
    seed: Seed | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions of SGLang and vLLM: sampling knobs OpenAI does not have.
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: MinTokens | None = None
    ignore_eos: bool | None = None  # generate max_tokens whatever the model would say (benchmarks)
    stop_token_ids: list[TokenId] | None = None


class ChatCompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None
    # Extension of SGLang and vLLM: extra variables for the chat template (`enable_thinking`).
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI fields this platform does not implement: refused when set (see _REFUSED_CHAT).
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # hints for OpenAI's prompt cache; the prefix cache needs none
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    prompt: str | list[str | int]
    echo: bool = False
    suffix: str | None = None
    logprobs: CompletionLogprobs | None = None
    best_of: N | None = None


# The chat template's variables that come from the request and the model, not from chat_template_kwargs.
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "pad_token",
                                "unk_token", "raise_exception", "strftime_now"})
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_PATH = re.compile(r"at `\$((?:\.\w+|\[\d+\])*)`")


MAX_TOOLS = 128  # tools per chat request (OpenAI's own limit); INFERBUS_MAX_TOOLS at the gateway
MAX_MESSAGES = 2048  # messages per chat request; INFERBUS_MAX_MESSAGES at the gateway


class _Counts(msgspec.Struct):
    """How many messages and tools a chat request holds, each left undecoded."""

    messages: list[msgspec.Raw] = []
    tools: list[msgspec.Raw] | None = None


_counts_decoder = msgspec.json.Decoder(_Counts)


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
        if text.startswith("Object contains unknown field"):
            field = text.split("`")[1]
            where = _param(text)
            name = f"{where}.{field}" if where else field
            raise OpenAIError(400, f"Unknown parameter: '{name}'.", param=name, code="unknown_parameter") from None
        if text.startswith("Object missing required field"):
            missing = text.split("`")[1] if "`" in text else None
            raise OpenAIError(
                400, f"Missing required parameter: '{missing}'.", param=missing, code="missing_required_parameter"
            ) from None
        raise OpenAIError(400, f"Invalid request: {text}", param=_param(text), code="invalid_value") from None
    except RecursionError:  # callers check the depth first (json_body); this is the backstop
        raise OpenAIError(400, "The request body is nested too deeply.", code="json_too_deep") from None
    except msgspec.DecodeError as error:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            raise OpenAIError(400, "The request body is not valid UTF-8.", code="invalid_encoding") from None
        raise OpenAIError(400, f"The request body is not valid JSON: {error}", code="invalid_json") from None


def _unsupported(param: str, why: str = "is not supported by this platform") -> OpenAIError:
    return OpenAIError(400, f"`{param}` {why}.", param=param, code="unsupported_value")


def _check_common(body: _Common) -> None:
    if body.logit_bias:
        # Keys are token ids of OpenAI's tokenizers; they mean nothing to this model's vocabulary.
        raise _unsupported("logit_bias")
    if isinstance(body.stop, list):
        if len(body.stop) > 32:
            raise OpenAIError(400, "At most 32 stop sequences are allowed.", param="stop", code="invalid_value")
        if any(not s for s in body.stop):
            raise OpenAIError(400, "Stop sequences must not be empty.", param="stop", code="invalid_value")
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(
            400, "stream_options is only allowed when stream is true.", param="stream_options", code="invalid_value"
        )


def parse_chat(body: bytes, *, max_tools: int = MAX_TOOLS, max_messages: int = MAX_MESSAGES) -> ChatCompletionRequest:
    # The counts first, from a decoding that builds nothing of the messages and tools (a tenth of
    # the full decoding's time): decoding, checking each tool's schema and rendering each message
    # cost time in proportion to them, so a request over a limit is refused before any of that.
    counts: _Counts = _decode(_counts_decoder, body)
    if len(counts.messages) > max_messages:
        raise OpenAIError(400, f"messages holds {len(counts.messages)} messages; at most {max_messages} are allowed.",
                          param="messages", code="invalid_value")
    if counts.tools is not None and len(counts.tools) > max_tools:
        raise OpenAIError(400, f"tools holds {len(counts.tools)} tools; at most {max_tools} are allowed.",
                          param="tools", code="invalid_value")
    request: ChatCompletionRequest = _decode(_chat_decoder, body)
    _check_common(request)
    if not request.messages:
        raise OpenAIError(400, "messages must contain at least one message.", param="messages", code="invalid_value")
    for i, message in enumerate(request.messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type == "refusal" and message.role == "assistant":
                    continue  # an earlier answer's refusal: its text is part of the conversation
                if part.type != "text":
                    raise OpenAIError(
                        400, f"Content part type '{part.type}' is not supported by this model; use text parts.",
                        param=f"messages[{i}].content[{j}].type", code="unsupported_value",
                    )
                if part.text is None:
                    raise OpenAIError(400, f"messages[{i}].content[{j}].text is required for a text part.",
                                      param=f"messages[{i}].content[{j}].text", code="missing_required_parameter")
        if message.role == "tool" and not message.tool_call_id:
            raise OpenAIError(400, f"messages[{i}].tool_call_id is required for role 'tool'.",
                              param=f"messages[{i}].tool_call_id", code="missing_required_parameter")
        if message.content is None and not message.tool_calls and message.role != "assistant":
            raise OpenAIError(
                400,
                f"messages[{i}].content must not be null for role '{message.role}'.",
                param=f"messages[{i}].content",
                code="invalid_value",
            )
    _refuse_unsupported_chat_fields(request)
    for name in request.chat_template_kwargs or ():
        if name in TEMPLATE_VARIABLES:
            raise OpenAIError(400, f"chat_template_kwargs must not set `{name}`, which the server gives the template.",
                              param=f"chat_template_kwargs.{name}", code="invalid_value")
    if request.top_logprobs is not None and not request.logprobs:
        raise OpenAIError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs", code="invalid_value")
    if request.response_format is not None:
        check_response_format(request.response_format)
    if request.tools is not None or request.tool_choice is not None:
        tools.check(request.tools, request.tool_choice)
    if request.max_completion_tokens is not None:
        request.max_tokens = request.max_completion_tokens
    return request


def parse_completion(body: bytes) -> CompletionRequest:
    request: CompletionRequest = _decode(_completion_decoder, body)
    _check_common(request)
    if isinstance(request.prompt, list):
        if len(request.prompt) != 1 or not isinstance(request.prompt[0], str):
            raise OpenAIError(
                400,
                "prompt must be a string or a list of exactly one string.",
                param="prompt",
                code="unsupported_value",
            )
        request.prompt = request.prompt[0]
    if request.echo:
        raise _unsupported("echo")
    if request.suffix is not None:
        raise _unsupported("suffix")
    if (request.best_of or 1) != 1:
        raise _unsupported("best_of", "greater than 1 is not supported")
    return request


def _refuse_unsupported_chat_fields(request: ChatCompletionRequest) -> None:
    """OpenAI fields without an implementation here: a 400 naming the field, never ignored."""
    for name in ("audio", "prediction", "web_search_options", "functions", "function_call", "reasoning_effort",
                 "verbosity"):
        if getattr(request, name) is not None:
            raise _unsupported(name)
    if request.modalities is not None and request.modalities != ["text"]:
        raise _unsupported("modalities", "other than [\"text\"] is not supported")
    if request.store:
        raise _unsupported("store", "true is not supported (completions are not stored)")
    if request.metadata:
        raise _unsupported("metadata", "is only meaningful with store, which is not supported")
    if request.service_tier not in (None, "auto", "default"):
        raise _unsupported(
            "service_tier", f"`{request.service_tier}` is not supported (the band comes from the API key)"
        )


def check_response_format(response_format: ResponseFormat) -> None:
    """A json_schema format needs a schema that is valid JSON Schema; 400 with the reason if not."""
    if response_format.type != "json_schema":
        return
    spec = response_format.json_schema
    if spec is None:
        raise OpenAIError(400, "response_format.json_schema is required when type is json_schema.",
                          param="response_format.json_schema", code="missing_required_parameter")
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", spec.name):
        raise OpenAIError(400, "response_format.json_schema.name must be 1-64 letters, digits, _ or -.",
                          param="response_format.json_schema.name", code="invalid_value")
    check_json_schema(spec.schema or {}, "response_format.json_schema.schema")


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
