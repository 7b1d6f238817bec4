"""The engine KV-event wire format and the simulated engine's ZMQ publisher, over a real socket."""

import time

import pytest
import zmq

from inferbus import kv_events
from inferbus.local import free_port
from inferbus.tokens import block_hashes
from services.sim_engine.kv_publisher import KvEventPublisher, KvEventsConfig
from services.sim_engine.radix_cache import RadixCache


def test_batches_round_trip_in_sglangs_array_layout() -> None:
    batch = kv_events.EventBatch(ts=1.5, events=[
        kv_events.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[5] * 8, block_size=4, lora_name="x@1"),
        kv_events.BlockRemoved(block_hashes=[1]),
        kv_events.AllBlocksCleared(),
    ])
    frames = kv_events.encode(7, batch)
    assert frames[0] == b"kv-events" and frames[1] == (7).to_bytes(8, "big")
    seq, decoded = kv_events.decode(frames)
    assert seq == 7 and decoded == batch
    import msgspec

    raw = msgspec.msgpack.decode(frames[2])
    assert raw[0] == 1.5 and raw[1][0][0] == "BlockStored" and raw[1][1] == ["BlockRemoved", [1]]
    with pytest.raises(ValueError):
        kv_events.decode([b"kv-events", b"\0" * 8])


def test_config_takes_sglangs_json_and_refuses_nonsense() -> None:
    assert KvEventsConfig.parse(None) is None
    assert KvEventsConfig.parse('{"publisher": "zmq", "endpoint": "tcp://*:5557"}') == KvEventsConfig("tcp://*:5557")
    with pytest.raises(ValueError, match="JSON"):
        KvEventsConfig.parse("tcp://*:5557")
    with pytest.raises(ValueError, match="endpoint"):
        KvEventsConfig.parse('{"publisher": "kafka"}')


def test_the_simulated_engine_publishes_its_cache_events_in_sequence() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = KvEventPublisher(KvEventsConfig(endpoint))
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(endpoint)
    cache = RadixCache(capacity_tokens=1000, block_size=4)
    try:
        time.sleep(0.2)  # PUB/SUB: a subscriber sees only what is sent after it joined
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
        assert (seq, seq2) == (1, 2)
        assert first.events[0].block_hashes == hashes and isinstance(second.events[0], kv_events.AllBlocksCleared)
        assert not subscriber.poll(100)
    finally:
        subscriber.close(0)
        publisher.close()
