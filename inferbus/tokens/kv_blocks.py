"""The engine's cache, rebuilt from its KV events into the platform's prefix blocks.

An engine names its cache pages with its own hash at its own page size (SGLang on CPU: one page
per token). The gateway hashes a prompt's token ids in blocks of `block_size` with
`inferbus.tokens.blocks.block_hashes`. To compare the two, the worker replays the token ids of every
`BlockStored` event into the platform's chained hash: it remembers, per engine page, where the
platform chain stands after that page (the last full block's hash and the tokens since), so a child
event that names its parent by the engine's hash continues the right chain. A page that completes
a platform block owns that block; when the engine evicts the last page that owns it (with a page
size that does not divide the block size, two branches can each complete the same block), the
block is gone.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from inferbus.tokens.blocks import chain_block, chain_root


class _Page:
    """The platform chain after one engine page."""

    __slots__ = ("parent", "tokens", "chain", "tail_len", "blocks", "namespace")

    def __init__(self, parent: int | None, tokens: tuple[int, ...], chain: bytes, tail_len: int,
                 blocks: tuple[int, ...], namespace: str) -> None:
        self.parent = parent  # the engine's hash of the page before it (None: the first page)
        self.tokens = tokens  # the page's token ids
        self.chain = chain  # chain state after the last full platform block ending at or before this page
        self.tail_len = tail_len  # tokens after that block, up to this page's end
        self.blocks = blocks  # platform blocks this page completed
        self.namespace = namespace


@dataclass
class Changes:
    """Platform blocks stored (in chain order) and removed by a batch of engine events."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False
    unknown_parents: int = 0  # stored events whose parent page was never seen (events were lost)


class BlockChains:
    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size = block_size
        self._pages: dict[int, _Page] = {}
        self._owners: dict[int, int] = {}  # platform block → pages that completed it

    def __len__(self) -> int:
        return len(self._pages)

    def _tail(self, page: _Page) -> list[int]:
        """The tokens after the last full platform block, up to the end of `page`."""
        pieces: list[tuple[int, ...]] = []
        need = page.tail_len
        current: _Page | None = page
        while need > 0 and current is not None:
            pieces.append(current.tokens[-need:] if len(current.tokens) > need else current.tokens)
            need -= len(pieces[-1])
            current = self._pages.get(current.parent) if current.parent is not None else None
        if need > 0:
            raise KeyError("an ancestor page is gone")
        tail: list[int] = []
        for piece in reversed(pieces):
            tail.extend(piece)
        return tail

    def stored(self, block_hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], page_size: int,
               namespace: str, changes: Changes) -> None:
        """An engine `BlockStored`: pages `block_hashes`, each of `page_size` of `token_ids`."""
        if parent is None:
            chain, tail = chain_root(namespace), []
        else:
            parent_page = self._pages.get(parent)
            if parent_page is None:
                changes.unknown_parents += 1
                return
            try:
                tail = self._tail(parent_page)
            except KeyError:
                changes.unknown_parents += 1
                return
            chain = parent_page.chain
        size = self.block_size
        previous = parent
        for index, engine_hash in enumerate(block_hashes):
            tokens = tuple(token_ids[index * page_size:(index + 1) * page_size])
            tail.extend(tokens)
            completed: list[int] = []
            while len(tail) >= size:
                chain = chain_block(chain, tail[:size])
                completed.append(int.from_bytes(chain, "little"))
                del tail[:size]
            if engine_hash in self._pages:  # stored again (SGLang re-sends a page it still has): one owner
                self._disown(self._pages[engine_hash].blocks, [])
            self._pages[engine_hash] = _Page(previous, tokens, chain, len(tail), tuple(completed), namespace)
            for block in completed:
                self._owners[block] = self._owners.get(block, 0) + 1
            changes.stored.extend(completed)
            previous = engine_hash

    def removed(self, block_hashes: Sequence[int], changes: Changes) -> None:
        for engine_hash in block_hashes:
            page = self._pages.pop(engine_hash, None)
            if page is not None:
                self._disown(page.blocks, changes.removed)

    def _disown(self, blocks: Sequence[int], removed: list[int]) -> None:
        for block in blocks:
            owners = self._owners.get(block, 0) - 1
            if owners > 0:
                self._owners[block] = owners
            else:
                self._owners.pop(block, None)
                removed.append(block)

    def cleared(self, changes: Changes) -> None:
        self._pages.clear()
        self._owners.clear()
        changes.stored.clear()
        changes.removed.clear()
        changes.cleared = True
