"""The Redis StatefulSet's bootstrap scripts (deploy/k8s/base/redis.yaml, ConfigMap redis-scripts),
run as its pods run them: three pods started at once, each a redis-server and a sentinel from the
scripts, under the pods' DNS names; then the primary's pod dies, the sentinels promote a replica,
and the pod comes back, and must rejoin as a replica of the new primary (not as a second primary).

Each pod is its own network namespace (a bridge between them, as a cluster network has it) with
the ports of the manifest, and the pods' names (`redis-0.redis-headless`,
`redis-0.redis-headless.inferbus.svc.cluster.local`, …) resolve to their addresses through a
/etc/hosts seen by these processes only (a private mount namespace): all inside a user namespace
of the test's own (`unshare`), nothing on the machine changes. The scripts, their environment and
their files' modes are taken from the manifest as kubelet would mount them."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from .podnet import PodNetwork

pytestmark = pytest.mark.slow

REDIS_YAML = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "base" / "redis.yaml"
NAMESPACE = "inferbus"
PASSWORD = "test-redis-password"  # noqa: S105 (a test's)
PODS = 3


def sentinel_setting(name: str) -> float:
    """A sentinel setting of sentinel.sh in seconds (`sentinel NAME inferbus MILLISECONDS`)."""
    configmap, _ = manifest()
    return int(re.search(rf"sentinel {name} inferbus (\d+)", configmap["data"]["sentinel.sh"]).group(1)) / 1000  # type: ignore[union-attr]


def fqdn(pod: int) -> str:
    return f"redis-{pod}.redis-headless.{NAMESPACE}.svc.cluster.local"


def manifest() -> tuple[dict, dict]:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(REDIS_YAML.read_text()) if d}
    return docs[("ConfigMap", "redis-scripts")], docs[("StatefulSet", "redis")]


def pod_env(statefulset: dict, container: str, pod: int, tmp: Path) -> dict[str, str]:
    """The container's environment as the manifest gives it: the Downward API and the Secret filled
    in, and its volumes' mount paths moved under `tmp` (the same variables, other directories)."""
    spec = statefulset["spec"]["template"]["spec"]
    [entry] = [c for c in spec["containers"] if c["name"] == container]
    mounts = {m["mountPath"]: m["name"] for m in entry["volumeMounts"]}
    env = {"HOME": str(tmp)}
    for var in entry["env"]:
        if "value" in var:
            value = var["value"]
            if value in mounts:  # a directory on a volume: this pod's own under tmp
                value = str(tmp / f"{mounts[value]}-{pod}")
                Path(value).mkdir(exist_ok=True)
            env[var["name"]] = value
        elif "fieldRef" in var["valueFrom"]:
            field = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = {"metadata.name": f"redis-{pod}", "metadata.namespace": NAMESPACE}[field]
        else:
            assert var["valueFrom"]["secretKeyRef"]["key"] == "REDIS_PASSWORD", var
            env[var["name"]] = PASSWORD
    return env


class Cluster:
    """The StatefulSet's three pods on a network of their own (`tests/podnet.py`)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        configmap, self.statefulset = manifest()
        spec = self.statefulset["spec"]["template"]["spec"]
        [volume] = [v for v in spec["volumes"] if v.get("configMap", {}).get("name") == "redis-scripts"]
        mode = volume["configMap"].get("defaultMode", 0o644)  # kubelet's default: not executable
        self.scripts = tmp / "scripts"
        self.scripts.mkdir()
        for name, text in configmap["data"].items():
            (self.scripts / name).write_text(text)
            (self.scripts / name).chmod(mode)
        self.network = PodNetwork(tmp, {f"redis-{i}": [fqdn(i), f"redis-{i}.redis-headless"] for i in range(PODS)})
        self.pods: set[int] = set()

    def start_pod(self, pod: int) -> None:
        """Its two containers as the manifest runs them (`/bin/sh SCRIPT`), each with its own
        environment."""
        containers = []
        for container in self.statefulset["spec"]["template"]["spec"]["containers"]:
            shell, script = container["command"]
            assert shell == "/bin/sh" and script.startswith("/scripts/"), container["command"]
            containers.append(([shell, str(self.scripts / Path(script).name)],
                               pod_env(self.statefulset, container["name"], pod, self.tmp)))
        self.network.start(f"redis-{pod}", containers)
        self.pods.add(pod)

    def kill_pod(self, pod: int) -> None:
        self.network.kill(f"redis-{pod}")
        self.pods.discard(pod)

    def cli(self, pod: int, port: int, *command: str) -> list[str]:
        out = self.network.run("redis-cli", "-h", f"redis-{pod}.redis-headless", "-p", str(port), "--no-auth-warning",
                               "-a", PASSWORD, *command)
        return out.stdout.splitlines() if out.returncode == 0 else []

    def info(self, pod: int) -> dict[str, str]:
        return dict(line.split(":", 1) for line in self.cli(pod, 6379, "info", "replication") if ":" in line)

    def primary_by_sentinel(self, pod: int) -> str:
        answer = self.cli(pod, 26379, "sentinel", "get-master-addr-by-name", "inferbus")
        return answer[0] if answer else ""

    def replicas_known(self, pod: int) -> int:
        """How many replicas, none of them down, the pod's sentinel knows."""
        answer = self.cli(pod, 26379, "sentinel", "replicas", "inferbus")
        return sum(1 for key, value in zip(answer, answer[1:], strict=False) if key == "flags" and value == "slave")

    def logs(self) -> str:
        return self.network.log_tails()

    def close(self) -> None:
        self.network.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    for tool in ("unshare", "nsenter", "ip", "redis-server", "redis-cli"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not installed")
    made = Cluster(tmp_path)
    try:
        yield made
    finally:
        made.close()


def wait_for(what: str, check, cluster: Cluster, within_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}\n{cluster.logs()}"
        time.sleep(0.25)


def test_pods_bootstrap_fail_over_and_the_old_primary_rejoins_as_a_replica(cluster: Cluster) -> None:
    for pod in range(PODS):  # podManagementPolicy: Parallel
        cluster.start_pod(pod)

    def settled(primary: int) -> bool:
        replicas = [p for p in cluster.pods if p != primary]
        return (cluster.info(primary).get("role") == "master"
                and all(cluster.info(p).get("master_link_status") == "up" for p in replicas)
                and all(cluster.primary_by_sentinel(p) == fqdn(primary) for p in cluster.pods)
                and all(len(cluster.cli(p, 26379, "sentinel", "sentinels", "inferbus")) > 0 for p in cluster.pods)
                # A sentinel learns the replicas from the primary's INFO (every 10 s): one that has
                # not yet could not promote any once the primary is gone.
                and all(cluster.replicas_known(p) == PODS - 1 for p in cluster.pods))

    wait_for("redis-0 primary, the others its replicas, every sentinel knowing them", lambda: settled(0), cluster, 30)
    assert cluster.cli(0, 6379, "set", "tenant:acme", "kept") == ["OK"]
    wait_for("the write replicated", lambda: all(cluster.cli(p, 6379, "get", "tenant:acme") == ["kept"]
                                                for p in (1, 2)), cluster, 10)
    quorum = cluster.cli(1, 26379, "sentinel", "ckquorum", "inferbus")
    assert quorum and quorum[0].startswith("OK 3 usable Sentinels"), quorum

    cluster.kill_pod(0)  # the primary's pod: node lost
    lost = time.monotonic()
    # At worst a first try finds no replica with fresh enough INFO and the next comes after twice
    # the failover timeout (see sentinel.sh).
    down_after, failover_timeout = sentinel_setting("down-after-milliseconds"), sentinel_setting("failover-timeout")
    wait_for(
        "a replica promoted by the two sentinels left",
        lambda: cluster.primary_by_sentinel(1) in (fqdn(1), fqdn(2)),
        cluster,
        down_after + 2 * failover_timeout + 5,
    )
    promoted = int(cluster.primary_by_sentinel(1).split(".")[0].removeprefix("redis-"))
    assert time.monotonic() - lost >= down_after - 1
    wait_for("the new primary takes writes", lambda: cluster.info(promoted).get("role") == "master", cluster, 10)
    assert cluster.cli(promoted, 6379, "get", "tenant:acme") == ["kept"]

    cluster.start_pod(0)  # rescheduled: same name, same volume
    wait_for("redis-0 answering", lambda: cluster.info(0), cluster, 10)
    # From its first answer: a pod that came up as a primary (the sentinels would demote it only
    # seconds later) took writes that are then lost.
    assert cluster.info(0).get("role") == "slave", "redis-0 came back as a second primary"
    wait_for("redis-0 back as a replica of the new primary, its sentinel following it",
             lambda: cluster.info(0).get("role") == "slave" and cluster.info(0).get("master_link_status") == "up"
             and cluster.primary_by_sentinel(0) == fqdn(promoted), cluster, 30)
    assert cluster.info(0).get("master_host") == fqdn(promoted)
    assert cluster.cli(promoted, 6379, "set", "tenant:acme", "after") == ["OK"]
    wait_for("redis-0 replicating the new primary", lambda: cluster.cli(0, 6379, "get", "tenant:acme") == ["after"],
             cluster, 10)
    assert [p for p in range(PODS) if cluster.info(p).get("role") == "master"] == [promoted]
