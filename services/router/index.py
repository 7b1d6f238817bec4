"""Which worker holds which prefix blocks: the router's mirror of the engines' caches.

Fed by workers' cache events (blocks stored and evicted, with a per-worker sequence number so a
lost event is noticed) and by the router's own placements (a placed request's blocks will be on
that worker a moment later, before any event says so). Memory is bounded: each worker keeps at
most `max_blocks` entries, least recently used first out, and entries untouched for `ttl_s` are
dropped, so a missed eviction cannot make the router believe in a block forever.

Pure: no I/O; time comes from the caller.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


TOUCH_INTERVAL_S = 1.0


class PrefixIndex:
    """Block hash → bitmask of the workers holding it; per worker, its blocks in LRU order.

    Bitmasks (plain ints) rather than sets: a million indexed blocks then cost the garbage
    collector nothing to walk, and matching a prompt is one dict lookup and one AND per block.
    """

    def __init__(self, *, max_blocks_per_worker: int = 250_000, ttl_s: float = 900.0) -> None:
        self.max_blocks = max_blocks_per_worker
        self.ttl_s = ttl_s
        self._holders: dict[int, int] = {}  # block hash → bitmask of workers
        self._blocks: dict[str, OrderedDict[int, float]] = {}  # worker → block hash → last touched
        self._bit: dict[str, int] = {}  # worker → its bit
        self._worker_of_bit: dict[int, str] = {}
        self._last_seq: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(len(blocks) for blocks in self._blocks.values())

    def blocks_of(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def _bit_of(self, worker_id: str) -> int:
        bit = self._bit.get(worker_id)
        if bit is None:
            bit = next(b for b in range(len(self._bit) + 1) if b not in self._worker_of_bit)
            self._bit[worker_id] = bit
            self._worker_of_bit[bit] = worker_id
        return bit

    # ---- updates ---------------------------------------------------------------------------

    def add(self, worker_id: str, hashes: Iterable[int], now: float) -> None:
        blocks = self._blocks.get(worker_id)
        if blocks is None:
            blocks = self._blocks[worker_id] = OrderedDict()
        flag = 1 << self._bit_of(worker_id)
        holders = self._holders
        move = blocks.move_to_end
        stale = now - TOUCH_INTERVAL_S
        for block in hashes:
            touched = blocks.get(block)
            if touched is None:
                holders[block] = holders.get(block, 0) | flag
                blocks[block] = now
            elif touched < stale:  # recency is kept to a second: hot blocks cost one lookup
                move(block)
                blocks[block] = now
        while len(blocks) > self.max_blocks:
            oldest, _ = blocks.popitem(last=False)
            self._unhold(oldest, flag)

    def remove(self, worker_id: str, hashes: Iterable[int]) -> None:
        blocks = self._blocks.get(worker_id)
        if not blocks:
            return
        flag = 1 << self._bit[worker_id]
        for block in hashes:
            if blocks.pop(block, None) is not None:
                self._unhold(block, flag)

    def forget(self, worker_id: str) -> None:
        """Drop everything known about a worker (it died, or its cache was cleared)."""
        self.clear_blocks(worker_id)
        self._last_seq.pop(worker_id, None)
        bit = self._bit.pop(worker_id, None)
        if bit is not None:
            del self._worker_of_bit[bit]

    def clear_blocks(self, worker_id: str) -> None:
        blocks = self._blocks.pop(worker_id, None)
        if blocks:
            flag = 1 << self._bit[worker_id]
            for block in blocks:
                self._unhold(block, flag)

    def expire(self, now: float) -> int:
        """Drop entries untouched for `ttl_s`; returns how many."""
        dropped = 0
        for worker_id, blocks in self._blocks.items():
            flag = 1 << self._bit[worker_id]
            while blocks:
                oldest, touched = next(iter(blocks.items()))
                if now - touched <= self.ttl_s:
                    break
                del blocks[oldest]
                self._unhold(oldest, flag)
                dropped += 1
        return dropped

    def _unhold(self, block: int, flag: int) -> None:
        mask = self._holders.get(block, 0) & ~flag
        if mask:
            self._holders[block] = mask
        else:
            self._holders.pop(block, None)

    # ---- sequence numbers --------------------------------------------------------------------

    def check_seq(self, worker_id: str, seq: int, snapshot: bool) -> bool:
        """Record a worker's event sequence number; False when events were missed (or, for a
        worker first heard of mid-stream, when the router has not seen its cache yet)."""
        last = self._last_seq.get(worker_id)
        self._last_seq[worker_id] = seq
        if snapshot:
            return True
        return last is not None and seq == last + 1

    # ---- queries ---------------------------------------------------------------------------

    def matched_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of `hashes` held, per worker holding at least the first one."""
        holders = self._holders
        alive = holders.get(hashes[0], 0) if hashes else 0
        if not alive:
            return {}
        matched: dict[str, int] = {}
        depth = 1
        for block in hashes[1:]:
            still = holders.get(block, 0) & alive
            if still != alive:
                self._record(alive & ~still, depth, matched)
                alive = still
                if not alive:
                    return matched
            depth += 1
        self._record(alive, depth, matched)
        return matched

    def _record(self, mask: int, depth: int, matched: dict[str, int]) -> None:
        while mask:
            low = mask & -mask
            matched[self._worker_of_bit[low.bit_length() - 1]] = depth
            mask ^= low
