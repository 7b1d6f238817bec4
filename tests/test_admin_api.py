"""The admin API and `inferbus tenants|keys`, against the running platform (a real gateway process)."""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest
from click.testing import CliRunner

from inferbus.local.ports import free_port
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from tools.commands.main import main

from .conftest import Platform

pytestmark = pytest.mark.e2e


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"  # the platform is shared by the whole session


def _error(response: httpx.Response, status: int, code: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code and error["param"] == param, error
    return error


def _refused_within(client: openai.OpenAI, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            client.models.list()
        except openai.AuthenticationError:
            return
        assert time.monotonic() < deadline, "a revoked key still works after the key cache TTL"
        time.sleep(0.1)


def test_admin_api_needs_the_admin_key(platform: Platform) -> None:
    url = platform.stack.gateway_url + "/admin/v1/tenants"
    _error(httpx.get(url), 401, "missing_api_key")
    _error(httpx.get(url, headers={"authorization": "Bearer ib-admin-wrong"}), 401, "invalid_api_key")
    # A tenant's key is no admin key, and the admin key is no tenant key.
    _error(httpx.get(url, headers={"authorization": f"Bearer {platform.api_key}"}), 401, "invalid_api_key")
    _error(httpx.post(url, json={"id": _id("sneaky")}, headers={"authorization": f"Bearer {platform.api_key}"}),
           401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=platform.base_url, api_key=platform.admin_key, max_retries=0).models.list()
    with platform.admin() as admin:
        assert admin.get("/tenants").status_code == 200


async def test_without_an_admin_key_the_admin_api_does_not_exist() -> None:
    app = create_app(GatewaySettings(admin_key=""))  # routing only: no lifespan, no connections
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        for method, path in (("GET", "/admin/v1/tenants"), ("POST", "/admin/v1/tenants"),
                             ("DELETE", "/admin/v1/tenants/demo/keys/key_1")):
            response = await http.request(method, path, headers={"authorization": "Bearer "})
            _error(response, 404, "unknown_url")


def test_tenant_crud_round_trip(platform: Platform) -> None:
    tenant_id = _id("acme")
    with platform.admin() as admin:
        created = admin.post("/tenants", json={"id": tenant_id, "name": "Acme", "band": "premium", "weight": 2,
                                               "limits": {"requests_per_minute": 100, "monthly_budget_usd": 50}})
        assert created.status_code == 201, created.text
        body = created.json()
        assert body["limits"] == {"requests_per_minute": 100, "input_tokens_per_minute": None,
                                  "output_tokens_per_minute": None, "max_concurrent": None, "monthly_budget_usd": 50.0}
        assert body["models"] == ["*"] and body["adapters"] == [] and body["disabled"] is False

        assert admin.get(f"/tenants/{tenant_id}").json() == body
        listed = admin.get("/tenants").json()
        assert listed["object"] == "list" and body in listed["data"]
        assert "demo" in [t["id"] for t in listed["data"]]  # made by start_platform, like `inferbus up`

        patched = admin.patch(f"/tenants/{tenant_id}", json={"limits": {"max_concurrent": 8}, "disabled": True})
        assert patched.status_code == 200, patched.text
        limits = patched.json()["limits"]
        assert limits["max_concurrent"] == 8 and limits["requests_per_minute"] == 100
        assert patched.json()["disabled"] is True and patched.json()["band"] == "premium"
        assert admin.get(f"/tenants/{tenant_id}").json() == patched.json()

        assert admin.delete(f"/tenants/{tenant_id}").json() == {"id": tenant_id, "deleted": True}
        _error(admin.get(f"/tenants/{tenant_id}"), 404, "tenant_not_found")
        assert tenant_id not in [t["id"] for t in admin.get("/tenants").json()["data"]]


def test_admin_errors_in_the_openai_format(platform: Platform) -> None:
    tenant_id = _id("err")
    with platform.admin() as admin:
        assert admin.post("/tenants", json={"id": tenant_id}).status_code == 201
        _error(admin.post("/tenants", json={"id": tenant_id}), 409, "tenant_exists", "id")
        _error(admin.post("/tenants", json={"id": "Bad Id"}), 400, "invalid_value", "id")
        _error(admin.post("/tenants", json={"id": _id("x"), "limits": {"requests_per_minute": -1}}),
               400, "invalid_value", "limits.requests_per_minute")
        _error(admin.post("/tenants", json={"id": _id("x"), "bnad": "premium"}), 400, "invalid_value", "bnad")
        _error(admin.post("/tenants", content=b"{not json"), 400, "invalid_json")
        _error(admin.patch(f"/tenants/{tenant_id}", json={"band": "gold"}), 400, "invalid_value", "band")
        _error(admin.patch(f"/tenants/{tenant_id}", json=[1]), 400, "invalid_value")
        _error(admin.post(f"/tenants/{tenant_id}/keys", json={"name": 7}), 400, "invalid_value", "name")
        for method, path in (("GET", "/tenants/nobody"), ("PATCH", "/tenants/nobody"), ("DELETE", "/tenants/nobody"),
                             ("POST", "/tenants/nobody/keys"), ("GET", "/tenants/nobody/keys"),
                             ("DELETE", "/tenants/nobody/keys/key_1")):
            _error(admin.request(method, path, json={}), 404, "tenant_not_found")
        _error(admin.delete(f"/tenants/{tenant_id}/keys/key_0123456789abcdef"), 404, "key_not_found")
        admin.delete(f"/tenants/{tenant_id}")


def test_a_key_made_through_the_api_works_with_the_sdk_until_revoked(platform: Platform) -> None:
    tenant_id = _id("sdk")
    with platform.admin() as admin:
        admin.post("/tenants", json={"id": tenant_id}).raise_for_status()
        made = admin.post(f"/tenants/{tenant_id}/keys", json={"name": "ci"})
        assert made.status_code == 201, made.text
        issued = made.json()
        assert issued["secret"].startswith("ib-") and issued["id"].startswith("key_") and issued["name"] == "ci"
        listed = admin.get(f"/tenants/{tenant_id}/keys").json()["data"]
        assert listed == [{"id": issued["id"], "name": "ci", "created": issued["created"],
                           "last4": issued["secret"][-4:], "last_used": None}]

        client = openai.OpenAI(base_url=platform.base_url, api_key=issued["secret"], max_retries=0)
        assert [m.id for m in client.models.list()] == [platform.stack.config.model]
        assert admin.delete(f"/tenants/{tenant_id}/keys/{issued['id']}").json() == {"id": issued["id"], "deleted": True}
        _refused_within(client, 3)  # INFERBUS_KEY_CACHE_TTL_S is 1 s on the test platform
        assert admin.get(f"/tenants/{tenant_id}/keys").json()["data"] == []

        # Deleting a tenant revokes its keys too.
        other = admin.post(f"/tenants/{tenant_id}/keys", json={}).json()
        client = openai.OpenAI(base_url=platform.base_url, api_key=other["secret"], max_retries=0)
        client.models.list()
        admin.delete(f"/tenants/{tenant_id}").raise_for_status()
        _refused_within(client, 3)


def test_cli_manages_tenants_and_keys(platform: Platform) -> None:
    runner = CliRunner()
    env = {"INFERBUS_URL": platform.stack.gateway_url, "INFERBUS_ADMIN_KEY": platform.admin_key}
    tenant_id = _id("cli")

    def run(*args: str, code: int = 0) -> str:
        result = runner.invoke(main, list(args), env=env)
        assert result.exit_code == code, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        return result.output

    run("tenants", "create", tenant_id, "--name", "CLI Corp", "--band", "premium", "--rpm", "120",
        "--budget-usd", "25", "--models", "a, b", "--weight", "3")
    table = run("tenants", "list")
    assert "INPUT TPM" in table.splitlines()[0]
    row = next(line for line in table.splitlines() if line.startswith(tenant_id))
    assert row.split()[:5] == [tenant_id, "CLI", "Corp", "premium", "3"] and "$25.00" in row and "a,b" in row
    shown = run("tenants", "show", tenant_id)
    assert "rpm:" in shown and "120" in shown and "max-concurrent: unlimited" in shown
    run("tenants", "update", tenant_id, "--rpm", "unlimited", "--max-concurrent", "2")
    with platform.admin() as admin:
        limits = admin.get(f"/tenants/{tenant_id}").json()["limits"]
    assert limits["requests_per_minute"] is None and limits["max_concurrent"] == 2
    assert "already exists" in run("tenants", "create", tenant_id, code=1)
    assert "Traceback" not in run("tenants", "create", "Bad_Id", code=1)

    result = runner.invoke(main, ["keys", "create", "--tenant", tenant_id, "--name", "laptop"], env=env)
    assert result.exit_code == 0, result.output
    secret = result.stdout.strip()
    assert secret.startswith("ib-") and "\n" not in secret
    assert "not shown again" in result.stderr
    client = openai.OpenAI(base_url=platform.base_url, api_key=secret, max_retries=0)
    client.models.list()
    listing = run("keys", "list", "--tenant", tenant_id)
    assert "laptop" in listing and secret[-4:] in listing and secret not in listing
    key_id = listing.splitlines()[1].split()[0]
    assert key_id.startswith("key_")
    assert "Revoked" in run("keys", "revoke", "--tenant", tenant_id, key_id)
    _refused_within(client, 3)
    assert "not found" in run("keys", "revoke", "--tenant", tenant_id, key_id, code=1)

    assert "Aborted" in runner.invoke(main, ["tenants", "delete", tenant_id], env=env, input="n\n").output
    run("tenants", "delete", tenant_id, "--yes")
    assert "not found" in run("tenants", "show", tenant_id, code=1)


def test_cli_explains_what_went_wrong(platform: Platform) -> None:
    runner = CliRunner()
    url = platform.stack.gateway_url

    def fails(args: list[str], env: dict[str, str]) -> str:
        result = runner.invoke(main, args, env=env)
        assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
        assert "Traceback" not in result.output
        return result.output

    assert "refused the admin key" in fails(["tenants", "list"], {"INFERBUS_URL": url, "INFERBUS_ADMIN_KEY": "nope"})
    assert "no admin key" in fails(["tenants", "list", "--url", url], {"INFERBUS_ADMIN_KEY": ""})
    dead = f"http://127.0.0.1:{free_port()}"
    unreachable = fails(["keys", "list", "--tenant", "demo", "--url", dead, "--admin-key", "k"], {})
    assert "cannot reach the gateway" in unreachable
    assert "nothing to change" in fails(["tenants", "update", "demo"], {"INFERBUS_URL": url, "INFERBUS_ADMIN_KEY": "k"})
    assert "--rpm" in fails(["tenants", "create", "x", "--rpm", "-5"], {"INFERBUS_ADMIN_KEY": "k"})
