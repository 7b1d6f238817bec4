"""Relays the engine's KV-cache events (ZMQ) to the router (NATS), and answers resync requests.

The engine's events name its pages with its own hash at its own page size; the relay rebuilds
them from their token ids into the platform's prefix blocks (`inferbus.tokens.kv_blocks`), the blocks
the gateway hashes prompts into, and relays those. SGLang's publisher connects to a concrete
endpoint, so by default the relay binds it; with `"bind": true` in the engine's config (or a
wildcard endpoint) the engine binds and the relay connects (`INFERBUS_ENGINE_KV_EVENTS_BIND`).

The relay keeps a mirror of which blocks the engine holds, so that when a router starts or misses
an event it can send a snapshot instead of the router guessing. Events that arrive together are
coalesced into one `CacheEvent`; each carries this worker's next sequence number, which is how the
router notices a loss. The engine's own sequence numbers are checked too: a gap there (the engine
dropped events for a slow subscriber) is counted, and the mirror may then hold blocks the engine
evicted; the router's index ages those out.
"""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio
from nats.aio.client import Client
from prometheus_client import Counter

from inferbus.runtime import logs
from inferbus.tokens import kv_events
from inferbus.tokens.kv_blocks import BlockChains, Changes
from proto import messages as m
from proto import subjects

log = logs.get(__name__)

ENGINE_GAPS = Counter("inferbus_worker_engine_kv_event_gaps_total", "Sequence gaps in the engine's KV-cache events")
RELAYED = Counter("inferbus_worker_cache_events_total", "Cache events relayed to the router")
UNKNOWN_PARENTS = Counter(
    "inferbus_worker_kv_unknown_parent_total",
    "Engine BlockStored events whose parent page the relay never saw (lost events): not indexed",
)

SNAPSHOT_CHUNK = 50_000  # block hashes per message: stays well under NATS's 1 MB payload limit


class CacheRelay:
    def __init__(self, nc: Client, worker_id: str, endpoint: str, *, block_size: int, bind: bool = True) -> None:
        self.nc = nc
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.bind = bind  # bind the endpoint (the engine's publisher connects), else connect to it
        self.block_size = block_size
        self.chains = BlockChains(block_size)
        self.blocks: dict[int, None] = {}  # the engine's cached platform blocks, oldest first
        self.seq = 0
        self._engine_seq: int | None = None
        self._context = zmq.asyncio.Context.instance()
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # a snapshot and live events must not interleave

    def start(self) -> None:
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.RCVHWM, 100_000)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        if self.bind:
            socket.bind(self.endpoint)
        else:
            socket.connect(self.endpoint)
        self._socket = socket
        self._task = asyncio.create_task(self._run(), name="cache-relay")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._socket is not None:
            self._socket.close(0)

    async def _run(self) -> None:
        assert self._socket is not None
        while True:
            frames = [await self._socket.recv_multipart()]
            while True:  # coalesce whatever else is already here
                try:
                    frames.append(await self._socket.recv_multipart(flags=zmq.NOBLOCK))
                except zmq.Again:
                    break
            try:
                await self._relay(frames)
            except Exception as error:  # the relay must outlive one bad message or a NATS hiccup
                log.warning("cache_relay_failed", error=repr(error))

    async def _relay(self, messages: list[list[bytes]]) -> None:
        event = m.CacheEvent(worker_id=self.worker_id, seq=0, ts=time.time())
        for frames in messages:
            try:
                engine_seq, batch = kv_events.decode(frames)
            except ValueError as error:
                log.warning("bad_kv_event", error=str(error))
                continue
            if self._engine_seq is not None and engine_seq != self._engine_seq + 1:
                ENGINE_GAPS.inc()
                log.warning("engine_kv_event_gap", expected=self._engine_seq + 1, got=engine_seq)
            self._engine_seq = engine_seq
            for item in batch.events:
                self._apply(item, event)
        if event.stored or event.removed or event.cleared:
            async with self._lock:
                self.seq += 1
                event.seq = self.seq
                await self.nc.publish(subjects.cache_subject(self.worker_id), m.encode(event))
            RELAYED.inc()

    def _apply(self, item: kv_events.Event, event: m.CacheEvent) -> None:
        changes = Changes()
        if isinstance(item, kv_events.BlockStored):
            namespace = item.lora_name or ""
            self.chains.stored(item.block_hashes, item.parent_block_hash, item.token_ids, item.block_size,
                               namespace, changes)
            if changes.unknown_parents:
                UNKNOWN_PARENTS.inc(changes.unknown_parents)
            if changes.stored:
                for block in changes.stored:
                    self.blocks[block] = None
                event.stored.append(m.BlockStored(block_hashes=changes.stored, block_size=self.block_size,
                                                  adapter=item.lora_name))
        elif isinstance(item, kv_events.BlockRemoved):
            self.chains.removed(item.block_hashes, changes)
            for block in changes.removed:
                self.blocks.pop(block, None)
            event.removed.extend(changes.removed)
        else:
            self.chains.cleared(changes)
            self.blocks.clear()
            # A clear inside a coalesced event: what was stored before it is gone too.
            event.stored.clear()
            event.removed.clear()
            event.cleared = True

    async def engine_restarted(self) -> None:
        """A new engine process starts with an empty cache and says nothing about the old one's:
        forget its pages and tell the router (a snapshot of nothing)."""
        changes = Changes()
        self.chains.cleared(changes)
        self.blocks.clear()
        self._engine_seq = None
        await self.publish_snapshot()

    async def publish_snapshot(self) -> None:
        """Everything the engine holds, as a `cleared` event followed by more stored blocks."""
        async with self._lock:
            blocks = list(self.blocks)
            chunks = [blocks[i : i + SNAPSHOT_CHUNK] for i in range(0, len(blocks), SNAPSHOT_CHUNK)] or [[]]
            for index, chunk in enumerate(chunks):
                self.seq += 1
                event = m.CacheEvent(
                    worker_id=self.worker_id, seq=self.seq, ts=time.time(), cleared=index == 0,
                    stored=[m.BlockStored(block_hashes=chunk)] if chunk else [],
                )
                await self.nc.publish(subjects.cache_subject(self.worker_id), m.encode(event))
        log.info("cache_snapshot_sent", blocks=len(blocks), messages=len(chunks))
