"""docker-compose.ha.yml's NATS cluster and Redis with sentinels, run as compose would run them:
the services' commands, environments (with the passwords `inferbus secrets --format env` makes)
and mounted files (the deployment's nats.conf and nats-auth.conf), each container a pod on a
network of its own under its service name (`tests/podnet.py`; the test machines have no Docker
engine). The NATS nodes must route to each other with the route user, hold a stream with three
replicas and keep taking writes with one node lost; the sentinels must promote the replica when
the primary is lost and make the returning primary a replica."""

from __future__ import annotations

import json
import re
import shutil
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from inferbus.bus.auth import new_secrets
from inferbus.local.servers import nats_server_binary  # the platform's (2.11 or later, as the image's)

from .podnet import PodNetwork

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
NODES = ("nats", "nats-b", "nats-c")
SERVER_NAMES = {
    "nats": "nats-a",
    "nats-b": "nats-b",
    "nats-c": "nats-c",
}  # their --name: zone a's is the base's service


def interpolate(value: str, variables: dict[str, str]) -> str:
    """Compose's variable interpolation for what the file uses: ${NAME:?message}, ${NAME:-default}, $$."""
    def one(match: re.Match[str]) -> str:
        name, form, rest = match.group(1), match.group(2) or "", match.group(3) or ""
        if name in variables:
            return variables[name]
        assert form == ":-", f"{name} is required and not set"
        return rest
    return re.sub(r"\$\{(\w+)(:\?|:-)?([^}]*)\}", one, value).replace("$$", "$")


def node(name: str, tmp: Path, variables: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The service's argv and environment after merging docker-compose.ha.yml over docker-compose.yml,
    its volumes' container paths replaced by the files (bind mounts) or directories (volumes) behind them."""
    base = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"].get(name, {})
    ha = yaml.safe_load((REPO / "docker-compose.ha.yml").read_text())["services"][name]
    command = ha.get("command", base.get("command"))
    env = {**base.get("environment", {}), **ha.get("environment", {})}
    mounts = {}
    for volume in base.get("volumes", []) + ha.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            mounts[target] = str(REPO / source)
        else:
            (tmp / f"{name}-{source}").mkdir()
            mounts[target] = str(tmp / f"{name}-{source}")
    for target, source in list(mounts.items()):  # a file mounted into a directory: nats.conf's include
        if target.startswith("/etc/nats/"):
            assert Path(source).parent == REPO / "deploy" / "k8s" / "base", "the includes resolve beside nats.conf"
    argv = [
        nats_server_binary(),
        *(mounts.get(interpolate(str(a), variables), interpolate(str(a), variables)) for a in command),
    ]
    return argv, {k: interpolate(str(v), variables) for k, v in env.items()}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[PodNetwork, dict[str, str]]]:
    for tool in ("unshare", "nsenter", "ip", "curl"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not installed")
    variables = new_secrets()
    network = PodNetwork(tmp_path, {name: [name] for name in NODES})
    try:
        for name in NODES:
            network.start(name, [node(name, tmp_path, variables)])
        yield network, variables
    finally:
        network.close()


def monitor(network: PodNetwork, name: str, path: str) -> dict:
    out = network.run("curl", "-sf", f"http://{name}:8222/{path}")
    return json.loads(out.stdout) if out.returncode == 0 and out.stdout else {}


def wait_for(what: str, check, network: PodNetwork, within_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}\n{network.log_tails()}"
        time.sleep(0.25)


CLIENT = textwrap.dedent('''
    import asyncio, sys
    import nats
    import nats.js.errors

    async def main(servers, user, password, stream, count):
        nc = await nats.connect(servers.split(","), user=user, password=password, connect_timeout=5)
        js = nc.jetstream()
        # JetStream is an account of its own: the clients' account reaches a stream on the subjects it
        # imports only, those of the platform's streams (a usage subject here).
        subject = "inferbus.usage." + stream
        if count == 0:
            # Just after the meta leader's election its answer can be lost while routes settle
            # (duplicate routes closing): asked again, the same config is answered with the stream.
            for attempt in range(10):
                try:
                    await js.add_stream(name=stream, subjects=[subject + ".>"], num_replicas=3)
                    break
                except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                    await asyncio.sleep(0.5)
            else:
                raise SystemExit("the stream was not made")
        for i in range(max(count, 1)):
            # While the stream elects a leader (just made, or its leader's node lost) nobody
            # answers: retried with the same message id, as the services do.
            for attempt in range(60):
                try:
                    await js.publish(subject + ".x", b"event", timeout=2, headers={"Nats-Msg-Id": f"{count}-{i}"})
                    break
                except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError, nats.errors.TimeoutError):
                    await asyncio.sleep(0.25)
                except nats.js.errors.APIError as error:
                    if error.err_code != 10158:  # "duplicate message id is in process": an earlier try is
                        raise                    # still being replicated; asking again gets its answer
                    await asyncio.sleep(0.25)
            else:
                raise SystemExit("no acknowledgement")
        info = await js.stream_info(stream)
        print(info.state.messages, len(info.cluster.replicas or []) + 1)
        await nc.close()

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
''')


def test_the_compose_nats_nodes_form_a_cluster_that_survives_a_node(cluster: tuple[PodNetwork, dict[str, str]]) -> None:
    network, variables = cluster
    wait_for("every node routed to the two others, a JetStream meta leader elected",
             lambda: all({r.get("remote_name") for r in monitor(network, n, "routez").get("routes", [])}
                         == {SERVER_NAMES[o] for o in NODES if o != n} for n in NODES)
             and all(monitor(network, n, "jsz").get("meta_cluster", {}).get("leader") for n in NODES),
             network, 30)
    servers = ",".join(f"nats://{n}:4222" for n in NODES)

    def client(count: int, listed: str = servers) -> list[int]:
        out = network.run(sys.executable, "-c", CLIENT, listed, "ops", variables["NATS_PASSWORD_OPS"], "LEDGER",
                          str(count), timeout=60)
        assert out.returncode == 0, out.stderr + network.log_tails()
        return [int(word) for word in out.stdout.split()]

    assert client(0) == [1, 3]  # a stream with three replicas, one message
    network.kill("nats")  # zone a's node
    assert client(5, "nats://nats-b:4222,nats://nats-c:4222")[0] == 6  # two of three: writes still acknowledged
    # The route user is the routes' alone: no client may use it.
    refused = network.run(sys.executable, "-c", "import asyncio, nats, sys; asyncio.run(nats.connect("
                          "'nats://nats-b:4222', user='route', password=sys.argv[1], max_reconnect_attempts=0, "
                          "allow_reconnect=False, connect_timeout=5))", variables["NATS_ROUTE_PASSWORD"])
    assert refused.returncode != 0 and "Authorization" in refused.stderr, refused.stderr


REDIS_PODS = ("redis", "redis-replica", "sentinel-a", "sentinel-b", "sentinel-c")


def container(name: str, tmp: Path, variables: dict[str, str]) -> tuple[list[str], dict[str, str], Path]:
    """A Redis or sentinel service's argv (entrypoint + command), environment and working directory
    after the merge. The container's own /tmp (where the sentinels write their config) is a
    directory of the pod's here."""
    base = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"].get(name, {})
    ha = yaml.safe_load((REPO / "docker-compose.ha.yml").read_text())["services"][name]
    entrypoint = ha.get("entrypoint", base.get("entrypoint", []))
    command = ha.get("command", base.get("command"))
    workdir = tmp / f"{name}-root"
    (workdir / "tmp").mkdir(parents=True, exist_ok=True)
    argv = [interpolate(str(a), variables).replace("/tmp/", f"{workdir}/tmp/") for a in [*entrypoint, *command]]
    env = {k: interpolate(str(v), variables) for k, v in {**base.get("environment", {}),
                                                          **ha.get("environment", {})}.items()}
    return argv, env, workdir


@pytest.fixture
def redis_pods(tmp_path: Path) -> Iterator[tuple[PodNetwork, dict[str, str]]]:
    for tool in ("unshare", "nsenter", "ip", "redis-server", "redis-cli"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not installed")
    variables = new_secrets()
    network = PodNetwork(tmp_path, {name: [name] for name in REDIS_PODS})
    try:
        for name in REDIS_PODS:
            argv, env, workdir = container(name, tmp_path, variables)
            network.start(name, [(argv, env)], workdir)
        yield network, variables
    finally:
        network.close()


def test_the_compose_sentinels_promote_the_replica_and_demote_a_returning_primary(
        redis_pods: tuple[PodNetwork, dict[str, str]], tmp_path: Path) -> None:
    network, variables = redis_pods

    def cli(host: str, port: int, *command: str) -> list[str]:
        out = network.run("redis-cli", "-h", host, "-p", str(port), "--no-auth-warning", "-a",
                          variables["REDIS_PASSWORD"], *command)
        return out.stdout.splitlines() if out.returncode == 0 else []

    def primary(sentinel: str) -> str:
        answer = cli(sentinel, 26379, "sentinel", "get-master-addr-by-name", "inferbus")
        return answer[0] if answer else ""

    def role(host: str) -> str:
        return (cli(host, 6379, "role") or [""])[0]  # master | slave

    sentinels = ("sentinel-a", "sentinel-b", "sentinel-c")

    def replicas_known(sentinel: str) -> int:
        answer = cli(sentinel, 26379, "sentinel", "replicas", "inferbus")
        return sum(1 for key, value in zip(answer, answer[1:], strict=False) if key == "flags" and value == "slave")

    wait_for("the sentinels watching redis with its replica",
             lambda: all(primary(s) == "redis" and replicas_known(s) == 1 for s in sentinels)
             and role("redis-replica") == "slave", network, 30)
    assert cli("redis", 6379, "set", "tenant:acme", "kept") == ["OK"]
    wait_for("the write replicated (asynchronously)", lambda: cli("redis-replica", 6379, "get", "tenant:acme")
             == ["kept"], network, 10)
    network.kill("redis")
    wait_for("redis-replica promoted", lambda: all(primary(s) == "redis-replica" for s in sentinels)
             and role("redis-replica") == "master", network, 5 + 2 * 10 + 10)
    assert cli("redis-replica", 6379, "get", "tenant:acme") == ["kept"]
    argv, env, workdir = container("redis", tmp_path, variables)  # the same data volume
    network.start("redis", [(argv, env)], workdir)  # `restart: unless-stopped`: it comes back as a primary
    wait_for("the returning redis made a replica of redis-replica", lambda: role("redis") == "slave", network, 30)
