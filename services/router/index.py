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

    def add(self, worker_id: str, hashes: Sequence[int], now: float, known: int = 0) -> None:
        """Record that `worker_id` holds the chain `hashes`. The first `known` blocks are known to
        be held already (the placement matched them): they are only touched, and only when the
        deepest of them has not been for a second."""
        blocks = self._blocks.get(worker_id)
        if blocks is None:
            blocks = self._blocks[worker_id] = OrderedDict()
        flag = 1 << self._bit_of(worker_id)
        holders = self._holders
        move = blocks.move_to_end
        stale = now - TOUCH_INTERVAL_S
        if 0 < known <= len(hashes) and blocks.get(hashes[known - 1], now) >= stale:
            hashes = hashes[known:]
        # Deepest first, so a chain's root is its most recently used block and LRU eviction takes
        # leaves before the blocks they extend, as the engines' radix caches do.
        for block in reversed(hashes):
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
        """Leading blocks of `hashes` held, per worker holding at least the first one.

        Caches hold whole prefixes (a block is only there with its parent), so the set of workers
        holding block d shrinks as d grows, and each worker's depth is found by bisection: a few
        lookups per distinct depth instead of one per block of a long prompt.
        """
        holders = self._holders
        first = holders.get(hashes[0], 0) if hashes else 0
        matched: dict[str, int] = {}
        if not first:
            return matched
        last = len(hashes) - 1
        deepest = holders.get(hashes[last], 0) & first if last else first
        self._record(deepest, last + 1, matched)
        # Intervals [lo, hi) with mask(lo) ⊋ mask(hi): workers in mask(lo) - mask(hi) stop inside.
        pending = [(0, last, first, deepest)]
        while pending:
            lo, hi, lo_mask, hi_mask = pending.pop()
            if lo_mask == hi_mask:
                continue
            if hi - lo == 1:
                self._record(lo_mask & ~hi_mask, lo + 1, matched)
                continue
            mid = (lo + hi) // 2
            mid_mask = holders.get(hashes[mid], 0) & lo_mask | hi_mask
            pending.append((lo, mid, lo_mask, mid_mask))
            pending.append((mid, hi, mid_mask, hi_mask))
        return matched

    def _record(self, mask: int, depth: int, matched: dict[str, int]) -> None:
        while mask:
            low = mask & -mask
            matched[self._worker_of_bit[low.bit_length() - 1]] = depth
            mask ^= low
