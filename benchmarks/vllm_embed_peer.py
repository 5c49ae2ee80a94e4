"""vLLM (CPU build) embedding a list of texts, run in its own virtualenv (`make bench`
creates .bench-venv) for benchmarks/embeddings.py.

    .bench-venv/bin/python benchmarks/vllm_embed_peer.py MODEL_DIR WORKLOAD.json OUT.npy

WORKLOAD.json: {"texts": [...], "dtype": "float32"|"bfloat16", "max_num_batched_tokens": N}.
Writes the embeddings to OUT.npy (so the caller can check their cosine) and prints
`KVFLEET_RESULT {"seconds", "num_texts"}`. Imports nothing from kvfleet.
"""

import json
import sys
import time


def main() -> None:
    model_dir, workload_path, out_path = sys.argv[1:4]
    import numpy as np
    from vllm import LLM

    with open(workload_path) as handle:
        workload = json.load(handle)
    llm = LLM(model=model_dir, runner="pooling", dtype=workload["dtype"], seed=0,
              max_num_batched_tokens=workload["max_num_batched_tokens"], max_num_seqs=256)
    texts = workload["texts"]
    llm.embed(texts[:64], use_tqdm=False)  # warm-up, as the other peers get
    start = time.perf_counter()
    outputs = llm.embed(texts, use_tqdm=False, tokenization_kwargs={"truncation": True, "max_length": 256})
    seconds = time.perf_counter() - start
    np.save(out_path, np.array([o.outputs.embedding for o in outputs], dtype=np.float32))
    print("KVFLEET_RESULT " + json.dumps({"seconds": seconds, "num_texts": len(outputs)}), flush=True)


if __name__ == "__main__":
    main()
