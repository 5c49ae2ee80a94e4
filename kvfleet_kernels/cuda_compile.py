"""Compile every Triton kernel for a CUDA architecture on a machine without a GPU.

    python -m kvfleet_kernels.cuda_compile [--arch 80 90] [--dtype bf16 fp16 fp32]

The interpreter (TRITON_INTERPRET=1) proves the kernels' arithmetic on the CPU but
never lowers them: a construct that does not compile, a bf16/fp16 type clash or a
register spill only shows on the real toolchain. Triton ships that toolchain (its
own LLVM and ptxas), so this builds each kernel to a cubin for the given SM
architectures and reads the cubin's resource usage (registers, spills, shared
memory) with the cuobjdump Triton also ships. Run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# Per kernel: its argument types ("T" is the activation/cache dtype under test), then the
# compile-time shapes to build: the engine's common cases at both ends of the grid. A variant's
# "types" overrides argument types (an fp8 KV cache is passed as its bytes, *u8).
# Integer arguments are strides and counts: i32, as Triton's launcher passes values below 2**31.
FP8_CACHES = {"key_cache_ptr": "*u8", "value_cache_ptr": "*u8"}
KERNELS = {
    # Decode: whole context per program (Llama-8B's heads, 64-token tiles and 128), and split-K
    # partitions (gpt-oss-like: 7 heads a KV head padded to 16 rows, sinks, 32-token blocks).
    "paged_attention": ("kvfleet_kernels.paged_attention", "_paged_decode_kernel", {
        "out_ptr": "*T", "partial_ptr": "*fp32", "query_ptr": "*T", "key_cache_ptr": "*T", "value_cache_ptr": "*T",
        "block_tables_ptr": "*i64", "context_lens_ptr": "*i64", "sinks_ptr": "*T", "scale": "fp32",
        "k_scale": "fp32", "v_scale": "fp32"},
        [{"NUM_QUERIES_PER_KV": 4, "ROWS": 16, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "TILE": 64, "PARTITION_TILES": 1,
          "SPLIT": False, "HAS_SINKS": False, "DOT_PRECISION": "tf32", "FP8": 0},
         {"NUM_QUERIES_PER_KV": 4, "ROWS": 16, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "TILE": 128, "PARTITION_TILES": 1,
          "SPLIT": False, "HAS_SINKS": False, "DOT_PRECISION": "tf32", "FP8": 0},
         {"NUM_QUERIES_PER_KV": 7, "ROWS": 16, "HEAD_DIM": 64, "BLOCK_SIZE": 32, "TILE": 64, "PARTITION_TILES": 8,
          "SPLIT": True, "HAS_SINKS": True, "DOT_PRECISION": "tf32", "FP8": 0},
         {"NUM_QUERIES_PER_KV": 4, "ROWS": 16, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "TILE": 128, "PARTITION_TILES": 1,
          "SPLIT": False, "HAS_SINKS": False, "DOT_PRECISION": "tf32", "FP8": 1, "types": FP8_CACHES},
         {"NUM_QUERIES_PER_KV": 7, "ROWS": 16, "HEAD_DIM": 64, "BLOCK_SIZE": 32, "TILE": 64, "PARTITION_TILES": 8,
          "SPLIT": True, "HAS_SINKS": True, "DOT_PRECISION": "tf32", "FP8": 2, "types": FP8_CACHES}]),
    "paged_attention_combine": ("kvfleet_kernels.paged_attention", "_combine_partitions_kernel", {
        "out_ptr": "*T", "partial_ptr": "*fp32", "sinks_ptr": "*T"},
        [{"HEAD_DIM": 128, "PARTITIONS": 8, "HAS_SINKS": False}, {"HEAD_DIM": 64, "PARTITIONS": 32, "HAS_SINKS": True}]),
    "prefill_attention": ("kvfleet_kernels.prefill_attention", "_prefill_kernel", {
        "out_ptr": "*T", "query_ptr": "*T", "key_cache_ptr": "*T", "value_cache_ptr": "*T",
        "block_tables_ptr": "*i64", "query_starts_ptr": "*i64", "context_lens_ptr": "*i64", "sinks_ptr": "*T",
        "scale": "fp32", "k_scale": "fp32", "v_scale": "fp32"},
        [{"NUM_QUERIES_PER_KV": 4, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_M": 64, "TILE": 64,
          "DOT_PRECISION": "tf32", "HAS_SINKS": False, "FP8": 0},
         {"NUM_QUERIES_PER_KV": 8, "HEAD_DIM": 64, "BLOCK_SIZE": 32, "BLOCK_M": 16, "TILE": 64,
          "DOT_PRECISION": "tf32", "HAS_SINKS": True, "FP8": 0},
         {"NUM_QUERIES_PER_KV": 4, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_M": 64, "TILE": 64,
          "DOT_PRECISION": "tf32", "HAS_SINKS": False, "FP8": 1, "types": FP8_CACHES}]),
    # Packed whole inputs of embedding models: an encoder's bidirectional attention at head size 32
    # (all-MiniLM), a decoder's causal one at 128 (Qwen3-Embedding), and a padded head size (48).
    "varlen_attention": ("kvfleet_kernels.varlen_attention", "_varlen_attention_kernel", {
        "out_ptr": "*T", "query_ptr": "*T", "key_ptr": "*T", "value_ptr": "*T", "cu_seqlens_ptr": "*i32",
        "scale": "fp32"},
        [{"NUM_QUERIES_PER_KV": 1, "HEAD_DIM": 32, "BLOCK_M": 64, "BLOCK_N": 32, "IS_CAUSAL": False,
          "DOT_PRECISION": "tf32"},
         {"NUM_QUERIES_PER_KV": 2, "HEAD_DIM": 128, "BLOCK_M": 64, "BLOCK_N": 32, "IS_CAUSAL": True,
          "DOT_PRECISION": "tf32"},
         {"NUM_QUERIES_PER_KV": 4, "HEAD_DIM": 64, "BLOCK_M": 16, "BLOCK_N": 32, "IS_CAUSAL": False,
          "DOT_PRECISION": "tf32"}]),
    # GEMM 1 (gate/up with the activation) and GEMM 2 (down, bias, routing weight) of a MoE layer.
    "fused_moe": ("kvfleet_kernels.fused_moe", "_fused_moe_kernel", {
        "a_ptr": "*T", "b_ptr": "*T", "bias_ptr": "*T", "c_ptr": "*T", "topk_weights_ptr": "*T",
        "sorted_row_ids_ptr": "*i64", "expert_ids_ptr": "*i64", "swiglu_alpha": "fp32", "swiglu_limit": "fp32"},
        [{"ROWS_PER_A_ROW": 8, "GATED": True, "ACTIVATION": 0, "HAS_BIAS": False, "MUL_ROUTED_WEIGHT": False,
          "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "DOT_PRECISION": "tf32"},
         {"ROWS_PER_A_ROW": 1, "GATED": False, "ACTIVATION": 1, "HAS_BIAS": True, "MUL_ROUTED_WEIGHT": True,
          "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "DOT_PRECISION": "tf32"}]),
    # The LoRA gather matmul (shrink and expand are the same kernel; expand accumulates).
    "lora_sgmv": ("kvfleet_kernels.lora", "_sgmv_kernel", {
        "x_ptr": "*T", "w_ptr": "*T", "out_ptr": "*T", "seg_starts_ptr": "*i64", "seg_slots_ptr": "*i64"},
        [{"ACCUMULATE": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "DOT_PRECISION": "tf32"}]),
    # Matmuls on quantized weights: 4-bit codes in AWQ/GPTQ's groups of 128 at decode (16 rows) and
    # prefill (64) tiles, 8-bit codes in GGUF's groups of 32; fp8 weights with per-channel scales.
    "quantized_matmul": ("kvfleet_kernels.quantized_matmul", "_quantized_matmul_kernel", {
        "x_ptr": "*T", "codes_ptr": "*u8", "scale_ptr": "*fp16", "offset_ptr": "*fp16", "out_ptr": "*T"},
        [{"BITS": 4, "GROUP": 128, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "DOT_PRECISION": "tf32"},
         {"BITS": 4, "GROUP": 128, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "DOT_PRECISION": "tf32"},
         {"BITS": 8, "GROUP": 32, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "DOT_PRECISION": "tf32"}]),
    "fp8_matmul": ("kvfleet_kernels.quantized_matmul", "_fp8_matmul_kernel", {
        "x_ptr": "*T", "weight_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": "*T"},
        [{"PER_CHANNEL": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "DOT_PRECISION": "tf32"}]),
    "store_kv": ("kvfleet_kernels.store_kv", "_store_kv_kernel", {
        "key_ptr": "*T", "value_ptr": "*T", "key_cache_ptr": "*T", "value_cache_ptr": "*T",
        "slot_mapping_ptr": "*i64"}, [{"ROW": 1024, "ROW_BLOCK": 1024}, {"ROW": 320, "ROW_BLOCK": 512}]),
    "rms_norm": ("kvfleet_kernels.rms_norm", "_rms_norm_kernel", {
        "out_ptr": "*T", "x_ptr": "*T", "residual_ptr": "*T", "residual_out_ptr": "*T", "weight_ptr": "*T",
        "eps": "fp32"}, [{"HIDDEN": 4096, "BLOCK": 4096, "HAS_RESIDUAL": True},
                         {"HIDDEN": 896, "BLOCK": 1024, "HAS_RESIDUAL": False}]),
    "rotary": ("kvfleet_kernels.rotary", "_rotary_kernel", {
        "query_ptr": "*T", "key_ptr": "*T", "cos_ptr": "*T", "sin_ptr": "*T"},
        [{"HALF": 64, "HEADS_BLOCK": 32}, {"HALF": 32, "HEADS_BLOCK": 16}]),
}
DTYPES = ("bf16", "fp16", "fp32")  # Triton's own names


@dataclass
class Compiled:
    kernel: str
    variant: int
    arch: int
    dtype: str
    registers: int
    spill_bytes: int  # local memory per thread: 0 unless registers ran out
    shared_bytes: int
    num_warps: int


def _cuobjdump() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_kernel(kernel: str, variant: int, arch: int, dtype: str) -> Compiled:
    module_name, function_name, typed, variants = KERNELS[kernel]
    constexprs = {name: value for name, value in variants[variant].items() if name != "types"}
    typed = typed | variants[variant].get("types", {})
    module = __import__(module_name, fromlist=[function_name])
    function = getattr(module, function_name)
    if not isinstance(function, triton.runtime.JITFunction):
        raise RuntimeError("kernels were imported under TRITON_INTERPRET=1; run this without it")
    signature = {}
    for name in function.arg_names:
        kind = typed.get(name, "i32")
        signature[name] = "constexpr" if name in constexprs else kind.replace("T", dtype)
    compiled = triton.compile(ASTSource(function, signature, constexprs), target=GPUTarget("cuda", arch, 32))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(_cuobjdump()), "--dump-resource-usage", cubin.name], check=True,
                               capture_output=True, text=True).stdout
    fields = dict(re.findall(r"(REG|LOCAL|SHARED):(\d+)", usage))
    return Compiled(kernel, variant, arch, dtype, int(fields["REG"]), int(fields["LOCAL"]), int(fields["SHARED"]) or
                    compiled.metadata.shared, compiled.metadata.num_warps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="SM versions, e.g. 80 (A100) 90 (H100)")
    parser.add_argument("--dtype", nargs="+", default=["bf16", "fp16"], choices=DTYPES)
    parser.add_argument("--kernel", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter never compiles")
    failures = 0
    cases = [(kernel, variant, arch, dtype) for kernel in args.kernel for variant in range(len(KERNELS[kernel][3]))
             for arch in args.arch for dtype in args.dtype]
    # Each case is independent LLVM and ptxas work: compile them on every core, report in order.
    with concurrent.futures.ProcessPoolExecutor() as pool:
        futures = [pool.submit(compile_kernel, *case) for case in cases]
    for (kernel, variant, arch, dtype), future in zip(cases, futures):
        name = f"{kernel}#{variant}"
        try:
            c = future.result()
        except Exception as error:  # noqa: BLE001 (report every kernel, then fail)
            failures += 1
            print(f"FAIL   {name:20s} sm_{arch} {dtype}: {type(error).__name__}: {error}")
            continue
        verdict = "ok" if c.spill_bytes == 0 else "SPILLS"
        failures += c.spill_bytes != 0
        print(f"{verdict:6s} {name:20s} sm_{arch} {dtype:4s} registers {c.registers:3d}  "
              f"spill {c.spill_bytes:4d} B  shared {c.shared_bytes:6d} B  warps {c.num_warps}")
    print(f"{len(cases) - failures} of {len(cases)} compiled without spills")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
