"""The OpenAPI documents, built from the app's routes and typed models (no platform needed)."""

from __future__ import annotations

import pytest

from services.gateway import batches_api, openapi
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings


def test_the_public_document_has_every_endpoint_with_its_body_and_no_admin_route() -> None:
    api = create_app(GatewaySettings(admin_key="k")).api
    doc = api.openapi()
    assert doc["openapi"].startswith("3.")
    documented = {(method, path) for path, item in doc["paths"].items() for method in item}
    assert documented == set(openapi.PUBLIC)
    for method, path in documented:
        operation = doc["paths"][path][method]
        assert operation["responses"] and "422" not in operation["responses"]
        for status, response in operation["responses"].items():
            if int(status) >= 400:
                assert response["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    upload = doc["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert upload["properties"]["file"] == {"type": "string", "format": "binary"}
    assert doc["paths"]["/health"]["get"].get("security") is None and chat["security"] == [{"bearer": []}]


def test_the_batch_body_in_the_document_matches_what_the_endpoint_accepts() -> None:
    schema = create_app(GatewaySettings()).api.openapi()["components"]["schemas"]["CreateBatchRequest"]
    assert sorted(schema["properties"]["endpoint"]["enum"]) == sorted(batches_api.BATCH_ENDPOINTS)
    assert schema["properties"]["completion_window"]["enum"] == list(batches_api.COMPLETION_WINDOWS)
    metadata = next(o for o in schema["properties"]["metadata"]["anyOf"] if o.get("type") == "object")
    assert metadata["maxProperties"] == batches_api.MAX_METADATA_PAIRS
    assert set(schema["required"]) == {"input_file_id", "endpoint", "completion_window"}


def test_the_admin_document_has_the_admin_routes_only_when_they_are_mounted() -> None:
    with_key = openapi.admin_document(create_app(GatewaySettings(admin_key="k")).api)
    assert {(m, p) for p, item in with_key["paths"].items() for m in item} == set(openapi.ADMIN)
    assert with_key["paths"]["/admin/v1/tenants"]["post"]["requestBody"]["content"]["application/json"]
    assert openapi.admin_document(create_app(GatewaySettings()).api)["paths"] == {}


@pytest.mark.slow
def test_the_bulk_adapter_body_in_the_document_matches_the_endpoints_limit() -> None:
    from services.gateway import admin_adapters

    doc = openapi.admin_document(create_app(GatewaySettings(admin_key="k")).api)
    schema = doc["components"]["schemas"]["NewAdapters"]["properties"]["adapters"]
    assert (schema["minItems"], schema["maxItems"]) == (1, admin_adapters.BULK_LIMIT)
