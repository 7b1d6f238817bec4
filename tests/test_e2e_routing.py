"""Prefix- and adapter-affinity routing with real processes: the router's view comes from the
engines' KV-cache events (ZMQ → worker → NATS), placements follow cached prefixes, adapters are
registered, loaded on demand and verified, and the router survives restarts and worker deaths.

One platform of three workers; tests run in file order and the last ones kill processes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import nats
import openai
import pytest
from nats.aio.msg import Msg

from proto import messages as m
from proto import subjects
from tools.capacity.traces import _WORDS

from .conftest import MODEL, Platform, read_usage, running_platform
from .waiting import await_for, wait_for

pytestmark = pytest.mark.e2e

HEARTBEAT_TTL_S = 3.0  # wide enough for a burst of 8k-token prompts to be placed on a busy 2-core machine
DIGEST = "sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(
        tmp_path_factory.mktemp("routing"), workers=3, time_scale=0.1,
        # Engines that answer 200 to any adapter load (as lazily loading engines do): the worker
        # must catch a bad adapter by verifying, not by trusting the load call.
        engine_args=["--lazy-lora-loading"],
        extra_env={
            "INFERBUS_HEARTBEAT_INTERVAL_S": "0.3",
            "INFERBUS_HEARTBEAT_TTL_S": str(HEARTBEAT_TTL_S),
            "INFERBUS_REQUEST_TIMEOUT_S": "20",
            "INFERBUS_ROUTER_RECOVERY_SCAN_S": "1",
            "INFERBUS_WORKER_MAX_RUNNING": "6",
            "INFERBUS_ACK_WAIT_S": "2",
            # Generous: on a busy 2-core CI machine a placement may take tens of milliseconds, and
            # a late one goes to the shared queue, which some tests must tell apart.
            "INFERBUS_PLACEMENT_TIMEOUT_MS": "500",
        },
    ) as running:
        yield running


def prefix(family: int, tokens: int = 2048) -> str:
    """A long shared prefix: `tokens` one-token words, different per family."""
    return "".join(_WORDS[(family * 7919 + i * 31) % len(_WORDS)] for i in range(tokens))


def complete(platform: Platform, prompt: str, model: str = MODEL, max_tokens: int = 4) -> openai.types.Completion:
    return platform.client(timeout=60).completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0
    )


def cached(response: openai.types.Completion) -> int:
    details = response.usage.prompt_tokens_details  # type: ignore[union-attr]
    return details.cached_tokens if details else 0


def test_turns_of_a_conversation_find_their_prefix_cached(fleet: Platform) -> None:
    # Four conversations, interleaved; each later turn extends the shared prefix of its family.
    hits, totals = 0, 0
    for turn in range(4):
        for family in range(4):
            response = complete(fleet, prefix(family) + f" turn {turn}")
            if turn > 0:
                hits += cached(response)
                totals += response.usage.prompt_tokens  # type: ignore[union-attr]
    # Without affinity a later turn lands on its prefix's worker one time in three.
    assert hits / totals > 0.85, f"prefix hit rate {hits / totals:.2f}"


def test_independent_prefixes_spread_over_the_workers(fleet: Platform) -> None:
    """The router spreads prompts that share no prefix over the workers. Its choices are read from
    what it tells its replicas (`Placed`), made whether or not the gateway still waited for the
    answer: on a loaded machine a late answer sends its request to the shared queue, which two
    workers with six slots each can drain alone."""
    async def placed_while(send: Callable[[], set[str]]) -> tuple[set[str], list[str]]:
        nc = await nats.connect(fleet.stack.nats_url)
        chosen: list[str] = []

        async def on_placed(msg: Msg) -> None:
            chosen.append(msgspec.msgpack.decode(msg.data, type=m.Placed).worker_id)

        await nc.subscribe(subjects.placed_subject(MODEL), cb=on_placed)
        await nc.flush()
        try:
            ids = await asyncio.to_thread(send)
            await await_for(lambda: len(chosen) >= len(ids), 30, what="the router's placements")
            return ids, chosen
        finally:
            await nc.close()

    def send() -> set[str]:
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            return {response.id.removeprefix("cmpl-") for response in
                    pool.map(lambda f: complete(fleet, prefix(100 + f, 1024), max_tokens=40), range(12))}

    ids, chosen = asyncio.run(placed_while(send))
    assert len(ids) == 12 and len(chosen) == 12, chosen
    assert len(set(chosen)) == 3, chosen
    assert len(read_usage(fleet, "demo", ids)) == 12  # each answered, once


def test_adapters_register_with_a_pinned_version_and_list_for_the_tenant(fleet: Platform) -> None:
    with fleet.admin() as admin:
        refused = admin.post("/adapters", json={"name": "support-bot", "version": "latest", "path": "s3://ok/support"})
        assert refused.status_code == 400 and "pinned digest" in refused.json()["error"]["message"]
        created = admin.post("/adapters", json={"name": "support-bot", "version": DIGEST, "path": "s3://ok/support"})
        assert created.status_code == 201, created.text
        assert created.json()["engine_name"] == "support-bot@" + "ab" * 6
        assert (
            admin.post("/adapters", json={"name": "broken", "version": DIGEST, "path": "missing/weights"}).status_code
            == 201
        )

    def listed() -> dict[str, openai.types.Model] | None:
        models = {card.id: card for card in fleet.client().models.list().data}
        return models if "broken" in models else None

    models = wait_for(listed, 30, interval=0.1, what="the adapters listed")
    assert set(models) == {MODEL, "support-bot", "broken"}
    assert models["support-bot"].model_extra["parent"] == MODEL


def test_an_adapter_is_loaded_on_demand_and_requests_follow_it(fleet: Platform) -> None:
    first = complete(fleet, "hello adapter", model="support-bot")
    assert first.model == "support-bot" and first.choices[0].text
    ids = {first.id.removeprefix("cmpl-")}
    for i in range(5):
        ids.add(complete(fleet, f"again {i}", model="support-bot").id.removeprefix("cmpl-"))
    events = read_usage(fleet, "demo", ids)
    assert {event.adapter for event in events} == {"support-bot@" + "ab" * 6}
    # The worker that loaded it keeps most of its traffic. An adapter with a large share of recent
    # traffic (here most of it) may take a second home when its first is busier (adapter_slots.py).
    per_worker = Counter(event.worker_id for event in events)
    assert len(per_worker) <= 2 and per_worker.most_common(1)[0][1] >= 4, per_worker


def test_a_bad_adapter_is_caught_by_verification_not_served(fleet: Platform) -> None:
    with pytest.raises(openai.APIStatusError) as raised:
        complete(fleet, "hello", model="broken")
    assert raised.value.status_code == 503
    assert "failed verification" in raised.value.message
    with pytest.raises(openai.NotFoundError):
        complete(fleet, "hello", model="nobody-registered-this")


def test_a_router_restart_rebuilds_its_view_from_the_workers(fleet: Platform) -> None:
    warm = [prefix(20 + family) for family in range(3)]
    for text in warm:
        complete(fleet, text + " first")
    router = fleet.stack.get("router")
    router.signal(signal.SIGKILL)
    router.wait(5)
    # Without a router the gateway still serves, from the shared queue.
    assert complete(fleet, prefix(30, 256)).choices[0].text
    _restart_router(fleet)
    # The new router knows only what the workers' cache snapshots told it, and each prefix's first
    # request goes where that prefix is cached. (A router placing by load alone would find all
    # three one time in 27.)
    for text in warm:
        assert cached(complete(fleet, text + " after the restart")) >= 1984, (
            "the restarted router did not learn where the prefix is cached"
        )


def _restart_router(platform: Platform) -> None:
    """Start the router again and wait until it is ready and every worker has sent it a snapshot."""
    router = platform.stack.get("router")
    workers = [process.log_path for process in platform.stack.processes if process.name.startswith("worker-")]

    def logged(path: Path, event: bytes) -> int:
        return path.read_bytes().count(b'"%s"' % event)

    def applied() -> set[str]:
        """Workers whose snapshot the restarted router applied (its log from the restart on)."""
        lines = router.log_path.read_bytes()[offset:].splitlines()
        return {json.loads(line).get("worker_id") for line in lines if b'"cache_snapshot_applied"' in line}

    ready, snapshots = (
        logged(router.log_path, b"router_ready"),
        [logged(path, b"cache_snapshot_sent") for path in workers],
    )
    offset = router.log_path.stat().st_size
    router.start()
    wait_for(lambda: logged(router.log_path, b"router_ready") > ready and all(
        logged(path, b"cache_snapshot_sent") > before for path, before in zip(workers, snapshots)
    ) and len(applied()) == len(workers), 30, what="the restarted router ready with every worker's snapshot applied")


def test_a_dead_workers_queue_moves_to_the_others_and_nothing_runs_twice(fleet: Platform) -> None:
    # A worker hangs (SIGSTOP) while streams run on every worker; requests for a prefix it caches
    # keep being placed on it until its heartbeat expires, and wait in its queue. Then it dies:
    # the router moves its queue to the shared one, the gateway migrates its streams, and every
    # request completes, billed once.
    hot = prefix(11, 8192)  # long: recomputing it elsewhere costs more than waiting in a queue
    warm = complete(fleet, hot)
    [owner] = read_usage(fleet, "demo", {warm.id.removeprefix("cmpl-")})
    victim = fleet.stack.get(owner.worker_id)

    def run(prompt: str) -> openai.types.Completion:
        return complete(fleet, prompt, max_tokens=600)

    watch = _QueueWatch(fleet, owner.worker_id)  # connected now: on a busy machine that takes a while
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        streams = [pool.submit(run, prefix(300 + i, 512)) for i in range(9)]
        time.sleep(0.5)
        victim.signal(signal.SIGSTOP)
        # Counted only once the worker is stopped: before, a request it has pulled but not yet
        # acknowledged counts as waiting and then runs there, and the router has nothing to move.
        time.sleep(0.1)
        watch.start()
        # A burst, not a trickle: on a busy machine the heartbeat (3 s) can expire before a
        # trickle reaches the router, and then nothing is placed on the hung worker at all.
        queued = [pool.submit(run, hot + f" question {i}") for i in range(12)]
        waiting = watch.result(timeout=30)
        assert waiting >= 1, "no request was placed on the hung worker: the test cannot test recovery"
        killed_at = time.time()
        victim.signal(signal.SIGKILL)
        responses = [future.result(timeout=90) for future in streams + queued]
    assert all(r.usage.completion_tokens == 600 for r in responses)  # type: ignore[union-attr]
    ids = {r.id.removeprefix("cmpl-") for r in responses}
    events = read_usage(fleet, "demo", ids)
    billed = Counter(e.request_id for e in events)
    assert sorted(e.request_id for e in events) == sorted(ids), [  # one usage event each: billed once
        (e.request_id, e.worker_id, e.attempt, e.completion_tokens, e.finished - killed_at) for e in events
        if billed[e.request_id] > 1]
    assert all(e.worker_id != owner.worker_id or e.finished < killed_at for e in events)
    moved = sum(
        json.loads(line).get("moved", 0) for line in fleet.stack.get("router").log_path.read_text().splitlines()
        if '"recovered_queue"' in line and f'"{owner.worker_id}"' in line
    )
    assert moved >= waiting, f"{waiting} requests waited on the hung worker, the router moved {moved}"
    # The router forgot it within the heartbeat TTL: new work goes to the two others only. Sent by
    # a client that retries as the SDK does by default: the starts the failure delayed (over the
    # standard band's 3 s budget) may still be in the overload policy's 10 s window of measured
    # starts, which sheds new work with a `retry-after` until they age out.
    retrying = fleet.client(timeout=60).with_options(max_retries=5)
    later = {retrying.completions.create(model=MODEL, prompt=prefix(200 + i, 256), max_tokens=4, temperature=0)
             .id.removeprefix("cmpl-") for i in range(6)}
    assert all(e.worker_id != owner.worker_id for e in read_usage(fleet, "demo", later))


class _QueueWatch:
    """Watches a worker's own queue (JetStream consumer state: pending + unacknowledged) from a
    thread, on one connection, until the router recovers it and deletes the consumer; `result`
    is the largest count seen. A hung worker cannot acknowledge, so its queue only grows until then."""

    def __init__(self, platform: Platform, worker_id: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self._started = threading.Event()
        self._largest = self._pool.submit(self._watch, platform.stack.nats_url, worker_id, self._started)

    def start(self) -> None:
        """Count from now on (the watch connects when it is made)."""
        self._started.set()

    def result(self, timeout: float) -> int:
        try:
            return self._largest.result(timeout=timeout)
        finally:
            self._pool.shutdown(wait=False)

    @staticmethod
    def _watch(nats_url: str, worker_id: str, started: threading.Event) -> int:
        import asyncio

        import nats
        import nats.js.errors

        from proto import subjects

        async def watch() -> int:
            nc = await nats.connect(nats_url)
            js, consumer, largest = nc.jetstream(), subjects.request_consumer("standard", MODEL, worker_id), 0
            try:
                await asyncio.to_thread(started.wait, 60)
                while True:
                    try:
                        info = await js.consumer_info(subjects.REQUESTS_STREAM, consumer)
                    except nats.js.errors.NotFoundError:
                        return largest
                    largest = max(largest, (info.num_pending or 0) + (info.num_ack_pending or 0))
                    await asyncio.sleep(0.05)
            finally:
                await nc.close()

        return asyncio.run(watch())
