"""Workload traces (`traces/` in this repository): arrivals, token counts and, for Mooncake, prefix blocks.

One reader for the live benchmarks and the discrete-event simulator, so both replay the same
requests. Mooncake traces name each 512-token block by an id that stands for the whole prefix up
to it; `mooncake_prompt` turns ids into text deterministically (same id, same text) with exactly
one token per word under `inferbus.tokens.blocks`, so shared prefixes stay shared token for token.
"""

from __future__ import annotations

import csv
import json
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512

# 4,096 distinct five-letter words, each one token with its leading space (letters ≤ 6 long).
def word(i: int, multiplier: int = 7919, offset: int = 13) -> str:
    """The i-th five-letter word of a vocabulary; `multiplier` coprime with 26 keeps them distinct,
    and another (multiplier, offset) gives another vocabulary."""
    n = (i * multiplier + offset) % 26**5
    letters = []
    for _ in range(5):
        n, digit = divmod(n, 26)
        letters.append("abcdefghijklmnopqrstuvwxyz"[digit])
    return " " + "".join(letters)


_WORDS = [word(i) for i in range(4096)]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # seconds from the start of the trace
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = field(default=())


def search_path() -> list[Path]:
    """Folders a trace named without a path is looked up in: `INFERBUS_TRACES_DIR` if set, then the
    checkout's own `traces/` (the public traces, with their sources in its README)."""
    folders = [Path(os.environ["INFERBUS_TRACES_DIR"])] if os.environ.get("INFERBUS_TRACES_DIR") else []
    folders.append(Path(__file__).resolve().parents[2] / "traces")
    return folders


def find(name: str | Path) -> Path:
    """A trace file: the path as given if it exists, else a file of that name on `search_path()`."""
    path = Path(name)
    if path.exists():
        return path
    for folder in search_path():
        if (folder / path.name).exists():
            return folder / path.name
    raise FileNotFoundError(f"no trace {str(name)!r}: not a file, nor in {', '.join(map(str, search_path()))} "
                            "(set INFERBUS_TRACES_DIR to the folder that holds the traces)")


def load(path: str | Path) -> list[TraceRequest]:
    """A trace file: Mooncake JSONL (`timestamp` in ms) or Azure CSV (`TIMESTAMP` as a datetime)."""
    path = Path(path)
    requests = list(_read_jsonl(path) if path.suffix == ".jsonl" else _read_azure_csv(path))
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def _read_jsonl(path: Path) -> Iterator[TraceRequest]:
    with path.open() as lines:
        for line in lines:
            if not line.strip():
                continue
            row = json.loads(line)
            yield TraceRequest(
                arrival_s=float(row["timestamp"]) / 1000.0,
                input_tokens=int(row["input_length"]),
                output_tokens=int(row["output_length"]),
                hash_ids=tuple(row.get("hash_ids") or ()),
            )


def _read_azure_csv(path: Path) -> Iterator[TraceRequest]:
    with path.open(newline="") as handle:
        start: datetime | None = None
        for row in csv.DictReader(handle):
            stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
            start = start or stamp
            yield TraceRequest(
                arrival_s=(stamp - start).total_seconds(),
                input_tokens=int(row["ContextTokens"]),
                output_tokens=int(row["GeneratedTokens"]),
            )


def rescale(requests: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """Arrival times multiplied by `factor` (< 1 compresses the trace: a higher request rate)."""
    return [
        TraceRequest(r.arrival_s * factor, r.input_tokens, r.output_tokens, r.hash_ids) for r in requests
    ]


def rate(requests: Sequence[TraceRequest]) -> float:
    """Mean arrival rate in requests per second."""
    if len(requests) < 2:
        return 0.0
    span = requests[-1].arrival_s - requests[0].arrival_s
    return (len(requests) - 1) / span if span > 0 else float("inf")


@lru_cache(maxsize=65_536)
def _block_text(block_id: int) -> str:
    # A cheap deterministic walk over the word list; different ids give different texts.
    x = (block_id * 2_654_435_761 + 1) & 0xFFFFFFFF
    words = []
    for _ in range(MOONCAKE_BLOCK_TOKENS):
        x = (x * 1_103_515_245 + 12_345) & 0x7FFFFFFF
        words.append(_WORDS[x >> 19])
    return "".join(words)


def mooncake_prompt(request: TraceRequest) -> str:
    """Prompt text of `input_tokens` tokens whose 512-token blocks are named by `hash_ids`."""
    parts = [_block_text(block_id) for block_id in request.hash_ids]
    tail = request.input_tokens - MOONCAKE_BLOCK_TOKENS * (len(parts) - 1)
    if parts and 0 < tail < MOONCAKE_BLOCK_TOKENS:
        # The last block is partial: its first `tail` words (each word is 6 characters).
        parts[-1] = parts[-1][: 6 * tail]
    return "".join(parts)


def replay_blocks(
    request: TraceRequest, cache: OrderedDict[int, None], limit: int | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> int:
    """Walk a request's prefix blocks through a cache of block ids kept in LRU order; returns the
    prompt tokens it found cached (its leading blocks already there). Every block is then the most
    recent; with `limit`, the least recent blocks beyond it are evicted after the walk."""
    hit, left, alive = 0, request.input_tokens, True
    for block_id in request.hash_ids:
        size = min(block_tokens, left)
        left -= size
        if alive and block_id in cache:
            hit += size
            cache.move_to_end(block_id)
        else:
            alive = False
            cache[block_id] = None
            cache.move_to_end(block_id)
    if limit is not None:
        while len(cache) > limit:
            cache.popitem(last=False)
    return hit


def ideal_hit_rate(requests: Sequence[TraceRequest]) -> float:
    """Token-weighted prefix-cache hit rate with an infinite cache, replaying in time order."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit = sum(replay_blocks(request, cache) for request in requests)
    total = sum(request.input_tokens for request in requests)
    return hit / total if total else 0.0
