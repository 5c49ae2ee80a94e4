"""Paged KV-cache block pool: free list, ref counts, hash-chained prefix cache.

Pure Python, no torch: block ids are decided here and only *used* by the model
runner, so the whole policy is unit-tested on exact ids.

NOTE: invariants
  * a block is in `free_blocks` iff its ref_count is 0;
  * a free block may still hold a cached full block (its `hash` is set and it is
    in `cached_blocks`); it is evicted, least recently freed first, only when the
    free list has to hand it out for new tokens;
  * a block's hash covers its parent's hash and its own token ids, so equal hashes
    mean equal whole prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as SequenceOf

from engine.sequence import Sequence
from kernels import cdiv


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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
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

    # -- prefix cache --------------------------------------------------------
    def _compute_block_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq.block_hashes over the full blocks among its first num_tokens tokens."""
        size = self.block_size
        for index in range(len(seq.block_hashes), num_tokens // size):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt
            seq.block_hashes.append(hash_block(parent, seq.token_ids[index * size : (index + 1) * size]))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq` (full blocks only).

        At least one token is always left to compute, since the model must run on
        the last token to produce the next one's logits.
        """
        if not self.enable_prefix_caching:
            return []
        self._compute_block_hashes(seq, seq.num_tokens - 1)
        hits: list[int] = []
        for index, block_hash in enumerate(seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]):
            block_id = self.cached_blocks.get(block_hash)
            tokens = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_queries += num_query_tokens
        self.num_prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Register the full blocks whose tokens are all computed, so later requests reuse them."""
        if not self.enable_prefix_caching:
            return
        self._compute_block_hashes(seq, num_computed_tokens)
        for index in range(min(len(seq.block_hashes), len(seq.block_table))):
            block = self.blocks[seq.block_table[index]]
            if block.hash is not None:
                continue
            block_hash = seq.block_hashes[index]
            if block_hash in self.cached_blocks:
                continue  # an equal block is cached already; this one stays private
            block.hash = block_hash
            block.token_ids = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
            self.cached_blocks[block_hash] = block.block_id

    # -- allocation ----------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[int] = ()) -> bool:
        return self._num_blocks_to_take(seq, num_new_tokens, cached_prefix) <= self.num_free_blocks

    def _num_blocks_to_take(self, seq: Sequence, num_new_tokens: int, cached_prefix: SequenceOf[int]) -> int:
        num_tokens = seq.num_computed_tokens + len(cached_prefix) * self.block_size + num_new_tokens
        num_new_blocks = self.num_blocks_for(num_tokens) - len(seq.block_table) - len(cached_prefix)
        # Cached blocks that sit on the free list leave it when they are reused.
        num_revived = sum(1 for block_id in cached_prefix if self.blocks[block_id].ref_count == 0)
        return max(num_new_blocks, 0) + num_revived + int(self._needs_copy_on_write(seq))

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        """The next token lands in a partly filled last block that another sequence shares."""
        return (bool(seq.block_table) and seq.num_computed_tokens % self.block_size != 0
                and self.blocks[seq.block_table[-1]].ref_count > 1)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: SequenceOf[int] = ()) -> bool:
        """Give `seq` the blocks for `num_new_tokens` more tokens (after any cached prefix).

        Returns False, changing nothing, when the free list is too short.
        """
        if self._num_blocks_to_take(seq, num_new_tokens, cached_prefix) > self.num_free_blocks:
            return False
        for block_id in cached_prefix:
            self._take(block_id)
            seq.block_table.append(block_id)
        num_tokens = seq.num_computed_tokens + len(cached_prefix) * self.block_size + num_new_tokens
        while len(seq.block_table) < self.num_blocks_for(num_tokens):
            seq.block_table.append(self._take_fresh())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share every block of `parent` (parallel sampling)."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)

    def copy_on_write(self, seq: Sequence) -> tuple[int, int] | None:
        """Before `seq` writes into its last block: if that block is shared, give `seq`
        a private copy. Returns (source, destination) block ids for the runner to copy."""
        if not self._needs_copy_on_write(seq):
            return None
        last = self.blocks[seq.block_table[-1]]
        last.ref_count -= 1
        new_id = self._take_fresh()
        seq.block_table[-1] = new_id
        return last.block_id, new_id

    def free(self, seq: Sequence) -> None:
        # Reverse order: a sequence's tail blocks are the least likely to be shared,
        # so they go to the front of the eviction order.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        seq.block_table = []

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
