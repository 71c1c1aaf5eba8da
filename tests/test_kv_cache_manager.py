import pytest

from engine.kv_cache_manager import KVCacheManager, hash_block
from engine.request import Request
from engine.sampling_params import SamplingParams


def _req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), eos_token_ids=[])


def test_chained_hash_depends_on_parent():
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert hash_block(b"p", [1, 2]) != hash_block(b"q", [1, 2])


def test_allocate_rounds_up_to_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = _req("a", range(9))
    ids = kv.allocate_slots(r, 9)
    assert len(ids) == 3 and len(set(ids)) == 3
    r.num_computed_tokens = 9
    assert kv.allocate_slots(r, 2) == [ ]          # 11 tokens still fit in 3 blocks
    r.num_computed_tokens = 11
    assert len(kv.allocate_slots(r, 2)) == 1       # 13 tokens need a 4th
    kv.free(r)
    assert kv.num_free_blocks == 10


def test_allocate_fails_without_changing_anything():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = _req("a", range(12))
    assert kv.allocate_slots(r, 12) is None
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []


def test_prefix_hit_full_blocks_only_and_never_the_last_token():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = _req("a", range(10))
    kv.allocate_slots(a, 10)                      # blocks 0,1 full and cached, 2 partial
    b = _req("b", list(range(8)) + [99, 98])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [x.block_id for x in hits] == kv.block_ids("a")[:2]
    # An identical 8-token prompt may reuse only one block: the last token must be computed.
    c = _req("c", range(8))
    hits, n = kv.get_computed_blocks(c)
    assert n == 4
    # A different first block breaks the chain even if the second block matches.
    d = _req("d", [7, 7, 7, 7] + list(range(4, 8)) + [1])
    assert kv.get_computed_blocks(d)[1] == 0


def test_hits_share_blocks_and_survive_the_owner():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = _req("a", range(9))
    kv.allocate_slots(a, 9)
    kv.free(a)
    assert kv.num_free_blocks == 6                # freed, but content still cached
    b = _req("b", list(range(8)) + [5, 5])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    new_ids = kv.allocate_slots(b, 2, hits)
    assert new_ids[:2] == [h.block_id for h in hits] and len(new_ids) == 3
    assert kv.num_free_blocks == 3


def test_free_hit_blocks_count_against_room():
    # Pool of 3: a cached-but-free block that becomes a hit cannot also be allocated fresh.
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = _req("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    kv.free(a)
    b = _req("b", [1, 2, 9, 9, 9, 9, 9])
    hits, n = kv.get_computed_blocks(b)
    assert n == 2
    assert kv.allocate_slots(b, 5, hits) is None   # needs 1 hit + 3 new > 3
    assert kv.num_free_blocks == 3


def test_no_caching_when_disabled():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False)
    a = _req("a", range(9))
    kv.allocate_slots(a, 9)
    b = _req("b", range(9))
    assert kv.get_computed_blocks(b) == ([], 0)


def test_free_registers_the_blocks_the_request_filled():
    """With async scheduling a step's slots are allocated before the token it computes is on
    the host (a placeholder), so allocate_slots cannot hash the block that token fills; a
    request ending at its limit is not scheduled again. Freeing it registers every block its
    computed tokens filled, so the next turn of a chat finds them."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", range(3))
    kv.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    kv.allocate_slots(a, 1)                       # its first output's KV, the token in flight
    a.num_computed_tokens = 4
    assert kv.pool.num_cached_blocks == 0         # block 0's last token was not known
    a.append_token(50, max_model_len=64)
    a.append_token(51, max_model_len=64)          # the last output: no KV of its own
    [first_block] = kv.block_ids("a")
    kv.free(a)
    b = _req("b", [0, 1, 2, 50, 51, 7])
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4 and [x.block_id for x in blocks] == [first_block]
    assert kv.num_free_blocks == 8


def test_a_request_freed_before_its_block_is_computed_registers_nothing_of_it():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", range(6))
    kv.allocate_slots(a, 4)                       # a chunk: 4 of 6 prompt tokens
    a.num_computed_tokens = 4
    kv.free(a)                                    # aborted before the rest was computed
    assert kv.pool.num_cached_blocks == 1
    b = _req("b", list(range(6)) + [9, 9, 9])
    assert kv.get_computed_blocks(b)[1] == 4      # the computed block, not the half-written one


def test_a_prefix_two_requests_computed_in_one_step_survives_the_first_copy_evicted():
    # a and b compute the same two blocks in the same step; a ends and its copy is evicted
    # while b still runs: c still finds the prefix, in b's blocks.
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a, b = _req("a", range(9)), _req("b", range(9))
    kv.allocate_slots(a, 9)
    kv.allocate_slots(b, 9)
    kv.free(a)
    filler = _req("f", [50 + i for i in range(8)])
    assert kv.allocate_slots(filler, 8) is not None       # takes a's 2 full blocks' room
    assert kv.num_free_blocks == 1
    c = _req("c", list(range(8)) + [7])
    hits, n = kv.get_computed_blocks(c)
    assert n == 8 and [h.block_id for h in hits] == kv.block_ids("b")[:2]
    assert kv.allocate_slots(c, 1, hits) is not None
    for r in (b, c, filler):
        kv.free(r)
    assert kv.num_free_blocks == 6


def test_blocks_behind_a_sliding_window_are_given_back_and_stay_cached():
    # Window 6, blocks of 4: a query at position p reads keys p-5..p.
    kv = KVCacheManager(num_blocks=10, block_size=4, sliding_window=6)
    r = _req("a", range(14))
    kv.allocate_slots(r, 14)
    ids = kv.block_ids("a")
    r.num_computed_tokens = 14
    kv.free_behind_window(r)           # the next query, at 14, reads keys 9..14: blocks 0, 1 go
    assert kv.block_ids("a") == [None, None] + ids[2:] and kv.num_free_blocks == 8
    kv.free_behind_window(r)           # nothing more: idempotent
    assert kv.num_free_blocks == 8
    assert kv.allocate_slots(r, 1) == []
    assert kv.num_blocks_allocated("a") == 4
    # The given-back blocks keep their content: a request with the same prefix takes them back.
    b = _req("b", list(range(8)) + [3])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits] == ids[:2]
    kv.free(r)
    assert kv.num_free_blocks == 10


def test_blocks_behind_the_window_not_yet_registered_are_kept_until_they_are():
    # The last block's tokens are not all known (a token in flight, async scheduling): its hash
    # cannot be made yet, so it is not given back before it is registered.
    kv = KVCacheManager(num_blocks=10, block_size=4, sliding_window=1)
    r = _req("a", range(8))
    kv.allocate_slots(r, 8)
    r.num_computed_tokens = 9          # 8 known tokens, the 9th computed from a token in flight
    kv._num_cached_blocks["a"] = 1     # as if only the first block were registered so far
    kv.free_behind_window(r)
    assert kv.block_ids("a")[0] is None and kv.block_ids("a")[1] is not None
    plain = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False, sliding_window=1)
    s = _req("s", range(8))
    plain.allocate_slots(s, 8)
    s.num_computed_tokens = 9
    plain.free_behind_window(s)        # without caching nothing waits for a hash
    assert plain.block_ids("s") == [None, None] and plain.num_free_blocks == 10


def test_a_bad_sliding_window_is_named():
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        KVCacheManager(num_blocks=4, block_size=4, sliding_window=0)


def test_a_windowed_lookup_hits_past_evicted_blocks_behind_the_window():
    # Window 6, blocks of 4: the token at 24 reads keys 19..24, in blocks 4 and 5 only.
    kv = KVCacheManager(num_blocks=10, block_size=4, sliding_window=6)
    a = _req("a", range(24))
    kv.allocate_slots(a, 24)
    blocks = list(kv._blocks["a"])
    kv.free(a)
    # Block 0 is evicted first (the others freed again after it), then blocks 0-3 are gone.
    kv.pool.touch(blocks[1:])
    kv.pool.free(blocks[1:])
    filler = _req("f", [500 + i for i in range(17)])
    kv.allocate_slots(filler, 17)                 # 4 blocks without content, then block 0
    assert blocks[0].block_hash is None           # evicted
    c = _req("c", list(range(24)) + [99])
    hits, n = kv.get_computed_blocks(c)
    assert n == 24 and hits == [None] * 4 + blocks[4:6]
    # A lookup from the first block (as without the window) would find nothing.
    assert kv.pool.get_cached_block(c.block_hashes[0]) is None
    ids = kv.allocate_slots(c, 1, hits)
    assert ids[:6] == [0] * 4 + [b.block_id for b in blocks[4:6]] and len(ids) == 7
    assert kv.block_ids("c")[:6] == [None] * 4 + [b.block_id for b in blocks[4:6]]
    c.num_computed_tokens = 24
    kv.free_behind_window(c)                      # the token at 24 reads keys 19..: block 4 stays
    assert kv.block_ids("c")[4] == blocks[4].block_id
    c.num_computed_tokens = 25
    kv.free_behind_window(c)                      # the token at 25 reads keys 20..: block 4 goes
    assert kv.block_ids("c")[4] is None
    kv.free(c)
    kv.free(filler)
    assert kv.num_free_blocks == 10


def test_a_windowed_lookup_needs_the_whole_window_cached():
    kv = KVCacheManager(num_blocks=10, block_size=4, sliding_window=9)
    a = _req("a", range(24))
    kv.allocate_slots(a, 24)
    blocks = list(kv._blocks["a"])
    kv.free(a)
    # Evict block 3: the token at 24 reads keys 16..24, blocks 4 and 5 - but the token at 20
    # (a hit of 5 blocks) reads 12..20, blocks 3 and 4. So the hit is 6 blocks, not 5.
    kv.pool.touch([b for b in blocks if b is not blocks[3]])
    kv.pool.free([b for b in blocks if b is not blocks[3]])
    kv.allocate_slots(_req("f", [500 + i for i in range(17)]), 17)
    assert blocks[3].block_hash is None
    c = _req("c", list(range(24)) + [99])
    assert kv.get_computed_blocks(c) == ([None] * 4 + blocks[4:6], 24)
    # A prompt that leaves a's after 20 tokens: a hit of 5 blocks would need block 3, so the
    # hit is 3 blocks, whose window (keys 4..12) lies in blocks 1 and 2.
    d = _req("d", list(range(20)) + [98, 97, 96, 95, 94])
    assert kv.get_computed_blocks(d) == ([None] + blocks[1:3], 12)
