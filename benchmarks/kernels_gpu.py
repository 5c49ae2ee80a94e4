"""Triton kernels against torch on the same shapes, on a CUDA device.

    python -m benchmarks.kernels_gpu [--json OUT.json] [--dry-run]

Decode attention: bf16, batch 1, 8, 64 and context 512, 4096 (plus a wider grid),
Llama-8B-like heads (32 query, 8 KV, head_dim 128), paged with 16-token blocks in a
shuffled pool. Achieved bandwidth counts the K/V and query bytes read and the output
written, as a fraction of this device's device-to-device copy, measured in the same
run (bytes read + written per second). Peer: torch's scaled_dot_product_attention on
the same shapes with K/V already contiguous (no paging to pay for). Prefill: causal
attention over 4 sequences of 1024 new tokens, TFLOP/s against SDPA. Varlen (embedding
models): bidirectional attention over 256 packed inputs of 1-256 tokens (log-normal
around 60), against SDPA on the same inputs padded to the longest. Also times
store_kv, rms_norm and rotary against their torch references. Goal: decode >= 70% of
the measured copy bandwidth at batch 64, context 4096.

--dry-run runs the same code on the CPU at tiny sizes in fp32 (kernels through
TRITON_INTERPRET=1): it proves the script, not the speed. Without CUDA and without
--dry-run it says so and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

DECODE_GRID = [(1, 512), (1, 4096), (8, 512), (8, 4096), (64, 512), (64, 4096), (256, 1024)]
REPEATS = {"cuda": 7, "cpu": 2}  # the interpreter is slow, and its times mean nothing
CALLS_PER_EVENT = 10
# Decode plans swept at context 4096 (kvfleet_kernels/paged_attention.py: decode_plan):
# (tile tokens, partition tokens (0: no split), num_warps).
DECODE_PLANS = [(tile, partition, warps) for tile, partition in ((32, 0), (64, 0), (128, 0), (256, 0), (128, 512))
                for warps in (4, 8)] + [(128, 256, 4), (128, 1024, 4)]

# Prefill plans swept at 4 x 1,024 causal (kvfleet_kernels/prefill_attention.py): (queries a
# program, keys a tile, num_warps, num_stages or None for Triton's default). (64, 16, 4) is the
# kernel as it was (one 16-token block a step), (64, 64, 4) its default since.
PREFILL_PLANS = [(64, 16, 4, None), (64, 64, 4, None), (64, 128, 4, None), (128, 64, 8, None),
                 (128, 128, 8, None), (64, 64, 8, 2)]


def timed(fn, device: str) -> float:
    """Median seconds of fn() on the device: on CUDA, CALLS_PER_EVENT calls back to back between
    two events, so that the host's launch latency hides behind the queue (device time)."""
    fn()
    times = []
    for _ in range(REPEATS[device]):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(CALLS_PER_EVENT):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000 / CALLS_PER_EVENT)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: str, num_bytes: int) -> float:
    """Bytes read plus written per second by a device-to-device copy."""
    a, b = (torch.empty(num_bytes, dtype=torch.uint8, device=device) for _ in range(2))
    return 2 * num_bytes / timed(lambda: b.copy_(a), device)


def decode_case(batch: int, context: int, heads: int, kv_heads: int, dim: int, dtype, device, block_size: int = 16,
                with_dense: bool = True):
    """(the kernel's inputs, SDPA's inputs or None without `with_dense`, bytes a call moves)"""
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim, device=device, dtype=dtype)  # [N, B, Hkv, D]
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq)  # [batch, blocks]
    lens = torch.full((batch,), context, device=device, dtype=torch.int64)
    query = torch.randn(batch, heads, dim, device=device, dtype=dtype)  # [batch, Hq, D]
    moved = (2 * key_cache.numel() + 2 * query.numel()) * key_cache.element_size()
    if not with_dense:
        return (query, key_cache, value_cache, block_tables, lens), None, moved
    # The peer's K/V: the same values, contiguous per sequence: [batch, Hkv, context, D]
    dense_k = key_cache[block_tables].reshape(batch, context, kv_heads, dim).transpose(1, 2).contiguous()
    dense_v = value_cache[block_tables].reshape(batch, context, kv_heads, dim).transpose(1, 2).contiguous()
    return (query, key_cache, value_cache, block_tables, lens), (query[:, :, None], dense_k, dense_v), moved


def bench_decode(device, dtype, sizes, grid, bandwidth) -> list[dict]:
    from kvfleet_kernels.paged_attention import paged_decode_attention

    heads, kv_heads, dim = sizes
    scale = dim**-0.5
    rows = []
    for batch, context in grid:
        kernel_inputs, (q, k, v), moved = decode_case(batch, context, heads, kv_heads, dim, dtype, device)
        triton_s = timed(partial(paged_decode_attention, *kernel_inputs, scale), device)
        sdpa_s = timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True),
                       device)
        rows.append({"batch": batch, "context": context, "triton_s": triton_s, "sdpa_s": sdpa_s,
                     "bytes_per_s": moved / triton_s, "fraction_of_copy": moved / triton_s / bandwidth,
                     "sdpa_fraction_of_copy": moved / sdpa_s / bandwidth})
    return rows


def bench_decode_plans(device, dtype, sizes, shapes, plans, bandwidth) -> list[dict]:
    """Each (tile, partition, warps) plan at each (batch, context): fraction of the copy
    bandwidth, and which plan decode_plan picks by itself."""
    from kvfleet_kernels.paged_attention import _num_multiprocessors, decode_plan, paged_decode_attention

    heads, kv_heads, dim = sizes
    rows = []
    for batch, context in shapes:
        kernel_inputs, _, moved = decode_case(batch, context, heads, kv_heads, dim, dtype, device, with_dense=False)
        chosen = decode_plan(batch, kv_heads, 16, context // 16, _num_multiprocessors(torch.device(device)))
        for tile, partition, warps in plans:
            seconds = timed(partial(paged_decode_attention, *kernel_inputs, dim**-0.5, partition_tokens=partition,
                                    tile_tokens=tile, num_warps=warps), device)
            rows.append({"batch": batch, "context": context, "tile": tile, "partition": partition, "warps": warps,
                         "seconds": seconds, "fraction_of_copy": moved / seconds / bandwidth,
                         "default": (tile, partition) == chosen[:2] and warps == 4})
        del kernel_inputs
    return rows


def bench_prefill(device, dtype, sizes, num_seqs: int, seq_len: int, plans: list[tuple] = ()) -> dict:
    """kvfleet's prefill kernel (its default plan, then each of `plans`: (block_m, tile keys,
    warps, stages or None)) against SDPA on the same causal prompts, in TFLOP/s."""
    from kvfleet_kernels.prefill_attention import prefill_attention
    from kvfleet_kernels.store_kv import store_kv

    heads, kv_heads, dim, block_size = *sizes, 16
    tokens = num_seqs * seq_len
    query = torch.randn(tokens, heads, dim, device=device, dtype=dtype)  # [T, Hq, D]
    key, value = (torch.randn(tokens, kv_heads, dim, device=device, dtype=dtype) for _ in range(2))
    caches = torch.zeros(2, tokens // block_size, block_size, kv_heads, dim, device=device, dtype=dtype)
    store_kv(key, value, caches[0], caches[1], torch.arange(tokens, device=device))
    tables = torch.arange(tokens // block_size, device=device).view(num_seqs, -1)
    starts = torch.arange(0, tokens + 1, seq_len, device=device)
    lens = torch.full((num_seqs,), seq_len, device=device)
    scale = dim**-0.5
    triton_s = timed(lambda: prefill_attention(query, caches[0], caches[1], tables, starts, lens, seq_len, scale),
                     device)
    q = query.view(num_seqs, seq_len, heads, dim).transpose(1, 2)
    k, v = (t.view(num_seqs, seq_len, kv_heads, dim).transpose(1, 2) for t in (key, value))
    sdpa_s = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True),
                   device)
    flops = 4 * num_seqs * heads * dim * seq_len * (seq_len + 1) / 2  # QK^T and PV over the causal half
    swept = []
    for block_m, tile, warps, stages in plans:
        seconds = timed(partial(prefill_attention, query, caches[0], caches[1], tables, starts, lens, seq_len, scale,
                                block_m=block_m, tile_keys=tile, num_warps=warps, num_stages=stages), device)
        swept.append({"block_m": block_m, "tile": tile, "warps": warps, "stages": stages, "seconds": seconds,
                      "tflops": flops / seconds / 1e12})
        print(f"  prefill plan block_m {block_m:>3} tile {tile:>3} warps {warps} stages {stages}: "
              f"{swept[-1]['tflops']:.1f} TFLOP/s", flush=True)
    return {"num_seqs": num_seqs, "seq_len": seq_len, "triton_s": triton_s, "sdpa_s": sdpa_s,
            "triton_tflops": flops / triton_s / 1e12, "sdpa_tflops": flops / sdpa_s / 1e12, "plans": swept}


def bench_varlen(device, dtype, sizes, seq_lens: list[int]) -> dict:
    """Embedding models' packed attention (bidirectional, no cache, no padding) against SDPA
    over the same inputs padded to the longest, as a padded batch would run them."""
    from kvfleet_kernels.varlen_attention import varlen_attention

    heads, kv_heads, dim = sizes
    tokens, longest = sum(seq_lens), max(seq_lens)
    query = torch.randn(tokens, heads, dim, device=device, dtype=dtype)  # [T, Hq, D]
    key, value = (torch.randn(tokens, kv_heads, dim, device=device, dtype=dtype) for _ in range(2))
    cu_seqlens = torch.tensor([0, *itertools.accumulate(seq_lens)], device=device, dtype=torch.int32)
    scale = dim**-0.5
    triton_s = timed(lambda: varlen_attention(query, key, value, cu_seqlens, longest, scale, False), device)
    q = torch.randn(len(seq_lens), heads, longest, dim, device=device, dtype=dtype)  # [N, Hq, L, D] padded
    k, v = (torch.randn(len(seq_lens), kv_heads, longest, dim, device=device, dtype=dtype) for _ in range(2))
    sdpa_s = timed(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True), device)
    flops = 4 * heads * dim * sum(n * n for n in seq_lens)  # QK^T and PV within each input
    return {"num_seqs": len(seq_lens), "tokens": tokens, "longest": longest, "triton_s": triton_s,
            "padded_sdpa_s": sdpa_s, "triton_tflops": flops / triton_s / 1e12}


def embedding_lengths(count: int, seed: int = 0) -> list[int]:
    """Log-normal around 60 tokens, clipped to 1-256: benchmarks/embeddings.py's mix."""
    rng = random.Random(seed)
    return [min(256, max(1, round(rng.lognormvariate(math.log(60), 0.6)))) for _ in range(count)]


def bench_small_kernels(device, dtype, tokens: int, sizes) -> dict:
    from kvfleet_kernels import reference
    from kvfleet_kernels.rms_norm import rms_norm
    from kvfleet_kernels.rotary import rotary
    from kvfleet_kernels.store_kv import store_kv

    heads, kv_heads, dim = sizes
    hidden = heads * dim
    x, residual = (torch.randn(tokens, hidden, device=device, dtype=dtype) for _ in range(2))
    weight = torch.randn(hidden, device=device, dtype=dtype)
    q, k = torch.randn(tokens, heads, dim, device=device, dtype=dtype), torch.randn(tokens, kv_heads, dim,
                                                                                    device=device, dtype=dtype)
    cos, sin = (torch.randn(tokens, dim, device=device, dtype=dtype) for _ in range(2))
    caches = torch.zeros(2, 2 * tokens // 16, 16, kv_heads, dim, device=device, dtype=dtype)
    slots = torch.randperm(2 * tokens, device=device)[:tokens]
    pairs = {"rms_norm+residual": (lambda: rms_norm(x, weight, 1e-6, residual),
                                   lambda: reference.rms_norm(x, weight, 1e-6, residual)),
             "rotary": (lambda: rotary(q, k, cos, sin), lambda: reference.rotary(q, k, cos, sin)),
             "store_kv": (lambda: store_kv(k, k, caches[0], caches[1], slots),
                          lambda: reference.store_kv(k, k, caches[0], caches[1], slots))}
    return {name: {"triton_s": timed(a, device), "torch_s": timed(b, device)} for name, (a, b) in pairs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        device, dtype, sizes, grid = "cpu", torch.float32, (4, 2, 32), [(1, 32), (2, 64)]
        prefill, tokens, copy_bytes = (2, 32), 64, 1 << 24
    elif torch.cuda.is_available():
        device, dtype, sizes, grid = "cuda", torch.bfloat16, (32, 8, 128), DECODE_GRID
        prefill, tokens, copy_bytes = (4, 1024), 4096, 1 << 30
    else:
        print("kernels_gpu: no CUDA device here; nothing to time (the kernels are tested on the CPU under "
              "TRITON_INTERPRET=1 by `make test`; --dry-run runs this script there).")
        return 0
    bandwidth = copy_bandwidth(device, copy_bytes)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    print(f"{name}: device copy {bandwidth / 1e9:.0f} GB/s (read + write), {dtype}")
    decode = bench_decode(device, dtype, sizes, grid, bandwidth)
    print(f"{'batch':>5} {'context':>7} {'triton ms':>9} {'sdpa ms':>9} {'GB/s':>7} {'of copy':>7} {'sdpa of copy':>12}")
    for row in decode:
        print(f"{row['batch']:>5} {row['context']:>7} {row['triton_s'] * 1e3:>9.3f} {row['sdpa_s'] * 1e3:>9.3f} "
              f"{row['bytes_per_s'] / 1e9:>7.0f} {row['fraction_of_copy']:>7.0%} {row['sdpa_fraction_of_copy']:>12.0%}")
    plan_shapes, plans = ([(1, 64)], [(16, 0, 4), (16, 32, 4)]) if args.dry_run else \
        ([(1, 4096), (8, 4096), (64, 4096)], DECODE_PLANS)
    plan_rows = bench_decode_plans(device, dtype, sizes, plan_shapes, plans, bandwidth)
    print(f"{'batch':>5} {'context':>7} {'tile':>4} {'split':>5} {'warps':>5} {'ms':>7} {'of copy':>7}")
    for row in plan_rows:
        print(f"{row['batch']:>5} {row['context']:>7} {row['tile']:>4} {row['partition']:>5} {row['warps']:>5} "
              f"{row['seconds'] * 1e3:>7.3f} {row['fraction_of_copy']:>7.0%}{'  (default)' if row['default'] else ''}")
    prefill_row = bench_prefill(device, dtype, sizes, *prefill,
                                plans=[(16, 16, 4, None), (32, 32, 4, 2)] if args.dry_run else PREFILL_PLANS)
    print(f"prefill {prefill[0]} x {prefill[1]} causal: triton {prefill_row['triton_tflops']:.1f} TFLOP/s, "
          f"sdpa {prefill_row['sdpa_tflops']:.1f} TFLOP/s")
    varlen = bench_varlen(device, dtype, sizes, [5, 17, 9] if args.dry_run else embedding_lengths(256))
    print(f"varlen (embeddings) {varlen['num_seqs']} inputs, {varlen['tokens']} tokens: triton "
          f"{varlen['triton_s'] * 1e3:.3f} ms ({varlen['triton_tflops']:.1f} TFLOP/s), padded sdpa "
          f"{varlen['padded_sdpa_s'] * 1e3:.3f} ms")
    small = bench_small_kernels(device, dtype, tokens, sizes)
    for kernel, times in small.items():
        print(f"{kernel:>18}: triton {times['triton_s'] * 1e3:.3f} ms, torch {times['torch_s'] * 1e3:.3f} ms, "
              f"{times['torch_s'] / times['triton_s']:.1f}x")
    goal = next((row["fraction_of_copy"] for row in decode if (row["batch"], row["context"]) == (64, 4096)), None)
    if goal is not None:
        print(f"decode at batch 64, context 4096: {goal:.0%} of the measured copy bandwidth (goal 70%)")
    report = {"device": name, "dtype": str(dtype), "dry_run": args.dry_run, "copy_bytes_per_s": bandwidth,
              "decode": decode, "decode_plans": plan_rows, "prefill": prefill_row, "varlen": varlen, "small_kernels": small, "decode_goal_fraction": goal}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
