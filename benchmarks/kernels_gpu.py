"""Triton kernels against their torch counterparts on a CUDA device.

    python benchmarks/kernels_gpu.py [--peak-gbps N]

Decode attention: bf16, batch 1-256, context 512-8192, Llama-8B-like heads (32 query,
8 KV, head_dim 128); achieved HBM GB/s (K/V and query bytes read, output written)
as a fraction of the device's peak. Torch counterpart: gather by block table, then
SDPA. Also times prefill, store_kv, rms_norm and rotary. Goal: decode at >= 70%
of peak HBM bandwidth at batch 64, context 4096. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

KNOWN_PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039,
                   "A100": 1555, "L40S": 864, "L4": 300, "A10G": 600}


def timed(fn, repeats: int = 20) -> float:
    """Median seconds of fn() on the GPU."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


def device_peak_gbps(override: float | None) -> tuple[float, str]:
    if override:
        return override, "given"
    name = torch.cuda.get_device_name()
    for key, value in KNOWN_PEAK_GBPS.items():
        if key in name:
            return value, f"datasheet ({key})"
    size = 1 << 30  # fall back to a measured device-to-device copy
    a, b = torch.empty(size, dtype=torch.uint8, device="cuda"), torch.empty(size, dtype=torch.uint8, device="cuda")
    return 2 * size / timed(lambda: b.copy_(a)) / 1e9, "measured copy"


def decode_case(batch: int, context: int, block_size: int = 16, heads: int = 32, kv_heads: int = 8, dim: int = 128):
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int64)
    query = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    moved = 2 * key_cache.numel() * 2 + 2 * query.numel() * 2
    return query, key_cache, value_cache, block_tables, lens, moved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak-gbps", type=float, help="the device's HBM bandwidth, if not in the table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels_gpu: no CUDA device here; nothing to time (the kernels are tested on the CPU under "
              "TRITON_INTERPRET=1 by `make test`).")
        return 0
    from kernels import reference
    from kernels.paged_attention import paged_decode_attention
    from kernels.rms_norm import rms_norm
    from kernels.rotary import rotary
    from kernels.store_kv import store_kv

    peak, source = device_peak_gbps(args.peak_gbps)
    print(f"{torch.cuda.get_device_name()}: peak HBM {peak:.0f} GB/s ({source})")
    rows = []
    print(f"{'batch':>5} {'context':>7} {'triton ms':>9} {'torch ms':>9} {'GB/s':>7} {'of peak':>7} {'speed-up':>8}")
    for batch in (1, 8, 32, 64, 128, 256):
        for context in (512, 1024, 2048, 4096, 8192):
            if batch * context > 256 * 4096:  # keeps the cache within a few GB
                continue
            *inputs, moved = decode_case(batch, context)
            scale = 128**-0.5
            triton_s = timed(partial(paged_decode_attention, *inputs, scale))
            torch_s = timed(partial(reference._decode_padded, *inputs, scale, None))
            gbps = moved / triton_s / 1e9
            rows.append({"batch": batch, "context": context, "triton_s": triton_s, "torch_s": torch_s,
                         "gbps": gbps, "fraction_of_peak": gbps / peak})
            print(f"{batch:>5} {context:>7} {triton_s * 1e3:>9.3f} {torch_s * 1e3:>9.3f} {gbps:>7.0f} "
                  f"{gbps / peak:>7.0%} {torch_s / triton_s:>7.1f}x")
    x, weight, residual = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16),
                           torch.randn(4096, device="cuda", dtype=torch.bfloat16),
                           torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16))
    others = {"rms_norm+residual": (lambda: rms_norm(x, weight, 1e-6, residual),
                                    lambda: reference.rms_norm(x, weight, 1e-6, residual))}
    q, k = torch.randn(4096, 32, 128, device="cuda", dtype=torch.bfloat16), torch.randn(4096, 8, 128, device="cuda",
                                                                                        dtype=torch.bfloat16)
    cos, sin = torch.randn(4096, 128, device="cuda", dtype=torch.bfloat16), torch.randn(4096, 128, device="cuda",
                                                                                        dtype=torch.bfloat16)
    others["rotary"] = (lambda: rotary(q, k, cos, sin), lambda: reference.rotary(q, k, cos, sin))
    caches = torch.zeros(2, 8192, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(8192 * 16, device="cuda")[:4096]
    others["store_kv"] = (lambda: store_kv(k, k, caches[0], caches[1], slots),
                          lambda: reference.store_kv(k, k, caches[0], caches[1], slots))
    for name, (triton_fn, torch_fn) in others.items():
        triton_s, torch_s = timed(triton_fn), timed(torch_fn)
        print(f"{name:>18}: triton {triton_s * 1e3:.3f} ms, torch {torch_s * 1e3:.3f} ms, "
              f"{torch_s / triton_s:.1f}x")
    goal = next(r for r in rows if r["batch"] == 64 and r["context"] == 4096)
    print(f"decode at batch 64, context 4096: {goal['fraction_of_peak']:.0%} of peak (goal 70%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
