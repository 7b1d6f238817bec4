"""Prefix-block hashing shared by every component, and a stand-in tokenizer for the capacity tools.

`block_hashes` is the platform's chained hash of token ids in fixed-size blocks: the gateway hashes
a prompt's ids with it and the worker rebuilds its engine's cache events into the same blocks
(`inferbus.tokens.kv_blocks`), whatever hash and page size the engine uses.

The stand-in tokenizer (`encode`, `count_tokens`, `standin_render_chat`) is not on the request
path, which uses the served model's own tokenizer and template (`inferbus.tokens.prompt`). The load
generator and the fleet simulator use it to size prompts without a model (BPE-like pieces, about
1.3 per English word, like Llama-3's tokenizer), and the simulated engine falls back to it when it
runs without a model directory.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from array import array
from collections.abc import Sequence
from typing import Any

VOCAB_SIZE = 128_256  # Llama-3's vocabulary size; ids only need to be stable, not meaningful.
# Tokens per prefix block, for every component: the engine's cache page, the router's index and the
# gateway's hashes must agree. 64 keeps a long prompt's hash list short (a 16k-token prompt is 250
# hashes) while losing at most 63 tokens of a shared prefix to the partial last block.
DEFAULT_BLOCK_SIZE = 64
# Piece → id memo: most pieces repeat, and a dict lookup is several times cheaper than crc32 of a
# freshly encoded string. Cleared when full, so memory stays bounded on adversarial input.
_MEMO_LIMIT = 500_000
_ids: dict[str, int] = {}

# Letters in runs of at most 6, digits in runs of at most 3, single punctuation, whitespace runs;
# a leading space sticks to the next piece as in byte-level BPE. A whitespace run leaves its last
# space to the word after it (GPT-2's `\s+(?!\S)`), so encode(a + " word") == encode(a) +
# encode(" word"): a prompt extended by generated text tokenizes as prompt plus output.
_PIECE = re.compile(r" ?[^\W\d_]{1,6}| ?\d{1,3}| ?[^\w\s]|\s+(?!\S)|\s+|_")


def encode(text: str) -> list[int]:
    """Token ids for `text`; the same text always gives the same ids in every process."""
    ids = _ids
    if len(ids) > _MEMO_LIMIT:
        ids.clear()
    out: list[int] = []
    append = out.append
    for piece in _PIECE.findall(text):
        token_id = ids.get(piece)
        if token_id is None:
            token_id = ids[piece] = zlib.crc32(piece.encode()) % VOCAB_SIZE
        append(token_id)
    return out


def pieces(text: str) -> list[str]:
    """The text of each token of `text` (`encode` maps each piece to its id)."""
    return _PIECE.findall(text)


def count_tokens(text: str) -> int:
    return len(_PIECE.findall(text))


def chain_root(namespace: str = "") -> bytes:
    """The chain state before the first block of a cache namespace (a LoRA adapter, or "")."""
    return hashlib.blake2b(namespace.encode(), digest_size=8).digest()


def chain_block(parent: bytes, block: Sequence[int]) -> bytes:
    """The chain state after one more full block: what `block_hashes` reports, as bytes."""
    return hashlib.blake2b(parent + array("I", block).tobytes(), digest_size=8).digest()


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
    parent = chain_root(namespace)
    full = len(token_ids) - len(token_ids) % block_size
    data = array("I", token_ids[:full]).tobytes()
    step = 4 * block_size
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes
    for start in range(0, 4 * full, step):
        parent = blake2b(parent + data[start : start + step], digest_size=8).digest()
        hashes.append(from_bytes(parent, "little"))
    return hashes


def content_text(content: Any) -> str:
    """Text of a message's `content`: a string, or a list of `{"type": "text", "text": ...}` parts
    (and an assistant's `{"type": "refusal", "refusal": ...}`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join((part.get("text") or "") if part.get("type") == "text" else (part.get("refusal") or "")
                   for part in content if part.get("type") in ("text", "refusal"))


def standin_render_chat(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> str:
    """A Llama-3-like rendering for sizing prompts without a model (never what an engine is sent)."""
    parts = ["<|begin_of_text|>"]
    if tools:
        parts.append("<|start_header_id|>system<|end_header_id|>\n\n")
        parts.append("Tools available:\n" + json.dumps(list(tools), sort_keys=True, separators=(",", ":")))
        parts.append("<|eot_id|>")
    for message in messages:
        parts.append(f"<|start_header_id|>{message['role']}<|end_header_id|>\n\n")
        parts.append(content_text(message.get("content")))
        for call in message.get("tool_calls") or ():
            parts.append(json.dumps(call, sort_keys=True, separators=(",", ":")))
        parts.append("<|eot_id|>")
    parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)
