"""bf16 causal prefill attention on the CPU: kvfleet's native kernels against torch's SDPA (the
CPU flash kernel transformers runs, and kvfleet's torch fallback), same queries, keys and values,
same run.

    python -m benchmarks.cpu_prefill_attention [--model demo] [--shapes 512x0,1200x256,2048x6144]

A shape is NEWxCACHED: NEW query positions after CACHED positions already in the cache (a
document after a cached instruction, or a later chunk of a long prompt), with the model's heads.
Systems, where this CPU runs them: `paged` (kvfleet_kernels/csrc/paged_prefill_amx.cpp, AMX: K/V
read from paged caches in the CPU layouts, blocks in one run as the engine allocates them),
`brgemm` (AMX, over contiguous K/V) or `bf16_dot` (avx512_bf16 without AMX), and `sdpa`
(kvfleet_kernels.reference.prefill_attention). For each shape the best of --repeats calls per
system, rounds interleaved: milliseconds, GFLOP/s over the causal triangle's scores, each
system's speed against SDPA, and the bf16 matmul probe of the same run. JSON summary last.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import matmul_probe_flops, print_summary
from engine.checkpoint import load_hf_config
from kvfleet_kernels import cpu_paged_attention, cpu_prefill_attention, reference

BLOCK_SIZE = 16  # the engine's default


def causal_flops(num_new: int, num_cached: int, num_heads: int, head_dim: int) -> float:
    """Both products over the scores the causal triangle holds: 2 x 2 x D FLOPs a score."""
    scores = num_heads * sum(num_cached + i + 1 for i in range(num_new))
    return 4.0 * head_dim * scores


def make_systems(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> dict:
    """Each system this CPU runs, as a call on the same values."""
    systems = {}
    if cpu_prefill_attention.paged_available():
        context_len, num_kv_heads, head_dim = key.shape
        num_blocks = (context_len + BLOCK_SIZE - 1) // BLOCK_SIZE
        plain = torch.zeros(num_blocks * BLOCK_SIZE, num_kv_heads, head_dim, dtype=key.dtype)
        plain_values = plain.clone()
        plain[:context_len], plain_values[:context_len] = key, value
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        key_cache = cpu_paged_attention.pack_key_cache(plain.view(shape))
        value_cache = cpu_paged_attention.pack_value_cache(plain_values.view(shape))
        block_table = torch.arange(num_blocks)
        if cpu_prefill_attention.supports_paged(query, key_cache, None):
            systems["paged"] = lambda: cpu_prefill_attention.paged_prefill_attention(
                query, key_cache, value_cache, block_table, context_len, scale)
    kernel = cpu_prefill_attention.kernel()
    if kernel is not None and cpu_prefill_attention.supports(query, None, kernel):
        systems[kernel] = lambda: cpu_prefill_attention.prefill_attention(query, key, value, scale, name=kernel)
    systems["sdpa"] = lambda: reference.prefill_attention(query, key, value, scale)
    return systems


def measure(systems: dict, repeats: int) -> dict[str, float]:
    best = {name: float("inf") for name in systems}
    for _ in range(repeats + 1):  # the first round warms up
        for name, call in systems.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="whose heads: a checkpoint folder, a .gguf or 'demo'")
    parser.add_argument("--shapes", default="64x0,512x0,1200x256,1800x256,2048x6144",
                        help="comma list of NEWxCACHED positions")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    try:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
        assert all(len(shape) == 2 and shape[0] >= 1 and shape[1] >= 0 for shape in shapes)
    except (ValueError, AssertionError):
        parser.error(f"--shapes: expected a comma list of NEWxCACHED with NEW >= 1, got {args.shapes!r}")
    config = load_hf_config(args.model)
    num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    probe = matmul_probe_flops(dtype=torch.bfloat16)
    print(f"{args.model}: {num_heads}/{num_kv_heads} heads of {head_dim}; bf16 probe {probe / 1e9:.0f} GFLOP/s")
    generator = torch.Generator().manual_seed(0)
    results = []
    for num_new, num_cached in shapes:
        query = torch.randn(num_new, num_heads, head_dim, generator=generator).bfloat16()
        key, value = (torch.randn(num_new + num_cached, num_kv_heads, head_dim, generator=generator).bfloat16()
                      for _ in range(2))
        best = measure(make_systems(query, key, value, head_dim ** -0.5), args.repeats)
        flops = causal_flops(num_new, num_cached, num_heads, head_dim)
        row = {"new": num_new, "cached": num_cached,
               **{name: {"ms": s * 1e3, "gflop_s": flops / s / 1e9, "vs_sdpa": best["sdpa"] / s}
                  for name, s in best.items()}}
        results.append(row)
        print(f"  {num_new:5d} new after {num_cached:5d}: " + "  ".join(
            f"{name} {row[name]['ms']:8.2f} ms ({row[name]['gflop_s']:5.0f} GFLOP/s, {row[name]['vs_sdpa']:.2f}x)"
            for name in best))
    print_summary({"benchmark": "cpu_prefill_attention", "model": args.model, "bf16_matmul_probe_flops": probe,
                   "heads": [num_heads, num_kv_heads, head_dim], "shapes": results})


if __name__ == "__main__":
    main()
