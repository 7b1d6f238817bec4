"""What a client sees of a finished generation, as pure functions: the gateway builds its
non-streaming responses with them and the batch service its output lines, so a batch line's body
is exactly what the same request would have returned."""

from __future__ import annotations

from typing import Any

from proto import messages as m

from .errors import OpenAIError


def usage_body(usage: m.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def finish_reason(reason: str | None) -> str:
    """OpenAI's finish reason for an engine's: only `length` is told apart, the rest is `stop`."""
    return "length" if reason == "length" else "stop"


def completion_body(endpoint: str, object_id: str, created: int, model: str, text: str, finish: str | None,
                    usage: m.Usage) -> dict[str, Any]:
    """A `chat.completion` (endpoint "chat") or `text_completion` object."""
    if endpoint == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                                  "logprobs": None, "finish_reason": finish_reason(finish)}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(finish)}
        obj = "text_completion"
    return {"id": object_id, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage_body(usage)}


def max_new_tokens(requested: int | None, prompt_tokens: int, max_model_len: int, default_max_tokens: int) -> int:
    """The max_tokens a request runs with: the requested one if the context has room for it, the
    default (capped by the room) if none was given; OpenAIError 400 when it does not fit."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise OpenAIError(400, f"This model's maximum context length is {max_model_len} tokens; "
                          f"your prompt has {prompt_tokens}.", param="messages", code="context_length_exceeded")
    if requested is None:
        return min(default_max_tokens, room)
    if requested > room:
        raise OpenAIError(400, f"max_tokens is too large: {requested}. This model's maximum context length is "
                          f"{max_model_len} tokens and your prompt has {prompt_tokens}.",
                          param="max_tokens", code="context_length_exceeded")
    return requested
