"""Kubernetes: one worker Deployment per pool, resized through its `scale` subresource with the
official client (RBAC: get/patch on deployments/scale, nothing else).

Warm pool on Kubernetes: the same Deployment, not a second one. Its pods run the worker with
INFERBUS_WORKER_STANDBY=true, so every new pod loads its engine and waits warm; the autoscaler
sets replicas = serving + warm and promotes as many as should serve over the bus. A second
"warm" Deployment would need moving a pod between Deployments on promotion, which Kubernetes
cannot do without restarting it, and that restart is the cold start the pool exists to avoid.
When replicas drop, the ReplicaSet controller picks the pods to stop; the worker's SIGTERM drain
hands back in-flight work, so any choice is safe, and the next tick promotes a warm pod if a
serving one went.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from inferbus.runtime import logs
from inferbus.runtime.extras import require

from .base import Actuator, FleetState, PoolFleet

log = logs.get(__name__)


def api_client(api_url: str = "") -> Any:
    """An ApiClient for `api_url`, else in-cluster (service account), else the local kubeconfig."""
    require("kubernetes", "k8s", "The Kubernetes actuator")
    from kubernetes import client, config

    if api_url:
        configuration = client.Configuration()
        configuration.host = api_url.rstrip("/")
        return client.ApiClient(configuration)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except Exception as error:
            raise SystemExit(f"no Kubernetes API: not in a cluster and no usable kubeconfig ({error}); "
                             "set INFERBUS_AUTOSCALER_K8S_API_URL") from None
    return client.ApiClient()


class KubernetesActuator(Actuator):
    name = "kubernetes"

    def __init__(self, namespace: str, deployments: dict[str, str], client: Any = None, api_url: str = "") -> None:
        super().__init__()
        self.namespace = namespace
        self.deployments = dict(deployments)
        self._client = client
        self._api_url = api_url
        self._apps: Any = None

    async def start(self) -> None:
        from kubernetes import client

        if self._client is None:
            self._client = api_client(self._api_url)
        self._apps = client.AppsV1Api(self._client)

    async def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def _deployment(self, pool: str) -> str:
        try:
            return self.deployments[pool]
        except KeyError:
            raise ValueError(f"no Deployment configured for pool {pool!r}") from None

    async def replicas(self, pool: str) -> int:
        scale = await asyncio.to_thread(
            self._apps.read_namespaced_deployment_scale, self._deployment(pool), self.namespace
        )
        return int(scale.spec.replicas or 0)

    async def current(self) -> FleetState:
        pools = {}
        for pool in self.deployments:
            pools[pool] = PoolFleet(await self.replicas(pool))
        return FleetState(pools)

    async def scale(self, pool: str, replicas: int, retire: Sequence[str] = ()) -> None:
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        name = self._deployment(pool)
        now = await self.replicas(pool)
        if now == replicas:
            return
        await asyncio.to_thread(self._apps.patch_namespaced_deployment_scale, name, self.namespace,
                                {"spec": {"replicas": replicas}})
        log.info("deployment_scaled", pool=pool, deployment=name, namespace=self.namespace, replicas_from=now,
                 replicas=replicas)
