"""The digest of the engine image this worker's engine runs, as the kubelet reports it, checked
against the release.

Nothing inside a container sees the digest of the image it runs: the Downward API has no field for
it, and an engine's `/server_info` reports its version, not its build. The kubelet knows it: the
pod's status lists each container with `imageID`, the digest of the image it really runs,
resolved when it was pulled, whatever tag or digest the pod spec named. So on Kubernetes the
worker reads its own pod (`GET /api/v1/namespaces/<ns>/pods/<name>` with its ServiceAccount
token; RBAC `get` on pods) and compares the engine container's `imageID` with the release's
`engine_image` digest. Outside Kubernetes (`inferbus up`, a simulated engine, a bare host) there
is no such witness, and the worker says so (`engine_image_unverified`) instead of pretending.

`INFERBUS_ENGINE_IMAGE_CHECK`: `auto` checks when the worker runs in a pod and logs why not when it
cannot; `kubernetes` requires the check (a worker that cannot read its pod refuses to start);
`off` never checks (and logs that too).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferbus.runtime import logs

log = logs.get(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


class ImageCheckError(RuntimeError):
    """The pod's status could not be read (no API, no permission, no such container)."""


def digest_of(reference: str) -> str | None:
    """The `sha256:<64 hex>` in an image reference or a kubelet `imageID`, or None."""
    found = _DIGEST.findall(reference)
    return found[-1] if found else None


def running_digest(pod: dict[str, Any], container: str) -> str:
    """The digest of the image `container` runs, from a pod as the API returns it. The engine is
    often a native sidecar, listed among the init containers' statuses."""
    status = pod.get("status") or {}
    statuses = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    for entry in statuses:
        if entry.get("name") == container:
            digest = digest_of(str(entry.get("imageID") or ""))
            if digest is None:
                raise ImageCheckError(f"the kubelet reports no image digest for container {container!r} yet "
                                      f"(imageID {entry.get('imageID')!r})")
            return digest
    names = sorted(str(entry.get("name")) for entry in statuses)
    raise ImageCheckError(f"the pod has no container {container!r} (it has {', '.join(names) or 'none'}): "
                          "set INFERBUS_ENGINE_CONTAINER to the engine's")


def problem(release_image: str, running: str) -> str | None:
    """Why the running image is not the release's (None: it is)."""
    pinned = digest_of(release_image)
    if pinned is None:
        return f"the release's engine image {release_image!r} has no digest to compare with"
    if running != pinned:
        return f"the engine runs image {running}, the release pins {release_image}"
    return None


@dataclass(frozen=True)
class PodAccess:
    api_url: str
    namespace: str
    pod: str
    token: str | None
    ca_file: str | None


def pod_access(api_url: str = "", pod: str = "", namespace: str = "") -> PodAccess | None:
    """How to read this worker's own pod: the in-cluster API and ServiceAccount, or `api_url`
    (INFERBUS_K8S_API_URL); None when not in a pod."""
    token_file, ca_file, ns_file = (SERVICE_ACCOUNT / name for name in ("token", "ca.crt", "namespace"))
    if not api_url:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host or not token_file.is_file():
            return None
        api_url = f"https://{host}:{port}"
    pod = pod or os.environ.get("HOSTNAME", "")
    namespace = namespace or (ns_file.read_text().strip() if ns_file.is_file() else "")
    if not pod or not namespace:
        return None
    token = token_file.read_text().strip() if token_file.is_file() else None
    return PodAccess(api_url.rstrip("/"), namespace, pod, token,
                     str(ca_file) if ca_file.is_file() else None)


async def read_pod(access: PodAccess) -> dict[str, Any]:
    import httpx

    headers = {"authorization": f"Bearer {access.token}"} if access.token else {}
    verify: Any = access.ca_file if access.ca_file and access.api_url.startswith("https") else True
    try:
        async with httpx.AsyncClient(timeout=10, verify=verify, headers=headers) as client:
            response = await client.get(f"{access.api_url}/api/v1/namespaces/{access.namespace}/pods/{access.pod}")
    except httpx.HTTPError as error:
        raise ImageCheckError(f"the Kubernetes API at {access.api_url} did not answer: {error!r}") from None
    if response.status_code == 403:
        raise ImageCheckError(f"not allowed to read pod {access.namespace}/{access.pod}: grant the worker's "
                              "ServiceAccount `get` on pods (docs/releases.md)")
    if response.status_code != 200:
        raise ImageCheckError(f"reading pod {access.namespace}/{access.pod} answered {response.status_code}")
    pod: dict[str, Any] = response.json()
    return pod


async def check(mode: str, release_image: str, container: str, access: PodAccess | None) -> str | None:
    """A mismatch to refuse the release for (None: verified, or not verifiable and allowed);
    raises ImageCheckError when `mode` is `kubernetes` and the check cannot be made."""
    if mode == "off":
        log.warning("engine_image_unverified", why="INFERBUS_ENGINE_IMAGE_CHECK=off", release_image=release_image)
        return None
    if access is None:
        if mode == "kubernetes":
            raise ImageCheckError("INFERBUS_ENGINE_IMAGE_CHECK=kubernetes, but this worker is not in a pod it can read")
        log.warning("engine_image_unverified", release_image=release_image,
                    why="not running in a Kubernetes pod: nothing here reports the engine image's digest")
        return None
    try:
        running = running_digest(await read_pod(access), container)
    except ImageCheckError as error:
        if mode == "kubernetes":
            raise
        log.warning("engine_image_unverified", release_image=release_image, why=str(error))
        return None
    found = problem(release_image, running)
    if found is None:
        log.info("engine_image_verified", image_id=running, container=container)
    return found
