"""vLLM (CPU build) as a peer, run in its own virtualenv (`make bench` creates
.bench-venv): it pins a transformers older than kvfleet's.

    .bench-venv/bin/python benchmarks/vllm_peer.py MODEL_DIR WORKLOAD.json

WORKLOAD.json: {"prompts": [[token ids]...], "output_lens": [...], "max_num_seqs": N, and
optionally "dtype" (float32), "max_model_len" (1024), "enable_prefix_caching" (false), and "lora":
{"adapters": [[name, folder]...], "max_loras", "max_lora_rank"} (request i runs adapter i % len),
"warm_up" (false: an untimed pass of 4 tokens a request first), "warm_up_prompt" (none: one
untimed request of these token ids and 1 output token first, for runs whose prompts must reach the
timed pass uncached)}.
Token-id prompts, no tokenizer, greedy, ignore_eos. Prints the result as a line
`KVFLEET_RESULT {"seconds", "output_tokens", "cpu_seconds", "peak_rss_mib"}` (vLLM logs to stdout
too); the last two over this process and its children (vLLM's engine core), the CPU seconds of the
timed pass alone. Imports nothing from kvfleet.
"""

import json
import sys
import time

import psutil  # vLLM's own dependency


def process_tree() -> list[psutil.Process]:
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def tree_cpu_seconds() -> float:
    return sum(sum(process.cpu_times()[:2]) for process in process_tree())


def tree_peak_rss_mib() -> float:
    """The processes' peak resident sets (VmHWM), summed."""
    total = 0
    for process in process_tree():
        with open(f"/proc/{process.pid}/status") as status:
            total += next((int(line.split()[1]) for line in status if line.startswith("VmHWM:")), 0)
    return total / 1024


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
    if workload.get("warm_up_prompt"):
        llm.generate([{"prompt_token_ids": workload["warm_up_prompt"]}],
                     SamplingParams(temperature=0, max_tokens=1, detokenize=False), use_tqdm=False)
    cpu_start, start = tree_cpu_seconds(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds, cpu_seconds = time.perf_counter() - start, tree_cpu_seconds() - cpu_start
    result = {"seconds": seconds, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
              "cpu_seconds": cpu_seconds, "peak_rss_mib": tree_peak_rss_mib()}
    print("KVFLEET_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
