"""Engine KV-cache events on ZMQ, in the format SGLang and vLLM publish (`--kv-events-config`).

Each ZMQ message has three frames: topic, an 8-byte big-endian sequence number, and a msgpack
batch `[ts, [event, ...], dp_rank]` whose events are tagged arrays:
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id]`,
`["BlockRemoved", block_hashes]`, `["AllBlocksCleared"]`. The simulated engine publishes it and
the worker subscribes to it, relaying the events to the router as `proto.messages.CacheEvent`.
"""

from __future__ import annotations

from typing import Union

import msgspec


class BlockStored(msgspec.Struct, array_like=True, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None  # engines number adapters; the lora name travels separately
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, array_like=True, tag=True):
    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, array_like=True, tag=True):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode(seq: int, batch: EventBatch, topic: bytes = b"kv-events") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), _encoder.encode(batch)]


def decode(frames: list[bytes]) -> tuple[int, EventBatch]:
    """(sequence number, batch) from a ZMQ multipart message; raises ValueError if malformed."""
    if len(frames) != 3:
        raise ValueError(f"expected 3 frames, got {len(frames)}")
    try:
        return int.from_bytes(frames[1], "big"), _decoder.decode(frames[2])
    except msgspec.DecodeError as error:
        raise ValueError(str(error)) from error
