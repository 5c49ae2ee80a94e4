"""vLLM (CPU build) as a peer, run in its own virtualenv (`make bench` creates
.bench-venv): it pins a transformers older than kvfleet's.

    .bench-venv/bin/python benchmarks/vllm_peer.py MODEL_DIR WORKLOAD.json

WORKLOAD.json: {"prompts": [[token ids]...], "output_lens": [...], "max_num_seqs": N, and
optionally "dtype" (float32), "max_model_len" (1024), "enable_prefix_caching" (false), and "lora":
{"adapters": [[name, folder]...], "max_loras", "max_lora_rank"} (request i runs adapter i % len),
"warm_up" (false: an untimed pass of 4 tokens a request first)}.
Token-id prompts, no tokenizer, greedy, ignore_eos. Prints the result as a line
`KVFLEET_RESULT {"seconds", "output_tokens"}` (vLLM logs to stdout too). Imports
nothing from kvfleet.
"""

import json
import sys
import time


def main() -> None:
    model_dir, workload_path = sys.argv[1], sys.argv[2]
    from vllm import LLM, SamplingParams

    with open(workload_path) as handle:
        workload = json.load(handle)
    lora = workload.get("lora")
    lora_options = {"enable_lora": True, "max_loras": lora["max_loras"], "max_lora_rank": lora["max_lora_rank"]} \
        if lora else {}
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=workload.get("dtype", "float32"),
              gpu_memory_utilization=0.3, max_num_seqs=workload["max_num_seqs"],
              max_model_len=workload.get("max_model_len", 1024),
              enable_prefix_caching=workload.get("enable_prefix_caching", False), seed=0, **lora_options)
    prompts = [{"prompt_token_ids": ids} for ids in workload["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in workload["output_lens"]]
    loras = None
    if lora:
        from vllm.lora.request import LoRARequest

        adapters = [LoRARequest(name, index + 1, path) for index, (name, path) in enumerate(lora["adapters"])]
        loras = [adapters[i % len(adapters)] for i in range(len(prompts))]
    if workload.get("warm_up"):  # an untimed pass over the same shapes, as the kvfleet side runs
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False),
                     use_tqdm=False, lora_request=loras)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}
    print("KVFLEET_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
