"""Block-level prefix cache with ref counts and LRU eviction, sharing one KV pool with running requests.

Blocks are identified by the chained hashes of `inferbus.tokens.blocks.block_hashes`, so a block's hash
names its whole prefix and the router (which hashes prompts the same way) can mirror this cache
from the events it emits. Pure: no I/O, no clock (recency is a logical counter).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class _Block:
    parent: int | None
    ref_count: int = 0
    children: int = 0
    last_use: int = 0


@dataclass
class RadixCache:
    """KV pool of `capacity_tokens`: cached blocks plus tokens privately held by running requests.

    A block may be evicted only when no request holds it and no cached block extends it, so a
    prefix never disappears before its continuations.
    """

    capacity_tokens: int
    block_size: int
    events: list[CacheEvent] = field(default_factory=list)
    private_tokens: int = 0
    _blocks: dict[int, _Block] = field(default_factory=dict)
    _evictable: list[tuple[int, int]] = field(default_factory=list)  # heap of (last_use, hash)
    _tick: int = 0
    _unreferenced: int = 0  # blocks no request holds: the most eviction could free

    @property
    def cached_tokens(self) -> int:
        return len(self._blocks) * self.block_size

    @property
    def used_tokens(self) -> int:
        return self.cached_tokens + self.private_tokens

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` in the cache; marks them recently used."""
        self._tick += 1
        matched = 0
        for block_hash in hashes:
            block = self._blocks.get(block_hash)
            if block is None:
                break
            block.last_use = self._tick
            matched += 1
        # A leaf's recency changed: re-queue it so the heap entry matches.
        if matched:
            self._push_if_evictable(hashes[matched - 1])
        return matched

    def insert(
        self,
        hashes: Sequence[int],
        token_ids: Sequence[int] = (),
        lora_name: str | None = None,
        start: int = 0,
    ) -> int:
        """Add the blocks of the chain `hashes` not yet cached; returns how many were new.

        The caller frees the private tokens these blocks held before inserting them, so the
        pool never goes over capacity. `start` skips leading blocks the caller knows are cached
        and pinned (a prompt cached chunk by chunk), so long prompts cost linear, not quadratic.
        """
        self._tick += 1
        new_start: int | None = None
        for index in range(start, len(hashes)):
            block_hash = hashes[index]
            block = self._blocks.get(block_hash)
            if block is not None:
                block.last_use = self._tick
                continue
            parent = hashes[index - 1] if index else None
            if parent is not None:
                self._blocks[parent].children += 1
            self._blocks[block_hash] = _Block(parent=parent, last_use=self._tick)
            self._unreferenced += 1
            if new_start is None:
                new_start = index
        if hashes:
            # The leaf's recency changed even when nothing was new (the same output cached again):
            # re-queue it, or its heap entry goes stale and the whole chain can never be evicted.
            self._push_if_evictable(hashes[-1])
        if new_start is None:
            return 0
        new = list(hashes[new_start:])
        size = self.block_size
        self.events.append(
            BlockStored(
                block_hashes=new,
                parent_block_hash=hashes[new_start - 1] if new_start else None,
                token_ids=list(token_ids[new_start * size : len(hashes) * size]),
                block_size=size,
                lora_name=lora_name,
            )
        )
        return len(new)

    def lock(self, hashes: Sequence[int]) -> None:
        """Pin cached blocks while a request uses them."""
        for block_hash in hashes:
            block = self._blocks[block_hash]
            if block.ref_count == 0:
                self._unreferenced -= 1
            block.ref_count += 1

    def unlock(self, hashes: Sequence[int]) -> None:
        for block_hash in hashes:
            block = self._blocks[block_hash]
            if block.ref_count == 0:
                raise RuntimeError(f"block {block_hash:#x} unlocked more often than locked")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._unreferenced += 1
        if hashes:
            self._push_if_evictable(hashes[-1])

    def allocate(self, tokens: int) -> bool:
        """Reserve `tokens` for a request's uncached KV, evicting unused blocks if needed."""
        if tokens > self.free_tokens:
            # Do not evict anything for an allocation that cannot succeed.
            if tokens > self.available_tokens():
                return False
            self.evict(tokens - self.free_tokens)
            if tokens > self.free_tokens:
                return False
        self.private_tokens += tokens
        return True

    def release(self, tokens: int) -> None:
        if tokens > self.private_tokens:
            raise RuntimeError(f"releasing {tokens} tokens but only {self.private_tokens} are held")
        self.private_tokens -= tokens

    def available_tokens(self) -> int:
        """Free tokens plus what eviction could reclaim."""
        return self.free_tokens + self._unreferenced * self.block_size

    def evict(self, tokens: int) -> int:
        """Evict least recently used unreferenced leaf blocks until `tokens` are freed; returns tokens freed."""
        removed: list[int] = []
        while self._evictable and len(removed) * self.block_size < tokens:
            last_use, block_hash = heapq.heappop(self._evictable)
            block = self._blocks.get(block_hash)
            # Stale heap entries: block gone, used since, now referenced or no longer a leaf.
            if block is None or block.last_use != last_use or block.ref_count or block.children:
                continue
            del self._blocks[block_hash]
            self._unreferenced -= 1
            removed.append(block_hash)
            if block.parent is not None:
                parent = self._blocks[block.parent]
                parent.children -= 1
                self._push_if_evictable(block.parent)
        if removed:
            self.events.append(BlockRemoved(block_hashes=removed))
        return len(removed) * self.block_size

    def clear(self) -> bool:
        """Drop every block; refused (False) while any block is in use."""
        if any(block.ref_count for block in self._blocks.values()):
            return False
        self._blocks.clear()
        self._evictable.clear()
        self._unreferenced = 0
        self.events.append(AllBlocksCleared())
        return True

    def block_hashes(self) -> list[int]:
        """Every cached block, for a snapshot of the cache."""
        return list(self._blocks)

    def drain_events(self) -> list[CacheEvent]:
        events, self.events = self.events, []
        return events

    def _push_if_evictable(self, block_hash: int) -> None:
        block = self._blocks.get(block_hash)
        if block is not None and block.ref_count == 0 and block.children == 0:
            heapq.heappush(self._evictable, (block.last_use, block_hash))
            if len(self._evictable) > 2 * len(self._blocks) + 1024:
                self._compact_heap()

    def _compact_heap(self) -> None:
        # Drop stale entries so repeated touches of hot prefixes do not grow the heap forever.
        self._evictable = [
            (block.last_use, block_hash)
            for block_hash, block in self._blocks.items()
            if block.ref_count == 0 and block.children == 0
        ]
        heapq.heapify(self._evictable)
