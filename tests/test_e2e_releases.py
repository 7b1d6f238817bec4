"""Releases against the live platform: workers verify what they serve, canaries are promoted or
rolled back by their gates, clients never see an error, usage says which release served them.

The platform starts without workers; each test starts replicas (a simulated engine and its worker)
on model directories it builds, pinned to releases it creates, as an operator would.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import nats
import pytest
from click.testing import CliRunner
from nats.aio.msg import Msg

from inferbus.local.process import Process
from inferbus.local.replicas import EngineSpec, replica_processes
from inferbus.releases import record
from proto import messages as m
from proto import subjects
from services.gateway.flight import Flight
from services.sim_engine import quality
from tools.commands.main import main

from .canary_helpers import Decisions, Load, cli, decisions
from .conftest import MODEL, Platform, dispatch, read_usage, running_platform
from .waiting import await_for

pytestmark = pytest.mark.e2e

COMMIT = "7d3c7a1f0e5b4d2c9a8b6e4f2d1c0b9a8e7f6d5c"
IMAGE = "inferbus/sim-engine@sha256:" + "5e" * 32
STEP_MS = 8.0


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    env = {
        # Small samples and short windows, so that a canary finishes in seconds (production: 200, 5 min).
        "INFERBUS_CANARY_MIN_SAMPLES": "40", "INFERBUS_CANARY_TICK_S": "0.5",
        # CPU contention on a shared test machine moves real step times by tens of percent; the
        # slow candidate's steps are 2.5 × longer.
        "INFERBUS_CANARY_LATENCY_TOLERANCE": "0.5",
    }
    with running_platform(tmp_path_factory.mktemp("releases"), workers=0, time_scale=1.0, batch=False,
                          extra_env=env) as running:
        yield running


class Replicas:
    def __init__(self, platform: Platform, root: Path, llama3_model_dir: Path) -> None:
        self.platform = platform
        self.root = root
        self.source = llama3_model_dir
        self.processes: list[Process] = []
        self.count = 0

    def model_dir(self, name: str, accuracy: float, weights: bytes = b"weights-v1") -> Path:
        target = self.root / name
        shutil.copytree(self.source, target)
        (target / "model.safetensors").write_bytes(weights * 1000)
        quality.write_accuracy(target, accuracy)
        return target

    def create(self, model_dir: Path, note: str = "") -> str:
        result = CliRunner().invoke(
            main,
            [
                "release",
                "create",
                "--model",
                MODEL,
                "--model-dir",
                str(model_dir),
                "--repo",
                "meta-llama/Llama-3.3-70B-Instruct",
                "--revision",
                COMMIT,
                "--engine-image",
                IMAGE,
                "--flag",
                "quantization=fp8",
                "--flag",
                f"sim_eval_accuracy={quality.accuracy_of(str(model_dir), None)}",
                "--note",
                note,
                "--nats-url",
                self.platform.stack.nats_url,
            ],
        )
        assert result.exit_code == 0, result.output
        return next(line for line in result.stdout.splitlines() if record.DIGEST.match(line))

    def start(self, model_dir: Path, release: str, step_ms: float = STEP_MS, wait: bool = True,
              worker_env: dict[str, str] | None = None) -> tuple[Process, Process]:
        self.count += 1
        index = 100 + self.count
        stack = self.platform.stack
        spec = EngineSpec(model=MODEL, time_scale=1.0, fixed_step_ms=step_ms)
        env = stack._env(INFERBUS_MODEL_DIR=str(model_dir))
        engine, worker = replica_processes(
            index,
            spec,
            env,
            stack.config.state_dir / "logs",
            worker_env={
                **stack.credentials(f"worker-{index}"),
                "INFERBUS_WORKER_RELEASE": release,
                **(worker_env or {}),
            },
        )
        self.processes += [engine, worker]
        engine.start()
        worker.start()
        if wait:
            deadline = time.monotonic() + 60
            while release not in self.live_releases():
                assert worker.alive(), worker.tail()
                assert time.monotonic() < deadline, worker.tail()
                time.sleep(0.2)
            # The gateway learns of the worker from its own watch, a moment later: until then,
            # with no other worker up, it answers 503 no_capacity.
            while httpx.get(f"{stack.gateway_url}/ready", timeout=5).status_code != 200:
                assert time.monotonic() < deadline, "the gateway never saw the worker"
                time.sleep(0.1)
        return engine, worker

    def live_releases(self) -> set[str]:
        async def read() -> set[str]:
            nc = await nats.connect(self.platform.stack.nats_url)
            try:
                kv = await nc.jetstream().key_value(subjects.WORKERS_BUCKET)
                found = set()
                for key in await kv.keys():
                    entry = await kv.get(key)
                    beat = msgspec.msgpack.decode(entry.value, type=m.Heartbeat)
                    if beat.state == "ready":
                        found.add(beat.release)
                return found
            except Exception:
                return set()
            finally:
                await nc.close()

        return asyncio.run(read())

    def stop_all(self) -> None:
        for process in reversed(self.processes):
            process.signal(15)
        for process in self.processes:
            if not process.wait(20):
                process.signal(9)
        self.processes.clear()


@pytest.fixture
def replicas(platform: Platform, tmp_path: Path, llama3_model_dir: Path) -> Iterator[Replicas]:
    started = Replicas(platform, tmp_path, llama3_model_dir)
    yield started
    started.stop_all()


def status(platform: Platform) -> dict:
    return json.loads(cli(platform, "release", "status", "--model", MODEL, "--json"))[0][0]


def start_canary(platform: Platform, candidate: str, *extra: str) -> None:
    cli(platform, "release", "canary", candidate, "--traffic", "25%", "--steps", "50%,100%", "--sticky", "prefix",
        "--window", "3s", *extra)


def test_good_candidate_is_promoted_without_a_client_error(platform: Platform, replicas: Replicas) -> None:
    stable_dir = replicas.model_dir("stable", 0.97)
    stable = replicas.create(stable_dir, "bf16 checkpoint")
    cli(platform, "release", "stable", stable)
    for _ in range(2):
        replicas.start(stable_dir, stable)
    # An FP8 conversion that answers the eval suite one point worse: within the suite's threshold.
    candidate_dir = replicas.model_dir("fp8", 0.96, weights=b"weights-fp8")
    candidate = replicas.create(candidate_dir, "fp8 conversion")
    assert candidate != stable
    replicas.start(candidate_dir, candidate)

    with Load(platform) as load:
        time.sleep(2)
        start_canary(platform, candidate, "--eval-suite", "arithmetic")
        # 40 items × 25 repeats per release: a one-point drop from 97% passes with probability > 0.99.
        evaluated = CliRunner().invoke(
            main,
            [
                "eval",
                "arithmetic",
                "--release",
                record.short(candidate),
                "--concurrency",
                "6",
                "--url",
                platform.stack.gateway_url,
                "--api-key",
                platform.api_key,
                "--nats-url",
                platform.stack.nats_url,
            ],
        )
        assert evaluated.exit_code == 0, evaluated.output
        assert evaluated.stdout.startswith("PASS: suite arithmetic: candidate")
        deadline = time.monotonic() + 150
        while status(platform)["state"] == "canary" and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)  # traffic after the promotion
    assert load.errors == []
    history = json.loads(cli(platform, "release", "status", "--model", MODEL, "--history", "--json"))[0]
    canary_states = history[[h["reason"] for h in history].index("canary started at 25%, eval gate: suite arithmetic"):]
    shares = [h["share"] for h in canary_states if h["state"] in ("canary", "promoted")]
    assert shares[0] == 0.25 and shares[-1] == 1.0 and 0.5 in shares, [(h["state"], h["reason"]) for h in canary_states]
    assert canary_states[-1]["state"] == "promoted" and canary_states[-1]["stable"] == candidate
    assert "SLO gate passed" in canary_states[-1]["reason"] and "eval gate passed" in canary_states[-1]["reason"]
    assert any(h["eval_verdict"] == "pass" for h in canary_states)

    # Usage names the release that served each request: both during the canary, only the
    # candidate's after the promotion.
    events = read_usage(platform, "demo", set(load.ids), timeout=20)
    by_release = {e.release for e in events}
    assert by_release == {stable, candidate}
    # Accepted after the promotion (and the second gateways take to see it): the candidate's. (Not
    # "the last N to finish": on a busy machine some accepted before it finish after it.)
    promoted_at = canary_states[-1]["updated"]
    after = [e for e in events if e.started > promoted_at + 1.0]
    assert after and {e.release for e in after} == {candidate}

    # The billing rollups group by release: each release's requests (the load's, plus the eval
    # run's pinned ones) are counted under it.
    served = {release: sum(1 for e in events if e.release == release) for release in (stable, candidate)}

    def by_release() -> dict[str | None, int] | None:
        response = httpx.get(
            platform.base_url + "/usage",
            headers={"authorization": f"Bearer {platform.api_key}"},
            params={"start_time": int(time.time()) - 3600, "bucket_width": "1d", "group_by": "release"},
        )
        assert response.status_code == 200, response.text
        counts = {r["release"]: r["num_model_requests"] for b in response.json()["data"] for r in b["results"]}
        return counts if all(counts.get(release, 0) >= n for release, n in served.items()) else None

    deadline = time.monotonic() + 30
    while (counts := by_release()) is None:
        assert time.monotonic() < deadline, f"the rollups never counted {served} by release"
        time.sleep(0.5)
    assert set(served) <= set(counts)


def test_slower_candidate_is_rolled_back_by_the_slo_gate(platform: Platform, replicas: Replicas) -> None:
    stable_dir = replicas.model_dir("stable", 0.95)
    stable = replicas.create(stable_dir)
    cli(platform, "release", "stable", stable)
    for _ in range(2):
        replicas.start(stable_dir, stable)
    slow_dir = replicas.model_dir("slow", 0.95, weights=b"weights-slow")
    slow = replicas.create(slow_dir, "engine upgrade with slower steps")
    replicas.start(slow_dir, slow, step_ms=STEP_MS * 2.5)

    with Load(platform) as load:
        time.sleep(2)
        start_canary(platform, slow)
        seen = decisions(platform, MODEL, {"promote", "rollback"}, timeout=150)
        time.sleep(1)
    assert load.errors == []
    assert seen[-1].action == "rollback", [(d.action, d.reason) for d in seen]
    assert "tpot p90" in seen[-1].reason and "SLO gate failed" in seen[-1].reason
    assert seen[-1].slo["candidate_requests"] >= 40
    now = status(platform)
    assert now["state"] == "rolled_back" and now["stable"] == stable and now.get("share", 0) == 0


def test_worse_eval_candidate_is_rolled_back_by_the_eval_gate(platform: Platform, replicas: Replicas) -> None:
    stable_dir = replicas.model_dir("stable", 0.95)
    stable = replicas.create(stable_dir)
    cli(platform, "release", "stable", stable)
    replicas.start(stable_dir, stable)
    broken_dir = replicas.model_dir("broken", 0.75, weights=b"weights-broken")
    broken = replicas.create(broken_dir, "a broken checkpoint")
    replicas.start(broken_dir, broken)
    start_canary(platform, broken, "--eval-suite", "arithmetic")

    with Decisions(platform, MODEL) as watch:
        result = CliRunner().invoke(main, ["eval", "arithmetic", "--release", record.short(broken), "--repeats", "8",
                                           "--url", platform.stack.gateway_url, "--api-key", platform.api_key,
                                           "--nats-url", platform.stack.nats_url])
        assert result.exit_code == 1, result.output
        assert result.stdout.startswith("FAIL: suite arithmetic: candidate")
        seen = watch.until({"rollback"}, timeout=30)
    assert seen and seen[-1].action == "rollback" and "eval gate failed" in seen[-1].reason
    assert status(platform)["state"] == "rolled_back"


def both_serving(platform: Platform, replicas: Replicas) -> tuple[str, str]:
    """A stable release and a candidate of the same quality, a replica of each serving."""
    stable_dir = replicas.model_dir("stable", 0.95)
    stable = replicas.create(stable_dir)
    cli(platform, "release", "stable", stable)
    replicas.start(stable_dir, stable)
    candidate_dir = replicas.model_dir("candidate", 0.95, weights=b"weights-candidate")
    candidate = replicas.create(candidate_dir)
    replicas.start(candidate_dir, candidate)
    return stable, candidate


def test_a_pinned_request_is_served_by_its_release_while_the_router_is_stopped(platform: Platform,
                                                                               replicas: Replicas) -> None:
    """Without the router's answer a request goes to the shared queue, which a worker of any
    release pulls: an eval run pinned to the candidate would score the stable release's answers
    (one CI run's candidate scored 87.8% where its engine answers 80.9%). The gateway places a
    pinned request on a worker of its release itself; the billing ledger says who served it."""
    stable, candidate = both_serving(platform, replicas)
    start_canary(platform, candidate)
    router = platform.stack.get("router")
    router.signal(signal.SIGSTOP)  # alive to NATS, answering nothing: every placement goes unanswered
    pinned: dict[str, str] = {}
    try:
        client = platform.client()
        for index in range(24):
            # Not alternating: the shared queue's two pullers take turns, which could match it.
            release = candidate if index < 12 else stable
            reply = client.chat.completions.create(
                model=MODEL, max_tokens=4, seed=index,
                messages=[{"role": "user", "content": f"What is {index} + 7? Answer with the number."}],
                extra_headers={"inferbus-release": record.short(release)})
            pinned[reply.id.removeprefix("chatcmpl-")] = release
    finally:
        router.signal(signal.SIGCONT)
        cli(platform, "release", "rollback", MODEL)
    events = read_usage(platform, "demo", set(pinned), timeout=30)
    served = {event.request_id: event.release for event in events}
    assert served == pinned


def test_a_request_pinned_to_another_release_is_handed_back_unrun(platform: Platform, replicas: Replicas) -> None:
    """A dead worker's queue is moved to the shared queue, which every release's workers pull. A
    worker that finds a request pinned to another release there hands it back to its gateway unrun
    (a retryable error before any token: the gateway places the next attempt on its release) and
    bills nothing for it."""
    stable_dir = replicas.model_dir("stable", 0.95)
    stable = replicas.create(stable_dir)
    cli(platform, "release", "stable", stable)
    replicas.start(stable_dir, stable)
    candidate = replicas.create(replicas.model_dir("candidate", 0.95, weights=b"weights-candidate"))
    owner = "pin-test"  # a gateway, as far as the worker can tell

    def request(release: str | None, pinned: bool) -> m.InferenceRequest:
        now = time.time()
        return m.InferenceRequest(
            request_id=uuid.uuid4().hex, tenant="demo", model=MODEL, prompt="What is 2 + 7?", created=now,
            deadline=now + 60, sampling=m.SamplingParams(max_new_tokens=4, temperature=0.0),
            reply_to=subjects.token_subject(owner), release=release, release_pinned=pinned)

    elsewhere = [request(candidate, True) for _ in range(4)]
    here = [request(stable, True), request(None, False)]
    events: dict[str, list[m.StreamEvent]] = {r.request_id: [] for r in elsewhere + here}

    async def moved_to_the_shared_queue() -> None:
        nc = await nats.connect(platform.stack.nats_url)
        js = nc.jetstream()

        async def on_frame(msg: Msg) -> None:
            for event in msgspec.msgpack.decode(msg.data, type=m.StreamFrame).events:
                events[event.request_id].append(event)

        sub = await nc.subscribe(subjects.event_filter(owner), cb=on_frame)
        try:
            subject = subjects.request_subject("standard", MODEL, subjects.ANY_TARGET, subjects.token_subject(owner))
            for item in elsewhere + here:
                await dispatch(js, item)
                await js.publish(subject, m.encode(item.on_wire()), headers={"Nats-Msg-Id": item.request_id})
            await await_for(lambda: all(isinstance(e[-1], (m.Final, m.StreamError)) for e in events.values() if e)
                            and all(events.values()), 60, what="every request ended")
        finally:
            await sub.unsubscribe()
            await nc.close()

    asyncio.run(moved_to_the_shared_queue())
    for item in elsewhere:
        [refused] = events[item.request_id]
        assert isinstance(refused, m.StreamError) and refused.retryable and refused.code == "release_mismatch"
        assert refused.message == f"pinned to release {candidate}, this worker serves {stable}"
    for item in here:
        assert isinstance(events[item.request_id][-1], m.Final)
    billed = {event.request_id: event.release for event in read_usage(platform, "demo", set(events), timeout=5)}
    assert billed == {item.request_id: stable for item in here}


def test_a_pinned_request_handed_back_is_served_by_its_release(platform: Platform, replicas: Replicas) -> None:
    """The gateway's side of the hand-back: a pinned request that reached a worker of another
    release (here its first attempt is put on that worker's own queue) comes back unrun as a
    retryable `release_mismatch`; the gateway places the next attempt on a worker of the pinned
    release, and the client gets that release's whole answer, billed once, to that release."""
    from services.gateway.dispatch import Dispatcher

    stable, candidate = both_serving(platform, replicas)
    gateway = "pin-gateway"

    async def serve() -> tuple[str, list[str], list[str | None], str]:
        nc = await nats.connect(platform.stack.nats_url, name="test-dispatcher")
        kv = await nc.jetstream().key_value(subjects.WORKERS_BUCKET)
        dispatcher = Dispatcher(nc, kv, gateway_id=gateway, heartbeat_ttl_s=3.0, max_attempts=3,
                                placement_timeout_s=0)
        await dispatcher.start()
        try:
            releases = lambda: {beat.release for _, beat in dispatcher.live_workers.values()}  # noqa: E731
            await await_for(lambda: releases() >= {stable, candidate}, 30, what="both releases' heartbeats")
            [wrong] = [worker_id for worker_id, (_, beat) in dispatcher.live_workers.items() if beat.release == stable]
            place, whys, placed = dispatcher._place, [], []

            async def first_on_the_wrong_release(flight: Flight) -> m.PlacementReply:
                reply = (m.PlacementReply(target=subjects.worker_target(wrong), worker_id=wrong)
                         if flight.request.attempt == 0 else await place(flight))
                placed.append(reply.worker_id)
                return reply

            migrate = dispatcher.migrate

            async def migrating(flight: Flight, why: str) -> bool:
                whys.append(why)
                return await migrate(flight, why)

            dispatcher._place = first_on_the_wrong_release  # type: ignore[method-assign]
            dispatcher.migrate = migrating  # type: ignore[method-assign]
            now = time.time()
            request = m.InferenceRequest(
                request_id=uuid.uuid4().hex, tenant="demo", model=MODEL, prompt="What is 2 + 7?", created=now,
                deadline=now + 60, sampling=m.SamplingParams(max_new_tokens=8, temperature=0.0),
                reply_to=subjects.token_subject(gateway), release=candidate, release_pinned=True)
            flight = await dispatcher.open(request)
            text = [event.text async for event in dispatcher.events(flight)
                    if isinstance(event, (m.TokenChunk, m.Final))]
            return request.request_id, whys, placed, "".join(text)
        finally:
            await dispatcher.stop()
            await nc.close()

    request_id, whys, placed, text = asyncio.run(serve())
    assert whys == ["release_mismatch"] and text
    assert len(placed) == 2 and placed[1] not in (None, placed[0]), placed  # the next attempt: the candidate's worker
    [billed] = read_usage(platform, "demo", {request_id}, timeout=10)
    assert billed.release == candidate and billed.usage.completion_tokens > 0


def test_pins_are_checked_at_the_gateway(platform: Platform, replicas: Replicas) -> None:
    stable_dir = replicas.model_dir("stable", 0.95)
    stable = replicas.create(stable_dir)
    cli(platform, "release", "stable", stable)
    replicas.start(stable_dir, stable)
    client = platform.client()
    answer = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "What is 2 + 3?"}],
        extra_headers={"inferbus-release": record.short(stable)}, seed=1)
    assert answer.parse().choices[0].message.content in {str(v) for v in (5, -5, 3, 4, 6, 7, 15)}
    import openai

    with pytest.raises(openai.BadRequestError, match="is not serving"):
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                       extra_headers={"inferbus-release": "deadbeefdeadbeef"})


def test_worker_refuses_a_model_dir_that_is_not_its_release(platform: Platform, replicas: Replicas) -> None:
    good = replicas.model_dir("good", 0.95)
    release = replicas.create(good)
    tampered = replicas.model_dir("tampered", 0.95)
    (tampered / "model.safetensors").write_bytes(b"weights-v1" * 999 + b"x")
    _, worker = replicas.start(tampered, release, wait=False)
    assert worker.wait(60), "the worker kept running on files that are not its release"
    assert worker.returncode != 0
    log = worker.tail(40)
    assert "refusing to serve release" in log and "model.safetensors has sha256" in log


def test_worker_refuses_adapter_files_that_are_not_their_version(platform: Platform, replicas: Replicas,
                                                                 tmp_path: Path) -> None:
    stable_dir = replicas.model_dir("stable", 0.95)
    stable = replicas.create(stable_dir)
    cli(platform, "release", "stable", stable)
    replicas.start(stable_dir, stable)
    adapter = tmp_path / "adapter-v2"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"lora-v2" * 100)
    digest = record.directory_digest(adapter)
    with platform.admin() as admin:
        for name, version in (("tenant-bot", digest), ("tampered-bot", digest)):
            assert (
                admin.post(
                    "/adapters",
                    json={
                        "name": name,
                        "version": version,
                        "path": str(adapter if name == "tenant-bot" else tmp_path / "copy"),
                    },
                ).status_code
                == 201
            )
    shutil.copytree(adapter, tmp_path / "copy")
    (tmp_path / "copy" / "adapter_model.safetensors").write_bytes(b"lora-v3" * 100)
    client = platform.client()
    served = client.chat.completions.create(
        model="tenant-bot", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
    )
    assert served.choices[0].message.content
    import openai

    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="tampered-bot", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert "the registered version is " + digest in str(refused.value)


def test_worker_refuses_an_engine_image_that_is_not_its_release(platform: Platform, replicas: Replicas) -> None:
    """The kubelet's `imageID` of the engine container, read from the worker's own pod over the
    Kubernetes API (here a local server answering as the API does), is not the release's image."""
    from http.server import ThreadingHTTPServer

    from tests.test_engine_image import OTHER, _Api, pod

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Api.status, _Api.served = 200, pod("docker.io/inferbus/sim-engine@" + OTHER)
    try:
        good = replicas.model_dir("good", 0.95)
        release = replicas.create(good)
        _, worker = replicas.start(
            good,
            release,
            wait=False,
            worker_env={
                "INFERBUS_ENGINE_IMAGE_CHECK": "kubernetes",
                "INFERBUS_K8S_API_URL": f"http://127.0.0.1:{server.server_address[1]}",
                "INFERBUS_POD_NAME": "worker-7c9f-abcde",
                "INFERBUS_POD_NAMESPACE": "inferbus",
            },
        )
        assert worker.wait(60), "the worker kept running on an engine image that is not its release's"
        assert worker.returncode != 0
        log = worker.tail(40)
        assert "refusing to serve release" in log and f"the engine runs image {OTHER}, the release pins {IMAGE}" in log
        assert ("/api/v1/namespaces/inferbus/pods/worker-7c9f-abcde", None) in _Api.seen
    finally:
        server.shutdown()
