import pytest

from inferbus.tokens.blocks import block_hashes
from services.sim_engine.radix_cache import AllBlocksCleared, BlockRemoved, BlockStored, RadixCache


def chain(seed: int, blocks: int, block_size: int = 4) -> list[int]:
    return block_hashes([seed * 1000 + i for i in range(blocks * block_size)], block_size)


def test_match_counts_leading_cached_blocks():
    cache = RadixCache(capacity_tokens=100, block_size=4)
    hashes = chain(1, 3)
    assert cache.match(hashes) == 0
    assert cache.insert(hashes[:2]) == 2
    assert cache.match(hashes) == 2
    assert cache.match(chain(2, 3)) == 0
    assert cache.cached_tokens == 8


def test_insert_emits_stored_events_with_parent_and_tokens():
    cache = RadixCache(capacity_tokens=100, block_size=4)
    tokens = list(range(12))
    hashes = block_hashes(tokens, 4)
    cache.insert(hashes[:1], tokens)
    cache.insert(hashes, tokens)
    cache.insert(hashes, tokens)  # nothing new: no event
    events = cache.drain_events()
    assert events == [
        BlockStored([hashes[0]], None, [0, 1, 2, 3], 4),
        BlockStored(hashes[1:], hashes[0], list(range(4, 12)), 4),
    ]
    assert cache.drain_events() == []


def test_lru_eviction_takes_leaves_first_and_oldest_first():
    cache = RadixCache(capacity_tokens=100, block_size=4)
    old, new = chain(1, 3), chain(2, 2)
    cache.insert(old)
    cache.insert(new)
    cache.match(new)
    freed = cache.evict(4)
    assert freed == 4
    # The oldest chain loses its leaf, never its root while the leaf is cached.
    assert old[2] not in cache and old[1] in cache and old[0] in cache
    assert cache.evict(8) == 8
    assert old[0] not in cache and new[0] in cache
    removed = [e for e in cache.drain_events() if isinstance(e, BlockRemoved)]
    assert [h for e in removed for h in e.block_hashes] == [old[2], old[1], old[0]]


def test_recently_matched_chain_survives_eviction():
    cache = RadixCache(capacity_tokens=100, block_size=4)
    first, second = chain(1, 2), chain(2, 2)
    cache.insert(first)
    cache.insert(second)
    cache.match(first)  # first is now more recent
    cache.evict(8)
    assert first[1] in cache and second[0] not in cache


def test_locked_blocks_are_not_evicted_until_unlocked():
    cache = RadixCache(capacity_tokens=100, block_size=4)
    hashes = chain(1, 2)
    cache.insert(hashes)
    cache.lock(hashes)
    assert cache.evict(100) == 0
    assert cache.available_tokens() == 100 - 8
    cache.unlock(hashes)
    assert cache.available_tokens() == 100
    with pytest.raises(RuntimeError):
        cache.unlock(hashes)
    assert cache.evict(100) == 8


def test_allocation_shares_capacity_and_evicts_cache():
    cache = RadixCache(capacity_tokens=16, block_size=4)
    cache.insert(chain(1, 2))
    assert cache.allocate(8)
    assert cache.free_tokens == 0
    assert cache.allocate(4)  # evicts one cached block
    assert cache.cached_tokens == 4
    assert not cache.allocate(8)  # only 4 more could be freed
    assert cache.private_tokens == 12
    cache.release(12)
    assert cache.used_tokens == 4
    with pytest.raises(RuntimeError):
        cache.release(1)


def test_clear_refused_while_in_use():
    cache = RadixCache(capacity_tokens=100, block_size=4)
    hashes = chain(1, 2)
    cache.insert(hashes)
    cache.lock(hashes[:1])
    assert not cache.clear()
    cache.unlock(hashes[:1])
    assert cache.clear()
    assert len(cache) == 0
    assert isinstance(cache.drain_events()[-1], AllBlocksCleared)


def test_heap_stays_bounded_under_repeated_matches():
    cache = RadixCache(capacity_tokens=1000, block_size=4)
    hashes = chain(1, 4)
    cache.insert(hashes)
    for _ in range(5000):
        cache.match(hashes)
    assert len(cache._evictable) <= 2 * len(cache) + 1024
    assert cache.evict(16) == 16


def test_a_chain_cached_again_stays_evictable():
    """The same output cached twice (greedy answers repeat) refreshes the leaf's recency; it must
    still be found by eviction, or the chain holds the pool for ever and a long prompt never fits."""
    cache = RadixCache(capacity_tokens=40, block_size=4)
    hashes = chain(1, 5)
    cache.insert(hashes)
    cache.lock(hashes[:3])
    cache.unlock(hashes[:3])
    assert cache.insert(hashes) == 0  # nothing new: only recency changed
    assert cache.available_tokens() == 40
    assert cache.allocate(40)  # possible only by evicting every block of the chain
    assert len(cache) == 0
