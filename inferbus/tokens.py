"""Deterministic tokenization and prefix-block hashing shared by every component.

The simulated engine has no real tokenizer (no model weights on CI machines), so it uses this
stand-in: BPE-like pieces (about 1.3 per English word, like Llama-3's tokenizer), each mapped to
a stable id. The router and the engine hash prompts with the same `block_hashes` so that the
router's view of a worker's prefix cache and the engine's cache agree.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from array import array
from collections.abc import Sequence

VOCAB_SIZE = 128_256  # Llama-3's vocabulary size; ids only need to be stable, not meaningful.
DEFAULT_BLOCK_SIZE = 16

# Letters in runs of at most 6, digits in runs of at most 3, single punctuation, whitespace runs;
# a leading space sticks to the next piece as in byte-level BPE. A whitespace run leaves its last
# space to the word after it (GPT-2's `\s+(?!\S)`), so encode(a + " word") == encode(a) +
# encode(" word"): a prompt extended by generated text tokenizes as prompt plus output.
_PIECE = re.compile(r" ?[^\W\d_]{1,6}| ?\d{1,3}| ?[^\w\s]|\s+(?!\S)|\s+|_")


def encode(text: str) -> list[int]:
    """Token ids for `text`; the same text always gives the same ids in every process."""
    return [zlib.crc32(piece.encode()) % VOCAB_SIZE for piece in _PIECE.findall(text)]


def count_tokens(text: str) -> int:
    return len(_PIECE.findall(text))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    namespace: str = "",
) -> list[int]:
    """Chained 64-bit hashes of the full blocks of `token_ids`.

    Hash i covers every token up to the end of block i, so equal hashes mean equal prefixes.
    `namespace` separates caches that must not be shared (a LoRA adapter's KV differs from the
    base model's for the same tokens).
    """
    hashes: list[int] = []
    parent = hashlib.blake2b(namespace.encode(), digest_size=8).digest()
    full = len(token_ids) - len(token_ids) % block_size
    for start in range(0, full, block_size):
        block = array("I", token_ids[start : start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes
