"""kvfleet's engine against transformers on one CUDA device, in bf16, on a ~1.1B
random Llama (TinyLlama's shape).

    python -m benchmarks.engine_gpu [--json OUT.json] [--dry-run] [--peers static,continuous]

256 requests (prompts 16-512 tokens, outputs 16-256, ignore_eos, fixed seed), the
same token ids for every engine. kvfleet runs twice: eager, and with its decode steps
replayed from CUDA graphs (`enforce_eager=False`, engine/cuda_graphs.py; on the CPU there
are none, so that run is eager too). Peers in the same run: transformers `generate` in
left-padded static batches of 64, and its continuous batching (`generate_batch`'s
engine). For the faster kvfleet run's decode-only steps it also reports the weights-read roofline:
the weights' bytes at the device's measured copy bandwidth, against the step's
median time, then profiles decode-only steps of 64 sequences (host functions by own time,
device kernels by time) for the log. Goal: kvfleet >= 3x static `generate`.

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


def run_kvfleet(model_dir: str, workload, max_batch_size: int, dtype: str, device: str,
                enforce_eager: bool = True) -> dict:
    llm = LLM(model_dir, dtype=dtype, device=device, max_num_seqs=max_batch_size, enable_prefix_caching=False,
              enforce_eager=enforce_eager)
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


def profile_decode_steps(model_dir: str, dtype: str, device: str, num_seqs: int = 64, num_steps: int = 8) -> dict:
    """Where a decode step's time goes: cProfile's host functions (by own time) and torch's
    profiler (ops by device time, then by host time) over num_steps decode-only steps of
    num_seqs sequences. Printed for the log; the median step goes in the report."""
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    llm = LLM(model_dir, dtype=dtype, device=device, max_num_seqs=num_seqs, enable_prefix_caching=False)
    engine = llm.engine
    for index in range(num_seqs):
        engine.add_request(str(index), [3 + (index * 7 + j) % 200 for j in range(64)],
                           SamplingParams(temperature=0, max_tokens=4 * num_steps + 8, ignore_eos=True,
                                          detokenize=False))
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running):
        engine.step()  # prefill everything first: what follows are decode-only steps
    engine.step()
    step_seconds = []
    for _ in range(num_steps):
        begin = time.perf_counter()
        engine.step()
        step_seconds.append(time.perf_counter() - begin)
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [engine.step() for _ in range(num_steps)])
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as trace:
        for _ in range(num_steps):
            engine.step()
        synchronize(device)
    sort_by = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(trace.key_averages().table(sort_by=sort_by, row_limit=25, max_name_column_width=60))
    print(trace.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    median = statistics.median(step_seconds)
    print(f"decode-only steps of {num_seqs} sequences: median {median * 1e3:.2f} ms")
    return {"num_seqs": num_seqs, "median_step_s": median}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU")
    parser.add_argument("--model-dir", help="where the random checkpoint is written (default: a temp folder)")
    parser.add_argument("--peers", default="static,continuous",
                        help="transformers peers to run: static (generate, the goal's peer), continuous")
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
    print(f"{len(workload.prompts)} requests, {workload.num_output_tokens} output tokens, {dtype_name} on {device}")
    peers = {"static": ("transformers_static", run_hf_static),
             "continuous": ("transformers_continuous", run_hf_continuous)}
    runs = {"kvfleet": lambda: run_kvfleet(model_dir, workload, 64, dtype_name, device),
            # decode steps from CUDA graphs (eager on the CPU, where there are none): not yet run on a GPU
            "kvfleet_cuda_graphs": lambda: run_kvfleet(model_dir, workload, 64, dtype_name, device, enforce_eager=False),
            **{name: lambda run_peer=run_peer: run_peer(model_dir, workload, 64, dtype=dtype, device=device)
               for name, run_peer in (peers[peer] for peer in args.peers.split(",") if peer)}}
    results = {}
    for name, run in runs.items():
        try:  # a run's own failure (another transformers version, a graph capture) costs only its row
            results[name] = run()
            # Printed as it lands: a part timeout in gpu_check keeps the rows before it in the log.
            print(f"{name:28s} {results[name]['output_tokens_per_s']:9.1f} output tok/s  ({results[name]['seconds']:.1f} s)",
                  flush=True)
        except Exception as error:  # noqa: BLE001
            if name == "kvfleet":
                raise
            print(f"{name} failed: {type(error).__name__}: {error}", flush=True)
            results[name] = {"error": f"{type(error).__name__}: {error}"}
    ours = [name for name, result in results.items() if name.startswith("kvfleet") and "error" not in result]
    ratios = {f"{mine}_over_{name}": results[mine]["output_tokens_per_s"] / result["output_tokens_per_s"]
              for mine in ours for name, result in results.items()
              if not name.startswith("kvfleet") and "error" not in result}
    kvfleet = max((results[name] for name in ours), key=lambda result: result["output_tokens_per_s"])
    roofline_s = kvfleet["weight_bytes"] / bandwidth
    fraction = roofline_s / kvfleet["median_decode_step_s"] if kvfleet["median_decode_step_s"] else None
    for name, ratio in ratios.items():
        print(f"{name:40s} {ratio:6.2f}x")
    if fraction is not None:
        print(f"decode steps (kvfleet's faster run): median {kvfleet['median_decode_step_s'] * 1e3:.2f} ms; reading the weights at the "
              f"measured copy bandwidth takes {roofline_s * 1e3:.2f} ms = {fraction:.0%} of the roofline")
    report = {"device": device, "dtype": dtype_name, "num_requests": len(workload.prompts),
              "copy_bytes_per_s": bandwidth, "results": results, "ratios": ratios,
              "weights_roofline_fraction": fraction}
    try:  # a diagnosis for the log: its failure costs none of the numbers above
        report["decode_profile"] = profile_decode_steps(model_dir, dtype_name, device, 4 if args.dry_run else 64)
    except Exception as error:  # noqa: BLE001
        print(f"decode profile failed: {type(error).__name__}: {error}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
