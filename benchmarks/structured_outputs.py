"""What constraints cost: a batch with half its requests constrained against the same
batch unconstrained, in the same run, and the compile time of each schema.

    python -m benchmarks.structured_outputs [--num-requests 128] [--max-tokens 64]

The demo model (random weights) and the ten schemas of examples/extraction_schemas.json.
Constrained requests run until their grammar completes (or --max-tokens); the baseline runs
the same prompts unconstrained with each request exactly as many tokens as in the
constrained run, before and after it. Goal: overhead <= 15%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import print_summary
from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.demo_model import demo_config, write_checkpoint


def tokens_per_second(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    model_dir = str(write_checkpoint(demo_config(), f"{tempfile.mkdtemp(prefix='kvfleet-so-')}/demo"))
    llm = LLM(model_dir, num_kv_blocks=2048, max_num_seqs=32)
    prompts = [f"Document {i}: extract the fields." for i in range(args.num_requests)]
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    schemas = list(json.loads((Path(__file__).resolve().parents[1] / "examples" / "extraction_schemas.json")
                              .read_text()).values())

    # Compile each schema once on its own, for its compile time (later runs hit the cache).
    structured = llm.engine._structured()
    compile_seconds = []
    for schema in schemas:
        start = time.perf_counter()
        structured.start(StructuredOutputsParams(json=schema)).compiled.result()
        compile_seconds.append(time.perf_counter() - start)

    constrained = [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                  structured_outputs=StructuredOutputsParams(json=schemas[i % len(schemas)]))
                   for i in range(args.num_requests)]
    mixed = [constrained[i] if i % 2 else free for i in range(args.num_requests)]
    tokens_per_second(llm, prompts[:8], [free] * 8)  # warm-up
    mixed_outputs = llm.generate(prompts, mixed, use_tqdm=False)  # learn each constrained request's length
    # The fair baseline does the same work unconstrained: each request as many tokens as its
    # constrained run produced (a grammar that completes ends its request early; that shortens
    # the batch's tail, which is not the constraint's cost).
    shaped = [SamplingParams(temperature=0, max_tokens=len(output.token_ids), ignore_eos=True)
              for output in mixed_outputs]
    plain_rate = tokens_per_second(llm, prompts, shaped)
    mixed_rate = tokens_per_second(llm, prompts, mixed)
    plain_again = tokens_per_second(llm, prompts, shaped)  # before and after: a shared host drifts
    baseline = (plain_rate + plain_again) / 2
    overhead = 1 - mixed_rate / baseline
    full_rate = tokens_per_second(llm, prompts, [free] * args.num_requests)
    print(f"same work unconstrained: {plain_rate:.0f} / {plain_again:.0f} tok/s; half constrained: "
          f"{mixed_rate:.0f} tok/s -> overhead {overhead:.1%} (goal <= 15%)")
    print(f"every request at --max-tokens, unconstrained: {full_rate:.0f} tok/s "
          f"({1 - mixed_rate / full_rate:.1%} above the constrained batch, tail effect included)")
    print(f"compile per schema: p50 {1e3 * statistics.median(compile_seconds):.1f} ms, "
          f"max {1e3 * max(compile_seconds):.1f} ms over {len(schemas)} schemas")
    print_summary({"unconstrained_tokens_per_s": baseline, "half_constrained_tokens_per_s": mixed_rate,
                   "overhead": overhead, "full_length_unconstrained_tokens_per_s": full_rate,
                   "compile_ms_p50": 1e3 * statistics.median(compile_seconds),
                   "compile_ms_max": 1e3 * max(compile_seconds), "num_requests": args.num_requests,
                   "max_tokens": args.max_tokens})


if __name__ == "__main__":
    main()
