"""A chat or completion call as the gateway relays it (`Call`, one `Choice` per `n`), and the
OpenAI frames of it: streamed chunks (content, tool calls, logprobs, usage) and the whole body."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from inferbus.openai import responses
from inferbus.openai.token_text import TokenTexts
from inferbus.openai.tools import ToolCall, ToolOutput
from proto import messages as m

from .flight import Flight

_json = msgspec.json.Encoder()


@dataclass
class Call:
    """What a chat or completion call needs after parsing, whatever the endpoint."""

    endpoint: str
    object_id: str
    model: str
    created: int
    include_usage: bool
    stream: bool
    started: float = field(default_factory=time.monotonic)  # admitted: authenticated, parsed, rendered, in quota
    arrived: float = 0.0  # the request reached this gateway's handler
    first_token_at: float | None = None
    flight: Flight | None = None
    usage: m.Usage | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # x-ratelimit-* for the response
    lease_held: bool = True  # the tenant's concurrency lease for this request
    logprobs: bool = False
    choices: list[Choice] = field(default_factory=list)  # one per `n`, each its own flight
    pumps: list[asyncio.Future[None]] = field(default_factory=list)  # n > 1: relays of the choices' events
    latency_labels: tuple[str, str, str] = ("", "base", "other")  # metrics.latency_labels: model, adapter, band
    adapter_label: str | None = None  # its adapter in the per-adapter metrics (adapter_metrics.py)

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"


@dataclass
class Choice:
    """One of the request's `n` outputs: its flight and what its stream has said so far."""

    index: int
    flight: Flight
    tool_output: ToolOutput | None = None  # reads tool calls out of the output when tools are offered
    pending_logprobs: list[m.TokenLogprob] = field(default_factory=list)  # not yet sent with a chunk
    token_texts: TokenTexts | None = None  # decodes its logprob tokens in context (logprobs asked for)
    text_offset: int = 0  # characters of completion text sent (legacy completions' text_offset)
    tool_calls_sent: int = 0
    started: bool = False  # its first chunk (with the role) was sent
    final: m.Final | None = None
    parts: list[str] = field(default_factory=list)  # non-streaming: the text so far
    logprobs: list[m.TokenLogprob] = field(default_factory=list)  # non-streaming: the logprobs so far
    written: int = 0  # completion tokens (client-visible total) in the chunks handed to the client's socket
    framed: int = 0  # ... and in chunks framed for it, not handed over yet


def chunks(call: Call, choice: Choice, text: str, logprobs: list[m.TokenLogprob] | None,
           final: bool = False) -> list[bytes]:
    """The chunks of some generated text of one choice: content as it comes, or, when tools
    are offered, content and tool calls as the parser finds them."""
    first = not choice.started
    choice.started = True
    if call.logprobs:
        choice.pending_logprobs.extend(logprobs or ())
    if choice.tool_output is None:
        return [chunk(call, text, None, first, index=choice.index, logprobs=take_logprobs(call, choice),
                      choice=choice)]
    parts = choice.tool_output.feed(text)
    if final:
        parts += choice.tool_output.finish()
    frames: list[bytes] = []
    if first:  # the role comes first, whatever follows
        frames.append(chunk(call, "", None, True, index=choice.index))
    for part in parts:
        if isinstance(part, ToolCall):
            frames.extend(tool_call_chunks(call, choice, part))
        else:
            frames.append(chunk(call, part, None, False, index=choice.index,
                                logprobs=take_logprobs(call, choice)))
    return frames


def take_logprobs(call: Call, choice: Choice) -> list[m.TokenLogprob] | None:
    if not call.logprobs:
        return None
    taken, choice.pending_logprobs = choice.pending_logprobs, []
    return taken


def tool_call_chunks(call: Call, choice: Choice, tool_call: ToolCall) -> list[bytes]:
    """OpenAI's streamed shape: a delta with the call's id, type and name, then its arguments."""
    index = choice.tool_calls_sent
    choice.tool_calls_sent += 1
    head = {
        "index": index,
        "id": tool_call.id,
        "type": "function",
        "function": {"name": tool_call.name, "arguments": ""},
    }
    return [chunk(call, None, None, False, index=choice.index, tool_calls=[head]),
            chunk(call, None, None, False, index=choice.index,
                  tool_calls=[{"index": index, "function": {"arguments": tool_call.arguments}}])]


def chunk(call: Call, text: str | None, finish: str | None, first: bool, *, index: int = 0,
          logprobs: list[m.TokenLogprob] | None = None, tool_calls: list[dict[str, Any]] | None = None,
          choice: Choice | None = None) -> bytes:
    if call.endpoint == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        if tool_calls is not None:
            delta["tool_calls"] = tool_calls
        body: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish,
                                "logprobs": responses.chat_logprobs(logprobs) if logprobs else None}
    else:
        offset = choice.text_offset if choice is not None else 0
        body = {"index": index, "text": text or "", "finish_reason": finish,
                "logprobs": responses.completion_logprobs(logprobs, offset) if logprobs else None}
        if choice is not None:
            choice.text_offset += len(text or "")
    frame: dict[str, Any] = {"id": call.object_id, "object": call.chunk_object, "created": call.created,
                             "model": call.model, "choices": [body]}
    if call.include_usage:
        frame["usage"] = None
    return b"data: " + _json.encode(frame) + b"\n\n"


def usage_chunk(call: Call, usage: m.Usage) -> bytes:
    frame = {"id": call.object_id, "object": call.chunk_object, "created": call.created, "model": call.model,
             "choices": [], "usage": responses.usage_body(usage)}
    return b"data: " + _json.encode(frame) + b"\n\n"


def completion_body(call: Call, usage: m.Usage) -> dict[str, Any]:
    bodies = []
    for choice in call.choices:
        assert choice.final is not None
        content: str | None = "".join(choice.parts)
        tool_calls = None
        if choice.tool_output is not None:
            content, calls = choice.tool_output.whole(content or "")
            tool_calls = [c.body() for c in calls] or None
        body = responses.completion_body(call.endpoint, call.object_id, call.created, call.model, content,
                                         choice.final.finish_reason, usage, tool_calls=tool_calls,
                                         logprobs=choice.logprobs if call.logprobs else None)
        body["choices"][0]["index"] = choice.index
        bodies.append(body)
    bodies[0]["choices"] = [b["choices"][0] for b in bodies]
    return bodies[0]
