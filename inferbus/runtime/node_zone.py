"""A pod's zone in Kubernetes: the `topology.kubernetes.io/zone` label of the node it runs on.

The Downward API gives a pod its node's name but not the node's labels, so the gateway and worker
pods run `inferbus node-zone` as an init container: it reads its node from the Kubernetes API (a
ClusterRole that may only `get` nodes, bound to the pod's ServiceAccount; the API token is mounted
into that init container alone) and writes the zone to a file on a volume the service container
shares, whose path the service takes as `INFERBUS_ZONE_FILE`. `INFERBUS_ZONE`, when set, wins.

Node API: https://kubernetes.io/docs/reference/kubernetes-api/cluster-resources/node-v1/
Well-known label: https://kubernetes.io/docs/reference/labels-annotations-taints/#topologykubernetesiozone
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ZONE_LABEL = "topology.kubernetes.io/zone"
LEGACY_ZONE_LABEL = "failure-domain.beta.kubernetes.io/zone"  # set by clusters older than 1.17 (deprecated)
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ZoneError(Exception):
    """The zone could not be learned: the message says what to fix."""


def zone_of_node(node: dict) -> str:
    """The zone a Node object (the API's JSON) is labelled with; "" when it has none."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    return str(labels.get(ZONE_LABEL) or labels.get(LEGACY_ZONE_LABEL) or "").strip()


def read_zone(zone: str, zone_file: str) -> str:
    """The zone a service runs in: `zone` (INFERBUS_ZONE) when given, else the content of
    `zone_file` (INFERBUS_ZONE_FILE, written by `inferbus node-zone`), else none ("")."""
    if zone or not zone_file:
        return zone
    try:
        return Path(zone_file).read_text().strip()
    except OSError as error:
        raise SystemExit(
            f"INFERBUS_ZONE_FILE={zone_file} cannot be read ({error.strerror}): in Kubernetes the "
            "`zone` init container writes it (inferbus node-zone); unset it to run without a zone"
        ) from None


@dataclass(frozen=True)
class ApiAccess:
    """Where the Kubernetes API is and how this pod authenticates to it (in-cluster)."""

    base_url: str  # https://HOST:PORT
    token: str
    ca_file: Path

    @classmethod
    def in_cluster(cls, environ: dict[str, str] | os._Environ[str] = os.environ,
                   account_dir: Path = SERVICE_ACCOUNT_DIR) -> ApiAccess:
        host, port = environ.get("KUBERNETES_SERVICE_HOST", ""), environ.get("KUBERNETES_SERVICE_PORT", "")
        if not host or not port:
            raise ZoneError("KUBERNETES_SERVICE_HOST/PORT are not set: not running in a Kubernetes pod")
        try:
            token = (account_dir / "token").read_text().strip()
        except OSError as error:
            raise ZoneError(f"no ServiceAccount token at {account_dir / 'token'} ({error.strerror}): mount one "
                            "into this container (deploy/k8s/base/zone.yaml)") from None
        host = f"[{host}]" if ":" in host else host  # an IPv6 service address
        return cls(f"https://{host}:{port}", token, account_dir / "ca.crt")


def fetch_node_zone(access: ApiAccess, node_name: str, timeout_s: float = 10.0) -> str:
    """GET the node `node_name` and return its zone label ("" when it has none)."""
    if not node_name:
        raise ZoneError("NODE_NAME is not set: give it the pod's spec.nodeName through the Downward API")
    context = ssl.create_default_context(cafile=str(access.ca_file))
    request = urllib.request.Request(f"{access.base_url}/api/v1/nodes/{urllib.parse.quote(node_name, safe='')}",
                                     headers={"Authorization": f"Bearer {access.token}", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:  # noqa: S310 (https only)
            return zone_of_node(json.loads(response.read()))
    except urllib.error.HTTPError as error:
        hint = (
            " (the pod's ServiceAccount needs the inferbus-node-zone ClusterRole: get nodes)"
            if error.code in (401, 403)
            else ""
        )
        raise ZoneError(f"reading node {node_name} from the Kubernetes API: HTTP {error.code}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise ZoneError(f"reading node {node_name} from the Kubernetes API at {access.base_url}: {error}") from None


def write_zone_file(path: Path, zone: str) -> None:
    """Write `zone` to `path` whole (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(zone + "\n")
    partial.replace(path)
