"""The configuration of a local multi-zone platform (`inferbus up --zones 3`): pure text and names.

Each zone gets a nats-server of one cluster (routes between all three, JetStream on, streams and
buckets with three replicas), a sentinel, a router and a gateway; the Redis primary lives in the
first zone and its replica in the second; workers are spread over the zones in turn. Losing a
zone (its NATS node, sentinel, router, gateway and workers) leaves a JetStream quorum (2 of 3), a
sentinel quorum (2 of 3) and the other zones' gateways and workers.

Cluster routes authenticate with their own user (not one of the services'), as nats-server's
cluster `authorization` block has it:
https://docs.nats.io/running-a-nats-service/configuration/clustering/cluster_config
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

ZONE_NAMES = "abcdefghij"
CLUSTER_NAME = "inferbus"
SENTINEL_SERVICE = "inferbus"
ROUTE_USER = "route"


def zone_names(count: int) -> list[str]:
    if not 1 <= count <= len(ZONE_NAMES):
        raise ValueError(f"zones must be between 1 and {len(ZONE_NAMES)}, not {count}")
    return list(ZONE_NAMES[:count])


def worker_zone(index: int, zones: list[str]) -> str:
    """Worker `index` (from 1) goes to the zones in turn, so every zone gets its share."""
    return zones[(index - 1) % len(zones)]


def preferred_first(urls: list[str], own: int) -> str:
    """A NATS_URL listing every node, the caller's own zone's first (clients keep the order)."""
    return ",".join(urls[own:] + urls[:own])


@dataclass
class NatsNode:
    zone: str
    port: int
    monitor_port: int
    cluster_port: int

    @property
    def server_name(self) -> str:
        return f"nats-{self.zone}"


@dataclass
class ClusterLayout:
    nodes: list[NatsNode]
    route_password: str
    routes: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.routes = [
            f"nats-route://{ROUTE_USER}:{self.route_password}@127.0.0.1:{n.cluster_port}" for n in self.nodes
        ]


def nats_cluster_block(layout: ClusterLayout, node: NatsNode, tls: tuple[Path, Path, Path] | None = None) -> str:
    """nats-server's `server_name` and `cluster` block for `node`: routes to every node (its own
    is ignored by the server), authenticated with the route user. With `tls` (certificate, key,
    CA) routes speak TLS only, and each side verifies the other's certificate against the CA
    (nats-server requires a client certificate on routes):
    https://docs.nats.io/running-a-nats-service/configuration/securing_nats/tls#tls-for-routes"""
    lines = [
        f"server_name: {json.dumps(node.server_name)}",
        "cluster {",
        f"  name: {json.dumps(CLUSTER_NAME)}",
        f'  listen: "127.0.0.1:{node.cluster_port}"',
        f"  authorization {{ user: {json.dumps(ROUTE_USER)}, password: {json.dumps(layout.route_password)} }}",
        "  routes: [" + ", ".join(json.dumps(r) for r in layout.routes if f":{node.cluster_port}" not in r) + "]",
    ]
    if tls is not None:
        cert, key, ca = (json.dumps(str(path)) for path in tls)
        lines.append(f"  tls {{ cert_file: {cert}, key_file: {key}, ca_file: {ca}, timeout: 5 }}")
    return "\n".join([*lines, "}"])


def redis_replication_lines(password: str, primary_port: int | None) -> str:
    """Lines added to a data node's redis.conf: the password it uses towards a primary (every node
    may become a replica after a failover), and for a replica, its primary."""
    lines = [f"masterauth {password}"]
    if primary_port is not None:
        lines.append(f"replicaof 127.0.0.1 {primary_port}")
    return "\n".join(lines) + "\n"


def sentinel_config(port: int, primary_port: int, password: str, data_dir: Path, *, quorum: int = 2,
                    down_after_ms: int = 1000, failover_timeout_ms: int = 10000) -> str:
    """A sentinel watching the primary: loopback only, the same password as the data nodes (for
    its clients and towards them). Sentinel rewrites this file as the topology changes."""
    return "\n".join([
        "bind 127.0.0.1", f"port {port}", f"dir {json.dumps(str(data_dir))}", f"requirepass {password}",
        f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {primary_port} {quorum}",
        f"sentinel auth-pass {SENTINEL_SERVICE} {password}",
        f"sentinel down-after-milliseconds {SENTINEL_SERVICE} {down_after_ms}",
        f"sentinel failover-timeout {SENTINEL_SERVICE} {failover_timeout_ms}",
        f"sentinel parallel-syncs {SENTINEL_SERVICE} 1", "",
    ])
