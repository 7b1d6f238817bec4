"""The router's prefix index fed by the engines' own cache events agrees with the engines.

Two simulated engine cores (the scheduler the simulated engine serves, page size 1 as SGLang on
CPU, or 16) run a shared-prefix workload placed by the affinity router. Their KV events are
rebuilt into platform blocks by the worker's `BlockChains` and fed to the router. With events that
match, the router's expectation of cached blocks is what the engine then reports (evictions
included), and the hit rate is at least that of the router's own placements alone: the events
never degrade routing.
"""

from __future__ import annotations

import random

import pytest

from inferbus.tokens.blocks import block_hashes
from inferbus.tokens.kv_blocks import BlockChains, Changes
from proto import messages as m
from services.router.config import RoutingConfig
from services.router.placement import make_placer
from services.sim_engine import radix_cache
from services.sim_engine.config import EngineConfig
from services.sim_engine.request import Request
from services.sim_engine.sampling import SamplingParams
from services.sim_engine.scheduler import Engine

BLOCK = 64
WORKERS = ("w1", "w2")
CAPACITY = 2_500  # tokens of KV per engine: less than the six prefixes, so engines evict


def _workload(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    families = [[rng.randrange(2048) for _ in range(rng.randrange(400, 900))] for _ in range(6)]
    requests = [family + [rng.randrange(2048) for _ in range(rng.randrange(20, 200))]
                for family in families for _ in range(5)]
    rng.shuffle(requests)
    return requests


def _relay(chains: BlockChains, events: list[radix_cache.CacheEvent], worker: str, seq: int) -> m.CacheEvent:
    """What the worker's relay sends the router for one batch of engine events."""
    out = m.CacheEvent(worker_id=worker, seq=seq, ts=0.0)
    for event in events:
        changes = Changes()
        if isinstance(event, radix_cache.BlockStored):
            chains.stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                          event.lora_name or "", changes)
            assert not changes.unknown_parents
            if changes.stored:
                out.stored.append(m.BlockStored(block_hashes=changes.stored, block_size=BLOCK))
        elif isinstance(event, radix_cache.BlockRemoved):
            chains.removed(event.block_hashes, changes)
            out.removed.extend(changes.removed)
        else:
            chains.cleared(changes)
            out.cleared = True
    return out


def _run(page: int, with_events: bool) -> tuple[float, list[tuple[int, int]]]:
    """(engine-reported hit rate, [(blocks the router expected cached, blocks the engine had)])."""
    now = [100.0]
    placer = make_placer("affinity", lambda: now[0], RoutingConfig(block_size=BLOCK, temperature=0.001),
                         random.Random(7))
    engines = {w: Engine(EngineConfig(block_size=page, fixed_step_ms=0, kv_capacity_tokens=CAPACITY)) for w in WORKERS}
    chains = {w: BlockChains(BLOCK) for w in WORKERS}
    seqs = dict.fromkeys(WORKERS, 0)
    placed = dict.fromkeys(WORKERS, 0)
    cached = prompt = 0
    expectations: list[tuple[int, int]] = []
    for index, ids in enumerate(_workload(seed=page)):
        now[0] += 0.5
        for worker in WORKERS:  # alive: heartbeats every second
            placer.registry.on_heartbeat(m.Heartbeat(worker_id=worker, model="m", engine_url="", started=0, ts=0,
                                                     max_running=8, block_size=BLOCK))
        ask = m.PlacementRequest(request_id=f"r{index}", model="m", prompt_tokens=len(ids),
                                 block_hashes=block_hashes(ids, BLOCK), block_size=BLOCK)
        reply = placer.place(ask)
        worker = reply.worker_id
        assert worker is not None
        placed[worker] += 1
        engine = engines[worker]
        request = Request(rid=f"r{index}", input_ids=ids, sampling=SamplingParams(max_new_tokens=4, temperature=0))
        engine.add(request)
        while engine.has_work:
            engine.step()
        cached += request.cached_tokens
        prompt += len(ids)
        expectations.append((reply.cached_blocks, request.cached_tokens // BLOCK))
        events = engine.cache.drain_events()
        if with_events:
            seqs[worker] += 1
            placer.registry.on_cache(_relay(chains[worker], events, worker, seqs[worker]))
        placer.registry.on_load(m.WorkerLoad(worker_id=worker, model="m", ts=0, seq=index + 1, running=0, waiting=0,
                                             in_flight=0, max_running=8, kv_used_tokens=0, kv_capacity_tokens=CAPACITY,
                                             pulled_own=placed[worker]))
    return cached / prompt, expectations


@pytest.mark.parametrize("page", [1, 16])
def test_engine_events_keep_the_hit_rate_of_placements_alone(page: int) -> None:
    with_events, expected = _run(page, with_events=True)
    placements_only, blind = _run(page, with_events=False)
    assert with_events >= placements_only > 0.5
    # With the events the router expects exactly the blocks the engine then finds, evictions
    # included; from its placements alone it expects blocks the engine has evicted.
    assert all(router <= engine for router, engine in expected), expected
    assert sum(router for router, _ in expected) >= 0.95 * sum(engine for _, engine in expected)
    assert any(router > engine for router, engine in blind)
