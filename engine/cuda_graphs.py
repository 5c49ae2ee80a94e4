"""CUDA graphs of decode-only steps (vLLM's and nano-vllm's CUDA graph capture).

On an H200 a decode step of 64 sequences of a ~1B model took 28 ms of host time for ~1.5 ms
of GPU work (gpu_check, 2026-12-04): ~50 kernel launches a layer, each ~11 us of Python and
driver. A graph replays a whole step's kernels from one launch. One graph per padded batch
size (`capture_sizes`: 1, 2, 4, then multiples of 8 up to max_num_seqs), all sharing one
memory pool, captured from the largest down; a step of n sequences runs the smallest graph of
at least n rows, its padding rows writing no K/V (slot -1, which store_kv skips) and reading
one cached position each.

A graph replays fixed addresses, so a step's inputs are copied into static buffers first:
token ids, positions, and per KV pool the slots, block tables and context lengths. The
block tables' width is fixed by `max_seq_len_to_capture` (8,192 tokens, vLLM's default);
a step whose sequences are longer, a prefill, or a batch above the largest size runs eagerly.

Graphs need every op of the forward pass to run on the device without reading back to the
host: the Triton backend on one device, no LoRA adapters (their slots are host state) and no
mixture of experts (the fused-MoE launcher sizes its grid from the routing).
`ineligible_reason` says which case holds. Tests run all of this on the CPU through the Triton interpreter, with
`graph_factory` replaced by a stand-in that replays a step by calling it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from engine.attention import AttentionMetadata, ForwardContext
from kvfleet_kernels import cdiv

logger = logging.getLogger(__name__)

MAX_SEQ_LEN_TO_CAPTURE = 8192


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes that get a graph: 1, 2, 4, then multiples of 8 (vLLM's default
    list), up to the first that holds max_num_seqs sequences."""
    candidates = [1, 2, 4, *range(8, cdiv(max_num_seqs, 8) * 8 + 1, 8)]
    return candidates[: next(i for i, size in enumerate(candidates) if size >= max_num_seqs) + 1]


def ineligible_reason(model: nn.Module, device: torch.device, backend_name: str, world_size: int,
                      lora: bool) -> str | None:
    """Why decode steps of this runner cannot be captured, or None when they can."""
    from engine.models.moe import FusedMoE  # noqa: PLC0415 (the model modules import this package's layers)

    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device.type}"
    if backend_name != "triton":
        return f"the {backend_name} attention backend runs on the host"
    if world_size > 1:
        return "tensor parallelism (its collectives run outside the graph)"
    if lora:
        return "LoRA adapters (their slots are host state)"
    if any(isinstance(module, FusedMoE) for module in model.modules()):
        return "a mixture of experts (the fused-MoE launcher sizes its grid from the routing)"
    return None


class CudaGraph:
    """One torch.cuda.CUDAGraph in the runner's shared memory pool."""

    def __init__(self, pool) -> None:
        self.graph, self.pool = torch.cuda.CUDAGraph(), pool

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            output = forward()
        torch.cuda.synchronize()
        return output

    def replay(self) -> None:
        self.graph.replay()


def cuda_graph_factory() -> Callable[[], CudaGraph]:
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaGraph(pool)


class DecodeGraphs:
    """Static buffers and one captured forward pass per padded batch size.

    model:        the model (forward(input_ids, positions, ctx) -> hidden [T, hidden])
    kv_caches:    per layer, (K, V) as the backend reads them; layer_groups: each layer's pool
    num_pools:    KV pools (2 for a model with local and global layers)
    with_seq_lens: longrope models read each token's sequence length
    graph_factory: makes one graph (capture(forward) -> output, replay()); CudaGraph's by default
    """

    def __init__(self, model: nn.Module, backend, kv_caches: list, layer_groups: list[int], num_pools: int,
                 block_size: int, max_model_len: int, max_num_seqs: int, with_seq_lens: bool, device: torch.device,
                 graph_factory: Callable[[], object] | None = None) -> None:
        self.model, self.backend, self.kv_caches, self.layer_groups = model, backend, kv_caches, layer_groups
        self.sizes = capture_sizes(max_num_seqs)
        self.max_seq_len = min(max_model_len, MAX_SEQ_LEN_TO_CAPTURE)  # the widest step a graph takes
        self.max_blocks = cdiv(self.max_seq_len, block_size)
        rows = self.sizes[-1]

        def buffer(*shape: int, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.int64, device=device)

        self.input_ids, self.positions = buffer(rows), buffer(rows)
        self.seq_lens = buffer(rows, fill=1) if with_seq_lens else None
        # Per pool; padding rows: no slot, one cached position in block 0.
        self.slots = [buffer(rows, fill=-1) for _ in range(num_pools)]
        self.block_tables = [buffer(rows, self.max_blocks) for _ in range(num_pools)]
        self.context_lens = [buffer(rows, fill=1) for _ in range(num_pools)]
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> hidden [size, hidden], written by each replay
        self._factory = graph_factory or cuda_graph_factory()

    def _forward(self, size: int) -> torch.Tensor:
        metas = [AttentionMetadata(slot_mapping=slots[:size], num_prefill_tokens=0,
                                   decode_block_tables=tables[:size], decode_context_lens=lens[:size],
                                   seq_lens=None if self.seq_lens is None else self.seq_lens[:size])
                 for slots, tables, lens in zip(self.slots, self.block_tables, self.context_lens)]
        ctx = ForwardContext(metas[0], self.kv_caches, self.backend, metas, self.layer_groups)
        return self.model(self.input_ids[:size], self.positions[:size], ctx)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every size, largest first (later graphs reuse the pool the first one sized). A
        warm-up run first compiles the Triton kernels and sets up cuBLAS outside the graph;
        padding rows write nothing, so the KV cache is untouched."""
        for size in reversed(self.sizes):
            self._forward(size)
            graph = self._factory()
            self.outputs[size] = graph.capture(lambda size=size: self._forward(size))
            self.graphs[size] = graph
        logger.info("captured CUDA graphs of decode steps for %d batch sizes (up to %d sequences of %d tokens)",
                    len(self.sizes), self.sizes[-1], self.max_seq_len)

    def padded_size(self, metas: list[AttentionMetadata], num_tokens: int) -> int | None:
        """The graph a step runs on: a decode-only step of at most the largest size whose
        tables fit the captured width; None: it runs eagerly."""
        if not self.graphs or num_tokens == 0 or num_tokens > self.sizes[-1]:
            return None
        if any(meta.num_prefill_tokens or meta.decode_block_tables.shape[1] > self.max_blocks for meta in metas):
            return None
        return next(size for size in self.sizes if size >= num_tokens)

    def run(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
            metas: list[AttentionMetadata]) -> torch.Tensor:
        """Copy the step's n rows into the buffers, reset rows n..size to padding (an earlier,
        larger step left its own there), replay; hidden [n, hidden]."""
        n = len(input_ids)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        if self.seq_lens is not None:
            self.seq_lens[:n].copy_(metas[0].seq_lens)
            self.seq_lens[n:size].fill_(1)
        for meta, slots, tables, lens in zip(metas, self.slots, self.block_tables, self.context_lens):
            width = meta.decode_block_tables.shape[1]
            slots[:n].copy_(meta.slot_mapping)
            slots[n:size].fill_(-1)
            tables[:n, :width].copy_(meta.decode_block_tables)  # columns past a context are never read
            tables[n:size].zero_()
            lens[:n].copy_(meta.decode_context_lens)
            lens[n:size].fill_(1)
        self.graphs[size].replay()
        return self.outputs[size][:n]
