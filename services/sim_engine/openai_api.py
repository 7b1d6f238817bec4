"""SGLang's OpenAI-compatible endpoints on the simulated engine: `/v1/chat/completions`,
`/v1/completions` and `/v1/models`, served next to the native `/generate` as SGLang serves them.

Clients that speak only the OpenAI API (`inferbus sweep`, NVIDIA's aiperf, the openai SDK) can
load the engine directly, without the platform in between. Chat messages are rendered with the
served model's own chat template and tokenizer (`inferbus.tokens.prompt.render_prompt`, as the gateway
does), so prompt token counts agree with the platform's; without a model directory, with the
stand-in rendering and tokenizer of the capacity tools (`inferbus.tokens.blocks`). Supported:
`max_tokens`/`max_completion_tokens`, the sampling fields SGLang maps (`ignore_eos`, `min_tokens`, ...), streaming with
`stream_options.include_usage`, and
`prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from inferbus.tokens.blocks import encode, standin_render_chat
from inferbus.tokens.prompt import PromptError, ServedModel, render_prompt

from .config import EngineConfig
from .disagg import Bootstrap
from .request import Request, RequestRejected, RequestUpdate
from .sampling import SamplingParams
from .scheduler import Engine
from .streams import Stream


class Serving(Protocol):
    """What the OpenAI routes use of the engine's HTTP server (`server.SimEngineServer`): what it
    serves and how it tokenizes, and its requests' start, end and abort."""

    config: EngineConfig
    engine: Engine
    served: ServedModel | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def submit(self, request: Request, stream_interval: int, internal: bool = False,
               bootstrap: Bootstrap | None = None) -> Stream: ...

    async def final_update(self, stream: Stream) -> RequestUpdate: ...

    def abort_if_running(self, rid: str) -> None: ...


def _error(message: str, status: int = 400) -> Response:
    # SGLang's OpenAI-serving error shape (also what the openai SDK parses).
    body = {"object": "error", "error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
    return JSONResponse(body, status)


def _sampling(body: dict[str, Any]) -> SamplingParams:
    """OpenAI request fields → SGLang sampling params (ValueError on bad values)."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    params: dict[str, Any] = {"max_new_tokens": 128 if max_tokens is None else max_tokens}
    for openai_name, sglang_name in (
        ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
        ("stop", "stop"), ("ignore_eos", "ignore_eos"), ("min_tokens", "min_new_tokens"),
        ("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty"),
        ("seed", "sampling_seed"), ("n", "n"),
    ):
        if body.get(openai_name) is not None:
            params[sglang_name] = body[openai_name]
    try:
        sampling = SamplingParams(**params)
    except TypeError as exc:
        raise ValueError(str(exc)) from exc
    for name in ("max_new_tokens", "min_new_tokens", "n", "top_k"):
        value = getattr(sampling, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    sampling.verify()
    return sampling


class OpenAIRoutes:
    """The OpenAI endpoints of one engine server (`routes`, added to its Starlette app)."""

    def __init__(self, server: Serving) -> None:
        self.server = server
        self.model = server.config.model
        self.routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
        ]

    async def models(self, http_request: HttpRequest) -> Response:
        """The base model, then each loaded adapter with the base as its `parent` (as SGLang lists them)."""
        created = int(time.time())
        entries = [{"id": self.model, "object": "model", "created": created, "owned_by": "sglang",
                    "root": self.model, "parent": None, "max_model_len": self.server.config.context_length}]
        entries += [{"id": name, "object": "model", "created": created, "owned_by": "sglang", "root": adapter.path,
                     "parent": self.model, "max_model_len": None}
                    for name, adapter in self.server.engine.adapters.items()]
        return JSONResponse({"object": "list", "data": entries})

    async def chat(self, http_request: HttpRequest) -> Response:
        body = await self._body(http_request)
        if isinstance(body, Response):
            return body
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m
                                                                     for m in messages):
            return _error("messages must be a non-empty list of {role, content} objects.")
        served = self.server.served
        if served is None:
            return await self._generate(body, encode(standin_render_chat(messages)), chat=True)
        try:
            prompt = render_prompt(served, messages=messages, tools=body.get("tools"))
        except PromptError as exc:
            return _error(str(exc))
        return await self._generate(body, prompt.ids, chat=True)

    async def completions(self, http_request: HttpRequest) -> Response:
        body = await self._body(http_request)
        if isinstance(body, Response):
            return body
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            input_ids = self.server.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < self.server.vocab_size
                                                         for t in prompt):
            input_ids = list(prompt)
        else:
            return _error("prompt must be a string or a list of token ids (batches are not supported).")
        return await self._generate(body, input_ids, chat=False)

    @staticmethod
    async def _body(http_request: HttpRequest) -> dict[str, Any] | Response:
        try:
            body = json.loads(await http_request.body())
        except ValueError as exc:
            return _error(f"The request body is not valid JSON: {exc}")
        return body if isinstance(body, dict) else _error("The request body must be a JSON object.")

    async def _generate(self, body: dict[str, Any], input_ids: list[int], chat: bool) -> Response:
        try:
            sampling = _sampling(body)
        except ValueError as exc:
            return _error(str(exc))
        room = body.get("bootstrap_room")  # prefill/decode disaggregation: SGLang's PD routing fields
        if room is not None and (not isinstance(room, int) or isinstance(room, bool)):
            return _error("bootstrap_room must be an integer (batches are not supported).")
        host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        bootstrap = None if room is None else Bootstrap(host if isinstance(host, str) else None,
                                                        port if isinstance(port, int) else None, room)
        request = Request(rid=uuid.uuid4().hex, input_ids=input_ids, sampling=sampling)
        try:
            stream = self.server.submit(request, 1, bootstrap=bootstrap)
        except RequestRejected as exc:
            return _error(str(exc))
        model = str(body.get("model") or self.model)
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            events = self._events(request, stream, model, chat, include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            update = await self.server.final_update(stream)
        finally:
            self.server.abort_if_running(request.rid)
        status = (update.finish_reason or {}).get("status_code")
        if isinstance(status, int) and 400 <= status < 600:  # refused by the scheduler: an error, as SGLang
            return _error(str((update.finish_reason or {}).get("message")), status)
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(update.finish_reason), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": update.text}
        else:
            choice["text"] = update.text
        return JSONResponse({
            "id": request.rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": _usage(request, update.num_output_tokens),
        })

    async def _events(self, request: Request, stream: Any, model: str, chat: bool,
                      include_usage: bool) -> AsyncIterator[bytes]:
        head = {"id": request.rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model}
        sent = 0  # characters of the cumulative text already streamed
        tokens = 0
        finished = False
        try:
            while not finished:
                update = await stream.queue.get()
                finished = update.finish_reason is not None
                delta = update.text[sent:]
                choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                          "finish_reason": _finish(update.finish_reason) if finished else None}
                if chat:
                    # The role comes with the first token.
                    choice["delta"] = {"role": "assistant", "content": delta} if tokens == 0 else {"content": delta}
                else:
                    choice["text"] = delta
                sent, tokens = len(update.text), update.num_output_tokens
                chunk: dict[str, Any] = {**head, "choices": [choice]}
                if include_usage:
                    chunk["usage"] = None
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            if include_usage:
                usage: dict[str, Any] = {**head, "choices": [], "usage": _usage(request, tokens)}
                yield b"data: " + json.dumps(usage).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                # The client went away: stop generating for it, as SGLang does.
                self.server.abort_if_running(request.rid)


def _finish(reason: dict[str, Any] | None) -> str | None:
    if reason is None:
        return None
    return {"length": "length", "stop": "stop", "abort": "abort"}.get(reason.get("type", ""), "stop")


def _usage(request: Request, completion_tokens: int) -> dict[str, Any]:
    prompt = len(request.input_ids)
    return {
        "prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": request.cached_tokens},
    }
