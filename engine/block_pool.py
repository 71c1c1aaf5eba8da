"""The pool of fixed-size KV blocks, with content-addressed reuse (automatic prefix caching).

A block is free when no request holds it (`ref_cnt == 0`). A free block may still carry a
`block_hash`: its KV is intact and a later request with the same prefix can take it back.
Free blocks without cached content are handed out first; then cached ones, least recently
freed first. So cached content is evicted LRU and only when nothing else is free.

Two requests that compute the same block in one step hold two copies of it: both are
registered under its hash, so the content stays findable until the last copy is evicted.
"""
from __future__ import annotations

from collections import OrderedDict


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order is eviction order: blocks without content at the front, then the
        # cached ones, the least recently freed first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Each cached content's copies, by block id, the first registered first.
        self._cached: dict[bytes, dict[int, KVBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Distinct cached contents (a content held in two copies counts once)."""
        return len(self._cached)

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        """A block holding this content: a copy some request holds if there is one, so that a
        hit leaves the free list alone."""
        copies = self._cached.get(block_hash)
        if copies is None:
            return None
        for block in copies.values():
            if block.ref_cnt:
                return block
        return block

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Takes `num_blocks` free blocks (evicting their cached content); caller checked room."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks with {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Takes a reference on cache hits; a free one leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drops a reference on each block; pass a request's blocks tail first so that its tail
        (least likely to be shared) is evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Makes a full block findable by its hash, beside any other copy of the same content
        (two requests computed it in the same step)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self._cached.setdefault(block_hash, {})[block.block_id] = block

    def _uncache(self, block: KVBlock) -> None:
        copies = self._cached[block.block_hash]
        del copies[block.block_id]
        if not copies:
            del self._cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for copies in self._cached.values():
            for block in copies.values():
                block.block_hash = None
        self._cached.clear()
