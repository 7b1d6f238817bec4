"""The Kubernetes actuator with the real `kubernetes` client against a fake API server: a small
local HTTP server implementing GET and PATCH of a Deployment's scale subresource."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest

pytest.importorskip("kubernetes")
from kubernetes.client.exceptions import ApiException  # noqa: E402

from inferbus.runtime import settings as settings_mod  # noqa: E402
from proto import messages as m  # noqa: E402
from proto import subjects  # noqa: E402
from services.autoscaler.actuators.kubernetes import KubernetesActuator, api_client  # noqa: E402
from services.autoscaler.service import Autoscaler  # noqa: E402
from services.autoscaler.settings import AutoscalerSettings  # noqa: E402

POOL = "meta-llama/Llama-3.3-70B-Instruct"
PREFIX = "/apis/apps/v1/namespaces/"


class FakeApiServer(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.replicas: dict[tuple[str, str], int] = {("inferbus", "worker"): 2}
        self.requests: list[tuple[str, str, str, object]] = []  # (method, path, content type, body)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeApiServer

    def log_message(self, *args: object) -> None:
        pass

    def _target(self) -> tuple[str, str] | None:
        path = self.path.split("?")[0]
        if not path.startswith(PREFIX) or not path.endswith("/scale"):
            return None
        parts = path[len(PREFIX):].split("/")  # ns, deployments, name, scale
        if len(parts) != 4 or parts[1] != "deployments":
            return None
        return parts[0], parts[2]

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _scale(self, key: tuple[str, str]) -> dict:
        n = self.server.replicas[key]
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {"name": key[1], "namespace": key[0], "resourceVersion": "1"},
                "spec": {"replicas": n}, "status": {"replicas": n, "selector": "app.kubernetes.io/name=worker"}}

    def _not_found(self, key: tuple[str, str] | None) -> None:
        self._reply(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
                          "message": f"deployments.apps \"{key[1] if key else '?'}\" not found"})

    def do_GET(self) -> None:  # noqa: N802
        key = self._target()
        self.server.requests.append(("GET", self.path, "", None))
        if key not in self.server.replicas:
            return self._not_found(key)
        self._reply(200, self._scale(key))

    def do_PATCH(self) -> None:  # noqa: N802
        key = self._target()
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
        content_type = self.headers.get("Content-Type", "")
        self.server.requests.append(("PATCH", self.path, content_type, body))
        if key not in self.server.replicas:
            return self._not_found(key)
        if "merge-patch+json" not in content_type:
            return self._reply(415, {"kind": "Status", "code": 415, "message": f"unsupported {content_type}"})
        replicas = body.get("spec", {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            return self._reply(422, {"kind": "Status", "code": 422, "message": "spec.replicas: Invalid value"})
        self.server.replicas[key] = replicas
        self._reply(200, self._scale(key))


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_reads_and_patches_the_scale_subresource(api: FakeApiServer) -> None:
    async def run() -> None:
        actuator = KubernetesActuator("inferbus", {POOL: "worker"}, client=api_client(api.url))
        await actuator.start()
        fleet = await actuator.current()
        assert fleet.pools[POOL].replicas == 2
        await actuator.scale(POOL, 5)
        assert api.replicas[("inferbus", "worker")] == 5
        assert (await actuator.current()).pools[POOL].replicas == 5
        patches = [r for r in api.requests if r[0] == "PATCH"]
        assert len(patches) == 1
        method, path, content_type, body = patches[0]
        assert path == "/apis/apps/v1/namespaces/inferbus/deployments/worker/scale"
        assert body == {"spec": {"replicas": 5}}
        await actuator.scale(POOL, 5)  # already there: no write
        assert len([r for r in api.requests if r[0] == "PATCH"]) == 1
        with pytest.raises(ValueError, match="no Deployment configured"):
            await actuator.scale("other-model", 1)
        await actuator.close()

    asyncio.run(run())


@pytest.mark.slow
def test_api_errors_surface_as_the_clients_exceptions(api: FakeApiServer) -> None:
    async def run() -> None:
        actuator = KubernetesActuator("inferbus", {POOL: "missing"}, client=api_client(api.url))
        await actuator.start()
        with pytest.raises(ApiException) as error:
            await actuator.current()
        assert error.value.status == 404
        await actuator.close()

    asyncio.run(run())


class _Bus:
    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append((subject, data))


@pytest.mark.slow
def test_the_service_tick_publishes_the_decision_and_scales_the_deployment(
        api: FakeApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERBUS_AUTOSCALER_ACTUATOR", "kubernetes")
    monkeypatch.setenv("INFERBUS_AUTOSCALER_K8S_API_URL", api.url)
    monkeypatch.setenv("INFERBUS_AUTOSCALER_GOODPUT_RPS", "4")
    monkeypatch.setenv("INFERBUS_AUTOSCALER_HEADROOM", "0")
    monkeypatch.setenv("INFERBUS_MODEL", POOL)
    settings = settings_mod.load(AutoscalerSettings)
    now = [100.0]

    async def run() -> None:
        actuator = KubernetesActuator("inferbus", settings.deployments(), client=api_client(api.url))
        autoscaler = Autoscaler(settings, actuator, clock=lambda: now[0])
        bus = _Bus()
        autoscaler.nc = bus  # type: ignore[assignment]
        sent: list[tuple[str, m.ControlCommand]] = []

        async def control(worker_id: str, command: m.ControlCommand) -> None:
            sent.append((worker_id, command))

        actuator.bind(control)
        await actuator.start()
        # Two serving workers taking 16 req/s (completions 16/s), one warm pod.
        for t in range(0, 11):
            now[0] = 100.0 + t
            for i, worker in enumerate(("worker-a", "worker-b")):
                autoscaler.aggregator.on_load(m.WorkerLoad(
                    worker_id=worker, model=POOL, ts=now[0], seq=t, running=10, waiting=0, in_flight=10 + i,
                    max_running=256, kv_used_tokens=0, kv_capacity_tokens=1000, completed=8 * t))
            autoscaler.aggregator.on_load(m.WorkerLoad(
                worker_id="worker-c", model=POOL, ts=now[0], seq=t, running=0, waiting=0, in_flight=0,
                max_running=0, kv_used_tokens=0, kv_capacity_tokens=0, phase="warm"))
        decision = await autoscaler.tick(POOL)
        assert decision.direction == "up" and decision.desired_serving == 4
        subject, data = bus.published[-1]
        assert subject == subjects.scale_subject(POOL)
        message = msgspec.msgpack.decode(data, type=m.ScaleDecision)
        assert message.reason.startswith("scale up 2→4: 16.0 req/s") and message.actuator == "kubernetes"
        assert (message.serving, message.warm, message.desired_serving) == (2, 1, 4)
        assert message.promote == ["worker-c"]
        assert [(w, c.action) for w, c in sent] == [("worker-c", "promote")]
        # Deployment = serving + warm target: the promoted pod plus a new one to cold-start.
        assert api.replicas[("inferbus", "worker")] == 4 + decision.desired_warm
        await actuator.close()

    asyncio.run(run())


def test_a_disaggregated_tick_scales_each_pools_deployment_on_its_own_signal(
        api: FakeApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill workers over their TTFT budget, decode workers within TPOT and KV: the prefill
    Deployment grows, the decode one (worker) is left as it is."""
    api.replicas[("inferbus", "worker-prefill")] = 2
    monkeypatch.setenv("INFERBUS_AUTOSCALER_ACTUATOR", "kubernetes")
    monkeypatch.setenv("INFERBUS_AUTOSCALER_K8S_API_URL", api.url)
    monkeypatch.setenv("INFERBUS_AUTOSCALER_DISAGGREGATED", "true")
    monkeypatch.setenv("INFERBUS_AUTOSCALER_GOODPUT_RPS", "8")  # decode
    monkeypatch.setenv("INFERBUS_AUTOSCALER_PREFILL_GOODPUT_RPS", "8")
    monkeypatch.setenv("INFERBUS_AUTOSCALER_PREFILL_TTFT_BUDGET_S", "0.5")
    monkeypatch.setenv("INFERBUS_AUTOSCALER_HEADROOM", "0")
    monkeypatch.setenv("INFERBUS_AUTOSCALER_MAX_WARM", "0")
    monkeypatch.setenv("INFERBUS_AUTOSCALER_PREFILL_MAX_WARM", "0")
    monkeypatch.setenv("INFERBUS_MODEL", POOL)
    settings = settings_mod.load(AutoscalerSettings)
    assert [(role, name) for _, role, name in settings.scaled_pools()] == [
        ("prefill", f"{POOL}:prefill"), ("decode", f"{POOL}:decode")]
    now = [100.0]

    def hist(seconds: float, count: int, bounds: tuple[float, ...]) -> list[int]:
        counts = [0] * (len(bounds) + 1)
        index = next(i for i, bound in enumerate(bounds) if seconds <= bound)
        counts[index] = count
        return counts

    async def run() -> None:
        actuator = KubernetesActuator("inferbus", settings.deployments(), client=api_client(api.url))
        autoscaler = Autoscaler(settings, actuator, clock=lambda: now[0])
        autoscaler.nc = _Bus()  # type: ignore[assignment]
        actuator.bind(lambda worker_id, command: asyncio.sleep(0))  # type: ignore[arg-type,return-value]
        await actuator.start()
        # 16 req/s through both pools, two replicas each (8 req/s each: at their goodput).
        for t in range(0, 11):
            now[0] = 100.0 + t
            for worker, role in (("p-a", "prefill"), ("p-b", "prefill"), ("d-a", "decode"), ("d-b", "decode")):
                # Prefill: 900 ms from accept to KV sent (over its 500 ms share); decode: within
                # TPOT and KV, though its TTFT (the client's) is long too.
                ttft = hist(0.9, 8 * t, m.LATENCY_BUCKETS_S)
                tpot = hist(0.02, 8 * t, m.TPOT_BUCKETS_S) if role == "decode" else []
                autoscaler.aggregator.on_load(m.WorkerLoad(
                    worker_id=worker, model=POOL, ts=now[0], seq=t, running=8, waiting=0, in_flight=8,
                    max_running=256, kv_used_tokens=300, kv_capacity_tokens=1000, completed=8 * t, role=role,
                    ttft_hist=ttft, tpot_fine_hist=tpot))
        prefill = await autoscaler.tick(POOL, "prefill")
        decode = await autoscaler.tick(POOL, "decode")
        assert prefill.pool == f"{POOL}:prefill" and prefill.direction == "up" and prefill.desired_serving == 4
        assert decode.pool == f"{POOL}:decode" and decode.direction == "hold" and decode.desired_serving == 2
        assert api.replicas[("inferbus", "worker-prefill")] == 4
        assert api.replicas[("inferbus", "worker")] == 2
        await actuator.close()

    asyncio.run(run())
