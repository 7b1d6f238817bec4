"""What a client sees of a finished generation, as pure functions: the gateway builds its
non-streaming responses with them and the batch service its output lines, so a batch line's body
is exactly what the same request would have returned."""

from __future__ import annotations

from typing import Any

from inferbus.openai.errors import OpenAIError
from proto import messages as m


def usage_body(usage: m.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def finish_reason(reason: str | None, tool_calls: bool = False) -> str:
    """OpenAI's finish reason for an engine's: `length`, `tool_calls` when the output was calls,
    else `stop`."""
    if reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(entries: list[m.TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object of some generated tokens."""
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": _token_bytes(e.token),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": _token_bytes(t)} for t, lp in e.top]}
                        for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[m.TokenLogprob], offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions `logprobs` object; `offset`: characters of the completion before
    these tokens (the text_offset of the first)."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries], "text_offset": offsets}


def completion_body(endpoint: str, object_id: str, created: int, model: str, text: str | None, finish: str | None,
                    usage: m.Usage, *, tool_calls: list[dict[str, Any]] | None = None,
                    logprobs: list[m.TokenLogprob] | None = None) -> dict[str, Any]:
    """A `chat.completion` (endpoint "chat") or `text_completion` object."""
    if endpoint == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": 0, "message": message,
                                  "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
                                  "finish_reason": finish_reason(finish, bool(tool_calls))}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text or "",
                  "logprobs": completion_logprobs(logprobs, 0) if logprobs is not None else None,
                  "finish_reason": finish_reason(finish)}
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
