"""The JSON objects of OpenAI's Files and Batch APIs, built from our records (what the official SDK's
`Batch` and `FileObject` parse)."""

from __future__ import annotations

from typing import Any

from proto import messages as m


def batch_object(record: m.BatchRecord) -> dict[str, Any]:
    usage = record.usage
    errors = None
    if record.errors:
        errors = {"object": "list", "data": [
            {"code": e.code, "message": e.message, "param": e.param, "line": e.line} for e in record.errors]}
    return {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "errors": errors,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": record.status,
        "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id,
        "created_at": record.created_at,
        "in_progress_at": record.in_progress_at,
        "expires_at": record.expires_at,
        "finalizing_at": record.finalizing_at,
        "completed_at": record.completed_at,
        "failed_at": record.failed_at,
        "expired_at": record.expired_at,
        "cancelling_at": record.cancelling_at,
        "cancelled_at": record.cancelled_at,
        "request_counts": {"total": record.total, "completed": record.completed, "failed": record.failed},
        "metadata": record.metadata,
        "model": record.model or None,
        "usage": {
            "input_tokens": usage.input_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.input_tokens + usage.output_tokens,
        },
    }


def file_object(record: m.FileRecord) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": record.created_at,
        "filename": record.filename,
        "purpose": record.purpose,
        "status": record.status,
    }
    if record.expires_at is not None:
        body["expires_at"] = record.expires_at
    return body


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A cursor-paginated list (`GET /v1/files`, `/v1/batches`): the next page is `after=last_id`."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
