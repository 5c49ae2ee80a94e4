"""Attention over the paged KV cache: the metadata the model runner builds once per
step, and the backends every attention layer calls.

Token layout of one step (flattened, prefills first):

    | prefill seq A (chunk) | prefill seq B | decode | decode | decode |
    |<-- num_prefill_tokens -------------->|<-- one token each ------>|
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from engine.kv_quant import KVScales, quantize_kv
from kvfleet_kernels import reference

logger = logging.getLogger(__name__)
UNSCALED = KVScales()  # the scales of a cache that is not fp8: read as stored


@dataclass
class PrefillSpan:
    query_start: int
    num_queries: int
    context_len: int  # tokens cached before this step + num_queries
    block_table: torch.Tensor  # [num_blocks_of_seq] int64
    # Additive masks [num_queries, context_len] by sliding window, built by the first layer
    # that needs one and reused by the rest of the step.
    biases: dict[int | None, torch.Tensor] = field(default_factory=dict)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64
    decode_context_lens: torch.Tensor  # [num_decodes] int64
    # Prefills in one of two forms, whichever the backend reads (`reads_prefill_spans`):
    # one span each (torch, cpu) ...
    prefills: list[PrefillSpan] = field(default_factory=list)
    # ... or tensors over every prefill at once (the Triton kernel).
    prefill_query_starts: torch.Tensor | None = None  # [num_prefills + 1] int64
    prefill_context_lens: torch.Tensor | None = None  # [num_prefills] int64
    prefill_block_tables: torch.Tensor | None = None  # [num_prefills, max_blocks] int64
    max_prefill_queries: int = 0
    seq_lens: torch.Tensor | None = None  # [T] the length of each token's sequence, prompt and output (longrope)


class TorchAttentionBackend:
    """Reference backend: gather K/V by block table, then SDPA. Runs everywhere."""

    name = "torch"
    reads_prefill_spans = True

    def __init__(self) -> None:
        self._gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def gather_buffers(self, key_cache: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two reusable [>= num_blocks, block_size, Hkv, D] buffers (grown by half as needed)."""
        if self._gather_buffers is None or self._gather_buffers[0].shape[0] < num_blocks \
                or self._gather_buffers[0].shape[1:] != key_cache.shape[1:]:
            rows = max(num_blocks, int(1.5 * (self._gather_buffers[0].shape[0] if self._gather_buffers else 0)))
            shape = (rows, *key_cache.shape[1:])
            self._gather_buffers = (torch.empty(shape, dtype=key_cache.dtype, device=key_cache.device),
                                    torch.empty(shape, dtype=key_cache.dtype, device=key_cache.device))
        return self._gather_buffers

    def cache_views(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (K, V) caches this backend reads, over one layer's pair as allocated (zeroed):
        [num_blocks, block_size, Hkv, D] each. Here, as allocated."""
        return key_cache, value_cache

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scale: KVScales = UNSCALED) -> None:
        """key/value [T, Hkv, D] into their slots (slot_mapping [T] int64) of the caches; into an fp8
        cache as key / kv_scale.k and value / kv_scale.v (engine/kv_quant.py)."""
        key, value = quantized_kv(key, value, key_cache.dtype, kv_scale)
        reference.store_kv(key, value, key_cache, value_cache, slot_mapping)

    def gather_keys(self, key_cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
        """One sequence's first context_len keys in token order: [context_len, Hkv, D], as stored."""
        return reference.gather_kv(key_cache, block_table, context_len)

    def gather_values(self, value_cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
        """gather_keys for the value cache."""
        return reference.gather_kv(value_cache, block_table, context_len)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                kv_scale: KVScales | None = None) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D], caches as cache_views gives them -> [T, Hq, D];
        sinks [Hq] or None (kvfleet_kernels/reference.py: prefill_attention); kv_scale: the layer's
        scales of an fp8 cache (engine/kv_quant.py)."""
        kv_scale = kv_scale or UNSCALED
        self.store_kv(key, value, key_cache, value_cache, meta.slot_mapping, kv_scale)
        if not meta.prefills:  # a decode-only step: the kernel's output is the layer's, no copy
            return self.decode(query, key_cache, value_cache, meta, scale, sliding_window, sinks, kv_scale)
        out = torch.empty_like(query)
        for span in meta.prefills:
            rows = slice(span.query_start, span.query_start + span.num_queries)
            self.prefill_span(out[rows], query[rows], key[rows], value[rows], key_cache, value_cache, span, scale,
                              sliding_window, sinks, kv_scale)
        if meta.num_prefill_tokens < query.shape[0]:
            decodes = slice(meta.num_prefill_tokens, None)
            out[decodes] = self.decode(query[decodes], key_cache, value_cache, meta, scale, sliding_window, sinks,
                                       kv_scale)
        return out

    def prefill_span(self, out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     key_cache: torch.Tensor, value_cache: torch.Tensor, span: PrefillSpan, scale: float,
                     sliding_window: int | None, sinks: torch.Tensor | None, kv_scale: KVScales = UNSCALED) -> None:
        """One sequence's prefill into out [Q, Hq, D]: its query/key/value rows [Q, H, D] over its
        whole context, whose earlier positions are read from the caches (an fp8 cache's times its
        scales; the step's own rows as computed, as vLLM's prefill reads them)."""
        if span.context_len == span.num_queries:  # nothing cached: use the fresh K/V directly
            keys, values = key, value
        else:
            keys = reference.dequantized(self.gather_keys(key_cache, span.block_table, span.context_len),
                                         kv_scale.k, query.dtype)
            values = reference.dequantized(self.gather_values(value_cache, span.block_table, span.context_len),
                                           kv_scale.v, query.dtype)
        out.copy_(self.prefill(query, keys, values, span, scale, sliding_window, sinks))

    def prefill(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, span: PrefillSpan, scale: float,
                sliding_window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """One sequence's prefill: query [Q, Hq, D] over keys/values [C, Hkv, D] -> [Q, Hq, D]."""
        bias = None
        # Sinks always take the bias (their softmax is spelled out); without them only a mask needs it.
        if sinks is not None or reference.needs_prefill_bias(span.num_queries, span.context_len, sliding_window):
            if sliding_window not in span.biases:  # built once a step, shared by every layer
                span.biases[sliding_window] = reference.prefill_bias(
                    span.num_queries, span.context_len, sliding_window, query.dtype, query.device)
            bias = span.biases[sliding_window]
        return reference.prefill_attention(query, keys, values, scale, sliding_window, bias, sinks)

    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, sliding_window: int | None,
               sinks: torch.Tensor | None = None, kv_scale: KVScales = UNSCALED) -> torch.Tensor:
        """query [num_decodes, Hq, D] -> [num_decodes, Hq, D]"""
        tables = meta.decode_block_tables
        return reference.paged_decode_attention(
            query, key_cache, value_cache, tables, meta.decode_context_lens, scale, sliding_window,
            self.gather_buffers(key_cache, tables.shape[0] * tables.shape[1]), sinks, (kv_scale.k, kv_scale.v))


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend with decode attention in native code reading the paged cache
    in place (kvfleet_kernels/cpu_paged_attention.py), and bf16 prefill attention in native code
    (kvfleet_kernels/cpu_prefill_attention.py: on AMX tiles reading the paged cache in place, or
    through oneDNN's brgemm for the head sizes that kernel does not take, or on avx512_bf16's dot
    product where there is no AMX); the CPU default where it builds.
    native_prefill None: the native prefill wherever one of those kernels runs."""

    name = "cpu"

    def __init__(self, native_prefill: bool | None = None) -> None:
        super().__init__()
        from kvfleet_kernels import cpu_paged_attention, cpu_prefill_attention  # noqa: PLC0415

        self._kernels = cpu_paged_attention
        self._decode = cpu_paged_attention.paged_decode_attention
        self._prefill_native = cpu_prefill_attention
        self.native_prefill = cpu_prefill_attention.preferred() if native_prefill is None else native_prefill
        # On AMX the paged kernel reads the caches in place; brgemm keeps the calls it cannot take.
        self.paged_prefill = self.native_prefill and cpu_prefill_attention.paged_available()
        if native_prefill is None and self.paged_prefill:
            logger.info("bf16 prefill attention: kvfleet's native kernel on AMX tiles, reading the paged cache")
        elif native_prefill is None and self.native_prefill:
            logger.info("bf16 prefill attention: kvfleet's native %s kernel", cpu_prefill_attention.kernel())
        if cpu_paged_attention.load_error() is None and cpu_paged_attention.decode_amx_available():
            logger.info("bf16 decode attention: on AMX tiles (head sizes 64 and 128)")

    def cache_views(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches in the decode kernel's layouts: keys [num_blocks, Hkv, D / x, block_size, x],
        values [num_blocks, Hkv, block_size / y, D, y] (kvfleet_kernels/csrc/decode_keys.h and
        decode_values.h say why)."""
        return self._kernels.key_cache_view(key_cache), self._kernels.value_cache_view(value_cache)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scale: KVScales = UNSCALED) -> None:
        key, value = quantized_kv(key, value, key_cache.dtype, kv_scale)
        self._kernels.store_kv(key, value, key_cache, value_cache, slot_mapping)

    def gather_keys(self, key_cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
        return self._kernels.gather_keys(key_cache, block_table, context_len)

    def gather_values(self, value_cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
        return self._kernels.gather_values(value_cache, block_table, context_len)

    def prefill_span(self, out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     key_cache: torch.Tensor, value_cache: torch.Tensor, span: PrefillSpan, scale: float,
                     sliding_window: int | None, sinks: torch.Tensor | None, kv_scale: KVScales = UNSCALED) -> None:
        if self.paged_prefill and self._prefill_native.supports_paged(query, key_cache, sinks):
            self._prefill_native.paged_prefill_attention(query, key_cache, value_cache, span.block_table,
                                                         span.context_len, scale, sliding_window, out=out)
            return
        super().prefill_span(out, query, key, value, key_cache, value_cache, span, scale, sliding_window, sinks,
                             kv_scale)

    def prefill(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, span: PrefillSpan, scale: float,
                sliding_window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
        if self.native_prefill and self._prefill_native.supports(query, sinks):
            return self._prefill_native.prefill_attention(query, keys, values, scale, sliding_window)
        return super().prefill(query, keys, values, span, scale, sliding_window, sinks)

    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, sliding_window: int | None,
               sinks: torch.Tensor | None = None, kv_scale: KVScales = UNSCALED) -> torch.Tensor:
        return self._decode(query, key_cache, value_cache, meta.decode_block_tables, meta.decode_context_lens,
                            scale, sliding_window, sinks=sinks, kv_scales=(kv_scale.k, kv_scale.v))


class TritonAttentionBackend:
    """Triton kernels reading the paged cache in place: store_kv, then prefill and
    decode attention. On the CPU only under TRITON_INTERPRET=1 (tests)."""

    name = "triton"
    reads_prefill_spans = False

    def __init__(self) -> None:
        from kvfleet_kernels import paged_attention, prefill_attention, store_kv  # noqa: PLC0415 (imports triton)

        self._store_kv = store_kv.store_kv
        self._prefill = prefill_attention.prefill_attention
        self._decode = paged_attention.paged_decode_attention

    def cache_views(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As allocated: [num_blocks, block_size, Hkv, D] each, the Triton kernels' layout."""
        return key_cache, value_cache

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                kv_scale: KVScales | None = None) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D], caches [num_blocks, block_size, Hkv, D] -> [T, Hq, D];
        sinks [Hq] or None (kvfleet_kernels/reference.py: prefill_attention); kv_scale: an fp8
        cache's scales (the kernels read its bytes and multiply)."""
        kv_scale = kv_scale or UNSCALED
        key, value = quantized_kv(key, value, key_cache.dtype, kv_scale)
        self._store_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        num_prefill, scales = meta.num_prefill_tokens, (kv_scale.k, kv_scale.v)
        if num_prefill:
            self._prefill(query[:num_prefill], key_cache, value_cache, meta.prefill_block_tables,
                          meta.prefill_query_starts, meta.prefill_context_lens, meta.max_prefill_queries, scale,
                          sliding_window, out=out[:num_prefill], sinks=sinks, kv_scales=scales)
        if num_prefill < query.shape[0]:
            self._decode(query[num_prefill:], key_cache, value_cache, meta.decode_block_tables,
                         meta.decode_context_lens, scale, sliding_window, out=out[num_prefill:], sinks=sinks,
                         kv_scales=scales)
        return out


def quantized_kv(key: torch.Tensor, value: torch.Tensor, cache_dtype: torch.dtype,
                 kv_scale: KVScales) -> tuple[torch.Tensor, torch.Tensor]:
    """key/value [T, Hkv, D] as an fp8 cache stores them (x / scale; the scales first computed
    from them where they are still to be); as they are for another cache."""
    if not reference.is_fp8(cache_dtype):
        return key, value
    kv_scale.observe(key, value)
    return quantize_kv(key, kv_scale.k, cache_dtype), quantize_kv(value, kv_scale.v, cache_dtype)


def resolve_backend_name(name: str, device: torch.device) -> str:
    """The kernels an attention_backend setting runs on `device`: "cpu" (native), "torch" or
    "triton". auto: triton on CUDA; on the CPU the native kernels, or torch where they cannot
    be built. Shared by the paged backends and the packed ones (engine/packed_attention.py)."""
    if name in ("auto", "cpu") and device.type == "cpu":
        from kvfleet_kernels.cpu_paged_attention import load_error  # noqa: PLC0415

        error = load_error()
        if error is None:
            return "cpu"
        if name == "cpu":
            raise ValueError(f"attention_backend='cpu' needs its native kernel, which could not be built "
                             f"(a C++ compiler and ninja are required): {error}")
        logger.warning("native CPU attention unavailable, using the torch path: %s", error)
        return "torch"
    if name == "cpu":
        raise ValueError(f"attention_backend='cpu' runs on the CPU only, not on {device.type}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return "torch"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend='triton' needs a CUDA device; on the CPU it runs only under "
                         "TRITON_INTERPRET=1 (set before kernels are imported), which is for tests")
    return "triton"


def select_backend(name: str, device: torch.device):
    backends = {"cpu": CpuAttentionBackend, "torch": TorchAttentionBackend, "triton": TritonAttentionBackend}
    return backends[resolve_backend_name(name, device)]()


@dataclass
class ForwardContext:
    """What every attention layer needs for one step, passed down the forward call."""

    meta: AttentionMetadata  # the first pool's (every pool shares positions and seq_lens)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (K, V) as the backend's cache_views gives them
    backend: TorchAttentionBackend | CpuAttentionBackend | TritonAttentionBackend
    metas: list[AttentionMetadata] | None = None  # per KV pool (engine/kv_cache.py)
    layer_groups: list[int] | None = None  # per layer: the pool it reads

    def layer_meta(self, layer_idx: int) -> AttentionMetadata:
        """The metadata of the pool layer `layer_idx` reads."""
        if self.metas is None:
            return self.meta
        return self.metas[self.layer_groups[layer_idx]]
