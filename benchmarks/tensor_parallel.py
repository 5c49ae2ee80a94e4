"""Tensor parallelism: one engine over N ranks against one device, same model, same workload.

    python -m benchmarks.tensor_parallel [--tp 2] [--num-requests 48] [--device cpu]

Reports output tokens/s of TP=1 and TP=N, how many greedy outputs are token-identical,
and the weight bytes each rank holds (its parameters, as the model classes build that
rank's shard).

On the CPU (gloo) the N ranks are processes sharing the host's cores, and every layer
adds an all-reduce over loopback TCP: TP=N is not expected to be faster there; what
this run shows is correctness and the memory split. On a machine with N GPUs
(`--device cuda`, NCCL) the same script measures the speedup; it has not been run on
one yet.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import AutoConfig

from benchmarks.common import ensure_model, llama_50m_config, make_workload, print_summary
from engine import LLM, SamplingParams, parallel
from engine.models import get_model_class


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def shard_weight_bytes(model_dir: str, world_size: int) -> list[int]:
    config = AutoConfig.from_pretrained(model_dir)
    sizes = []
    for rank in range(world_size):
        with parallel.rank_view(rank, world_size):
            sizes.append(weight_bytes(get_model_class(config)(config, max_positions=64)))
    return sizes


def run(model_dir: str, workload, tp: int, device: str, max_num_seqs: int):
    llm = LLM(model_dir, tensor_parallel_size=tp, device=device, max_num_seqs=max_num_seqs, num_kv_blocks=2048)
    try:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
        llm.generate(workload.prompts[:2], params[:2], use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(workload.prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    return outputs, workload.num_output_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--model", help="a checkpoint folder; default: the ~56M random Llama of the benchmarks")
    args = parser.parse_args()
    model_dir = args.model or ensure_model(f"{tempfile.gettempdir()}/kvfleet-bench-llama-50m", llama_50m_config())
    workload = make_workload(args.num_requests, 1024, seed=0, prompt_range=(16, 256), output_range=(16, 64))

    single, single_rate = run(model_dir, workload, 1, args.device, args.max_num_seqs)
    sharded, sharded_rate = run(model_dir, workload, args.tp, args.device, args.max_num_seqs)
    identical = sum(a.token_ids == b.token_ids for a, b in zip(single, sharded)) / len(single)
    [single_bytes], shards = shard_weight_bytes(model_dir, 1), shard_weight_bytes(model_dir, args.tp)
    print(f"TP=1: {single_rate:.0f} tok/s, {single_bytes / 2**20:.1f} MiB of weights")
    print(f"TP={args.tp}: {sharded_rate:.0f} tok/s ({sharded_rate / single_rate:.2f}x), per rank "
          + ", ".join(f"{b / 2**20:.1f} MiB ({b / single_bytes:.0%})" for b in shards))
    print(f"greedy outputs token-identical: {identical:.0%}")
    print_summary({"device": args.device, "tp": args.tp, "tp1_tokens_per_s": single_rate,
                   "tpn_tokens_per_s": sharded_rate, "speedup": sharded_rate / single_rate,
                   "tp1_weight_bytes": single_bytes, "rank_weight_bytes": shards,
                   "rank_weight_share": [b / single_bytes for b in shards], "identical_fraction": identical,
                   "num_requests": args.num_requests})


if __name__ == "__main__":
    main()
