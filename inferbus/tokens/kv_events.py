"""Engine KV-cache events on ZMQ, as SGLang 0.5.23 publishes them (`--kv-events-config`).

Each ZMQ message has three frames: the topic (empty by default), an 8-byte big-endian sequence
number, and a msgpack batch `[ts, [event, ...], attn_dp_rank]`. Events are maps tagged by `type`:
`{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
"lora_id", "medium", "lora_name"}`, `{"type": "BlockRemoved", "block_hashes", "medium"}`,
`{"type": "AllBlocksCleared"}` (SGLang's `python/sglang/srt/disaggregation/kv_events.py`).
Older SGLang and vLLM releases sent each event as a tagged array (`["BlockStored", hashes, ...]`);
`decode` reads both. The block hashes are the engine's own: consumers rebuild their blocks from
`token_ids` (`inferbus.tokens.kv_blocks`), so the engine's hash function and page size do not matter.

The publisher's socket connects to a concrete address and binds only a wildcard one (`tcp://*:P`)
or when the config says `"bind": true`; the consumer must take the other side (`publisher_binds`).
"""

from __future__ import annotations

import json
from typing import Any, Union

import msgspec


class BlockStored(msgspec.Struct, tag=True, tag_field="type"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None  # engines number adapters; the name is what names a cache namespace
    medium: str | None = "GPU"
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, tag_field="type"):
    block_hashes: list[int]
    medium: str | None = "GPU"


class AllBlocksCleared(msgspec.Struct, tag=True, tag_field="type"):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Event]
    attn_dp_rank: int | None = None


# The array layout of older publishers: field order after the tag.
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}

_encoder = msgspec.msgpack.Encoder()
_raw_decoder = msgspec.msgpack.Decoder(list[Any])


def encode(seq: int, batch: EventBatch, topic: bytes = b"") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), _encoder.encode(batch)]


def _event(raw: Any) -> Event:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        names = _ARRAY_FIELDS.get(raw[0])
        if names is None:
            raise ValueError(f"unknown event type {raw[0]!r}")
        raw = {"type": raw[0], **dict(zip(names, raw[1:]))}
    return msgspec.convert(raw, Event)  # type: ignore[arg-type]


def decode(frames: list[bytes]) -> tuple[int, EventBatch]:
    """(sequence number, batch) from a ZMQ multipart message; raises ValueError if malformed."""
    if len(frames) != 3:
        raise ValueError(f"expected 3 frames, got {len(frames)}")
    try:
        raw = _raw_decoder.decode(frames[2])
        if len(raw) not in (2, 3) or not isinstance(raw[1], list):
            raise ValueError("expected [ts, [events], dp_rank]")
        batch = EventBatch(float(raw[0]), [_event(item) for item in raw[1]], raw[2] if len(raw) > 2 else None)
    except (msgspec.MsgspecError, TypeError) as error:
        raise ValueError(str(error)) from error
    return int.from_bytes(frames[1], "big"), batch


def publisher_binds(config: dict[str, Any]) -> bool:
    """Whether SGLang's publisher binds its endpoint (else it connects, and the consumer must bind)."""
    endpoint = str(config.get("endpoint", "tcp://*:5557"))
    wildcard = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    return bool(config.get("bind")) or wildcard


def parse_config(text: str) -> dict[str, Any]:
    """SGLang's `--kv-events-config` JSON; ValueError when it is not an object."""
    config = json.loads(text)
    if not isinstance(config, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    return config
