"""Causal prefill attention for bf16 models in native code (csrc/prefill_attention_cpu.cpp, in
the library kvfleet_kernels/cpu_paged_attention.py builds), on CPUs with avx512_bf16: both products on
the CPU's bf16 dot product, where torch's CPU flash kernel runs bf16 at its fp32 speed.

On CPUs with AMX that is no longer so: torch's flash kernel then runs its bf16 tiles on AMX
through oneDNN's brgemm, and beats this kernel about 3x (1,400 tokens, SmolLM2's 9/3 heads
of 64: 3.8 against 12.0 ms), so `preferred()` is false there and the CPU backend keeps torch's."""

from __future__ import annotations

import functools

import torch

from kvfleet_kernels.cpu_paged_attention import load_error


@functools.cache
def available() -> bool:
    """The library built, for a CPU with avx512_bf16 (it is compiled for the host it runs on)."""
    return load_error() is None and bool(torch.ops.kvfleet_cpu.bf16_prefill_available())


@functools.cache
def preferred() -> bool:
    """Whether this kernel is the faster bf16 prefill here: built, and the CPU has no AMX tiles."""
    return available() and not torch.cpu._is_amx_tile_supported()


def supports(query: torch.Tensor, sinks: torch.Tensor | None) -> bool:
    """Whether prefill_attention takes this call: bf16 on the CPU, head size 64 or 128, no sinks."""
    return (sinks is None and query.dtype == torch.bfloat16 and query.device.type == "cpu"
            and query.shape[-1] in (64, 128) and available())


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                      sliding_window: int | None = None) -> torch.Tensor:
    """Same contract as kvfleet_kernels.reference.prefill_attention without sinks: query [Q, Hq, D] (the
    last Q positions of the context), key/value [C, Hkv, D] -> [Q, Hq, D]; rows of any stride.
    Probabilities are rounded to bf16 before they weigh V, as torch's flash kernel does."""
    if not available():
        raise RuntimeError(f"native bf16 prefill attention is unavailable here: "
                           f"{load_error() or 'the CPU has no avx512_bf16'}")
    out = torch.empty(query.shape, dtype=query.dtype)
    torch.ops.kvfleet_cpu.prefill_attention(out, query, key, value, scale, sliding_window or 0)
    return out
