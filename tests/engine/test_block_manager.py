"""Block manager policy, asserted on exact block ids (no torch involved)."""

from engine.block_manager import NULL_BLOCK, BlockManager, make_block_manager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def seq(tokens, request_id="r") -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams())


def test_allocates_from_the_front_of_the_free_list_and_frees_in_reverse():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq(range(10))  # 10 tokens -> 3 blocks
    assert manager.allocate(a, 10)
    assert a.block_table == [0, 1, 2]
    assert manager.num_free_blocks == 5
    b = seq(range(4), "b")
    assert manager.allocate(b, 4)
    assert b.block_table == [3]
    manager.free(a)
    assert a.block_table == []
    assert manager.num_free_blocks == 7
    # Freed tail first: block 2 is the next handed out, then 1, then 0.
    c = seq(range(12), "c")
    assert manager.allocate(c, 12)
    assert c.block_table == [4, 5, 6]
    d = seq(range(12), "d")
    assert manager.allocate(d, 12)
    assert d.block_table == [7, 2, 1]


def test_growth_takes_a_block_only_at_a_block_boundary():
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = seq(range(4))
    assert manager.allocate(a, 4)
    a.num_computed_tokens = 4
    a.token_ids.append(7)
    assert manager.allocate(a, 1)  # token 5 opens block 2
    assert a.block_table == [0, 1]
    a.num_computed_tokens = 5
    a.token_ids.append(8)
    assert manager.allocate(a, 1)  # token 6 fits in block 1
    assert a.block_table == [0, 1]
    assert manager.num_free_blocks == 2


def test_allocation_that_does_not_fit_changes_nothing():
    manager = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    a = seq(range(8))
    assert manager.allocate(a, 8)
    b = seq(range(8), "b")
    assert not manager.can_allocate(b, 8)
    assert not manager.allocate(b, 8)
    assert b.block_table == [] and manager.num_free_blocks == 1


def test_prefix_cache_reuses_full_blocks_by_id_and_counts_hits():
    manager = BlockManager(num_blocks=10, block_size=4)
    shared = list(range(100, 108))  # two full blocks
    a = seq(shared + [1, 2, 3])
    assert manager.find_cached_prefix(a) == []
    assert manager.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    manager.cache_full_blocks(a, a.num_computed_tokens)
    assert a.block_table == [0, 1, 2]
    b = seq(shared + [9, 9], "b")
    hits = manager.find_cached_prefix(b)
    assert hits == [0, 1]
    assert manager.allocate(b, 2, hits)
    assert b.block_table == [0, 1, 3]
    assert [manager.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]


def test_whole_prompt_hit_still_leaves_the_last_token_to_compute():
    manager = BlockManager(num_blocks=10, block_size=4)
    a = seq(range(8))
    manager.allocate(a, 8)
    manager.cache_full_blocks(a, 8)
    b = seq(range(8), "b")
    assert manager.find_cached_prefix(b) == [0]  # block 1 holds the last token, which must run


def test_freed_cached_blocks_are_revived_until_evicted_lru():
    manager = BlockManager(num_blocks=4, block_size=4)
    a = seq(range(9))
    manager.allocate(a, 9)
    manager.cache_full_blocks(a, 9)
    manager.free(a)  # blocks 0, 1 cached; free order: 2, 1, 0 appended after 3
    assert list(manager.free_blocks) == [3, 2, 1, 0]
    b = seq(list(range(8)) + [50], "b")
    hits = manager.find_cached_prefix(b)
    assert hits == [0, 1]
    assert manager.allocate(b, 1, hits)  # revives 0 and 1, takes 3 for the new token
    assert b.block_table == [0, 1, 3]
    manager.free(b)
    # Pressure: a 16-token request needs all 4 blocks and evicts the cached ones.
    c = seq(range(200, 216), "c")
    assert manager.find_cached_prefix(c) == []
    assert manager.allocate(c, 16)
    assert sorted(c.block_table) == [0, 1, 2, 3]
    assert manager.cached_blocks == {}
    d = seq(list(range(8)) + [50], "d")
    manager.free(c)
    assert manager.find_cached_prefix(d) == []


def test_fork_shares_blocks_and_copy_on_write_splits_the_partial_one():
    manager = BlockManager(num_blocks=6, block_size=4)
    parent = seq(range(6))
    manager.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = seq(range(6), "child")
    manager.fork(parent, child)
    child.num_computed_tokens = 6
    assert child.block_table == [0, 1]
    assert [manager.blocks[i].ref_count for i in (0, 1)] == [2, 2]
    assert manager.copy_on_write(child) == [(0, 1, 2)]  # (pool, source, destination)
    assert child.block_table == [0, 2] and parent.block_table == [0, 1]
    assert manager.copy_on_write(parent) == []  # now private
    manager.free(parent)
    manager.free(child)
    assert manager.num_free_blocks == 6


def test_a_sliding_window_hands_back_the_blocks_it_has_passed():
    # Window 6, blocks of 4: a query at q reads keys q - 5 .. q.
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, sliding_window=6)
    a = seq(range(14))
    assert manager.allocate(a, 14)
    assert a.block_table == [0, 1, 2, 3]
    a.num_computed_tokens = 14  # the next query is at 14: keys 9.. -> blocks 0 and 1 (tokens 0-7) are dead
    manager.release_dead(a)
    assert a.block_table == [NULL_BLOCK, NULL_BLOCK, 2, 3]
    assert manager.num_free_blocks == 6 and manager.num_released == 2
    a.token_ids.extend([20, 21, 22])
    assert manager.allocate(a, 3)  # tokens 14-16: one more block, taken from the freed ones
    assert a.block_table == [NULL_BLOCK, NULL_BLOCK, 2, 3, 4]
    a.num_computed_tokens = 17  # keys 12..: block 2 (tokens 8-11) is dead too
    manager.release_dead(a)
    assert a.block_table == [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 3, 4]
    manager.free(a)  # NULL entries are skipped
    assert manager.num_free_blocks == 8 and a.block_table == []


def test_with_a_window_a_prefix_hit_needs_only_the_blocks_in_view():
    manager = BlockManager(num_blocks=8, block_size=4, sliding_window=6)
    a = seq(range(17))
    assert manager.allocate(a, 17)
    a.num_computed_tokens = 17
    manager.cache_full_blocks(a, 17)  # blocks 0-3 hold tokens 0-15
    manager.release_dead(a)  # blocks 0, 1, 2 go back to the free list, still cached
    manager.free(a)
    b = seq(list(range(16)) + [99, 98])
    # The hit covers 16 tokens; the first new query (16) reads keys 11..: blocks 2 and 3 must be
    # cached, blocks 0 and 1 need not be.
    manager.blocks[0].hash = None  # as if block 0 had been evicted
    manager.cached_blocks = {h: i for h, i in manager.cached_blocks.items() if i != 0}
    assert manager.find_cached_prefix(b) == [NULL_BLOCK, NULL_BLOCK, 2, 3]
    assert manager.allocate(b, 2, [NULL_BLOCK, NULL_BLOCK, 2, 3])
    assert b.block_table[:4] == [NULL_BLOCK, NULL_BLOCK, 2, 3] and len(b.block_table) == 5


def test_a_hybrid_model_holds_a_table_in_each_pool_and_allocates_both_or_neither():
    manager = make_block_manager([(10, None), (3, 4)], block_size=4, enable_prefix_caching=False)
    a = seq(range(8))
    assert manager.allocate(a, 8)
    assert a.block_table == [0, 1] and a.sliding_block_table == [0, 1]
    b = seq(range(8), "b")
    assert not manager.allocate(b, 8)  # the sliding pool has one block left
    assert b.block_table == [] and b.sliding_block_table == [] and manager.num_free_blocks == 8
    a.num_computed_tokens = 8  # window 4: the next query (8) reads keys 5..: block 0 is dead there
    manager.release_dead(a)
    assert a.block_table == [0, 1] and a.sliding_block_table == [NULL_BLOCK, 1]
    assert manager.allocate(b, 8)
    assert b.block_table == [2, 3] and b.sliding_block_table == [2, 0]
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 10 and manager.sliding.num_free_blocks == 3


def test_a_block_a_chunk_filled_only_in_part_is_never_published():
    """A prefix lookup hashes every full block of the prompt; a prefill chunk that ends
    inside a block must not publish that block (another request would read its unwritten
    slots as a cached prefix)."""
    manager = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(13))
    assert manager.find_cached_prefix(a) == [] and len(a.block_hashes) == 3
    assert manager.allocate(a, 6)  # a chunk of 6 tokens: block 0 full, block 1 half written
    a.num_computed_tokens = 6
    manager.cache_full_blocks(a, 6)
    assert [manager.blocks[i].hash is not None for i in a.block_table] == [True, False]
    b = seq(range(13), "b")
    assert manager.find_cached_prefix(b) == [a.block_table[0]]
