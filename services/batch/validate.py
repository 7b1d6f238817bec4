"""Validation of a batch's input file, before anything runs. Pure: lines in, a verdict out.

Every request line must be a JSON object with a unique non-empty `custom_id`, `method` POST, `url`
the batch's endpoint, and a `body` that parses as that endpoint's request (the gateway's own
schemas) and whose request the bus can carry (the sampling parameters built as for publishing),
within the gateway's size and nesting limits; all lines name one model. Blank lines are skipped.
Line numbers in errors are 1-based lines of the file, as editors count; requests are numbered
0-based in file order (`batch_line`). Validation stops after `max_errors` errors: a file with a
systematic mistake says so quickly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from inferbus.openai.errors import OpenAIError
from inferbus.openai.json_body import check_depth
from proto import messages as m

from .lines import ENDPOINT_KINDS, decode_line, line_sampling, parse_body


@dataclass(frozen=True)
class Limits:
    max_lines: int = 50_000
    max_bytes: int = 200 * 1024 * 1024
    max_errors: int = 100
    max_line_bytes: int = 4 * 1024 * 1024  # one request line, as the gateway's largest body
    max_json_depth: int = 128  # nesting of a line's body, as the gateway's


@dataclass
class Validated:
    model: str  # the one model every line names
    total: int
    custom_ids: list[str] = field(default_factory=list)  # by request (0-based), in file order
    offsets: list[int] = field(default_factory=list)  # byte offset of each request's line in the file


def validate(raw_lines: Iterable[bytes], endpoint: str, limits: Limits = Limits(),
             check_model: Callable[[str], str | None] = lambda model: None) -> Validated | list[m.BatchErrorEntry]:
    """`raw_lines`: the file's lines as bytes, newlines included (iterating a file opened "rb").
    `check_model(model)` returns why the batch's tenant may not use `model`, or None."""
    errors: list[m.BatchErrorEntry] = []

    def error(code: str, message: str, line: int | None = None, param: str | None = None) -> bool:
        errors.append(m.BatchErrorEntry(code=code, message=message, line=line, param=param))
        return len(errors) >= limits.max_errors

    if endpoint not in ENDPOINT_KINDS:
        error("invalid_endpoint", f"Unsupported endpoint `{endpoint}`; use one of {', '.join(ENDPOINT_KINDS)}.",
              param="endpoint")
        return errors
    model: str | None = None
    model_line = 0
    seen: dict[str, int] = {}
    custom_ids: list[str] = []
    offsets: list[int] = []
    offset = 0
    number = 0
    for number, raw in enumerate(raw_lines, start=1):
        start, offset = offset, offset + len(raw)
        if offset > limits.max_bytes:
            error("file_too_large", f"The input file is larger than {limits.max_bytes} bytes.")
            return errors
        if not raw.strip():
            continue
        if len(custom_ids) >= limits.max_lines:
            error("too_many_requests", f"The input file has more than {limits.max_lines} requests.", line=number)
            return errors
        if len(raw) > limits.max_line_bytes:
            if error("line_too_large", f"Line {number} is larger than {limits.max_line_bytes} bytes.", line=number):
                return errors
            continue
        try:
            check_depth(raw, limits.max_json_depth + 1)  # +1: the line's own object around its body
            item = decode_line(raw)
        except OpenAIError as problem:
            if error(problem.code or "invalid_json_line", f"Line {number}: {problem.message}", line=number):
                return errors
            continue
        except msgspec.ValidationError as problem:
            if error("invalid_request", f"Line {number}: {problem}", line=number):
                return errors
            continue
        except msgspec.DecodeError as problem:
            if error("invalid_json_line", f"Line {number} is not a valid JSON object: {problem}", line=number):
                return errors
            continue
        if not item.custom_id:
            if error("missing_custom_id", f"Line {number} has no `custom_id`.", line=number, param="custom_id"):
                return errors
            continue
        if item.custom_id in seen:
            if error("duplicate_custom_id", f"Line {number}: custom_id `{item.custom_id}` is already used on line "
                     f"{seen[item.custom_id]}; custom_id must be unique within a batch.", line=number,
                     param="custom_id"):
                return errors
            continue
        seen[item.custom_id] = number
        if item.method != "POST":
            if error("invalid_method", f"Line {number}: method must be `POST`, got `{item.method}`.", line=number,
                     param="method"):
                return errors
            continue
        if item.url != endpoint:
            if error("invalid_url",
                     f"Line {number}: url `{item.url}` does not match the batch's endpoint `{endpoint}`.",
                     line=number, param="url"):
                return errors
            continue
        body_bytes = item.body_bytes()
        if body_bytes is None:
            if error("missing_body", f"Line {number} has no `body`.", line=number, param="body"):
                return errors
            continue
        try:
            body = parse_body(endpoint, body_bytes)
            line_sampling(body, body.max_tokens or 1)  # the bus can carry it (max_tokens' room is checked when it runs)
        except OpenAIError as problem:
            param = f"body.{problem.param}" if problem.param else "body"
            if error(problem.code or "invalid_request", f"Line {number}: {problem.message}", line=number, param=param):
                return errors
            continue
        if model is None:
            model, model_line = body.model, number
        elif body.model != model:
            if error("mismatched_model", f"Line {number}: model `{body.model}` differs from `{model}` on line "
                     f"{model_line}; a batch uses one model.", line=number, param="body.model"):
                return errors
            continue
        custom_ids.append(item.custom_id)
        offsets.append(start)
    if errors:
        return errors
    if model is None:
        error("empty_file", "The input file has no requests.")
        return errors
    refusal = check_model(model)
    if refusal is not None:
        error("model_not_found", refusal, line=model_line, param="body.model")
        return errors
    return Validated(model=model, total=len(custom_ids), custom_ids=custom_ids, offsets=offsets)
