"""An fp8 KV cache on the CPU: kvfleet with its KV cache in the model's dtype (bf16 where the CPU
has avx512_bf16 or AMX, else fp32), fp8 (e4m3) and fp8_e5m2, and
llama.cpp's llama-server with its cache in f16 and q8_0 (its own 8-bit cache), on the same GGUF
file, token ids and workloads, in one run.

    python -m benchmarks.kv_cache_fp8 [--models smollm2,1b] [--workloads document,long] [--rounds N]
        [--peers llama]

Models: smollm2 (the demo's own Q4_1 file) and 1b (a random Llama of Llama-3.2-1B's shapes
quantized to Q4_K_M by llama-quantize; benchmarks/random_gguf.py writes it, cached
under .bench-llama/). kvfleet runs the file on its quantized kernels in the host's dtype (`--dtype
auto`: bf16 where the CPU computes it natively, else fp32). Workloads (fixed
seed, greedy, ignore_eos): document (benchmarks/common.py: 24 requests, a shared 256-token
instruction and a 600-1,800-token document each, answers of 16-128), and long (12 requests of
1,500-token prompts and 192-token answers: decode steps over long contexts, where a step reads
the most KV bytes). Every request runs at once (max_num_seqs / slots = the requests).

Reported per system: output tokens/s (each run in a fresh process; rounds interleave the
systems and keep each one's best), the ratio to kvfleet's cache in the model's dtype and to llama-server's f16
cache, peak resident memory, and the tokens kvfleet's cache holds in 1 GiB
(--kv-cache-memory). Ends with a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from benchmarks.common import WORKLOADS, Workload
from benchmarks.llama_cpp import LlamaServer, build_llama_cpp
from benchmarks.quantized import context_length, peak_rss_mib, run_child
from benchmarks.random_gguf import write_random_model

KV_MEMORY = "1GiB"
KVFLEET_CACHES = {"kvfleet_model_dtype_kv": "auto", "kvfleet_fp8_kv": "fp8", "kvfleet_fp8_e5m2_kv": "fp8_e5m2"}
LLAMA_CACHES = {"llama_server_f16_kv": "f16", "llama_server_q8_0_kv": "q8_0"}


def long_workload(vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    return Workload([[rng.randrange(3, vocab_size) for _ in range(1500)] for _ in range(12)], [192] * 12)


def workload(name: str) -> Workload:
    return long_workload(49152) if name == "long" else WORKLOADS[name](49152)


def run_kvfleet_child(model: str, kv_cache_dtype: str, workload_name: str) -> dict:
    """In this (child) process: the workload through LLM.generate; seconds, blocks, peak memory."""
    from engine import LLM, SamplingParams  # noqa: PLC0415 (the child only)

    work = workload(workload_name)
    llm = LLM(model, dtype="auto", quantized_kernels=True, kv_cache_dtype=kv_cache_dtype,
              kv_cache_memory=KV_MEMORY, max_num_seqs=len(work.prompts),
              max_model_len=context_length(work.prompts, work.output_lens),
              enable_prefix_caching=workload_name == "document")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    llm.generate([work.prompts[0][:64]], [SamplingParams(max_tokens=2)], use_tqdm=False)  # one-time costs
    start = time.perf_counter()
    outputs = llm.generate(work.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    assert tokens == work.num_output_tokens, (tokens, work.num_output_tokens)
    engine = llm.engine
    return {"output_tokens": tokens, "seconds": seconds, "peak_rss_mib": peak_rss_mib("self"),
            "kv_tokens_in_memory": engine.num_total_blocks * engine.config.block_size,
            "preemptions": engine.stats().num_preemptions,
            "dtype": str(engine.model_runner.dtype).removeprefix("torch.")}


def run_kvfleet(model: str, kv_cache_dtype: str, workload_name: str) -> dict:
    return run_child("benchmarks.kv_cache_fp8", model, kv_cache_dtype, workload_name)


def run_llama_server(bin_dir: Path, model: str, cache_type: str, workload_name: str) -> dict:
    work = workload(workload_name)
    slots = len(work.prompts)
    # Its quantized V cache needs flash attention; both caches run with it, so that only the type differs.
    extra = ["--cache-type-k", cache_type, "--cache-type-v", cache_type, "--flash-attn", "on"]
    context = max(map(len, work.prompts)) + max(work.output_lens)
    with LlamaServer(bin_dir, model, slots=slots, context_per_slot=context, extra_args=extra) as server:
        server.complete(work.prompts[0][:64], 1)  # warm-up
        start = time.perf_counter()
        tokens = server.run_all(work.prompts, work.output_lens, slots)
        seconds = time.perf_counter() - start
        memory = peak_rss_mib(server.pid)
    assert tokens == work.num_output_tokens, (tokens, work.num_output_tokens)
    return {"output_tokens": tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds,
            "peak_rss_mib": memory}


def bench(model: str, workload_name: str, bin_dir: Path | None, rounds: int) -> dict:
    runs = {name: (lambda dtype=dtype: run_kvfleet(model, dtype, workload_name))
            for name, dtype in KVFLEET_CACHES.items()}
    if bin_dir is not None:
        runs |= {name: (lambda kind=kind: run_llama_server(bin_dir, model, kind, workload_name))
                 for name, kind in LLAMA_CACHES.items()}
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for system, run in runs.items():
            result = run()
            if system not in best or result["output_tokens_per_s"] > best[system]["output_tokens_per_s"]:
                best[system] = result
    ours = best["kvfleet_model_dtype_kv"]["output_tokens_per_s"]
    peer = best.get("llama_server_f16_kv", {}).get("output_tokens_per_s")
    for system, result in best.items():
        result["vs_kvfleet_model_dtype_kv"] = result["output_tokens_per_s"] / ours
        result["vs_llama_server_f16_kv"] = result["output_tokens_per_s"] / peer if peer else None
        held = f"  KV holds {result['kv_tokens_in_memory']:,} tokens" if "kv_tokens_in_memory" in result else ""
        versus = f"  {result['vs_llama_server_f16_kv']:5.2f}x llama f16" if peer else ""
        print(f"{workload_name:8s} {system:22s} {result['output_tokens_per_s']:8.1f} tok/s  "
              f"{result['vs_kvfleet_model_dtype_kv']:5.2f}x model-dtype KV{versus}  peak RSS {result['peak_rss_mib']:6.0f} MiB"
              f"{held}")
    return best


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print("KVFLEET_RESULT " + json.dumps(run_kvfleet_child(sys.argv[2], sys.argv[3], sys.argv[4])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,1b")
    parser.add_argument("--workloads", default="document,long")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--peers", default="llama", help="llama, or none")
    parser.add_argument("--cache", default=".bench-llama")
    args = parser.parse_args()
    from engine.checkpoint import demo_model_path  # noqa: PLC0415

    bin_dir = build_llama_cpp(Path(args.cache)) if args.peers == "llama" or "1b" in args.models else None
    files = {"smollm2": lambda: str(demo_model_path()),
             "1b": lambda: write_random_model("1b", Path(args.cache), bin_dir)["quantized"]}
    summary = {}
    for name in args.models.split(","):
        model = files[name]()
        summary[name] = {w: bench(model, w, bin_dir if args.peers == "llama" else None, args.rounds)
                         for w in args.workloads.split(",")}
    print(json.dumps({"kv_cache_memory": KV_MEMORY, "results": summary}, indent=1))


if __name__ == "__main__":
    main()
