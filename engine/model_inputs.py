"""A step's model inputs: from the scheduled sequences to the host tensors rank 0 broadcasts
(`step_inputs`, engine/shard.py: StepInputs), and from those to what the forward pass reads on
the model's device (`ModelInputBuilder`): token ids, positions, and one AttentionMetadata per
KV pool. Every index is computed on the host and copied to the device once; nothing here
reads a device tensor back."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, PrefillSpan
from engine.devices import repeat_interleave
from engine.lora.manager import SlotTable, lora_step_inputs
from engine.sequence import Sequence
from engine.shard import StepInputs
from kvfleet_kernels import cdiv


def padded_tables(tables: list[list[int]]) -> torch.Tensor:
    """[S, width] block ids, padded with 0; NULL_BLOCK entries (blocks a sliding window
    has passed) read block 0 too: the kernels mask those positions, and every block
    holds finite values."""
    width = max(len(table) for table in tables)
    return torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int64).clamp_(min=0)


def step_inputs(seqs: list[Sequence], num_new: list[int], copies: list[tuple[int, int, int]], rows: list[int],
                hybrid: bool, lora_slots: SlotTable | None, running_adapters: set[str]) -> StepInputs:
    """What a step needs from the sequences (prefills first), as host tensors. `hybrid`: the
    model has a second, sliding-window KV pool with its own block tables."""
    input_ids: list[int] = []
    for seq, n in zip(seqs, num_new):
        input_ids.extend(seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n])
    sliding_tables = (padded_tables([s.sliding_block_table for s in seqs]) if hybrid
                      else torch.zeros(len(seqs), 0, dtype=torch.int64))
    return StepInputs(torch.tensor(input_ids), torch.tensor([s.num_computed_tokens for s in seqs]),
                      torch.tensor(num_new), padded_tables([s.block_table for s in seqs]),
                      torch.tensor(copies, dtype=torch.int64).view(-1, 3), torch.tensor(rows, dtype=torch.int64),
                      torch.tensor([s.num_tokens for s in seqs]), sliding_tables,
                      *lora_step_inputs(lora_slots, seqs, running_adapters))


class ModelInputBuilder:
    """Every rank's StepInputs -> (input_ids [T], positions [T], one AttentionMetadata per KV
    pool) on `device`. A hybrid model's two pools have their own block ids, so their own slots
    and tables. `reads_prefill_spans`: the attention backend's form of the prefills;
    `long_rope_after`: a longrope model's pretraining length (the only reader of seq_lens)."""

    def __init__(self, device: torch.device, block_size: int, num_pools: int, reads_prefill_spans: bool,
                 long_rope_after: int | None) -> None:
        self.device, self.block_size, self.num_pools = device, block_size, num_pools
        self.reads_prefill_spans, self.long_rope_after = reads_prefill_spans, long_rope_after

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the model's device: through pinned memory and without waiting on CUDA."""
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def build(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
        lens, starts = inputs.lens, inputs.starts
        seq_of_token = repeat_interleave(torch.arange(len(lens)), lens)  # [T]
        offsets = lens.cumsum(0) - lens  # first row of each sequence in the flat batch
        positions = torch.arange(len(inputs.input_ids)) - offsets[seq_of_token] + starts[seq_of_token]  # [T]
        tables = [inputs.block_tables] + ([inputs.sliding_block_tables] if self.num_pools == 2 else [])
        # Only longrope reads them (engine/models/layers.py); other models skip the gather.
        seq_lens = self.to_device(inputs.seq_lens[seq_of_token]) if self.long_rope_after is not None else None
        metas = []
        for block_tables in tables:
            meta = self._attention_metadata(block_tables, inputs, seq_of_token, offsets, positions)
            meta.seq_lens = seq_lens
            metas.append(meta)
        return self.to_device(inputs.input_ids), self.to_device(positions), metas

    def _attention_metadata(self, block_tables: torch.Tensor, inputs: StepInputs, seq_of_token: torch.Tensor,
                            offsets: torch.Tensor, positions: torch.Tensor) -> AttentionMetadata:
        """The step's slots and tables in one pool; prefills in the form the backend reads."""
        lens, starts = inputs.lens, inputs.starts
        num_new = lens.tolist()
        num_prefills = sum(1 for n in num_new if n > 1)
        # Real table lengths: a sequence's blocks cover its context (padding is beyond).
        table_lens = [cdiv(context, self.block_size) for context in (starts + lens).tolist()]
        slot_mapping = (block_tables[seq_of_token, positions // self.block_size] * self.block_size
                        + positions % self.block_size)  # [T]
        context_lens = starts + lens  # [num_seqs]
        device_tables = self.to_device(block_tables)  # [num_seqs, width]
        num_decode_blocks = max(table_lens[num_prefills:], default=0)
        meta = AttentionMetadata(
            slot_mapping=self.to_device(slot_mapping),
            num_prefill_tokens=int(lens[:num_prefills].sum()),
            decode_block_tables=device_tables[num_prefills:, :num_decode_blocks],
            decode_context_lens=self.to_device(context_lens[num_prefills:]),
        )
        if num_prefills and self.reads_prefill_spans:
            meta.prefills = [PrefillSpan(int(offsets[i]), num_new[i], int(context_lens[i]),
                                         device_tables[i, : table_lens[i]])
                             for i in range(num_prefills)]
        elif num_prefills:
            query_starts = torch.zeros(num_prefills + 1, dtype=torch.int64)
            query_starts[1:] = lens[:num_prefills].cumsum(0)
            meta.prefill_query_starts = self.to_device(query_starts)
            meta.prefill_context_lens = self.to_device(context_lens[:num_prefills])
            meta.prefill_block_tables = device_tables[:num_prefills, :max(table_lens[:num_prefills])]
            meta.max_prefill_queries = max(num_new[:num_prefills])
        return meta
