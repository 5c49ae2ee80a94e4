"""The paged KV cache's layout: which layers share a pool of blocks, and how many
blocks each pool gets.

Every layer reads the same blocks, unless a model mixes full-attention layers with
sliding-window ones (Gemma 3: five local layers to one global). Then the sliding
layers get a pool of their own, where a sequence holds only the blocks its window
still covers (engine/block_manager.py hands the others back as the window moves):
that pool is sized to every running sequence's window plus one step's new tokens, and
the memory it does not take goes to the full-attention layers' pool, so more tokens
fit. A model whose every layer has the same window keeps one pool and hands back the
blocks the window has passed.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from kvfleet_kernels import cdiv


@dataclass(frozen=True)
class KVGroup:
    layers: list[int]  # the layer indices reading this pool, in order
    sliding_window: int | None  # None: these layers attend to the whole context


def kv_groups(attention_layers) -> list[KVGroup]:
    """One group, or the full-attention and the sliding layers' groups of a hybrid model.
    Layers with different windows share one pool read in full (nothing is released)."""
    windows = [getattr(layer, "sliding_window", None) for layer in attention_layers]
    indices = [layer.layer_idx for layer in attention_layers]
    distinct = {w for w in windows if w is not None}
    if len(distinct) != 1:
        return [KVGroup(indices, None)]
    window = distinct.pop()
    if all(w is not None for w in windows):
        return [KVGroup(indices, window)]
    return [KVGroup([i for i, w in zip(indices, windows) if w is None], None),
            KVGroup([i for i, w in zip(indices, windows) if w is not None], window)]


def sliding_pool_bound(config: EngineConfig, window: int) -> int:
    """Blocks that always hold each running sequence's window (the blocks its next
    queries read) and one step's new tokens, however they fall on block edges."""
    return config.max_num_seqs * (cdiv(window, config.block_size) + 2) + \
        cdiv(config.max_num_batched_tokens, config.block_size)


def pool_sizes(groups: list[KVGroup], config: EngineConfig, bytes_per_layer_block: int,
               memory: int | None) -> list[int]:
    """Blocks per pool: `config.num_kv_blocks` for the full layers' pool (the sliding
    pool no larger), else what `memory` bytes hold, the sliding pool taken first."""
    num_layers = sum(len(group.layers) for group in groups)
    plain = config.num_kv_blocks if config.num_kv_blocks is not None else memory // (num_layers * bytes_per_layer_block)
    if len(groups) == 1:
        return [plain]
    full, sliding = groups
    num_sliding = min(plain, sliding_pool_bound(config, sliding.sliding_window))
    if config.num_kv_blocks is not None:
        return [plain, num_sliding]
    sliding_bytes = num_sliding * len(sliding.layers) * bytes_per_layer_block
    return [(memory - sliding_bytes) // (len(full.layers) * bytes_per_layer_block), num_sliding]
