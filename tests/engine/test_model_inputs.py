"""A step's model inputs, exactly: the host tensors rank 0 builds from its sequences, then the
token ids, positions, slots and block tables the attention backends read (engine/model_inputs.py)."""

from __future__ import annotations

import torch

from engine.model_inputs import ModelInputBuilder, padded_tables, step_inputs
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.shard import StepInputs

BLOCK_SIZE = 4


def step(starts: list[int], lens: list[int], tables: list[list[int]], sliding: list[list[int]] | None = None):
    """StepInputs for sequences with `starts` tokens cached and `lens` new ones (prefills first)."""
    total = sum(lens)
    return StepInputs(torch.arange(100, 100 + total), torch.tensor(starts), torch.tensor(lens), padded_tables(tables),
                      torch.zeros(0, 3, dtype=torch.int64), torch.tensor([total - 1]),
                      torch.tensor([s + n for s, n in zip(starts, lens)]),
                      padded_tables(sliding) if sliding else torch.zeros(len(starts), 0, dtype=torch.int64),
                      torch.full((len(starts),), -1), torch.zeros(0, dtype=torch.uint8))


def test_a_mixed_step_has_each_tokens_position_slot_and_table():
    # A prefill of 3 tokens after 6 cached (blocks 7, 2, 9), then two decodes at positions 4 and 0.
    inputs = step([6, 4, 0], [3, 1, 1], [[7, 2, 9], [5, 8], [3]])
    builder = ModelInputBuilder(torch.device("cpu"), BLOCK_SIZE, 1, reads_prefill_spans=True, long_rope_after=None)
    input_ids, positions, (meta,) = builder.build(inputs)
    assert input_ids.tolist() == [100, 101, 102, 103, 104]
    assert positions.tolist() == [6, 7, 8, 4, 0]
    # slot = block * 4 + position % 4: 6 and 7 in block 2, 8 in block 9; 4 in block 8; 0 in block 3
    assert meta.slot_mapping.tolist() == [2 * 4 + 2, 2 * 4 + 3, 9 * 4 + 0, 8 * 4 + 0, 3 * 4 + 0]
    assert meta.num_prefill_tokens == 3 and meta.seq_lens is None
    assert meta.decode_block_tables.tolist() == [[5, 8], [3, 0]] and meta.decode_context_lens.tolist() == [5, 1]
    (span,) = meta.prefills
    assert (span.query_start, span.num_queries, span.context_len, span.block_table.tolist()) == (0, 3, 9, [7, 2, 9])


def test_the_triton_form_packs_every_prefill_and_a_hybrid_model_gets_its_sliding_pool():
    inputs = step([0, 2, 7], [2, 3, 1], [[1], [4, 6], [2, 3]], sliding=[[11], [12, 13], [0, 14]])
    builder = ModelInputBuilder(torch.device("cpu"), BLOCK_SIZE, 2, reads_prefill_spans=False, long_rope_after=64)
    _, positions, (full, sliding) = builder.build(inputs)
    assert positions.tolist() == [0, 1, 2, 3, 4, 7]
    assert full.prefill_query_starts.tolist() == [0, 2, 5] and full.prefill_context_lens.tolist() == [2, 5]
    assert full.prefill_block_tables.tolist() == [[1, 0], [4, 6]] and full.max_prefill_queries == 3
    assert full.slot_mapping.tolist() == [4, 5, 18, 19, 24, 15]
    assert sliding.slot_mapping.tolist() == [44, 45, 50, 51, 52, 59]
    assert sliding.decode_block_tables.tolist() == [[0, 14]]
    assert full.seq_lens.tolist() == [2, 2, 5, 5, 5, 8]  # longrope: each token's sequence length


def test_step_inputs_take_each_sequences_new_tokens():
    params = SamplingParams(max_tokens=4)
    first, second = Sequence("a", [1, 2, 3, 4, 5], params), Sequence("b", [6, 7], params)
    first.num_computed_tokens, first.block_table, second.block_table = 2, [3, 1], [4]
    inputs = step_inputs([first, second], [3, 2], [(0, 1, 2)], [2, 4], False, None, set())
    assert inputs.input_ids.tolist() == [3, 4, 5, 6, 7]
    assert inputs.starts.tolist() == [2, 0] and inputs.lens.tolist() == [3, 2]
    assert inputs.block_tables.tolist() == [[3, 1], [4, 0]] and inputs.copies.tolist() == [[0, 1, 2]]
    assert inputs.rows.tolist() == [2, 4] and inputs.seq_lens.tolist() == [5, 2]
    assert inputs.sliding_block_tables.shape == (2, 0) and inputs.lora_slots.tolist() == [-1, -1]
