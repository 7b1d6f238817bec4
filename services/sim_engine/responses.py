"""The native API's JSON responses, encoded as the simulated engine encodes them everywhere."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response

encode_json = msgspec.json.Encoder().encode


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(encode_json(payload), status, media_type="application/json")


def error_response(message: str, status: int = 400) -> Response:
    # SGLang's create_error_response shape.
    return json_response({"error": {"message": message}}, status)
