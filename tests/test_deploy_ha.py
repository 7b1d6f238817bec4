"""The deployment survives a node's or a zone's loss: NATS as a 3-node cluster with routes and
JetStream R3, Redis with Sentinel failover, every stateful and serving part spread by zone and
kept from sharing a host, and disruption budgets that let drains take one at a time."""

from __future__ import annotations

from pathlib import Path

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
