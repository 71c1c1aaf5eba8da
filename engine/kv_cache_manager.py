"""Per-request block tables over the BlockPool, and the prefix-cache lookup.

A full block is keyed by a chained hash: H(parent's hash, the block's token ids), so equal
keys mean equal whole prefixes, not only equal blocks.

Sliding window (`sliding_window`, given when every layer of the model attends within it, as
Mistral 7B v0.1): no query at a position p reads a key at or before p - W, so a request's blocks
wholly behind its window are given back to the pool as its window moves on (vLLM's sliding-window
manager does the same); their table entries stay in place, never read. They keep their content
and hash, as any freed block: a later request with the same prefix can still take them back,
and its lookup needs only the blocks its first token to compute can see (`get_computed_blocks`).
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from engine.block_pool import BlockPool, KVBlock
from engine.request import Request


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


_NO_BLOCKS: list[int] = []   # shared, never mutated: "no new blocks this step"


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching)
        # Each request's table; None where a block behind its sliding window was given back.
        self._blocks: dict[str, list[KVBlock | None]] = {}
        self._num_cached_blocks: dict[str, int] = {}   # how many of its blocks are registered
        self._num_behind_window: dict[str, int] = {}   # how many of its first blocks are given back

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_allocated(self, request_id: str) -> int:
        """The blocks in the request's table, those given back behind its window included."""
        return len(self._blocks.get(request_id, ()))

    def block_ids(self, request_id: str) -> list[int | None]:
        """The request's table; None for a block given back behind its window."""
        return [None if b is None else b.block_id for b in self._blocks.get(request_id, ())]

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extends `request.block_hashes` to cover every full block within `num_tokens`."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs]))

    def get_computed_blocks(self, request: Request, prefix_blocks: Sequence[KVBlock | None] = (),
                            max_blocks: int | None = None) -> tuple[list[KVBlock | None], int]:
        """The longest cached prefix of the request, in whole blocks; at least one token is
        always left to compute, since sampling needs the last token's hidden state.
        `prefix_blocks`: the request's first blocks, known to hold its prefix (a prefix group's
        pinned blocks): taken as they are, even with prefix caching off, and the lookup goes on
        after them.
        With a sliding window (and no `prefix_blocks`), only the blocks the first token to
        compute can see must be cached: the hit is the longest whose window's blocks are, and the
        blocks behind that window come back as None (vLLM's sliding-window lookup; a block's
        chained hash stands for its whole prefix).
        `max_blocks`: a hit of at most that many blocks."""
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks is not None:
            max_hit_blocks = min(max_hit_blocks, max_blocks)
        hits: list[KVBlock | None] = list(prefix_blocks[:max_hit_blocks])
        if not self.enable_caching:
            return hits, len(hits) * self.block_size
        self._update_block_hashes(request, max_hit_blocks * self.block_size)
        if self.sliding_window is not None and not hits:
            return self._window_hits(request.block_hashes, max_hit_blocks)
        for block_hash in request.block_hashes[len(hits):max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _window_hits(self, block_hashes: list[bytes], max_hit_blocks: int
                     ) -> tuple[list[KVBlock | None], int]:
        """From the longest candidate down: the first `end` whose blocks from the window of
        position end * block_size on are all cached."""
        bs, window = self.block_size, self.sliding_window
        end, found = max_hit_blocks, []
        for i in range(max_hit_blocks - 1, -1, -1):
            block = self.pool.get_cached_block(block_hashes[i])
            if block is None:
                end, found = i, []
                continue
            found.append(block)
            if i <= max(0, end * bs - window + 1) // bs:
                return [None] * i + found[::-1], end * bs
        return [], 0

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock | None] = ()) -> list[int] | None:
        """Makes room for `num_new_tokens` more tokens after the computed ones (plus the
        prefix-cache hits in `computed_blocks`, None behind a sliding window: not taken, id 0
        in what is returned). Returns the ids of the blocks added to the request's table, or
        None (and changes nothing) when the pool is short."""
        blocks = self._blocks.get(request.request_id)
        if blocks is not None and not computed_blocks:
            # The common decode case: the token still fits in the last block.
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(blocks) * self.block_size:
                if (self.enable_caching and num_tokens // self.block_size
                        > self._num_cached_blocks.get(request.request_id, 0)):
                    self._cache_full_blocks(request, blocks, num_tokens)
                return _NO_BLOCKS
        if blocks is None:
            blocks = self._blocks[request.request_id] = []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, num_needed - len(blocks) - len(computed_blocks))
        # Hits behind a sliding window (None, the first ones) are not taken at all.
        num_behind = (computed_blocks.count(None)
                      if computed_blocks and computed_blocks[0] is None else 0)
        held_hits = computed_blocks[num_behind:] if num_behind else computed_blocks
        # A hit on a free cached block takes that block off the free list.
        num_free_hits = sum(b.ref_cnt == 0 for b in held_hits) if held_hits else 0
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            if not blocks:
                del self._blocks[request.request_id]
            return None
        # Take the hits first: allocating could otherwise evict them.
        if held_hits:
            self.pool.touch(held_hits)
        new_blocks = self.pool.allocate(num_new_blocks)
        if computed_blocks:
            new_blocks = list(computed_blocks) + new_blocks
        blocks.extend(new_blocks)
        if num_behind:
            # (Given back from the start: nothing there to register either.)
            self._num_behind_window[request.request_id] = num_behind
            self._num_cached_blocks[request.request_id] = num_behind
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        if num_behind:
            # The runner's table needs an id there; no kernel reads behind the window.
            return [0] * num_behind + [b.block_id for b in new_blocks[num_behind:]]
        return [b.block_id for b in new_blocks]

    def free_behind_window(self, request: Request) -> None:
        """Gives back the request's blocks that no query from its next token on can read: those
        wholly before position num_computed_tokens - W + 1. Blocks not registered in the prefix
        cache yet (their tokens not all known) are kept until they are."""
        blocks = self._blocks.get(request.request_id)
        if not blocks:
            return
        num_behind = max(0, request.num_computed_tokens - self.sliding_window + 1) // self.block_size
        if self.enable_caching:
            num_behind = min(num_behind, self._num_cached_blocks.get(request.request_id, 0))
        start = self._num_behind_window.get(request.request_id, 0)
        if num_behind <= start:
            return
        gone = blocks[start:num_behind]
        blocks[start:num_behind] = [None] * len(gone)
        self._num_behind_window[request.request_id] = num_behind
        self.pool.free(gone[::-1])

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        """Registers blocks that are full once this step's tokens are written. Safe to do now:
        a later request can only read them in a later step, after this step wrote them."""
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request, num_full * self.block_size)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def pin_prefix(self, request: Request, num_blocks: int) -> list[KVBlock | None]:
        """Takes a reference of its own on the request's first `num_blocks` blocks (a prefix
        group's prefix): they stay resident, and keep their content, until `unpin`. Blocks
        the request gave back behind its window stay None: they must lie behind the window of
        the prefix's end, where members start, so that no member reads them."""
        blocks = self._blocks[request.request_id][:num_blocks]
        assert len(blocks) == num_blocks, (request.request_id, num_blocks, len(blocks))
        if self.sliding_window is not None:
            read = max(0, num_blocks * self.block_size - self.sliding_window + 1) // self.block_size
            assert None not in blocks[read:], (request.request_id, num_blocks, read)
        self.pool.touch([b for b in blocks if b is not None])
        return blocks

    def unpin(self, blocks: list[KVBlock | None]) -> None:
        self.pool.free([b for b in blocks[::-1] if b is not None])

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, None)
        if blocks and self.enable_caching:
            # Blocks its last steps filled: a request ending at its limit is not scheduled
            # again (async scheduling plans the step after its last before that one is
            # collected), so allocate_slots never saw its last block full.
            self._cache_full_blocks(request, blocks, request.num_computed_tokens)
        self._num_cached_blocks.pop(request.request_id, None)
        if self._num_behind_window.pop(request.request_id, 0):
            blocks = [b for b in blocks if b is not None]
        if blocks:
            self.pool.free(blocks[::-1])
