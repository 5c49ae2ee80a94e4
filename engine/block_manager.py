"""Paged KV-cache block pool: free list, ref counts, hash-chained prefix cache.

Pure Python, no torch: block ids are decided here and only *used* by the model
runner, so the whole policy is unit-tested on exact ids.

NOTE: invariants
  * a block is in `free_blocks` iff its ref_count is 0;
  * a free block may still hold a cached full block (its `hash` is set and it is
    in `cached_blocks`); it is evicted, least recently freed first, only when the
    free list has to hand it out for new tokens;
  * a block's hash covers its parent's hash and its own token ids, so equal hashes
    mean equal whole prefixes;
  * with a sliding window, a table entry whose tokens no query can attend to any more
    is NULL_BLOCK: its block went back to the pool (`release_dead`). Tables keep one
    entry per logical block, so positions still index them.

Hybrid models (Gemma 3: local and global layers) keep two pools, one per kind of
layer, in HybridBlockManager: a sequence holds `block_table` in the full-attention
layers' pool and `sliding_block_table` in the sliding layers' pool, whose dead blocks
are released as the window moves on.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence as SequenceOf

from engine.sequence import Sequence
from kvfleet_kernels import cdiv

NULL_BLOCK = -1


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.hash})"


def hash_block(parent_hash: int | str | None, token_ids: SequenceOf[int]) -> int:
    return hash((parent_hash, tuple(token_ids)))


class BlockManager:
    """One pool. `sliding_window`: the layers it serves attend to that many tokens, so
    blocks behind the window are released; `table`: the Sequence attribute holding the
    sequence's block ids in this pool; `group`: this pool's index in the model runner."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, table: str = "block_table", group: int = 0) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.table, self.group = table, group
        self.num_released = 0  # blocks handed back early because the window had passed them
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the front is the least recently freed.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[int, int] = {}  # block hash -> block id
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of those, tokens found cached

    # -- sizes -------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _table(self, seq: Sequence) -> list[int]:
        return getattr(seq, self.table)

    def num_dead_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no query from position `num_computed_tokens` on attends to: a
        query at q reads keys q - window + 1 .. q (transformers' sliding mask)."""
        if self.sliding_window is None:
            return 0
        return max(0, (num_computed_tokens - self.sliding_window + 1) // self.block_size)

    def release_dead(self, seq: Sequence) -> None:
        """Hand back the blocks the window has passed (they stay in the prefix cache)."""
        table = self._table(seq)
        for index in range(min(self.num_dead_blocks(seq.num_computed_tokens), len(table))):
            if table[index] != NULL_BLOCK:
                self._release(table[index])
                table[index] = NULL_BLOCK
                self.num_released += 1

    # -- prefix cache --------------------------------------------------------
    def _compute_block_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq.block_hashes over the full blocks among its first num_tokens tokens."""
        size = self.block_size
        for index in range(len(seq.block_hashes), num_tokens // size):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt
            seq.block_hashes.append(hash_block(parent, seq.token_ids[index * size : (index + 1) * size]))

    def find_cached_prefix(self, seq: Sequence, max_blocks: int | None = None) -> list[int]:
        """Block ids holding the longest cached prefix of `seq` (full blocks only).

        At least one token is always left to compute, since the model must run on
        the last token to produce the next one's logits.
        """
        if not self.enable_prefix_caching:
            return []
        self._compute_block_hashes(seq, seq.num_tokens - 1)
        num_candidates = min(len(seq.block_hashes), (seq.num_tokens - 1) // self.block_size)
        if max_blocks is not None:
            num_candidates = min(num_candidates, max_blocks)
        if self.sliding_window is None:  # the longest run of cached blocks from the first
            return list(itertools.takewhile(lambda block_id: block_id is not None,
                                            (self._cached(seq, index) for index in range(num_candidates))))
        cached = [self._cached(seq, index) for index in range(num_candidates)]
        # With a window, only the blocks the first new query can see must be cached: the
        # longest prefix whose live blocks are all found wins; its dead ones are NULL.
        for num_blocks in range(num_candidates, 0, -1):
            dead = self.num_dead_blocks(num_blocks * self.block_size)
            if all(block_id is not None for block_id in cached[dead:num_blocks]):
                return [NULL_BLOCK] * dead + cached[dead:num_blocks]
        return []

    def _cached(self, seq: Sequence, index: int) -> int | None:
        """The cached block holding block `index` of `seq`, if any."""
        block_id = self.cached_blocks.get(seq.block_hashes[index])
        tokens = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
        return block_id if block_id is not None and self.blocks[block_id].token_ids == tokens else None

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_queries += num_query_tokens
        self.num_prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Register the full blocks whose tokens are all computed, so later requests reuse them."""
        if not self.enable_prefix_caching:
            return
        self._compute_block_hashes(seq, num_computed_tokens)
        table = self._table(seq)
        # Only blocks whose every token is computed: seq.block_hashes may run further (a prefix
        # lookup hashes the whole prompt), and a chunk can end inside an allocated block.
        for index in range(min(num_computed_tokens // self.block_size, len(table))):
            if table[index] == NULL_BLOCK:
                continue
            block = self.blocks[table[index]]
            if block.hash is not None:
                continue
            block_hash = seq.block_hashes[index]
            if block_hash in self.cached_blocks:
                continue  # an equal block is cached already; this one stays private
            block.hash = block_hash
            block.token_ids = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
            self.cached_blocks[block_hash] = block.block_id

    # -- allocation ----------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: SequenceOf[int] = ()) -> bool:
        return self._num_blocks_to_take(seq, num_new_tokens, cached_prefix) <= self.num_free_blocks

    def _num_blocks_to_take(self, seq: Sequence, num_new_tokens: int, cached_prefix: SequenceOf[int]) -> int:
        num_tokens = seq.num_computed_tokens + len(cached_prefix) * self.block_size + num_new_tokens
        num_new_blocks = self.num_blocks_for(num_tokens) - len(self._table(seq)) - len(cached_prefix)
        # Cached blocks that sit on the free list leave it when they are reused.
        num_revived = sum(1 for block_id in cached_prefix
                          if block_id != NULL_BLOCK and self.blocks[block_id].ref_count == 0)
        return max(num_new_blocks, 0) + num_revived + int(self._needs_copy_on_write(seq))

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        """The next token lands in a partly filled last block that another sequence shares."""
        table = self._table(seq)
        return (bool(table) and seq.num_computed_tokens % self.block_size != 0
                and self.blocks[table[-1]].ref_count > 1)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: SequenceOf[int] = ()) -> bool:
        """Give `seq` the blocks for `num_new_tokens` more tokens (after any cached prefix).

        Returns False, changing nothing, when the free list is too short.
        """
        if self._num_blocks_to_take(seq, num_new_tokens, cached_prefix) > self.num_free_blocks:
            return False
        table = self._table(seq)
        for block_id in cached_prefix:
            if block_id != NULL_BLOCK:
                self._take(block_id)
            table.append(block_id)
        num_tokens = seq.num_computed_tokens + len(cached_prefix) * self.block_size + num_new_tokens
        while len(table) < self.num_blocks_for(num_tokens):
            table.append(self._take_fresh())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share every block of `parent` (parallel sampling)."""
        table = self._table(parent)
        for block_id in table:
            if block_id != NULL_BLOCK:
                self.blocks[block_id].ref_count += 1
        setattr(child, self.table, list(table))
        child.block_hashes = list(parent.block_hashes)

    def copy_on_write(self, seq: Sequence) -> list[tuple[int, int, int]]:
        """Before `seq` writes into its last block: if that block is shared, give `seq`
        a private copy. Returns the (group, source, destination) copies for the runner."""
        if not self._needs_copy_on_write(seq):
            return []
        table = self._table(seq)
        last = self.blocks[table[-1]]
        last.ref_count -= 1
        new_id = self._take_fresh()
        table[-1] = new_id
        return [(self.group, last.block_id, new_id)]

    def free(self, seq: Sequence) -> None:
        # Reverse order: a sequence's tail blocks are the least likely to be shared,
        # so they go to the front of the eviction order.
        for block_id in reversed(self._table(seq)):
            if block_id != NULL_BLOCK:
                self._release(block_id)
        setattr(seq, self.table, [])

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks[block_id] = None

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached content
            if self.cached_blocks.get(block.hash) == block_id:
                del self.cached_blocks[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id


class HybridBlockManager:
    """The two pools of a model with full-attention and sliding-window layers (Gemma 3),
    behind BlockManager's interface. The full pool decides capacity (what admission and
    the stats see); the sliding pool is sized so that every running sequence's window and
    one step's new tokens always fit (engine/model_runner.py), and hands blocks back as
    the window moves on. A prefix hit counts where both pools hold it: cached-prefix
    entries are (full, sliding) block-id pairs."""

    def __init__(self, full: BlockManager, sliding: BlockManager) -> None:
        self.full, self.sliding = full, sliding
        self.block_size = full.block_size
        self.enable_prefix_caching = full.enable_prefix_caching

    @property
    def num_total_blocks(self) -> int:
        return self.full.num_total_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    @property
    def num_prefix_queries(self) -> int:
        return self.full.num_prefix_queries

    @property
    def num_prefix_hits(self) -> int:
        return self.full.num_prefix_hits

    @property
    def num_released(self) -> int:
        return self.sliding.num_released

    def num_blocks_for(self, num_tokens: int) -> int:
        return self.full.num_blocks_for(num_tokens)

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.full.record_prefix_lookup(num_query_tokens, num_hit_tokens)

    def find_cached_prefix(self, seq: Sequence) -> list[tuple[int, int]]:
        full_hits = self.full.find_cached_prefix(seq)
        return list(zip(full_hits, self.sliding.find_cached_prefix(seq, max_blocks=len(full_hits))))

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        self.full.cache_full_blocks(seq, num_computed_tokens)
        self.sliding.cache_full_blocks(seq, num_computed_tokens)

    @staticmethod
    def _split(cached_prefix: SequenceOf) -> tuple[list[int], list[int]]:
        """(full, sliding) pairs -> the full pool's block ids, the sliding pool's."""
        return [pair[0] for pair in cached_prefix], [pair[1] for pair in cached_prefix]

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: SequenceOf = ()) -> bool:
        full_prefix, sliding_prefix = self._split(cached_prefix)
        return (self.full.can_allocate(seq, num_new_tokens, full_prefix)
                and self.sliding.can_allocate(seq, num_new_tokens, sliding_prefix))

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: SequenceOf = ()) -> bool:
        """Both pools or neither: returns False, changing nothing, when either is short."""
        if not self.can_allocate(seq, num_new_tokens, cached_prefix):
            return False
        full_prefix, sliding_prefix = self._split(cached_prefix)
        self.full.allocate(seq, num_new_tokens, full_prefix)
        self.sliding.allocate(seq, num_new_tokens, sliding_prefix)
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.full.fork(parent, child)
        self.sliding.fork(parent, child)

    def copy_on_write(self, seq: Sequence) -> list[tuple[int, int, int]]:
        return self.full.copy_on_write(seq) + self.sliding.copy_on_write(seq)

    def free(self, seq: Sequence) -> None:
        self.full.free(seq)
        self.sliding.free(seq)

    def release_dead(self, seq: Sequence) -> None:
        self.sliding.release_dead(seq)


def make_block_manager(pools: list[tuple[int, int | None]], block_size: int,
                       enable_prefix_caching: bool) -> BlockManager | HybridBlockManager:
    """`pools`: (blocks, sliding window or None) of each KV group the model runner made:
    one pool, or the full-attention and the sliding layers' pools of a hybrid model."""
    if len(pools) == 1:
        return BlockManager(pools[0][0], block_size, enable_prefix_caching, sliding_window=pools[0][1])
    (num_full, _), (num_sliding, window) = pools
    return HybridBlockManager(
        BlockManager(num_full, block_size, enable_prefix_caching),
        BlockManager(num_sliding, block_size, enable_prefix_caching, sliding_window=window,
                     table="sliding_block_table", group=1))
