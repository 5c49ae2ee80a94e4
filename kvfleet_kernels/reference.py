"""Torch reference of every kernel: the CPU path of the engine and the oracle the
Triton kernels are tested against.

Paged KV layout, per layer: [num_blocks, block_size, num_kv_heads, head_dim].
A token at position p of a sequence lives in slot
block_table[p // block_size] * block_size + p % block_size.
An fp8 cache (float8_e4m3fn, float8_e5m2) holds x / scale: store_kv takes rows already
quantized (engine/kv_quant.py), and the decode path reads them back times its kv_scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfleet_kernels import cdiv

# The grouped matmuls' references (MoE experts, LoRA segments), kept under reference.* as well.
from kvfleet_kernels.reference_grouped import (  # noqa: F401
    fused_moe,
    gated_activation,
    rows_by_expert,
    sgmv,
    sum_expert_rows,
)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new K/V rows into their cache slots. key, value: [num_tokens, num_kv_heads,
    head_dim]; key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: [num_tokens] int64."""
    store_rows(key, key_cache, slot_mapping)
    store_rows(value, value_cache, slot_mapping)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # an fp8 KV cache's element types


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor's bytes (torch's index_copy_ and index_select take no fp8; the Triton kernels
    read an fp8 cache's bytes), others as they are."""
    return tensor.view(torch.uint8) if is_fp8(tensor.dtype) else tensor


def dequantized(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fp8 cache rows -> rows * scale in `dtype`; rows of another dtype as they are. Every fp8 value
    is exact in bf16, fp16 and fp32, so the product is rounded once, as in fp32."""
    if not is_fp8(x.dtype):
        return x
    widened = x.to(dtype)
    return widened if scale == 1.0 else widened.mul_(scale)


def store_rows(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """rows [num_tokens, num_kv_heads, head_dim] into their slots of one plain cache,
    [num_blocks, block_size, num_kv_heads, head_dim]."""
    as_bytes(cache).view(-1, *rows.shape[1:]).index_copy_(0, slot_mapping, as_bytes(rows))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's first context_len K (or V) rows: cache [num_blocks, block_size,
    num_kv_heads, head_dim], block_table [num_blocks_of_seq] -> [context_len, Hkv, D]."""
    return as_bytes(cache)[block_table].flatten(0, 1)[:context_len].view(cache.dtype)


def _window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, sliding_window: int | None):
    """[num_queries, num_keys] bool: causal, and inside the sliding window if any."""
    mask = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        mask &= key_positions[None, :] > query_positions[:, None] - sliding_window
    return mask


def needs_prefill_bias(num_queries: int, context_len: int, sliding_window: int | None) -> bool:
    """False when causal attention without a mask serves: no window, and a cached prefix
    no longer than the new tokens (padded_causal_attention)."""
    return sliding_window is not None or context_len - num_queries > num_queries


def prefill_bias(num_queries: int, context_len: int, sliding_window: int | None, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """[num_queries, context_len] additive mask (0 or -inf) for queries at the last
    num_queries positions of the context: causal, and inside the sliding window if any."""
    query_positions = torch.arange(context_len - num_queries, context_len, device=device)
    key_positions = torch.arange(context_len, device=device)
    visible = _window_mask(query_positions, key_positions, sliding_window)
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                      sliding_window: int | None = None, bias: torch.Tensor | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its whole context.

    query: [num_queries, num_heads, head_dim]   (the last num_queries positions of the context)
    key, value: [context_len, num_kv_heads, head_dim]
    bias: prefill_bias(...) when the caller keeps it across layers; built here otherwise
    sinks: [num_heads] or None: a learned logit per head that joins every softmax
        denominator and attends to nothing (gpt-oss), so a head can put weight nowhere
    returns [num_queries, num_heads, head_dim]
    """
    num_queries, num_heads, head_dim = query.shape
    context_len, num_kv_heads = key.shape[0], key.shape[1]
    k, v = key.transpose(0, 1), value.transpose(0, 1)  # [Hkv, C, D]
    if sinks is None:
        # 4-d on purpose: the CPU's flash kernel only takes [B, H, L, D]; a 3-d call falls to
        # the math path, which builds the whole [H, Q, C] score matrix: 131 -> 6.7 ms (bf16)
        # and 111 -> 16 ms (fp32) for 1,500 tokens of SmolLM2's 9/3 heads here.
        if not needs_prefill_bias(num_queries, context_len, sliding_window):
            return padded_causal_attention(query, k, v, scale)
        if bias is None:
            bias = prefill_bias(num_queries, context_len, sliding_window, query.dtype, query.device)
        out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], k[None], v[None], attn_mask=bias,
                                             scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    if bias is None:
        bias = prefill_bias(num_queries, context_len, sliding_window, query.dtype, query.device)
    # Sinks (gpt-oss) join the softmax, which SDPA cannot take: spelled out (baddbmm,
    # softmax, bmm), GQA without expanding K/V: a group's query heads become extra query
    # rows of their KV head.
    # Every query sees at least its own key, so no softmax row is all -inf.
    group = num_heads // num_kv_heads
    q = query.view(num_queries, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, Q, D]
    q = q.reshape(num_kv_heads, group * num_queries, head_dim)  # rows g * Q + i
    rows_bias = bias.repeat(group, 1).expand(num_kv_heads, -1, -1)  # [Hkv, G * Q, C]
    scores = torch.baddbmm(rows_bias, q, k.transpose(1, 2), alpha=scale)  # [Hkv, G * Q, C]
    probs = softmax_with_sinks(scores, sinks.view(num_kv_heads, group, 1).expand(-1, -1, num_queries).reshape(
        num_kv_heads, group * num_queries, 1))
    out = torch.bmm(probs, v)  # [Hkv, G * Q, D]
    return out.view(num_kv_heads, group, num_queries, head_dim).permute(2, 0, 1, 3).reshape(query.shape)


def padded_causal_attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last Q positions over a context of C, with no mask.

    query [Q, Hq, D]; k, v [Hkv, C, D] -> [Q, Hq, D]. SDPA's is_causal aligns query row i
    with key i (top left), so the queries go to the bottom of a [C, Hq, D] tensor whose
    first C - Q rows are zeros: row C - Q + i then sees keys 0..C - Q + i, as it must, and
    the zero rows change nothing below them. Why: a mask costs the CPU's flash kernel its
    causal block skipping and an add per score: a 1,200-token document after a 256-token
    cached instruction (SmolLM2's 9/3 heads, bf16) took 19.3 ms a layer masked, 13.9 ms
    padded. The zero rows cost (C - Q)^2 / 2 scores, so this is the path only while the
    cached prefix is no longer than the new tokens (needs_prefill_bias)."""
    num_queries, context_len = query.shape[0], k.shape[1]
    padded = query
    if context_len > num_queries:
        padded = query.new_empty((context_len, *query.shape[1:]))  # [C, Hq, D]
        padded[: context_len - num_queries].zero_()
        padded[context_len - num_queries :] = query
    out = F.scaled_dot_product_attention(padded.transpose(0, 1)[None], k[None], v[None], is_causal=True,
                                         scale=scale, enable_gqa=True)  # [1, Hq, C, D]
    return out[0, :, context_len - num_queries :].transpose(0, 1)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq_lens: list[int],
                     scale: float, causal: bool) -> torch.Tensor:
    """Attention within each sequence of a packed batch (no cache, no padding): the oracle.

    query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads, head_dim]
    seq_lens: the sequences' lengths, back to back (summing to num_tokens)
    causal: decoder embedding models; False: encoders (every token sees its whole sequence)
    returns [num_tokens, num_heads, head_dim]
    """
    out = torch.empty_like(query)
    start = 0
    for seq_len in seq_lens:
        rows = slice(start, start + seq_len)
        out[rows] = F.scaled_dot_product_attention(query[rows].transpose(0, 1), key[rows].transpose(0, 1),
                                                   value[rows].transpose(0, 1), is_causal=causal, scale=scale,
                                                   enable_gqa=True).transpose(0, 1)
        start += seq_len
    return out


# Sequences padded together for one SDPA call differ in length by at most this factor, so
# attention pads at most ~1/4 of its rows (inputs come sorted by length, so groups are few).
PADDED_GROUP_RATIO = 1.25


def padding_groups(seq_lens: list[int]) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive sequences whose lengths are within PADDED_GROUP_RATIO."""
    groups, start = [], 0
    for index in range(1, len(seq_lens) + 1):
        run = seq_lens[start:index + 1]
        if index == len(seq_lens) or max(run) > PADDED_GROUP_RATIO * min(run):
            groups.append((start, index))
            start = index
    return groups


@dataclass
class PaddedGroup:
    """Sequences [first, last) of a packed batch, padded together for one SDPA call."""

    rows: slice  # their rows in the packed batch
    num_seqs: int
    longest: int
    gather: torch.Tensor | None  # [N, L] packed row of each padded slot (padding: a zero row); None if all equal
    valid: torch.Tensor | None  # [N, L] bool: a real token
    mask: torch.Tensor | None  # [N, 1, L or 1, L] bool for SDPA, or None


def padding_plan(seq_lens: list[int], causal: bool, device: torch.device) -> list[PaddedGroup]:
    """How padded_varlen_attention pads `seq_lens`: built once a step, read by every layer."""
    plan, start = [], 0
    for first, last in padding_groups(seq_lens):
        lens_list = seq_lens[first:last]
        num_tokens, longest = sum(lens_list), max(lens_list)
        offsets = torch.arange(longest, device=device)
        causal_mask = (offsets[None, :] <= offsets[:, None])[None, None] if causal else None
        if min(lens_list) == longest:  # all of one length: a plain reshape, no key mask
            gather = valid = None
            mask = causal_mask
        else:
            lens = torch.tensor(lens_list, device=device)
            valid = offsets[None, :] < lens[:, None]  # [N, L]
            gather = torch.where(valid, (torch.cumsum(lens, 0) - lens)[:, None] + offsets[None, :], num_tokens)
            mask = valid[:, None, None, :] if causal_mask is None else valid[:, None, None, :] & causal_mask
        plan.append(PaddedGroup(slice(start, start + num_tokens), last - first, longest, gather, valid, mask))
        start += num_tokens
    return plan


def padded_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq_lens: list[int],
                            scale: float, causal: bool, plan: list[PaddedGroup] | None = None) -> torch.Tensor:
    """varlen_attention as a few batched SDPA calls (the CPU path): runs of sequences of
    similar length (padding_groups) are padded to their longest for attention alone, with
    padded keys masked; shapes as varlen_attention's. A few calls instead of one per
    sequence: the engine sorts inputs by length, so little is padded."""
    plan = plan if plan is not None else padding_plan(seq_lens, causal, query.device)
    outputs = []
    for group in plan:
        q, k, v = query[group.rows], key[group.rows], value[group.rows]

        def padded(x: torch.Tensor, group: PaddedGroup = group) -> torch.Tensor:  # [T, H, D] -> [N, H, L, D]
            if group.gather is None:
                return x.view(group.num_seqs, group.longest, *x.shape[1:]).transpose(1, 2)
            return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[group.gather].transpose(1, 2)

        out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=group.mask, scale=scale,
                                             enable_gqa=True).transpose(1, 2)  # [N, L, H, D]
        outputs.append(out.reshape(q.shape) if group.valid is None else out[group.valid])
    return torch.cat(outputs)  # [T, H, D]: the groups are consecutive in packed order


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of scores [..., C], with sinks [..., 1] (broadcast like
    scores) as one more logit whose probability is dropped: the rows sum to below one."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    combined = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1]


# A padded batch call costs about this many extra context tokens per sequence less
# than a loop iteration of small ops (measured on CPU; it only picks the faster path).
PER_SEQUENCE_OVERHEAD_TOKENS = 256


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None,
                           gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
                           sinks: torch.Tensor | None = None,
                           kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """One new token per sequence attending over its paged context.

    query:        [num_seqs, num_heads, head_dim]
    key_cache:    [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: [num_seqs, max_blocks_per_seq] int (entries past a sequence's blocks are ignored)
    context_lens: [num_seqs] int, including the new token
    sinks:        [num_heads] or None (prefill_attention says what they are)
    kv_scales:    (k_scale, v_scale) of fp8 caches: what they hold times these is K and V
    returns       [num_seqs, num_heads, head_dim]

    NOTE: two equivalent paths. One padded [num_seqs, max_context] gather and a single
    masked attention is cheapest when contexts are short or alike; when they differ a
    lot, gathering only each sequence's own blocks moves far fewer bytes.
    `gather_buffers` (two tensors shaped like the caches, any number of blocks) are
    reused for the padded gather: a fresh allocation of that size is returned to the
    OS after each call and page-faults back in, which costs more than the copy.
    """
    lens = context_lens.tolist()
    padded_tokens = len(lens) * max(lens)
    if sinks is None and padded_tokens <= sum(lens) + PER_SEQUENCE_OVERHEAD_TOKENS * len(lens):
        return _decode_padded(query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window,
                              gather_buffers, kv_scales)
    return _decode_per_sequence(query, key_cache, value_cache, block_tables, lens, scale, sliding_window, sinks,
                                kv_scales)


def _gather_blocks(cache: torch.Tensor, table: torch.Tensor, buffer: torch.Tensor | None, scale: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """cache rows `table` -> [len(table), block_size, Hkv, D] in `dtype` (an fp8 cache's times
    `scale`), gathered into `buffer` when it is large enough."""
    if buffer is None or buffer.shape[0] < table.shape[0]:
        rows = as_bytes(cache).index_select(0, table)
    else:
        rows = torch.index_select(as_bytes(cache), 0, table, out=as_bytes(buffer[: table.shape[0]]))
    return dequantized(rows.view(cache.dtype), scale, dtype)


def _decode_padded(query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window,
                   gather_buffers=None, kv_scales=(1.0, 1.0)):
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_blocks = cdiv(int(context_lens.max()), block_size)
    table = block_tables[:, :num_blocks].reshape(-1)
    key_buffer, value_buffer = gather_buffers or (None, None)
    # [num_seqs, Hkv, max_context, D]
    keys = _gather_blocks(key_cache, table, key_buffer, kv_scales[0], query.dtype)
    keys = keys.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = _gather_blocks(value_cache, table, value_buffer, kv_scales[1], query.dtype)
    values = values.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=query.device)
    mask = positions[None, :] < context_lens[:, None]  # [num_seqs, max_context]
    if sliding_window is not None:
        mask &= positions[None, :] >= (context_lens[:, None] - sliding_window)
    out = F.scaled_dot_product_attention(query[:, :, None, :], keys, values, attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out[:, :, 0, :]


def _decode_per_sequence(query, key_cache, value_cache, block_tables, lens, scale, sliding_window, sinks=None,
                         kv_scales=(1.0, 1.0)):
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    head_sinks = None if sinks is None else sinks.view(num_kv_heads, group, 1)
    grouped_query = query.view(num_seqs, num_kv_heads, group, head_dim).transpose(2, 3)  # [S, Hkv, D, G]
    out = torch.empty_like(query)
    for index, context_len in enumerate(lens):
        first = 0 if sliding_window is None else max(0, context_len - sliding_window)
        blocks = block_tables[index, : cdiv(context_len, block_size)]
        keys = _gather_blocks(key_cache, blocks, None, kv_scales[0], query.dtype)
        keys = keys.flatten(0, 1)[first:context_len].transpose(0, 1)  # [Hkv, C, D]
        values = _gather_blocks(value_cache, blocks, None, kv_scales[1], query.dtype)
        values = values.flatten(0, 1)[first:context_len].transpose(0, 1)
        scores = torch.matmul(keys, grouped_query[index]) * scale  # [Hkv, C, G]
        probs = softmax_with_sinks(scores.transpose(1, 2), head_sinks).transpose(1, 2)  # [Hkv, C, G]
        out[index] = torch.matmul(probs.transpose(1, 2), values).reshape(num_heads, head_dim)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm as in transformers (fp32 statistics); x, residual [num_tokens, hidden],
    weight [hidden]. With `residual`, first adds it and returns (normed, new_residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * hidden.to(input_dtype)
    return out if residual is None else (out, residual)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim]"""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary embedding, rotate-half (GPT-NeoX / Llama) style, on query [T, Hq, D] and
    key [T, Hkv, D] with cos, sin [T, D]. Returns new (query, key)."""
    return rotate_half(query, cos, sin), rotate_half(key, cos, sin)
