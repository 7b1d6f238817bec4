"""Workloads for the fleet simulator: trace requests → token ids, and synthetic traces for tests.

The simulator never renders prompt text (tokenizing a 15k-token prompt is far slower than
simulating it). Token ids are made straight from the trace's block ids instead: a block id always
gives the same `block_tokens` ids, so requests that share leading block ids share a token prefix,
and `inferbus.tokens.blocks.block_hashes` over those ids gives the router and the engine the same
chained hashes, exactly as with rendered text. Ids are bytes of a SHAKE-128 stream (0..255): the
engine only hashes them, and a 64-token block of random bytes never collides in practice.
Requests without block ids (Azure traces) get ids unique to the request, so they share nothing.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from tools.capacity import traces
from tools.capacity.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest


class PromptTokens:
    """Deterministic token ids for trace requests (see the module docstring)."""

    def __init__(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> None:
        self.block_tokens = block_tokens
        self._blocks: dict[int, bytes] = {}

    def block(self, block_id: int) -> bytes:
        data = self._blocks.get(block_id)
        if data is None:
            seed = b"block:" + block_id.to_bytes(8, "little", signed=True)
            data = self._blocks[block_id] = hashlib.shake_128(seed).digest(self.block_tokens)
        return data

    def ids(self, request: TraceRequest, index: int) -> list[int]:
        """`request.input_tokens` ids; `index` (the request's position in its trace) makes
        requests without block ids, and any tail past the last block, unique."""
        n = request.input_tokens
        if request.hash_ids:
            block = self.block
            data = b"".join([block(block_id) for block_id in request.hash_ids])
        else:
            data = b""
        if len(data) < n:
            seed = b"request:" + index.to_bytes(8, "little")
            data += hashlib.shake_128(seed).digest(n - len(data))
        return list(data[:n])

    def __len__(self) -> int:
        return len(self._blocks)


def at_rate(requests: Sequence[TraceRequest], target_rps: float) -> list[TraceRequest]:
    """The trace with arrival times scaled so its mean rate is `target_rps`, starting at 0."""
    if not requests:
        return []
    start = requests[0].arrival_s
    shifted = [TraceRequest(r.arrival_s - start, r.input_tokens, r.output_tokens, r.hash_ids) for r in requests]
    current = traces.rate(shifted)
    if current <= 0 or current == float("inf"):
        return shifted
    return traces.rescale(shifted, current / target_rps)


def prefix_families(
    n: int,
    *,
    families: int = 8,
    shared_blocks: int = 4,
    unique_blocks: int = 1,
    block_tokens: int = 64,
    output_tokens: int = 16,
    rate_rps: float = 20.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """A prefix-heavy synthetic trace: each request is one of `families` long shared prefixes
    (`shared_blocks` blocks) plus `unique_blocks` blocks of its own; Poisson arrivals.

    Block ids are Mooncake-style (an id names its whole prefix); use `PromptTokens(block_tokens)`.
    """
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    t = 0.0
    next_unique = families * shared_blocks
    for _ in range(n):
        t += rng.expovariate(rate_rps)
        family = rng.randrange(families)
        ids = tuple(range(family * shared_blocks, (family + 1) * shared_blocks))
        ids += tuple(range(next_unique, next_unique + unique_blocks))
        next_unique += unique_blocks
        out.append(TraceRequest(t, len(ids) * block_tokens, output_tokens, ids))
    return out


def azure_like(n: int, seed: int = 5) -> list[TraceRequest]:
    """Azure-conversation-like lengths (lognormal, no prefix ids), Poisson arrivals at 1 req/s:
    a synthetic stand-in to rescale with `at_rate`."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0)
        out.append(
            TraceRequest(t, max(8, int(rng.lognormvariate(6.9, 0.8))), max(2, int(rng.lognormvariate(4.9, 0.9))))
        )
    return out
