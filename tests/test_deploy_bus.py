"""The deployment's closed bus: the checked-in NATS users and permissions are the code's, a real
nats-server accepts them and refuses anonymous clients, and every service in deploy/ and
docker-compose.yml connects with its own identity from the Secret (NetworkPolicies in front)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import nats
import pytest

from inferbus.bus.auth import (
    DEPLOYMENT_ROLES,
    REDIS_PASSWORD_ENV,
    ROUTE_PASSWORD_ENV,
    deployment_auth_config,
    new_password,
    new_secrets,
    password_env,
)
from inferbus.bus.connection import BusSettings
from inferbus.local.ports import free_port
from inferbus.local.probes import http_ok
from inferbus.local.servers import nats_server_binary

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
AUTH = K8S / "base" / "nats-auth.conf"
SECRET = "inferbus-bus"
# The inferbus services, the NATS identity each runs as, and whether it uses Redis.
SERVICES = {"gateway": ("gateway", True), "billing": ("billing", True), "batch": ("batch", True),
            "router": ("router", False), "autoscaler": ("autoscaler", False), "worker": ("worker", False)}


def test_the_checked_in_permissions_are_the_codes() -> None:
    assert AUTH.read_text() == deployment_auth_config(), (
        "regenerate: inferbus bus-config > deploy/k8s/base/nats-auth.conf"
    )


@pytest.mark.slow
def test_the_deployment_config_is_valid_only_with_every_password() -> None:
    secrets = new_secrets()
    env = {**os.environ, **secrets, "POD_NAME": "nats-0"}
    check = [nats_server_binary(), "-c", str(K8S / "base" / "nats.conf"), "-t"]
    assert subprocess.run(check, env=env, capture_output=True).returncode == 0
    del env[password_env("worker")]
    refused = subprocess.run(check, env=env, capture_output=True, text=True)
    assert refused.returncode != 0 and password_env("worker") in refused.stdout + refused.stderr


@pytest.mark.slow
def test_a_nats_server_with_the_deployments_users_closes_the_bus(tmp_path: Path) -> None:
    secrets = new_secrets()
    port, monitor = free_port(), free_port()
    shutil.copy(AUTH, tmp_path / "nats-auth.conf")
    (tmp_path / "nats.conf").write_text(f'listen: "127.0.0.1:{port}"\nhttp: "127.0.0.1:{monitor}"\n'
                                        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\ninclude "nats-auth.conf"\n')
    server = subprocess.Popen([nats_server_binary(), "-c", str(tmp_path / "nats.conf")], env={**os.environ, **secrets},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not http_ok(f"http://127.0.0.1:{monitor}/healthz"):
            assert time.monotonic() < deadline and server.poll() is None, "nats-server did not start"
            time.sleep(0.05)
        url = f"nats://127.0.0.1:{port}"

        async def run() -> list[str]:
            with pytest.raises(Exception):  # noqa: B017 (nats.py raises several kinds)
                await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0)
            errors: list[str] = []

            async def on_error(error: Exception) -> None:
                errors.append(str(error))

            worker = BusSettings(user="worker", password=secrets[password_env("worker")])
            nc = await nats.connect(url, error_cb=on_error, allow_reconnect=False, **worker.options(url))  # type: ignore[arg-type]
            await nc.subscribe("inferbus.tok.>")
            await nc.publish("inferbus.metrics.w1", b"{}")  # allowed: its load report
            await nc.flush()
            await asyncio.sleep(0.2)
            await nc.close()
            return errors

        errors = asyncio.run(run())
        assert len(errors) == 1 and "subscription" in errors[0].lower() and "inferbus.tok.>" in errors[0]
    finally:
        server.terminate()
        server.wait()


def _manifests() -> list[Path]:
    """Whole manifests (patches, `*-patch.yaml`, are partial objects)."""
    return sorted(
        p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml" and not p.name.endswith("-patch.yaml")
    )


def _containers() -> list[tuple[Path, dict]]:
    found = []
    for path in _manifests():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in ("Deployment", "StatefulSet"):
                for container in doc["spec"]["template"]["spec"]["containers"]:
                    found.append((path, container))
    return found


def _secret_key(entry: dict) -> str | None:
    ref = entry.get("valueFrom", {}).get("secretKeyRef", {})
    return ref.get("key") if ref.get("name") == SECRET else None


@pytest.mark.slow
def test_every_k8s_service_connects_as_its_own_identity() -> None:
    seen = set()
    for path, container in _containers():
        args = container.get("args") or []
        if not args or args[0] not in SERVICES:
            continue
        user, uses_redis = SERVICES[args[0]]
        env = {e["name"]: e for e in container.get("env", [])}
        assert env["NATS_USER"]["value"] == user, path
        assert _secret_key(env["NATS_PASSWORD"]) == password_env(user), path
        if uses_redis:
            assert _secret_key(env["REDIS_PASSWORD"]) == REDIS_PASSWORD_ENV, path
            # Through the sentinels, which find the primary (deploy/k8s/base/redis.yaml).
            assert env["REDIS_URL"]["value"].startswith("redis+sentinel://:$(REDIS_PASSWORD)@"), path
        seen.add(args[0])
    assert seen == set(SERVICES)
    config = yaml.safe_load((K8S / "base" / "configmap.yaml").read_text())["data"]
    assert "REDIS_URL" not in config, "a Redis URL without its password would be used by any service that has none"


@pytest.mark.slow
def test_nats_and_redis_take_their_passwords_from_the_secret() -> None:
    by_name = {c["name"]: c for _, c in _containers()}
    nats_env = {_secret_key(e) for e in by_name["nats"]["env"]}
    assert {password_env(user) for user, _, _ in DEPLOYMENT_ROLES} | {ROUTE_PASSWORD_ENV} <= nats_env
    for name in ("redis", "sentinel"):  # each Redis pod: the data node and its sentinel
        assert REDIS_PASSWORD_ENV in {_secret_key(e) for e in by_name[name]["env"]}, name
    scripts = next(d for d in yaml.safe_load_all((K8S / "base" / "redis.yaml").read_text())
                   if d["kind"] == "ConfigMap")["data"]
    assert '--requirepass "$REDIS_PASSWORD" --masterauth "$REDIS_PASSWORD"' in scripts["redis.sh"]
    assert "requirepass $REDIS_PASSWORD" in scripts["sentinel.sh"]
    assert "sentinel auth-pass inferbus $REDIS_PASSWORD" in scripts["sentinel.sh"]
    assert "password: $NATS_ROUTE_PASSWORD" in (K8S / "base" / "nats.conf").read_text()  # routes need it too


def test_network_policies_admit_only_the_services_that_use_nats_and_redis() -> None:
    policies = {d["metadata"]["name"]: d for d in yaml.safe_load_all((K8S / "base" / "networkpolicy.yaml").read_text())}

    def clients(name: str, port: int) -> set[str]:
        rule = next(r for r in policies[name]["spec"]["ingress"] if port in {p["port"] for p in r["ports"]}
                    and "matchExpressions" in r.get("from", [{}])[0].get("podSelector", {}))
        expression = rule["from"][0]["podSelector"]["matchExpressions"][0]
        assert expression["key"] == "app.kubernetes.io/name" and expression["operator"] == "In"
        return set(expression["values"])

    assert clients("nats-clients", 4222) == {
        "gateway",
        "router",
        "billing",
        "batch",
        "autoscaler",
        "worker",
        "worker-sim",
    }
    assert clients("redis-clients", 6379) == {"gateway", "billing", "batch"}
    # NATS's monitoring port (users, subscriptions, consumers; no authentication) is open to no pod.
    admitted_ports = {p["port"] for rule in policies["nats-clients"]["spec"]["ingress"] for p in rule["ports"]}
    assert admitted_ports == {4222, 6222}
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert "networkpolicy.yaml" in kustomization["resources"]


def test_compose_services_connect_with_their_own_identity() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    for name, service in compose.items():
        command = service.get("command") or []
        if not command or command[0] not in SERVICES:
            continue
        user, uses_redis = SERVICES[command[0]]
        env = service["environment"]
        assert env["NATS_USER"] == user and env["NATS_PASSWORD"].startswith(f"${{{password_env(user)}:?"), name
        assert ("store" in service["networks"]) == uses_redis, name
        if uses_redis:
            assert env["REDIS_URL"].startswith(f"redis://:${{{REDIS_PASSWORD_ENV}:?"), name
    assert compose["nats"]["networks"] == ["bus"] and compose["redis"]["networks"] == ["store"]
    assert "--requirepass" in compose["redis"]["command"]


@pytest.mark.slow
def test_no_pod_can_read_another_identitys_password() -> None:
    """What the role-wide identities rest on (docs/security.md): a pod gets its own role's password
    as one Secret key, never the whole Secret (a volume, envFrom or a projected volume would give
    every pod every identity's password). Only nats-server itself reads all of them."""
    for path in _manifests():
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") not in ("Deployment", "StatefulSet"):
                continue
            spec = doc["spec"]["template"]["spec"]
            for volume in spec.get("volumes", []):
                assert volume.get("secret", {}).get("secretName") != SECRET, (path, volume)
                sources = volume.get("projected", {}).get("sources", [])
                assert all(s.get("secret", {}).get("name") != SECRET for s in sources), (path, volume)
            for container in spec["containers"] + spec.get("initContainers", []):
                assert all(e.get("secretRef", {}).get("name") != SECRET for e in container.get("envFrom", [])), path
                if container["name"] == "nats":
                    continue
                keys = {_secret_key(e) for e in container.get("env", [])} - {None}
                own = {password_env(e["value"]) for e in container.get("env", []) if e["name"] == "NATS_USER"}
                assert keys <= own | {REDIS_PASSWORD_ENV}, (path, container["name"], keys)


PER_POD = K8S / "per-pod-identities"


@pytest.mark.slow
def test_per_pod_identities_patch_every_service_onto_its_own_token() -> None:
    """The per-pod-identities component: every Deployment of a service on the bus is patched to run
    as the ServiceAccount of its role (as `inferbus auth-callout` maps them), with a projected
    token for the callout's audience instead of a password, its pod name as its NATS user, and as
    its gateway or batch service id (the scope of its permissions)."""
    from inferbus.bus.callout import ROLE_BY_SERVICE_ACCOUNT
    from services.auth_callout.settings import AuthCalloutSettings

    component = yaml.safe_load((PER_POD / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    patches = {p["target"]["name"]: PER_POD / p["path"] for p in component["patches"]}
    accounts = {d["metadata"]["name"] for path in _manifests() for d in yaml.safe_load_all(path.read_text())
                if d and d.get("kind") == "ServiceAccount"}
    services = {doc["metadata"]["name"]: doc for path in _manifests() for doc in yaml.safe_load_all(path.read_text())
                if doc and doc.get("kind") == "Deployment"
                and (doc["spec"]["template"]["spec"]["containers"][0].get("args") or [""])[0] in SERVICES}
    assert set(services) <= set(patches), set(services) - set(patches)
    for name, deployment in services.items():
        base_spec = deployment["spec"]["template"]["spec"]
        container = base_spec["containers"][0]
        role = SERVICES[container["args"][0]][0]
        patch = yaml.safe_load(patches[name].read_text())
        spec = patch["spec"]["template"]["spec"]
        account = spec.get("serviceAccountName", base_spec.get("serviceAccountName"))
        assert account in accounts and ROLE_BY_SERVICE_ACCOUNT[account] == role, (name, account)
        [patched] = [c for c in spec["containers"] if c["name"] == container["name"]]
        env = {e["name"]: e for e in patched["env"]}
        assert env["NATS_PASSWORD"].get("$patch") == "delete", name
        assert (
            env["NATS_USER"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            and env["NATS_USER"]["value"] is None
        )
        # (The batch service keeps its stable id, the callout's fixed scope for it.)
        scope_env = {"gateway": "INFERBUS_GATEWAY_ID", "worker": "INFERBUS_WORKER_ID"}.get(role)
        if scope_env is not None:  # the worker's is the pod name already
            source = env.get(scope_env) or {e["name"]: e for e in container["env"]}[scope_env]
            assert source["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", (name, scope_env)
        [volume] = [v for v in spec["volumes"] if v["name"] == "nats-token"]
        token = volume["projected"]["sources"][0]["serviceAccountToken"]
        assert token["audience"] == AuthCalloutSettings().audience
        [mount] = [m for m in patched["volumeMounts"] if m["name"] == "nats-token"]
        assert env["NATS_TOKEN_FILE"]["value"] == f"{mount['mountPath']}/{token['path']}"
    nats_env = {e["name"] for e in yaml.safe_load((PER_POD / "nats-patch.yaml").read_text())
                ["spec"]["template"]["spec"]["containers"][0]["env"]}
    config = (PER_POD / "nats-auth.conf").read_text()
    referenced = set(re.findall(r"password: \$([A-Z_]+)|issuer: \$([A-Z_]+)", config))
    assert {n for pair in referenced for n in pair if n} <= nats_env | {"NATS_PASSWORD_OPS"}, referenced


@pytest.mark.slow
def test_the_per_pod_nats_config_is_valid_with_its_secrets(tmp_path: Path) -> None:
    import nkeys

    from inferbus.bus.callout import new_account_seed

    shutil.copy(PER_POD / "nats-auth.conf", tmp_path / "nats-auth.conf")
    shutil.copy(K8S / "base" / "nats.conf", tmp_path / "nats.conf")
    env = {**os.environ, "INFERBUS_CALLOUT_ISSUER": nkeys.from_seed(new_account_seed()).public_key.decode(),
           "NATS_PASSWORD_AUTH": new_password(), "NATS_PASSWORD_OPS": new_password(),
           # The base StatefulSet's env, which the component's patch merges into by name.
           ROUTE_PASSWORD_ENV: new_password()}
    check = [nats_server_binary(), "-c", str(tmp_path / "nats.conf"), "-t"]
    result = subprocess.run(check, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    del env["INFERBUS_CALLOUT_ISSUER"]
    assert subprocess.run(check, env=env, capture_output=True).returncode != 0
