"""Client for SGLang's native HTTP API (`/generate`, `/abort_request`, `/v1/loads`, ...).

The simulated engine serves the same API, so this client cannot tell them apart.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from proto.messages import InferenceRequest, TokenLogprob

from .http import ConnectionPool, HTTPError


class EngineError(Exception):
    """The engine refused or failed a request. `retryable` errors may succeed on another engine."""

    def __init__(self, message: str, *, code: str = "engine_error", retryable: bool = False, status: int = 500):
        super().__init__(message)
        self.code = code
        self.retryable = retryable
        self.status = status


@dataclass
class EngineUpdate:
    """Deltas from one read of the stream; several engine chunks coalesce into one update."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # the ids of `text`, from SGLang's cumulative output_ids
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    finish: dict[str, Any] | None = None
    logprobs: list[TokenLogprob] | None = None  # of this update's tokens, when the request asked


@dataclass
class EngineLoad:
    running: int = 0
    waiting: int = 0
    used_tokens: int = 0
    capacity_tokens: int = 0
    cache_hit_rate: float = 0.0
    # A prefill engine's PD queues (its `disaggregation` section): prompts waiting for their decode
    # engine's handshake (counted in `waiting` too, as SGLang counts them) and prompts computed
    # whose KV is on its way (counted in neither).
    bootstrapping: int = 0
    transferring: int = 0


@dataclass
class PrefillResult:
    """A prefill engine's answer for one prompt: its length and what its prefix cache held."""

    prompt_tokens: int = 0
    cached_tokens: int = 0


_json = msgspec.json.Decoder()


def generate_body(request: InferenceRequest, rid: str | None = None) -> dict[str, Any]:
    """SGLang's `/generate` body for `request` (without `stream` and the PD trio)."""
    body: dict[str, Any] = {"sampling_params": sampling_params(request), "rid": rid or request.engine_rid()}
    if request.input_ids:
        # The gateway's tokenization: the engine computes exactly what was counted and hashed,
        # and a migration continues from the ids already generated.
        body["input_ids"] = request.input_ids + request.resumed_ids
    else:
        body["text"] = request.prompt + request.resumed_text
    if request.priority:
        body["priority"] = request.priority
    if request.adapter:
        body["lora_path"] = request.adapter
    if request.sampling.logprobs:
        body.update(return_logprob=True, top_logprobs_num=request.sampling.top_logprobs, return_text_in_logprobs=True)
    return body


def sampling_params(request: InferenceRequest) -> dict[str, Any]:
    s = request.sampling
    params: dict[str, Any] = {
        "max_new_tokens": s.max_new_tokens - request.resumed_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
    }
    if s.stop:
        params["stop"] = s.stop
    if s.seed is not None:
        params["sampling_seed"] = s.seed
    if s.presence_penalty:
        params["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        params["frequency_penalty"] = s.frequency_penalty
    if s.top_k != -1:
        params["top_k"] = s.top_k
    if s.min_p:
        params["min_p"] = s.min_p
    if s.repetition_penalty != 1.0:
        params["repetition_penalty"] = s.repetition_penalty
    if s.min_new_tokens:
        # What was generated before a migration counts towards the minimum.
        params["min_new_tokens"] = min(max(0, s.min_new_tokens - request.resumed_tokens), params["max_new_tokens"])
    if s.ignore_eos:
        params["ignore_eos"] = True
    if s.stop_token_ids:
        params["stop_token_ids"] = s.stop_token_ids
    if not s.skip_special_tokens:
        params["skip_special_tokens"] = False
    for grammar in ("json_schema", "regex", "ebnf"):
        if getattr(s, grammar) is not None:
            params[grammar] = getattr(s, grammar)
    return params


def _logprob_entry(entry: Any) -> tuple[str, float, int]:
    # SGLang's shape with return_text_in_logprobs: [logprob, token_id, token_text].
    logprob, token_id, text = entry
    return (text if text is not None else f"<{token_id}>"), float(logprob), int(token_id)


def new_logprobs(meta: dict[str, Any], sent: int) -> list[TokenLogprob]:
    """The logprobs in an engine chunk's meta_info of the output tokens after the first `sent`.

    SGLang repeats all of them in every chunk of a stream, like the text; with
    --incremental-streaming-output only the new ones. The lists end at `completion_tokens`
    either way, which tells where they start."""
    tokens = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    first = max(0, int(meta.get("completion_tokens", len(tokens))) - len(tokens))  # output index of tokens[0]
    out = []
    for i in range(max(0, sent - first), len(tokens)):
        token, logprob, token_id = _logprob_entry(tokens[i])
        top = [_logprob_entry(t) for t in (tops[i] if i < len(tops) and tops[i] else ())]
        out.append(TokenLogprob(token=token, logprob=logprob, top=[(text, lp) for text, lp, _ in top],
                                token_id=token_id, top_ids=[alternative for _, _, alternative in top]))
    return out


class _Meta(msgspec.Struct):
    """The fields of a chunk's meta_info the worker reads; the rest are skipped unparsed."""

    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: Any = None
    output_token_logprobs: list[Any] | None = None
    output_top_logprobs: list[Any] | None = None


class _Chunk(msgspec.Struct):
    text: str = ""
    output_ids: list[int] | None = None
    meta_info: _Meta | None = None
    error: Any = None


_chunks_decoder = msgspec.json.Decoder(list[_Chunk])
_NO_META = _Meta()


class StreamReader:
    """SGLang's `/generate` stream (server-sent events of JSON chunks) read as it arrives: each
    `feed` of the bytes one socket read brought returns one update with everything they said.

    The chunks of a read are decoded in one call into typed structs (only the fields read here),
    not one dict per chunk. SGLang repeats the whole text (and output_ids, unless
    --incremental-streaming-output) in every chunk: only what is new goes into the update."""

    def __init__(self) -> None:
        self._buffer = b""
        self._sent_chars = 0
        self._sent_ids = 0
        self._sent_logprobs = 0
        self._completion_tokens = 0
        self._cached_tokens = 0
        self.done = False  # the stream said [DONE] or finished

    def feed(self, data: bytes) -> EngineUpdate | None:
        buffer = self._buffer + data if self._buffer else data
        frames = buffer.split(b"\n\n")
        self._buffer = frames.pop()
        payloads = []
        for frame in frames:
            if not frame.startswith(b"data:"):
                continue
            payload = frame[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                break
            payloads.append(payload)
        if not payloads:
            return None
        update = EngineUpdate(completion_tokens=self._completion_tokens, cached_tokens=self._cached_tokens)
        texts: list[str] = []
        for chunk in _chunks_decoder.decode(b"[" + b",".join(payloads) + b"]"):
            if chunk.error is not None:
                raise _stream_error(chunk.error)
            text = chunk.text
            if len(text) > self._sent_chars:  # cumulative: send only what is new
                texts.append(text[self._sent_chars:])
                self._sent_chars = len(text)
            meta = chunk.meta_info or _NO_META
            output_ids = chunk.output_ids
            if output_ids:
                # Cumulative, or only the new ids with --incremental-streaming-output: the list
                # ends at completion_tokens either way, which tells where it starts.
                count = len(output_ids)
                first = max(0, (meta.completion_tokens if meta.completion_tokens is not None else count) - count)
                update.token_ids.extend(output_ids[max(0, self._sent_ids - first):])
                self._sent_ids = max(self._sent_ids, first + count)
            if meta.completion_tokens is not None:
                update.completion_tokens = meta.completion_tokens
            if meta.prompt_tokens is not None:
                update.prompt_tokens = meta.prompt_tokens
            if meta.cached_tokens is not None:
                update.cached_tokens = meta.cached_tokens
            if meta.output_token_logprobs is not None:
                fresh = new_logprobs({"output_token_logprobs": meta.output_token_logprobs,
                                      "output_top_logprobs": meta.output_top_logprobs,
                                      "completion_tokens": meta.completion_tokens
                                      if meta.completion_tokens is not None else len(meta.output_token_logprobs)},
                                     self._sent_logprobs)
                self._sent_logprobs += len(fresh)
                update.logprobs = (update.logprobs or []) + fresh
            if meta.finish_reason:
                update.finish = meta.finish_reason
        update.text = "".join(texts)
        self._completion_tokens, self._cached_tokens = update.completion_tokens, update.cached_tokens
        if update.finish:
            self.done = True
        if update.text or update.finish or update.prompt_tokens is not None:
            return update
        return None


# SGLang's fake bootstrap host: a prefill or decode engine computes a request naming it alone, its KV
# transfer faked (what SGLang's own warm-up sends), so a probe needs no peer engine.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


class EngineClient:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self._pool: ConnectionPool | None = None
        # A prefill or decode engine (SGLang's PD mode) refuses a request without a bootstrap room:
        # its probes name the fake bootstrap host.
        self.disaggregated = False

    async def start(self) -> None:
        self._pool = ConnectionPool(self.base_url)

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()

    @property
    def pool(self) -> ConnectionPool:
        assert self._pool is not None, "EngineClient.start() not called"
        return self._pool

    async def _call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        payload = b"" if body is None else msgspec.json.encode(body)
        response = await self.pool.request(method, path, payload)
        return response.status, await response.read()

    async def generate(self, request: InferenceRequest, headers: dict[str, str], *,
                       bootstrap: dict[str, Any] | None = None, rid: str | None = None) -> AsyncIterator[EngineUpdate]:
        """Stream `request` through the engine, yielding deltas until the finish update.
        `bootstrap`: SGLang's PD trio (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`) for a
        decode engine, whose KV comes from the prefill engine named there; `rid`: the engine rid
        (default the attempt's)."""
        body = generate_body(request, rid)
        body["stream"] = True
        if bootstrap:
            body.update(bootstrap)
        try:
            response = await self.pool.request("POST", "/generate", msgspec.json.encode(body), headers)
            if response.status != 200:
                raise _http_error(response.status, await response.read())
            reader = StreamReader()
            async for data in response.iter_chunks():
                update = reader.feed(data)
                if update is not None:
                    yield update
                if reader.done:
                    return
        except HTTPError as error:
            raise EngineError(f"engine unavailable: {error}", code="engine_unavailable", retryable=True,
                              status=503) from error
        raise EngineError("engine stream ended without a finish reason", code="engine_error", retryable=True,
                          status=502)

    async def prefill(self, request: InferenceRequest, headers: dict[str, str], *, bootstrap: dict[str, Any],
                      rid: str) -> PrefillResult:
        """The prefill half of `request` on a prefill engine (SGLang `--disaggregation-mode prefill`):
        it computes the prompt and sends the KV to the decode engine waiting in the bootstrap room,
        and answers once the transfer is done (or failed)."""
        body = generate_body(request, rid)
        body.update(bootstrap)
        try:
            status, raw = await self._call_with("POST", "/generate", body, headers)
        except HTTPError as error:
            raise EngineError(f"engine unavailable: {error}", code="engine_unavailable", retryable=True,
                              status=503) from error
        if status != 200:
            raise _http_error(status, raw)
        try:
            answer = _json.decode(raw)
        except msgspec.DecodeError as error:
            raise EngineError(f"unreadable prefill answer: {error}", retryable=True, status=502) from error
        if isinstance(answer, list):  # one answer per prompt; this is one prompt
            answer = answer[0] if answer else {}
        if not isinstance(answer, dict):
            raise EngineError("unreadable prefill answer", retryable=True, status=502)
        if "error" in answer:
            raise _stream_error(answer["error"])
        meta = answer.get("meta_info") or {}
        finish = meta.get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            # SGLang ends a prefill whose transfer failed (or that was aborted) this way.
            raise EngineError(str(finish.get("message") or "prefill aborted"), code="prefill_aborted", retryable=True,
                              status=503)
        return PrefillResult(prompt_tokens=int(meta.get("prompt_tokens") or 0),
                             cached_tokens=int(meta.get("cached_tokens") or 0))

    async def _call_with(self, method: str, path: str, body: Any, headers: dict[str, str]) -> tuple[int, bytes]:
        response = await self.pool.request(method, path, msgspec.json.encode(body), headers)
        return response.status, await response.read()

    async def abort(self, engine_rid: str) -> None:
        try:
            await self._call("POST", "/abort_request", {"rid": engine_rid})
        except HTTPError:
            pass  # the stream itself will report the failure

    async def loads(self) -> EngineLoad:
        _, raw = await self._call("GET", "/v1/loads?include=all")
        entries = _json.decode(raw).get("loads") or [{}]
        load = EngineLoad()
        for entry in entries:  # one per data-parallel rank
            load.running += entry.get("num_running_reqs", 0)
            load.waiting += entry.get("num_waiting_reqs", 0)
            load.used_tokens += entry.get("num_used_tokens", 0)
            load.capacity_tokens += entry.get("max_total_num_tokens", 0)
            load.cache_hit_rate = max(load.cache_hit_rate, entry.get("cache_hit_rate", 0.0))
            queues = entry.get("disaggregation") or {}
            load.bootstrapping += queues.get("prefill_bootstrap_queue_reqs", 0)
            load.transferring += queues.get("prefill_inflight_queue_reqs", 0)
        return load

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        status, raw = await self._call("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path})
        try:
            result = _json.decode(raw) if raw else {}
        except msgspec.DecodeError:
            result = {"success": False, "error_message": raw.decode(errors="replace")}
        if status != 200:
            result["success"] = False
        return result

    async def unload_lora(self, name: str) -> None:
        try:
            await self._call("POST", "/unload_lora_adapter", {"lora_name": name})
        except HTTPError:
            pass

    async def probe(self, lora_name: str | None = None) -> None:
        """One greedy token, non-streaming; raises EngineError when the engine cannot serve it."""
        body: dict[str, Any] = {"text": "ping", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        if lora_name:
            body["lora_path"] = lora_name
        if self.disaggregated:
            body.update(bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_port=None,
                        bootstrap_room=secrets.randbits(63))
        status, raw = await self._call("POST", "/generate", body)
        if status != 200:
            raise _http_error(status, raw)
        try:
            answer = _json.decode(raw)
        except msgspec.DecodeError as error:
            raise EngineError(f"unreadable answer: {error}") from error
        if isinstance(answer, dict) and "error" in answer:
            raise _stream_error(answer["error"])
        finish = (answer.get("meta_info") or {}).get("finish_reason") or {} if isinstance(answer, dict) else {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            raise EngineError(str(finish.get("message", "aborted")))

    async def loaded_adapters(self) -> list[str]:
        """The adapters the engine has loaded now: the `/v1/models` entries with a `parent` (SGLang
        lists the base model, then each loaded adapter with the base as its parent)."""
        status, raw = await self._call("GET", "/v1/models")
        if status != 200:
            raise _http_error(status, raw)
        data = (_json.decode(raw) or {}).get("data") or []
        return [entry["id"] for entry in data if isinstance(entry, dict) and entry.get("parent") and entry.get("id")]

    async def server_info(self) -> dict[str, Any]:
        _, raw = await self._call("GET", "/server_info")
        return _json.decode(raw)

    async def ready(self) -> bool:
        try:
            status, _ = await self._call("GET", "/ready")
            return status == 200
        except HTTPError:
            return False


def _http_error(status: int, body: bytes) -> EngineError:
    # SGLang answers {"error": {"message": ...}} (older versions: {"error": "..."}).
    try:
        error = _json.decode(body).get("error", body.decode(errors="replace"))
        message = str(error.get("message", error)) if isinstance(error, dict) else str(error)
    except (msgspec.DecodeError, AttributeError):
        message = body.decode(errors="replace")
    if status == 400 and ("never been loaded" in message or "adapters are not loaded" in message):
        # SGLang after a restart: the worker reloads the adapter and sends the request again.
        return EngineError(message, code="adapter_not_loaded", retryable=False, status=503)
    if status == 400:
        return EngineError(message, code="invalid_request", retryable=False, status=400)
    return EngineError(message, code="engine_error", retryable=status >= 500, status=502 if status >= 500 else status)


def _stream_error(error: Any) -> EngineError:
    # SGLang reports a request it refuses after the stream started (an unknown adapter, an input
    # too long, ...) in-band: {"error": {"message", "type": "invalid_request_error", "code": 400}}.
    # Classified as the same refusal answered before the stream would be.
    if isinstance(error, dict) and isinstance(error.get("code"), int) and 400 <= error["code"] < 500:
        return _http_error(error["code"], msgspec.json.encode({"error": error}))
    if isinstance(error, dict):
        return EngineError(
            str(error.get("message", error)),
            code=str(error.get("code") or error.get("type") or "engine_error"),
            retryable=bool(error.get("retryable", False)),
            status=500,
        )
    return EngineError(str(error))
