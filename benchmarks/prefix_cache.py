"""Automatic prefix caching on a document-pipeline workload: 256 requests share a
1,000-token instruction prefix, each with its own short suffix. The same engine
runs it with caching on and off, in the same run.

    python benchmarks/prefix_cache.py [--num-requests 256] [--prefix-len 1000]

Prints both times, the speed-up, the hit rate (cached / queried prompt tokens) and
a JSON summary. Goal: at least 4x faster with caching.
"""

from __future__ import annotations

import argparse
import random
import time

from transformers import LlamaConfig

from benchmarks.common import ensure_model, print_summary
from engine import LLM, EngineStats, SamplingParams


def model_config() -> LlamaConfig:
    """A ~20M-parameter Llama with room for a 1,000-token prefix."""
    return LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                       architectures=["LlamaForCausalLM"])


def run(model_dir: str, prompts: list[list[int]], caching: bool,
        max_tokens: int) -> tuple[float, EngineStats, list[list[int]]]:
    llm = LLM(model_dir, enable_prefix_caching=caching, max_num_seqs=64)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == max_tokens for o in outputs)
    return elapsed, llm.engine.stats(), [o.token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model-dir", default="out/bench-llama-prefix")
    args = parser.parse_args()
    config = model_config()
    model_dir = ensure_model(args.model_dir, config)
    rng = random.Random(0)
    prefix = [rng.randrange(3, config.vocab_size) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.randrange(3, config.vocab_size) for _ in range(rng.randint(8, 64))]
               for _ in range(args.num_requests)]
    cached_seconds, cached, cached_tokens = run(model_dir, prompts, True, args.max_tokens)
    plain_seconds, _, plain_tokens = run(model_dir, prompts, False, args.max_tokens)
    assert cached_tokens == plain_tokens, "prefix caching changed the outputs"
    hit_rate = cached.num_prefix_hit_tokens / cached.num_prefix_queried_tokens
    speedup = plain_seconds / cached_seconds
    print(f"caching off: {plain_seconds:.1f} s   caching on: {cached_seconds:.1f} s   speed-up {speedup:.2f}x")
    print(f"hit rate: {hit_rate:.1%} of {cached.num_prefix_queried_tokens} prompt tokens "
          f"({cached.num_prefix_hit_tokens} served from cache); outputs identical")
    print_summary({"benchmark": "prefix_cache", "num_requests": args.num_requests, "prefix_len": args.prefix_len,
                   "seconds_with_caching": cached_seconds, "seconds_without_caching": plain_seconds,
                   "speedup": speedup, "hit_rate": hit_rate})


if __name__ == "__main__":
    main()
