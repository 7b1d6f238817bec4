"""The public OpenAPI document, fuzzed by schemathesis against a live platform, and bad input that
must be the client's 4xx: a body nested 100,000 levels deep, a seed the bus cannot carry, in an
HTTP request or in a batch line."""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from .conftest import MODEL, Platform, running_platform

pytestmark = pytest.mark.e2e

DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """One fast simulated worker; answers are short (16 tokens unless asked) and the context is
    2,048 tokens, so fuzzed generation requests finish quickly or are refused."""
    with running_platform(tmp_path_factory.mktemp("openapi"), workers=1, time_scale=0.05,
                          extra_env={"INFERBUS_DEFAULT_MAX_TOKENS": "16", "INFERBUS_MAX_MODEL_LEN": "2048"}) as running:
        yield running


def test_the_document_describes_every_public_endpoint_and_no_admin_one(platform: Platform) -> None:
    doc = httpx.get(platform.stack.gateway_url + "/openapi.json").json()
    paths = doc["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/batches", "/v1/files"):
        body = paths[path]["post"]["requestBody"]["content"]
        (media, content), = body.items()
        assert "$ref" in content["schema"] or content["schema"]["properties"], (path, media)
    assert set(doc["components"]["schemas"]["ChatCompletionRequest"]["required"]) == {"model", "messages"}
    for path in ("/v1/models", "/v1/models/{model_id}", "/v1/files/{file_id}/content", "/v1/batches/{batch_id}/cancel",
                 "/v1/usage", "/v1/costs"):
        assert path in paths
    assert {p["name"] for p in paths["/v1/usage"]["get"]["parameters"]} >= {"start_time", "bucket_width", "group_by"}
    assert not [p for p in paths if p.startswith("/admin")]
    admin_url = platform.stack.gateway_url + "/admin/openapi.json"
    assert httpx.get(admin_url).status_code == 401
    assert httpx.get(admin_url, headers={"authorization": f"Bearer {platform.api_key}"}).status_code == 401
    admin = httpx.get(admin_url, headers={"authorization": f"Bearer {platform.admin_key}"}).json()
    assert "/admin/v1/tenants" in admin["paths"] and not [p for p in admin["paths"] if p.startswith("/v1/")]


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# Examples per operation and mode: about a minute for the whole document; raise it for a deeper run.
EXAMPLES = int(os.environ.get("INFERBUS_FUZZ_EXAMPLES", "10"))


def fuzz(document_url: str, auth: dict[str, str], skip: tuple[str, ...] = ()) -> None:
    """schemathesis on every operation of the document at `document_url`, with `auth`: valid
    (positive) and invalid (negative) bodies, parameters and paths. No 5xx, and every answer's
    status, content type and body are the document's."""
    schema = schemathesis.openapi.from_url(document_url, headers=auth)
    failures: list[str] = []
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path in skip:
            continue
        operations += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(mode, headers=auth))
            @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            def run(case: schemathesis.Case) -> None:
                case.call_and_validate(headers=auth, timeout=30, checks=CHECKS)

            try:
                run()
            except Unsatisfiable:  # nothing in this operation can be made invalid (a bare GET, a string id)
                continue
            except Exception as error:  # every operation is fuzzed; all failures are reported together
                failures.append(f"{mode.value} {operation.method.upper()} {operation.path}: {error}")
    assert operations >= 9
    assert not failures, "\n\n".join(failures)


def test_fuzzed_requests_get_no_server_error_and_documented_responses(platform: Platform) -> None:
    """The public document with a tenant's key. `/ready` is left out: its 503 (NATS or Redis
    away) is its documented answer, and it has no input to fuzz."""
    fuzz(platform.stack.gateway_url + "/openapi.json", {"authorization": f"Bearer {platform.api_key}"},
         skip=("/ready",))


# ---- bad input: 4xx, never a 5xx --------------------------------------------------------------


def _post(platform: Platform, path: str, body: bytes, key: str) -> httpx.Response:
    return httpx.post(platform.stack.gateway_url + path, content=body, timeout=30,
                      headers={"authorization": f"Bearer {key}", "content-type": "application/json"})


@pytest.mark.parametrize("path, admin", [("/v1/chat/completions", False), ("/v1/completions", False),
                                         ("/v1/batches", False), ("/admin/v1/tenants", True),
                                         ("/admin/v1/adapters", True), ("/admin/v1/prices", True)])
def test_a_body_nested_100000_levels_deep_is_a_400(platform: Platform, path: str, admin: bool) -> None:
    body = b'{"model": "m", "messages": ' + DEEP + b"}"
    response = _post(platform, path, body, platform.admin_key if admin else platform.api_key)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "json_too_deep"


def test_a_body_over_the_size_limit_is_a_413_everywhere(platform: Platform) -> None:
    body = b'{"id": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    for path, key in (("/v1/chat/completions", platform.api_key), ("/admin/v1/tenants", platform.admin_key),
                      ("/v1/batches", platform.api_key)):
        response = _post(platform, path, body, key)
        assert response.status_code == 413, (path, response.text)
        assert response.json()["error"]["code"] == "request_too_large"


def test_a_seed_the_bus_cannot_carry_is_a_400_not_a_retryable_503(platform: Platform) -> None:
    """And it holds no quota: a tenant allowed one request at a time is refused nothing after it."""
    tenant = "t-" + secrets.token_hex(4)
    with platform.admin() as admin:
        assert admin.post("/tenants", json={"id": tenant, "limits": {"max_concurrent": 1}}).status_code == 201
        key = admin.post(f"/tenants/{tenant}/keys", json={"name": "seed"}).json()["secret"]
    client = openai.OpenAI(base_url=platform.base_url, api_key=key, max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "hi"}]
    for _ in range(2):
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=MODEL, messages=messages, seed=2**70)  # type: ignore[arg-type]
        assert raised.value.status_code == 400 and raised.value.body["param"] == "seed"  # type: ignore[index]
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, seed=7)  # type: ignore[arg-type]


def test_a_batch_line_the_bus_cannot_carry_ends_the_batch_with_a_clear_error(
    platform: Platform, tmp_path: Path
) -> None:
    """Once, such a line was published ~7 times a second forever and the batch never finished."""
    client = platform.client(timeout=30)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 4,
                       **({"seed": 2**70} if i == 1 else {})}} for i in range(3)]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    file_id = client.files.create(file=("input.jsonl", data), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 30
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "failed" and batch.errors and batch.errors.data
    error = batch.errors.data[0]
    assert (error.line, error.param) == (2, "body.seed") and "seed" in (error.message or "")


def test_fuzzed_admin_requests_get_no_server_error_and_documented_responses(platform: Platform) -> None:
    """The admin document with the admin key (last: it creates and deletes tenants at random)."""
    fuzz(platform.stack.gateway_url + "/admin/openapi.json", {"authorization": f"Bearer {platform.admin_key}"})
