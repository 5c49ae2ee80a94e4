"""kvfleet's engine against transformers on one CUDA device, in bf16, on a ~1.1B
random Llama (TinyLlama's shape).

    python -m benchmarks.engine_gpu [--json OUT.json] [--dry-run]

256 requests (prompts 16-512 tokens, outputs 16-256, ignore_eos, fixed seed), the
same token ids for every engine. Peers in the same run: transformers `generate` in
left-padded static batches of 64, and its continuous batching (`generate_batch`'s
engine). For kvfleet's decode-only steps it also reports the weights-read roofline:
the weights' bytes at the device's measured copy bandwidth, against the step's
median time. Goal: kvfleet >= 3x static `generate`.

--dry-run: a tiny Llama on the CPU in fp32, 8 requests: proves the script, not the speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

from benchmarks.common import ensure_model, make_workload
from benchmarks.kernels_gpu import copy_bandwidth
from benchmarks.peers import run_hf_continuous, run_hf_static, synchronize
from engine import LLM, SamplingParams


def llama_1b_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                       num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                       architectures=["LlamaForCausalLM"])


def tiny_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       architectures=["LlamaForCausalLM"])


def run_kvfleet(model_dir: str, workload, max_batch_size: int, dtype: str, device: str) -> dict:
    llm = LLM(model_dir, dtype=dtype, device=device, max_num_seqs=max_batch_size, enable_prefix_caching=False)
    engine = llm.engine
    # Warm-up: compile the kernels before the clock starts, as the peers' first calls are not timed apart either.
    llm.generate(workload.prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model_runner.model.parameters())
    for index, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
        engine.add_request(str(index), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                              detokenize=False))
    decode_step_seconds, num_out = [], 0
    synchronize(device)
    start = time.perf_counter()
    while engine.has_unfinished():
        step_start = time.perf_counter()
        is_decode = all(s.num_computed_tokens == s.num_tokens - 1 for s in engine.scheduler.running) \
            and not engine.scheduler.waiting
        for output in engine.step():  # the step's sampled tokens reach the host: it is synchronized
            num_out += len(output.token_ids)
        if is_decode:
            decode_step_seconds.append(time.perf_counter() - step_start)
    elapsed = time.perf_counter() - start
    assert num_out == workload.num_output_tokens, (num_out, workload.num_output_tokens)
    return {"seconds": elapsed, "output_tokens_per_s": num_out / elapsed, "weight_bytes": weight_bytes,
            "median_decode_step_s": statistics.median(decode_step_seconds) if decode_step_seconds else None,
            "num_decode_steps": len(decode_step_seconds)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU")
    parser.add_argument("--model-dir", help="where the random checkpoint is written (default: a temp folder)")
    args = parser.parse_args(argv)
    if args.dry_run:
        config, device, dtype, workload = tiny_config(), "cpu", torch.float32, make_workload(
            8, 512, prompt_range=(4, 32), output_range=(4, 16))
    elif torch.cuda.is_available():
        config, device, dtype, workload = llama_1b_config(), "cuda", torch.bfloat16, make_workload(256, 32000)
    else:
        print("engine_gpu: no CUDA device here (--dry-run runs this script on the CPU).")
        return 0
    folder = Path(args.model_dir or tempfile.mkdtemp(prefix="kvfleet-engine-gpu-"))
    model_dir = ensure_model(folder, config)
    bandwidth = copy_bandwidth(device, 1 << (30 if device == "cuda" else 24))
    dtype_name = str(dtype).removeprefix("torch.")
    results = {"kvfleet": run_kvfleet(model_dir, workload, 64, dtype_name, device),
               "transformers_static": run_hf_static(model_dir, workload, 64, dtype=dtype, device=device),
               "transformers_continuous": run_hf_continuous(model_dir, workload, 64, dtype=dtype, device=device)}
    kvfleet = results["kvfleet"]
    ratios = {f"kvfleet_over_{name}": kvfleet["output_tokens_per_s"] / result["output_tokens_per_s"]
              for name, result in results.items() if name != "kvfleet"}
    roofline_s = kvfleet["weight_bytes"] / bandwidth
    fraction = roofline_s / kvfleet["median_decode_step_s"] if kvfleet["median_decode_step_s"] else None
    print(f"{len(workload.prompts)} requests, {workload.num_output_tokens} output tokens, {dtype_name} on {device}")
    for name, result in results.items():
        print(f"{name:28s} {result['output_tokens_per_s']:9.1f} output tok/s  ({result['seconds']:.1f} s)")
    for name, ratio in ratios.items():
        print(f"{name:40s} {ratio:6.2f}x")
    if fraction is not None:
        print(f"decode steps: median {kvfleet['median_decode_step_s'] * 1e3:.2f} ms; reading the weights at the "
              f"measured copy bandwidth takes {roofline_s * 1e3:.2f} ms = {fraction:.0%} of the roofline")
    report = {"device": device, "dtype": dtype_name, "num_requests": len(workload.prompts),
              "copy_bytes_per_s": bandwidth, "results": results, "ratios": ratios,
              "weights_roofline_fraction": fraction}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
