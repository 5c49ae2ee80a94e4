"""Causal prefill attention for bf16 models in native code (in the library
kvfleet_kernels/cpu_paged_attention.py builds), one kernel per kind of CPU:

- "brgemm" (csrc/prefill_attention_brgemm.cpp), on CPUs with AMX: flash attention whose two
  products run on oneDNN's brgemm microkernel (AMX tiles), computing only the key blocks the
  causal triangle needs. Torch's CPU flash kernel, which also reaches AMX through brgemm, spent
  ~0.5 ns a score there on two cores and computed ~1/3 more scores than the triangle holds.
- "bf16_dot" (csrc/prefill_attention_cpu.cpp), on CPUs with avx512_bf16 but no AMX: both products
  on the CPU's bf16 dot product, where torch's flash kernel runs bf16 at its fp32 speed.

`kernel()` names this CPU's; where neither applies the CPU backend keeps torch's flash kernel.

On CPUs with AMX, `paged_prefill_attention` (csrc/paged_prefill_amx.cpp) goes further: it reads
K/V from the paged cache in place (the decode kernel's layouts, already the B tiles of both
products), so a prompt after a cached prefix gathers nothing, and it drives the tiles itself with
one palette and a softmax of about half the instructions; the CPU backend runs it wherever it
takes the call, and brgemm elsewhere (head sizes 32 or 96, caches of other layouts)."""

from __future__ import annotations

import functools

import torch

from kvfleet_kernels.cpu_paged_attention import load_error

KERNELS = ("brgemm", "bf16_dot")


@functools.cache
def available_kernels() -> tuple[str, ...]:
    """The kernels this CPU runs (the library is compiled for the host it runs on)."""
    if load_error() is not None:
        return ()
    ops = torch.ops.kvfleet_cpu
    found = {"brgemm": torch.cpu._is_amx_tile_supported() and bool(ops.brgemm_bf16_supported()),
             "bf16_dot": bool(ops.bf16_prefill_available())}
    return tuple(name for name in KERNELS if found[name])


def available() -> bool:
    return bool(available_kernels())


@functools.cache
def kernel() -> str | None:
    """This CPU's faster native bf16 prefill attention: brgemm with AMX tiles, else bf16_dot."""
    kernels = available_kernels()
    return kernels[0] if kernels else None


def preferred() -> bool:
    """Whether a native kernel is this CPU's bf16 prefill attention (the CPU backend's default)."""
    return kernel() is not None


def supports(query: torch.Tensor, sinks: torch.Tensor | None, name: str | None = None) -> bool:
    """Whether the kernel (this CPU's by default) takes this call: bf16 on the CPU, no sinks, and a
    head size it has tiles for (brgemm: multiples of 32 up to 256; bf16_dot: 64 or 128)."""
    name = name or kernel()
    head_dim = query.shape[-1]
    sizes_ok = head_dim % 32 == 0 and head_dim <= 256 if name == "brgemm" else head_dim in (64, 128)
    return (name in available_kernels() and sinks is None and query.dtype == torch.bfloat16
            and query.device.type == "cpu" and sizes_ok)


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                      sliding_window: int | None = None, name: str | None = None) -> torch.Tensor:
    """Same contract as kvfleet_kernels.reference.prefill_attention without sinks: query [Q, Hq, D] (the
    last Q positions of the context), key/value [C, Hkv, D] -> [Q, Hq, D]; rows of any stride.
    Probabilities are rounded to bf16 before they weigh V, as torch's flash kernel does.
    name: "brgemm" or "bf16_dot" (default: this CPU's)."""
    name = name or kernel()
    if name not in available_kernels():
        raise RuntimeError(f"native bf16 prefill attention {name!r} is unavailable here: "
                           f"{load_error() or f'this CPU runs {list(available_kernels()) or None}'}")
    out = torch.empty(query.shape, dtype=query.dtype)
    op = torch.ops.kvfleet_cpu.prefill_attention_brgemm if name == "brgemm" else torch.ops.kvfleet_cpu.prefill_attention
    op(out, query, key, value, scale, sliding_window or 0)
    return out


@functools.cache
def paged_available() -> bool:
    """Whether paged_prefill_attention runs here: built for a CPU with amx_bf16, and Linux lends
    this process the tile state."""
    return load_error() is None and bool(torch.ops.kvfleet_cpu.paged_prefill_amx_available())


def supports_paged(query: torch.Tensor, key_cache: torch.Tensor, sinks: torch.Tensor | None) -> bool:
    """Whether paged_prefill_attention takes this call: bf16 on the CPU, no sinks, a head size of a
    multiple of 64 up to 256 and blocks of a multiple of 16 positions (key_cache as
    cpu_paged_attention.key_cache_view gives it)."""
    head_dim, block_size = query.shape[-1], key_cache.shape[3]
    return (paged_available() and sinks is None and query.dtype == key_cache.dtype == torch.bfloat16
            and query.device.type == "cpu" and head_dim % 64 == 0 and head_dim <= 256 and block_size % 16 == 0)


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_table: torch.Tensor, context_len: int, scale: float,
                            sliding_window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's causal prefill over its paged context, on AMX tiles: prefill_attention's
    contract with the keys and values read through the block table, after store_kv has put the
    new tokens' there.

    query:       [Q, Hq, D] bf16, the context's last Q positions (rows of any stride)
    key_cache:   [num_blocks, Hkv, D // 2, block_size, 2] (cpu_paged_attention.key_cache_view)
    value_cache: [num_blocks, Hkv, block_size // 2, D, 2] (cpu_paged_attention.value_cache_view)
    block_table: [>= ceil(context_len / block_size)] int64, the sequence's blocks
    returns      out, [Q, Hq, D]
    """
    if not paged_available():
        raise RuntimeError(f"paged bf16 prefill attention needs AMX tiles: {load_error() or 'this CPU has none'}")
    out = torch.empty(query.shape, dtype=query.dtype) if out is None else out
    torch.ops.kvfleet_cpu.paged_prefill_attention(out, query, key_cache, value_cache, block_table.contiguous(),
                                                  context_len, scale, sliding_window or 0)
    return out
