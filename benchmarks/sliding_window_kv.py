"""KV memory on a long-context Gemma 3 run: what the sliding-window layers' own pool
saves, against one pool every layer reads in full, and against transformers' cache.

    python -m benchmarks.sliding_window_kv [--prompt-len 4096] [--num-requests 8]

The model has Gemma 3 1B's KV layout (26 layers, five local to one global, window 512,
one KV head of 256, fp32) with a narrow random body, so the run takes seconds while
the KV arithmetic is the real model's. Reported: the pools kvfleet lays out in a fixed
--kv-cache-memory and the tokens its full-attention pool then holds against one shared
pool; the blocks each pool held at the run's peak and the bytes that is, against what
one shared pool would hold for the same tokens; and, per request, kvfleet's KV bytes
at the end against transformers' DynamicCache for the same sequence (it too keeps only
the window on local layers). JSON summary last.
"""

from __future__ import annotations

import argparse
import random
import tempfile

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from benchmarks.common import print_summary
from engine import LLM, SamplingParams
from engine.demo_model import build_tokenizer, write_checkpoint


def gemma3_1b_kv_layout(max_positions: int) -> Gemma3TextConfig:
    return Gemma3TextConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=26,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                            max_position_embeddings=max_positions, architectures=["Gemma3ForCausalLM"])


def run_kvfleet(model_dir: str, prompts: list[list[int]], max_tokens: int, memory: int) -> dict:
    llm = LLM(model_dir, kv_cache_memory=memory, max_num_seqs=len(prompts), dtype="float32")
    engine, runner = llm.engine, llm.engine.model_runner
    manager = engine.scheduler.block_manager
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    peak = {"full": 0, "sliding": 0}
    last_tables = None
    while engine.has_unfinished():
        engine.step()
        peak["full"] = max(peak["full"], manager.full.num_total_blocks - manager.full.num_free_blocks)
        peak["sliding"] = max(peak["sliding"], manager.sliding.num_total_blocks - manager.sliding.num_free_blocks)
        if engine.scheduler.running:
            seq = engine.scheduler.running[0]
            last_tables = (sum(b >= 0 for b in seq.block_table), sum(b >= 0 for b in seq.sliding_block_table))
    full_layers, sliding_layers = (len(group.layers) for group in runner.kv_groups)
    per_layer = runner.bytes_per_layer_block
    one_pool_blocks = memory // (runner.num_layers * per_layer)
    return {
        "pools": [{"blocks": n, "sliding_window": w} for n, w in runner.kv_pools],
        "layers": {"full": full_layers, "sliding": sliding_layers},
        "full_pool_tokens": runner.kv_pools[0][0] * runner.block_size,
        "one_shared_pool_tokens": one_pool_blocks * runner.block_size,
        "peak_blocks": peak,
        "peak_bytes": peak["full"] * full_layers * per_layer + peak["sliding"] * sliding_layers * per_layer,
        "peak_bytes_one_shared_pool": peak["full"] * runner.num_layers * per_layer,
        "released_blocks": manager.num_released,
        "last_request_bytes": last_tables[0] * full_layers * per_layer + last_tables[1] * sliding_layers * per_layer,
    }


def transformers_cache_bytes(model_dir: str, prompt: list[int], max_tokens: int) -> int:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, pad_token_id=0, return_dict_in_generate=True)
    return sum(layer.keys.numel() * 4 + layer.values.numel() * 4 for layer in out.past_key_values.layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1024) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    with tempfile.TemporaryDirectory() as folder:
        config = gemma3_1b_kv_layout(args.prompt_len + args.max_tokens + 64)
        model_dir = str(write_checkpoint(config, folder, tokenizer=build_tokenizer(1024)))
        kvfleet = run_kvfleet(model_dir, prompts, args.max_tokens, args.kv_cache_memory)
        hf_bytes = transformers_cache_bytes(model_dir, prompts[-1], args.max_tokens)
    mib = 1 << 20
    print(f"layout in {args.kv_cache_memory / mib:.0f} MiB: {kvfleet['layers']['full']} global layers' pool of "
          f"{kvfleet['pools'][0]['blocks']} blocks ({kvfleet['full_pool_tokens']} tokens), "
          f"{kvfleet['layers']['sliding']} local layers' pool of {kvfleet['pools'][1]['blocks']} blocks; "
          f"one shared pool would hold {kvfleet['one_shared_pool_tokens']} tokens "
          f"({kvfleet['full_pool_tokens'] / kvfleet['one_shared_pool_tokens']:.2f}x as many in the first)")
    print(f"peak of the run ({args.num_requests} x {args.prompt_len} + {args.max_tokens} tokens): "
          f"{kvfleet['peak_bytes'] / mib:.1f} MiB held, against {kvfleet['peak_bytes_one_shared_pool'] / mib:.1f} MiB "
          f"in one shared pool: {1 - kvfleet['peak_bytes'] / kvfleet['peak_bytes_one_shared_pool']:.0%} saved; "
          f"{kvfleet['released_blocks']} blocks handed back as windows moved")
    print(f"one request at its end: kvfleet {kvfleet['last_request_bytes'] / mib:.1f} MiB, "
          f"transformers' DynamicCache {hf_bytes / mib:.1f} MiB")
    print_summary({"benchmark": "sliding_window_kv", "prompt_len": args.prompt_len,
                   "num_requests": args.num_requests, "max_tokens": args.max_tokens,
                   "kv_cache_memory": args.kv_cache_memory, "kvfleet": kvfleet,
                   "transformers_request_cache_bytes": hf_bytes})


if __name__ == "__main__":
    main()
