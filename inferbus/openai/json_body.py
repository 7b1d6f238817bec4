"""Size and nesting limits on JSON request bodies, so a hostile body is a 400 or 413, never a 500.

msgspec decodes recursively: a body nested deeper than the interpreter's recursion limit raises
`RecursionError`, and a legitimate request never needs more than a few dozen levels (a JSON
schema in `response_format` or a tool's `parameters` is the deepest thing a client sends). The
depth is measured before decoding, in linear time and at C speed: escapes are dropped, then
strings, then everything but brackets, and the running sum of +1/-1 per bracket gives the depth.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import msgspec
from starlette.requests import Request

from inferbus.openai.errors import OpenAIError

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


@dataclass(frozen=True)
class JsonLimits:
    max_depth: int = 128  # nesting levels of arrays and objects
    max_bytes: int = 1024 * 1024  # body size, for the endpoints without a limit of their own


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in `body` (0 for a scalar). Linear in its size,
    also for bodies that are not valid JSON (their verdict is the decoder's)."""
    if body.count(b"[") + body.count(b"{") == 0:
        return 0
    unescaped = _ESCAPE.sub(b"", body) if b"\\" in body else body
    brackets = _STRING.sub(b"", unescaped).translate(None, _NOT_BRACKET)
    return max(0, max(accumulate(map(_STEP.__getitem__, brackets)), default=0))


def check_depth(body: bytes, max_depth: int) -> None:
    """OpenAIError 400 when `body` nests deeper than `max_depth`."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return  # cannot nest deeper than it has brackets
    depth = json_depth(body)
    if depth > max_depth:
        raise OpenAIError(400, f"The JSON body is nested {depth} levels deep; the limit is {max_depth}.",
                          code="json_too_deep")


def decode(body: bytes, limits: JsonLimits, type: Any = Any) -> Any:
    """`body` decoded as `type` within `limits`; OpenAIError 400/413 for anything a client got wrong."""
    if len(body) > limits.max_bytes:
        raise too_large(limits.max_bytes)
    if not body.strip():
        raise OpenAIError(400, "The request body is empty; send a JSON object.", code="invalid_json")
    check_depth(body, limits.max_depth)
    try:
        return msgspec.json.decode(body, type=type)
    except msgspec.ValidationError as error:
        raise OpenAIError(400, f"Invalid request: {error}", code="invalid_value") from None
    except (msgspec.DecodeError, RecursionError):
        raise OpenAIError(400, "The request body is not valid JSON.", code="invalid_json") from None


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"Request body too large: over {limit} bytes.", code="request_too_large")


def limits_of(request: Request) -> JsonLimits:
    """The limits the app was configured with (`app.state.json_limits`), else the defaults."""
    return getattr(request.app.state, "json_limits", None) or JsonLimits()


async def read(request: Request, limits: JsonLimits | None = None) -> bytes:
    """The raw body of a FastAPI request, refused with 413 as soon as it passes the size limit."""
    limits = limits or limits_of(request)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_bytes:
        raise too_large(limits.max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_bytes:
            raise too_large(limits.max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, type: Any = Any, limits: JsonLimits | None = None) -> Any:
    """A FastAPI request's JSON body, read and decoded within the app's limits."""
    limits = limits or limits_of(request)
    return decode(await read(request, limits), limits, type)
