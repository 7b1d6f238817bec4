"""The engine KV-event wire format (SGLang 0.5.23), the simulated engine's ZMQ publisher over a real
socket in both bind modes, and the rebuilding of engine pages into the platform's prefix blocks."""

import random
import time

import msgspec
import pytest
import zmq

from inferbus.local.ports import free_port
from inferbus.tokens import kv_events
from inferbus.tokens.blocks import block_hashes
from inferbus.tokens.kv_blocks import BlockChains, Changes
from services.sim_engine.kv_publisher import KvEventPublisher, KvEventsConfig
from services.sim_engine.radix_cache import RadixCache


def test_batches_are_sglangs_tagged_maps_and_round_trip() -> None:
    batch = kv_events.EventBatch(ts=1.5, events=[
        kv_events.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[5] * 8, block_size=4,
                              lora_name="x@1"),
        kv_events.BlockRemoved(block_hashes=[1]),
        kv_events.AllBlocksCleared(),
    ], attn_dp_rank=0)
    frames = kv_events.encode(7, batch)
    assert frames[0] == b"" and frames[1] == (7).to_bytes(8, "big")
    seq, decoded = kv_events.decode(frames)
    assert seq == 7 and decoded == batch
    raw = msgspec.msgpack.decode(frames[2])
    assert raw[0] == 1.5 and raw[2] == 0
    assert raw[1][0] == {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                         "token_ids": [5] * 8, "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": "x@1"}
    assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
    assert raw[1][2] == {"type": "AllBlocksCleared"}
    with pytest.raises(ValueError):
        kv_events.decode([b"", b"\0" * 8])
    with pytest.raises(ValueError):
        kv_events.decode([b"", b"\0" * 8, msgspec.msgpack.encode({"not": "a batch"})])


def test_older_publishers_tagged_arrays_are_read_too() -> None:
    payload = msgspec.msgpack.encode([2.0, [["BlockStored", [9], None, [1, 2], 2, None], ["BlockRemoved", [9]],
                                            ["AllBlocksCleared"]]])
    seq, batch = kv_events.decode([b"kv", (3).to_bytes(8, "big"), payload])
    assert seq == 3 and batch.attn_dp_rank is None
    assert batch.events[0] == kv_events.BlockStored(block_hashes=[9], parent_block_hash=None, token_ids=[1, 2],
                                                    block_size=2, lora_id=None)
    assert isinstance(batch.events[1], kv_events.BlockRemoved) and isinstance(
        batch.events[2], kv_events.AllBlocksCleared
    )


def test_config_takes_sglangs_json_and_refuses_nonsense() -> None:
    assert KvEventsConfig.parse(None) is None
    assert KvEventsConfig.parse('{"publisher": "zmq", "endpoint": "tcp://*:5557"}') == KvEventsConfig("tcp://*:5557")
    assert KvEventsConfig.parse('{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:1", "bind": true}').bind
    with pytest.raises(ValueError, match="JSON"):
        KvEventsConfig.parse("tcp://*:5557")
    with pytest.raises(ValueError, match="endpoint"):
        KvEventsConfig.parse('{"publisher": "kafka"}')
    # SGLang's heuristic: a concrete address is connected to, a wildcard one bound, unless "bind".
    assert not kv_events.publisher_binds({"endpoint": "tcp://127.0.0.1:5557"})
    assert kv_events.publisher_binds({"endpoint": "tcp://*:5557"})
    assert kv_events.publisher_binds({"endpoint": "tcp://127.0.0.1:5557", "bind": True})


@pytest.mark.parametrize("publisher_binds", [False, True])
def test_the_simulated_engine_publishes_its_cache_events_in_sequence(publisher_binds: bool) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    if not publisher_binds:
        subscriber.bind(endpoint)  # SGLang's publisher connects to a concrete address: the consumer binds
    publisher = KvEventPublisher(KvEventsConfig(endpoint, bind=publisher_binds))
    if publisher_binds:
        subscriber.connect(endpoint)
    cache = RadixCache(capacity_tokens=10_000, block_size=4)
    try:
        time.sleep(0.3)  # PUB/SUB: a subscriber sees only what is sent after it joined
        # A connecting PUB socket takes in the subscription only after its first sends (libzmq),
        # so its first batches are lost, as with SGLang's default: publish until one arrives.
        for warmup in range(20):
            cache.insert(block_hashes([9000 + warmup] * 4, 4), [9000 + warmup] * 4)
            publisher.publish(cache)
            if subscriber.poll(100):
                break
        expected, _ = kv_events.decode(subscriber.recv_multipart())
        assert expected == warmup and (warmup == 0 or not publisher_binds)  # numbered from 0, as SGLang does
        ids = list(range(16))
        hashes = block_hashes(ids, 4)
        cache.insert(hashes, ids)
        publisher.publish(cache)
        cache.clear()
        publisher.publish(cache)
        publisher.publish(cache)  # nothing new: nothing sent
        assert subscriber.poll(2000)
        seq, first = kv_events.decode(subscriber.recv_multipart())
        seq2, second = kv_events.decode(subscriber.recv_multipart())
        assert (seq, seq2) == (expected + 1, expected + 2)
        stored = first.events[0]
        assert isinstance(stored, kv_events.BlockStored) and stored.block_hashes == hashes and stored.token_ids == ids
        assert isinstance(second.events[0], kv_events.AllBlocksCleared)
        assert not subscriber.poll(100)
    finally:
        subscriber.close(0)
        publisher.close()


def _engine_events(ids: list[int], page: int, parent: int | None, start: int, salt: int) -> tuple[list[int], list[int]]:
    """Engine page hashes (any hash at all: here random) for ids[start:] in pages of `page`."""
    rng = random.Random(salt)
    full = len(ids) - len(ids) % page
    return [rng.getrandbits(63) for _ in range(start // page, full // page)], ids[start:full]


@pytest.mark.parametrize("page", [1, 16, 64, 48])
def test_engine_pages_rebuild_into_the_gateways_blocks_whatever_the_page_size(page: int) -> None:
    rng = random.Random(page)
    prompt = [rng.randrange(2048) for _ in range(700)]
    chains = BlockChains(64)
    changes = Changes()
    # First the prompt's first 300 tokens (rounded to pages), then the rest as a child event.
    cut = 300 - 300 % page
    first_hashes, first_ids = _engine_events(prompt[:cut], page, None, 0, 1)
    chains.stored(first_hashes, None, first_ids, page, "", changes)
    rest_hashes, rest_ids = _engine_events(prompt, page, first_hashes[-1], cut, 2)
    chains.stored(rest_hashes, first_hashes[-1], rest_ids, page, "", changes)
    full = len(prompt) - len(prompt) % page
    assert changes.stored == block_hashes(prompt[:full], 64)
    # A second request shares the first 256 tokens and diverges: only its new blocks are stored.
    other = prompt[:256] + [rng.randrange(2048) for _ in range(200)]
    branch_from = 256 - 256 % page
    parent = first_hashes[branch_from // page - 1]
    more = Changes()
    branch_hashes, branch_ids = _engine_events(other, page, parent, branch_from, 3)
    chains.stored(branch_hashes, parent, branch_ids, page, "", more)
    other_full = len(other) - len(other) % page
    # (A page straddling the fork completes the shared block again: it is stored once more.)
    assert more.stored == block_hashes(other[:other_full], 64)[branch_from // 64:]
    # Evicting the branch's pages removes the blocks only they hold: not one the first branch holds too.
    gone = Changes()
    chains.removed(branch_hashes, gone)
    assert sorted(gone.removed) == sorted(block_hashes(other[:other_full], 64)[256 // 64:])


def test_adapter_pages_hash_in_the_adapters_namespace_and_lost_parents_are_counted() -> None:
    ids = list(range(128))
    chains = BlockChains(64)
    changes = Changes()
    chains.stored(list(range(1000, 1128)), None, ids, 1, "sql@0123456789ab", changes)
    assert changes.stored == block_hashes(ids, 64, namespace="sql@0123456789ab") != block_hashes(ids, 64)
    lost = Changes()
    chains.stored([5], 424242, [1], 1, "", lost)
    assert lost.unknown_parents == 1 and not lost.stored
    cleared = Changes()
    chains.cleared(cleared)
    assert cleared.cleared and len(chains) == 0
