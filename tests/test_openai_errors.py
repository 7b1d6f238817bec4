"""The OpenAI-format error handler: a refusal by the platform (5xx) leaves a log line; a client's
mistake does not (the access log has those)."""

from __future__ import annotations

import logging

import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route
from starlette.testclient import TestClient
from structlog.testing import capture_logs

from inferbus.openai.errors import OpenAIError, openai_error_handler


async def refuse(request: Request) -> None:
    status = int(request.path_params["status"])
    raise OpenAIError(status, "no", code="no_capacity" if status >= 500 else "invalid_value",
                      headers={"retry-after": "5"} if status >= 500 else None)


def test_a_refusal_is_logged_with_its_code_and_a_client_error_is_not() -> None:
    app = Starlette(routes=[Route("/v1/x/{status}", refuse)], exception_handlers={OpenAIError: openai_error_handler})
    client = TestClient(app)
    saved = structlog.get_config()  # a service started in this process may have set a higher level
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with capture_logs() as logged:
            refused = client.get("/v1/x/503")
            bad = client.get("/v1/x/400")
    finally:
        structlog.configure(**saved)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
    assert refused.json()["error"]["code"] == "no_capacity"
    assert bad.status_code == 400
    assert [(e["event"], e["status"], e["code"], e["path"]) for e in logged] == [
        ("request_refused", 503, "no_capacity", "/v1/x/503")]
