"""OpenAI-format errors: `{"error": {"message", "type", "param", "code"}}`, never a traceback."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "timeout_error",
}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, request_id: str | None = None) -> Response:
        headers = dict(self.headers)
        if request_id:
            headers["x-request-id"] = request_id
        return Response(
            msgspec.json.encode(self.body()), status_code=self.status, headers=headers, media_type="application/json"
        )


async def openai_error_handler(request: Request, error: Exception) -> Response:
    assert isinstance(error, OpenAIError)
    if error.status >= 500:  # the platform's refusals (no workers, overload, a store down) leave a trace
        from inferbus.runtime import logs

        logs.get(__name__).warning("request_refused", path=request.url.path, status=error.status, code=error.code)
    return error.response(getattr(request.state, "request_id", None))


async def http_exception_handler(request: Request, error: Exception) -> Response:
    status = getattr(error, "status_code", 500)
    detail = getattr(error, "detail", None)
    message = (
        detail
        if isinstance(detail, str)
        else {404: "Not found", 405: "Method not allowed"}.get(status, "Request failed")
    )
    if status == 404 and message == "Not Found":
        message = f"Unknown endpoint: {request.method} {request.url.path}"
    return OpenAIError(status, message, code={404: "unknown_url", 405: "method_not_allowed"}.get(status)).response(
        getattr(request.state, "request_id", None)
    )


async def validation_exception_handler(request: Request, error: Exception) -> Response:
    # FastAPI's own 422s (query parameters); bodies are validated by msgspec in schemas.py.
    errors: list[dict[str, Any]] = getattr(error, "errors", lambda: [])()
    first = errors[0] if errors else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return OpenAIError(400, first.get("msg", "Invalid request"), param=param, code="invalid_value").response(
        getattr(request.state, "request_id", None)
    )


async def unhandled_exception_handler(request: Request, error: Exception) -> Response:
    from inferbus.runtime import logs

    if isinstance(error, RecursionError):  # a hostile body that got past the depth checks: still the client's
        logs.get(__name__).warning("request_too_deep", path=request.url.path)
        return OpenAIError(400, "The request is nested too deeply.", code="json_too_deep").response(
            getattr(request.state, "request_id", None)
        )
    logs.get(__name__).exception("unhandled_error", path=request.url.path)
    return OpenAIError(500, "The server had an error while processing your request.", code="internal_error").response(
        getattr(request.state, "request_id", None)
    )
