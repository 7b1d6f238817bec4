"""A worker's queue of LoRA adapter loads: when each queued adapter will be ready, learned from
the loads measured, and what the worker reports of it while loads are under way."""

from __future__ import annotations

import asyncio

import pytest

from proto import messages as m
from services.worker.adapter_loads import LoadQueue
from services.worker.adapters import AdapterError, Adapters


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_queued_load_waits_for_the_ones_ahead_of_it() -> None:
    clock = Clock()
    queue = LoadQueue(clock, default_s=0.5)
    assert queue.expected() == {} and queue.backlog_s() == 0.0
    for name in ("a", "b", "c"):
        queue.enqueue(name)
    queue.enqueue("b")  # asked twice: one load, it keeps its place
    assert queue.expected() == pytest.approx({"a": 0.5, "b": 1.0, "c": 1.5})
    queue.start("a")
    clock.now += 0.2
    assert queue.expected() == pytest.approx({"a": 0.3, "b": 0.8, "c": 1.3})
    clock.now += 0.8  # running past its estimate: expected to end soon, not to have ended
    assert queue.expected()["a"] == pytest.approx(0.05)
    queue.finish("a")  # took 1.0 s: the mean learns from it
    assert queue.mean_s == pytest.approx(1.0)
    assert queue.expected() == pytest.approx({"b": 1.0, "c": 2.0})
    queue.start("c")  # the engine took them in another order
    clock.now += 0.5
    queue.finish("c", measured=False)  # failed: no lesson about load times
    assert queue.mean_s == pytest.approx(1.0) and queue.expected() == pytest.approx({"b": 1.0})
    queue.finish("b", measured=False)  # dropped before it started (its lookup failed)
    assert queue.expected() == {}


def test_the_expected_time_of_a_load_follows_the_adapters_size_once_one_of_known_size_was_measured() -> None:
    clock = Clock()
    queue = LoadQueue(clock, default_s=0.5)
    queue.enqueue("small", 100_000_000)
    queue.start("small")
    clock.now += 0.25
    queue.finish("small")  # 400 MB/s, fixed costs included
    assert queue.one_load_s(800_000_000) == pytest.approx(2.0)
    assert queue.one_load_s(None) == pytest.approx(0.25)  # unknown size: the mean load
    queue.enqueue("big")
    queue.set_size("big", 800_000_000)  # its size learned after it was queued
    assert queue.expected() == pytest.approx({"big": 2.0})


class SlowEngine:
    """Loads that end when the test says so, so what the worker reports meanwhile can be read."""

    def __init__(self) -> None:
        self.release: dict[str, asyncio.Event] = {}
        self.loaded: dict[str, str] = {}

    async def load_lora(self, name: str, path: str) -> dict:
        await self.release.setdefault(name, asyncio.Event()).wait()
        self.loaded[name] = path
        return {"success": True, "loaded_adapters": dict(self.loaded)}

    async def probe(self, lora_name: str | None = None) -> None:
        return None


async def test_the_worker_reports_its_queued_loads_until_each_is_loaded() -> None:
    known = {
        name: m.AdapterSpec(name=name, base_model="m", version="sha256:" + "cd" * 32, path=f"s3://{name}", created=0)
        for name in ("a", "b")
    }

    async def lookup(name: str) -> m.AdapterSpec | None:
        return known.get(name)

    engine = SlowEngine()
    changes: list[int] = []
    answered: list[int] = []  # the engine answering loads is progress, not a hung GPU
    adapters = Adapters(engine, lookup, on_change=lambda: changes.append(1),  # type: ignore[arg-type]
                        on_progress=lambda: answered.append(1))
    a, b = known["a"].engine_name, known["b"].engine_name
    first = asyncio.ensure_future(adapters.ensure(a))
    second = asyncio.ensure_future(adapters.ensure(b))
    await asyncio.sleep(0.05)
    pending = adapters.pending_loads()
    assert list(pending) == [a, b] and pending[a] < pending[b]  # b waits for a's load
    assert adapters.one_load_s() == 0.0 and changes  # nothing measured yet; the report was asked for
    engine.release.setdefault(a, asyncio.Event()).set()
    await first
    assert list(adapters.pending_loads()) == [b] and adapters.one_load_s() > 0.0 and answered == [1]
    engine.release.setdefault(b, asyncio.Event()).set()
    await second
    assert adapters.pending_loads() == {} and adapters.names() == sorted([a, b])
    with pytest.raises(AdapterError):
        await adapters.ensure("nope@0123456789ab")  # not registered: fails and leaves no queued load
    assert adapters.pending_loads() == {}


def test_prefetches_load_after_every_load_a_request_waits_for() -> None:
    clock = Clock()
    queue = LoadQueue(clock, default_s=0.5)
    queue.enqueue("pre-1", background=True)
    queue.enqueue("pre-2", background=True)
    queue.enqueue("wanted")
    assert queue.next_up() == "wanted" and queue.prefetches() == 2
    assert queue.expected() == pytest.approx({"wanted": 0.5})  # nobody waits for a queued prefetch
    queue.enqueue("pre-2")  # a request asks for a queued prefetch: it goes ahead of the other
    assert [q.name for q in queue.in_turn()] == ["wanted", "pre-2", "pre-1"]
    queue.start("wanted")
    queue.finish("wanted")
    queue.start("pre-2")
    queue.finish("pre-2")
    queue.start("pre-1")
    assert queue.prefetches() == 1 and "pre-1" in queue.expected()  # in flight: it does delay the next load


async def test_a_worker_loads_what_requests_wait_for_before_its_prefetches() -> None:
    known = {
        name: m.AdapterSpec(name=name, base_model="m", version="sha256:" + "ef" * 32, path=f"s3://{name}", created=0)
        for name in ("busy", "pre", "wanted")
    }

    async def lookup(name: str) -> m.AdapterSpec | None:
        return known.get(name)

    engine = SlowEngine()
    order: list[str] = []
    load = engine.load_lora

    async def recording_load(name: str, path: str) -> dict:
        order.append(name.partition("@")[0])
        return await load(name, path)

    engine.load_lora = recording_load  # type: ignore[method-assign]
    adapters = Adapters(engine, lookup)  # type: ignore[arg-type]
    busy, pre, wanted = (known[n].engine_name for n in ("busy", "pre", "wanted"))
    first = asyncio.ensure_future(adapters.ensure(busy))
    await asyncio.sleep(0.02)  # the engine is loading `busy`
    prefetch = asyncio.ensure_future(adapters.ensure(pre, background=True))
    request = asyncio.ensure_future(adapters.ensure(wanted))
    await asyncio.sleep(0.02)
    assert adapters.prefetches() == 1 and list(adapters.pending_loads()) == [busy, wanted]
    for name in (busy, wanted, pre):
        engine.release.setdefault(name, asyncio.Event()).set()
    await asyncio.gather(first, prefetch, request)
    assert order == ["busy", "wanted", "pre"] and adapters.prefetches() == 0


async def test_an_adapter_being_verified_is_reported_as_a_load_ready_now() -> None:
    """The engine holds it (and counts it against its cap) before the worker's probe ends: a report
    without it would show the router room that is not there, and a prefetch into it evicts."""
    spec = m.AdapterSpec(name="new", base_model="m", version="sha256:" + "ab" * 32, path="s3://new", created=0)

    async def lookup(name: str) -> m.AdapterSpec | None:
        return spec if name == "new" else None

    engine = SlowEngine()
    probing = asyncio.Event()
    probed = asyncio.Event()

    async def slow_probe(lora_name: str | None = None) -> None:
        probing.set()
        await probed.wait()

    engine.probe = slow_probe  # type: ignore[method-assign]
    adapters = Adapters(engine, lookup)  # type: ignore[arg-type]
    engine.release.setdefault(spec.engine_name, asyncio.Event()).set()
    load = asyncio.ensure_future(adapters.ensure(spec.engine_name))
    await asyncio.wait_for(probing.wait(), 5)
    assert adapters.pending_loads() == {spec.engine_name: 0.0} and adapters.names() == []
    probed.set()
    await load
    assert adapters.pending_loads() == {} and adapters.names() == [spec.engine_name]
