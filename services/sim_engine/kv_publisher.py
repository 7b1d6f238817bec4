"""Publishes the simulated engine's prefix-cache events on ZMQ, as SGLang 0.5.23 does with
`--kv-events-config '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"}'`: the PUB socket
connects to a concrete address (the consumer binds it) and binds a wildcard one or when the config
says `"bind": true`; sequence numbers count from 0 at start, topic `""` unless configured.

Without an endpoint the events are drained and dropped, so they never pile up in memory.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from inferbus.tokens import kv_events

from . import radix_cache
from .radix_cache import RadixCache


@dataclass(frozen=True)
class KvEventsConfig:
    endpoint: str
    topic: str = ""
    bind: bool = False  # SGLang's KVEventsConfig.bind: bind the endpoint even though it is concrete

    @classmethod
    def parse(cls, text: str | None) -> KvEventsConfig | None:
        """SGLang's JSON form; `publisher` must be `zmq` (or `null` to disable)."""
        if not text:
            return None
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--kv-events-config is not JSON: {error}") from None
        if spec.get("publisher", "zmq") in (None, "null"):
            return None
        if spec.get("publisher", "zmq") != "zmq" or not spec.get("endpoint"):
            raise ValueError('--kv-events-config needs {"publisher": "zmq", "endpoint": "tcp://host:port"}')
        return cls(endpoint=str(spec["endpoint"]), topic=str(spec.get("topic", "")), bind=bool(spec.get("bind", False)))


class KvEventPublisher:
    def __init__(self, config: KvEventsConfig | None) -> None:
        self.config = config
        self.seq = 0
        self._socket: Any = None  # a zmq PUB socket, when configured
        if config is not None:
            import zmq

            self._socket = zmq.Context.instance().socket(zmq.PUB)
            self._socket.setsockopt(zmq.SNDHWM, 100_000)
            self._socket.setsockopt(zmq.LINGER, 0)
            if kv_events.publisher_binds({"endpoint": config.endpoint, "bind": config.bind}):
                self._socket.bind(config.endpoint)
            else:
                self._socket.connect(config.endpoint)

    def publish(self, cache: RadixCache) -> None:
        events = cache.drain_events()
        if not events or self._socket is None or self.config is None:
            return
        batch = kv_events.EventBatch(ts=time.time(), events=[_convert(event) for event in events], attn_dp_rank=0)
        import zmq

        seq, self.seq = self.seq, self.seq + 1  # numbered from 0, sent or not, as SGLang does
        try:
            self._socket.send_multipart(kv_events.encode(seq, batch, self.config.topic.encode()), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # subscribers that fall behind lose events and see a sequence gap, as with SGLang

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None


def _convert(event: radix_cache.CacheEvent) -> kv_events.Event:
    if isinstance(event, radix_cache.BlockStored):
        return kv_events.BlockStored(
            block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids, block_size=event.block_size, lora_id=None, medium="GPU",
            lora_name=event.lora_name,
        )
    if isinstance(event, radix_cache.BlockRemoved):
        return kv_events.BlockRemoved(block_hashes=event.block_hashes)
    return kv_events.AllBlocksCleared()
