"""The deployment survives a node's or a zone's loss: NATS as a 3-node cluster with routes and
JetStream R3, Redis with Sentinel failover, every stateful and serving part spread by zone and
kept from sharing a host, disruption budgets that let drains take one at a time, and gateways and
workers that know their zone (the router's zone preference)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
ZONE = "topology.kubernetes.io/zone"


def objects() -> dict[tuple[str, str], dict]:
    found = {}
    for path in K8S.rglob("*.yaml"):
        if path.name == "kustomization.yaml" or path.name.endswith("-patch.yaml"):
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


@pytest.mark.slow
def test_nats_is_a_three_node_cluster_with_authenticated_routes_and_r3() -> None:
    nats = objects()[("StatefulSet", "nats")]
    assert nats["spec"]["replicas"] == 3 and nats["spec"]["podManagementPolicy"] == "Parallel"
    container = nats["spec"]["template"]["spec"]["containers"][0]
    routes = container["args"][container["args"].index("--routes") + 1].split(",")
    assert routes == [f"nats://route:$(NATS_ROUTE_PASSWORD)@nats-{i}.nats-headless:6222" for i in range(3)]
    assert {"name": "cluster", "containerPort": 6222} in container["ports"]
    conf = (K8S / "base" / "nats.conf").read_text()
    assert "cluster {" in conf and "user: route" in conf and "listen: 0.0.0.0:6222" in conf
    config = objects()[("ConfigMap", "inferbus-config")]["data"]
    assert config["INFERBUS_JS_REPLICAS"] == "3"
    assert config["NATS_URL"].split(",") == [f"nats://nats-{i}.nats-headless:4222" for i in range(3)]


@pytest.mark.slow
def test_redis_fails_over_under_three_sentinels() -> None:
    found = objects()
    redis = found[("StatefulSet", "redis")]
    assert redis["spec"]["replicas"] == 3
    containers = {c["name"] for c in redis["spec"]["template"]["spec"]["containers"]}
    assert containers == {"redis", "sentinel"}
    sentinel = found[("ConfigMap", "redis-scripts")]["data"]["sentinel.sh"]
    assert "sentinel monitor inferbus $primary 6379 2" in sentinel  # quorum 2 of 3
    assert ("Deployment", "redis") not in found


def test_every_part_is_spread_by_zone_and_drains_one_at_a_time() -> None:
    found = objects()
    for kind, name in (("StatefulSet", "nats"), ("StatefulSet", "redis"), ("Deployment", "gateway"),
                       ("Deployment", "router"), ("Deployment", "worker")):
        spec = found[(kind, name)]["spec"]["template"]["spec"]
        spread = [c for c in spec.get("topologySpreadConstraints", []) if c["topologyKey"] == ZONE]
        assert spread and spread[0]["maxSkew"] == 1 and spread[0]["whenUnsatisfiable"] == "DoNotSchedule", name
        assert spread[0]["labelSelector"]["matchLabels"]["app.kubernetes.io/name"] == name
        budget = found[("PodDisruptionBudget", name)]["spec"]
        assert budget.get("maxUnavailable") == 1 or budget.get("minAvailable"), name
    for name in ("nats", "redis"):  # stateful: never two replicas on one host
        anti = found[("StatefulSet", name)]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == "kubernetes.io/hostname"


def _render(overlay: str) -> list[dict]:
    """`kubectl kustomize` of an overlay given as a kustomization's text, in which `K8S` stands for
    deploy/k8s (kustomize takes relative paths only)."""
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl not installed: kustomize rendering not checked")
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "kustomization.yaml").write_text(overlay.replace("K8S", os.path.relpath(K8S, directory)))
        out = subprocess.run([kubectl, "kustomize", directory], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


OVERLAYS = {
    "production": ("inferbus", "resources: [K8S]\n", ("gateway", "worker")),
    "staging": ("inferbus-staging", "resources: [K8S/staging]\n", ("gateway", "worker-sim")),
    "per-pod-identities": (
        "inferbus",
        "resources: [K8S]\ncomponents: [K8S/per-pod-identities]\n",
        ("gateway", "worker"),
    ),
}
KUSTOMIZATION = "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"


@pytest.mark.slow
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_gateways_and_workers_learn_their_nodes_zone(overlay: str) -> None:
    """The Downward API cannot read node labels: a `zone` init container reads the node's zone from
    the Kubernetes API, with a ServiceAccount that may only get nodes and a token only it holds, and
    writes it where the service reads INFERBUS_ZONE_FILE."""
    namespace, text, deployments = OVERLAYS[overlay]
    docs = _render(KUSTOMIZATION + text)
    found = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    bindings = [d for d in docs if d["kind"] == "ClusterRoleBinding" and d["roleRef"]["name"] == "inferbus-node-zone"]
    assert len(bindings) == 1
    assert found[("ClusterRole", "inferbus-node-zone")]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    bound = {(s["namespace"], s["name"]) for s in bindings[0]["subjects"] if s["kind"] == "ServiceAccount"}
    for name in deployments:
        spec = found[("Deployment", name)]["spec"]["template"]["spec"]
        assert (namespace, spec["serviceAccountName"]) in bound, (overlay, name)
        assert spec["automountServiceAccountToken"] is False, name  # no API token in the service's container
        zone = spec["initContainers"][0]
        assert zone["name"] == "zone", f"{name}: the zone is read first, before an engine loads"
        assert zone["args"][:2] == ["node-zone", "--out"]
        out = Path(zone["args"][2])
        node = {e["name"]: e for e in zone["env"]}["NODE_NAME"]
        assert node["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        volumes = {v["name"]: v for v in spec["volumes"]}
        writes = {m["mountPath"]: m["name"] for m in zone["volumeMounts"]}
        assert "emptyDir" in volumes[writes[str(out.parent)]]
        api = volumes[writes["/var/run/secrets/kubernetes.io/serviceaccount"]]["projected"]["sources"]
        assert {"serviceAccountToken": {"path": "token", "expirationSeconds": 600}} in api  # the API's audience
        assert any(s.get("configMap", {}).get("name") == "kube-root-ca.crt" for s in api)
        [service] = [c for c in spec["containers"] if c["name"] in ("gateway", "worker")]
        assert {e["name"]: e.get("value") for e in service["env"]}["INFERBUS_ZONE_FILE"] == str(out)
        reads = {m["mountPath"]: m for m in service["volumeMounts"]}[str(out.parent)]
        assert reads["name"] == writes[str(out.parent)] and reads["readOnly"] is True
        token_volume = writes["/var/run/secrets/kubernetes.io/serviceaccount"]
        holders = [c["name"] for c in spec["initContainers"] + spec["containers"]
                   if any(m["name"] == token_volume for m in c.get("volumeMounts", []))]
        assert holders == ["zone"], name


@pytest.mark.slow
def test_staging_binds_its_own_accounts_under_its_own_name() -> None:
    """The binding is cluster-scoped: staging applied to the same cluster must not take production's."""
    names = {overlay: [d["metadata"]["name"] for d in _render(KUSTOMIZATION + OVERLAYS[overlay][1])
                       if d["kind"] == "ClusterRoleBinding" and d["roleRef"]["name"] == "inferbus-node-zone"]
             for overlay in ("production", "staging")}
    assert names["production"] != names["staging"]


COMPOSE = K8S.parent.parent / "docker-compose.yml"
COMPOSE_HA = K8S.parent.parent / "docker-compose.ha.yml"


def test_the_compose_ha_override_matches_the_compose_spec() -> None:
    import json

    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).resolve().parent / "schemas" / "compose-spec.json").read_text())
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft7Validator(schema).iter_errors(yaml.safe_load(COMPOSE_HA.read_text()))]
    assert not errors, "\n".join(errors)


def test_the_compose_ha_override_clusters_nats_fails_redis_over_and_zones_the_services() -> None:
    """docker-compose.ha.yml over docker-compose.yml: three NATS nodes routed to each other with the
    route user, every service of the base on all three with R3, Redis through three sentinels, and
    a gateway and a worker pair in each of two zones."""
    from inferbus.bus.auth import ROUTE_PASSWORD_ENV, new_secrets

    base = yaml.safe_load(COMPOSE.read_text())["services"]
    ha = yaml.safe_load(COMPOSE_HA.read_text())["services"]
    nodes = ("nats", "nats-b", "nats-c")
    names, route_lists = set(), []
    for node in nodes:
        command = ha[node]["command"]
        names.add(command[command.index("--name") + 1])
        route_lists.append(command[command.index("--routes") + 1].split(","))
        assert command[:2] == ["-c", "/etc/nats/nats.conf"] and "-js" in command
        mounts = ha[node]["volumes"] + (base[node]["volumes"] if node in base else [])
        assert "./deploy/k8s/base/nats.conf:/etc/nats/nats.conf:ro" in mounts
        assert "./deploy/k8s/base/nats-auth.conf:/etc/nats/nats-auth.conf:ro" in mounts
        assert ROUTE_PASSWORD_ENV in ha[node]["environment"]
    assert len(names) == 3  # JetStream places replicas by server name
    password = "${NATS_ROUTE_PASSWORD:?run: inferbus secrets --format env > .env}"
    assert all(routes == [f"nats://route:{password}@{n}:6222" for n in nodes] for routes in route_lists)
    assert ROUTE_PASSWORD_ENV in new_secrets()  # `inferbus secrets --format env > .env` gives it
    conf = (K8S / "base" / "nats.conf").read_text()
    assert "user: route" in conf and "password: $NATS_ROUTE_PASSWORD" in conf and 'include "nats-auth.conf"' in conf

    sentinel = [n for n in ha if n.startswith("sentinel-")]
    assert len(sentinel) == 3
    for name in sentinel:
        script = ha[name]["command"][0]
        assert "sentinel monitor inferbus redis 6379 2" in script and ha[name]["networks"] == ["store"]
    replica = ha["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1:replica.index("--replicaof") + 3] == ["redis", "6379"]
    redis_url = "redis+sentinel://:${REDIS_PASSWORD:?run: inferbus secrets --format env > .env}@" + \
        ",".join(f"{s}:26379" for s in sorted(sentinel)) + "/inferbus/0"

    services = {**{n: s for n, s in base.items() if n not in ("nats", "redis")}, "gateway-b": ha["gateway-b"]}
    zones = {}
    for name, service in services.items():
        env = {**service.get("environment", {}), **ha.get(name, {}).get("environment", {})}
        if "NATS_USER" in env:  # a service on the bus (the engines get NATS_URL with the shared env, unused)
            assert sorted(env["NATS_URL"].split(",")) == sorted(f"nats://{n}:4222" for n in nodes), name
            assert env["INFERBUS_JS_REPLICAS"] == "3", name
        if "REDIS_URL" in env:
            assert env["REDIS_URL"] == redis_url, name
        if env.get("INFERBUS_ZONE"):
            zones[name] = env["INFERBUS_ZONE"]
    assert {zones["gateway"], zones["gateway-b"]} == {"a", "b"}
    assert {zones["worker-1"], zones["worker-2"]} == {"a", "b"}
    assert ha["gateway-b"]["networks"] == base["gateway"]["networks"]
