import subprocess
import sys

import pytest

from engine.block_pool import BlockPool


def test_scheduler_and_pool_import_no_torch():
    code = ("import sys, engine.block_pool, engine.kv_cache_manager, engine.scheduler; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_allocate_and_free_counts():
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 5
    assert all(b.ref_cnt == 1 for b in blocks)
    pool.free(blocks)
    assert pool.num_free_blocks == 8


def test_allocate_more_than_free_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.allocate(3)


def test_cached_block_survives_free_and_is_reused():
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    pool.cache_block(b, b"h1")
    pool.free([b])
    assert pool.num_free_blocks == 4
    hit = pool.get_cached_block(b"h1")
    assert hit is b
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 3


def test_eviction_is_lru_and_only_when_free():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for blk, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache_block(blk, h)
    pool.free([b])      # freed first: evicted first
    pool.free([a])
    # c is still held: it must not be evicted.
    [x] = pool.allocate(1)
    assert x is b
    assert pool.get_cached_block(b"b") is None
    assert pool.get_cached_block(b"a") is a
    assert pool.get_cached_block(b"c") is c


def test_blocks_without_content_are_handed_out_before_cached_ones():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.cache_block(a, b"a")
    pool.cache_block(b, b"b")
    pool.free([b, a])                     # cached, freed first
    pool.free([d, c])                     # no content, freed last
    first = pool.allocate(2)
    assert set(first) == {c, d}
    assert pool.get_cached_block(b"a") is a and pool.get_cached_block(b"b") is b
    # Then the cached ones, least recently freed first.
    [x] = pool.allocate(1)
    assert x is b and pool.get_cached_block(b"b") is None
    assert pool.get_cached_block(b"a") is a


def test_shared_block_refcount():
    pool = BlockPool(2)
    [a] = pool.allocate(1)
    pool.cache_block(a, b"x")
    pool.touch([a])                       # a second request shares it
    assert a.ref_cnt == 2
    pool.free([a])
    assert pool.num_free_blocks == 1      # still held by one
    pool.free([a])
    assert pool.num_free_blocks == 2


def test_duplicate_content_registers_both_copies_and_hits_the_first_held():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"same")
    pool.cache_block(b, b"same")
    assert pool.get_cached_block(b"same") is a
    assert a.block_hash == b.block_hash == b"same"


def test_caching_disabled():
    pool = BlockPool(2, enable_caching=False)
    [a] = pool.allocate(1)
    pool.cache_block(a, b"x")
    assert pool.get_cached_block(b"x") is None


def test_a_second_copy_of_a_content_stays_findable_when_the_first_is_evicted():
    # Two requests computed the same block in one step: a and b hold the same content.
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, b"h")
    pool.cache_block(b, b"h")
    assert pool.num_cached_blocks == 1              # one content, two copies
    pool.free([a])
    assert pool.get_cached_block(b"h") is b         # a hit takes the held copy, not a free one
    [x] = pool.allocate(1)                          # evicts a
    assert x is a and a.block_hash is None
    assert pool.get_cached_block(b"h") is b
    pool.free([b])
    assert pool.get_cached_block(b"h") is b         # free now, still cached
    [y] = pool.allocate(1)
    assert y is b and pool.get_cached_block(b"h") is None and pool.num_cached_blocks == 0


def test_reset_prefix_cache_forgets_every_copy():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"h")
    pool.cache_block(b, b"h")
    pool.reset_prefix_cache()
    assert pool.get_cached_block(b"h") is None and pool.num_cached_blocks == 0
    assert a.block_hash is None and b.block_hash is None
    pool.free([a, b])
    assert pool.num_free_blocks == 2
