"""Shared pieces of the benchmarks: the fixed-seed workload, the ~50M-parameter
random Llama (or a real model as the peers can read it), the matmul probe and analytic
FLOP counts."""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from engine.checkpoint import resolve_checkpoint
from engine.demo_model import build_tokenizer, write_checkpoint


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, vocab_size: int, seed: int = 0, prompt_range=(16, 512),
                  output_range=(16, 256)) -> Workload:
    rng = random.Random(seed)
    lens = [rng.randint(*prompt_range) for _ in range(num_requests)]
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lens]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_requests)])


def make_chat_workload(vocab_size: int, seed: int = 0, num_requests: int = 96) -> Workload:
    """Chat-shaped: prompts of 32-512 tokens, answers of 64-256."""
    return make_workload(num_requests, vocab_size, seed, prompt_range=(32, 512), output_range=(64, 256))


def make_document_workload(vocab_size: int, seed: int = 0, num_requests: int = 24) -> Workload:
    """Document-shaped: one 256-token instruction shared by every request (the prefix cache
    holds it), then a 600-1,800-token document of its own; answers of 16-128 tokens."""
    rng = random.Random(seed)
    instruction = [rng.randrange(3, vocab_size) for _ in range(256)]
    prompts = [instruction + [rng.randrange(3, vocab_size) for _ in range(rng.randint(600, 1800))]
               for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(16, 128) for _ in range(num_requests)])


WORKLOADS = {"chat": make_chat_workload, "document": make_document_workload}


def llama_50m_config() -> LlamaConfig:
    """About 56M parameters: 8 layers of width 512, GQA 8/4 heads, a 32k vocabulary."""
    return LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                       architectures=["LlamaForCausalLM"])


def ensure_model(path: str | Path, config: LlamaConfig | None = None) -> str:
    path = Path(path)
    if not (path / "model.safetensors").exists():
        write_checkpoint(config or llama_50m_config(), path, seed=0, tokenizer=build_tokenizer(1024))
    return str(path)


def peer_checkpoint(model: str, out_dir: str | Path) -> str:
    """A folder of safetensors the peers can read holding `model`'s weights: the model's
    own folder, or for a GGUF (`demo` included) its dequantized fp32 weights written once
    to `out_dir` by transformers, with its tokenizer."""
    checkpoint = resolve_checkpoint(model)
    if not checkpoint.gguf_file:
        return str(checkpoint.folder)
    out_dir = Path(out_dir)
    if not (out_dir / "model.safetensors").exists():
        path, kwargs = checkpoint.from_pretrained_args()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
        # save_pretrained refuses a model loaded from a GGUF; its weights are plain fp32 by now.
        out_dir.mkdir(parents=True, exist_ok=True)
        save_model(model, str(out_dir / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))
        AutoTokenizer.from_pretrained(path, **kwargs).save_pretrained(out_dir)
    return str(out_dir)


RESULT_MARK = "KVFLEET_RESULT "  # a peer process's last stdout line so marked is its JSON result


def child_result(done: subprocess.CompletedProcess, who: str) -> dict:
    """The JSON on the last RESULT_MARK line of a finished peer process's stdout (its logs may share
    stdout: vLLM's do); a RuntimeError naming `who` with the end of its output where it failed."""
    marked = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if done.returncode != 0 or not marked:
        raise RuntimeError(f"{who} failed (exit {done.returncode}):\n{(done.stderr or done.stdout)[-3000:]}")
    return json.loads(marked[-1].removeprefix(RESULT_MARK))


def matmul_probe_flops(size: int = 2048, repeats: int = 10, device: str = "cpu",
                       dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a square matmul in `dtype` on `device`, right now."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    a @ b  # warm-up
    synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - start)


# A sample reading under this share of the best one counts as the slow mode (below).
SLOW_PROBE_SHARE = 0.6


@contextlib.contextmanager
def sampled_matmul_speed(dtype: torch.dtype, interval: float = 0.5, size: int = 512) -> Iterator[list[float]]:
    """Runs benchmarks/matmul_sampler.py beside the block; the list it yields fills, as they come,
    with the FLOP/s of a one-thread matmul sampled every `interval` seconds through it. Why: on
    2-core Xeon hosts with AMX the matrix unit is shared with something outside the VM, and its
    speed flips within seconds between two modes (a one-thread bf16 512^3 matmul ~900 against ~400
    GFLOP/s; one tile product with its tile loaded from L1 ~7 against ~28 ns) while AVX-512 FMAs
    stay at one speed. Probes before and after a run can miss the mode it met (docs/performance.md)."""
    command = [sys.executable, "-m", "benchmarks.matmul_sampler", str(dtype).removeprefix("torch."),
               str(interval), str(size)]
    sampler = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    samples: list[float] = []
    reader = threading.Thread(target=lambda: samples.extend(float(line) for line in sampler.stdout), daemon=True)
    reader.start()
    try:
        yield samples
    finally:
        sampler.terminate()
        sampler.wait(timeout=60)
        reader.join(timeout=60)  # every figure was flushed as it was taken: the pipe's last ones too


def slow_share(samples: list[float], best: float) -> float:
    """The share of `samples` under SLOW_PROBE_SHARE of `best`: how often the host was slow
    (0 when there are none)."""
    return sum(sample < SLOW_PROBE_SHARE * best for sample in samples) / max(len(samples), 1)


def stream_read_probe_bytes_per_s(num_bytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes/s of one pass summing a fp32 buffer larger than this host's L3: the memory
    bandwidth a decode step's K/V reads can reach, right now. The best of `repeats`."""
    buffer = torch.ones(num_bytes // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def flops_per_token(config: LlamaConfig) -> tuple[float, float, float]:
    """(every linear layer, the LM head, attention per context token): FLOPs for one token."""
    head_dim = config.hidden_size // config.num_attention_heads
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = config.hidden_size * (q_size + 2 * kv_size) + q_size * config.hidden_size \
        + 3 * config.hidden_size * config.intermediate_size
    return (2 * per_layer * config.num_hidden_layers, 2 * config.hidden_size * config.vocab_size,
            4 * q_size * config.num_hidden_layers)  # QK^T and PV


def workload_flops(config: LlamaConfig, workload: Workload) -> float:
    """Useful FLOPs of the workload: every linear layer on every token, the LM head
    on every sampled token, and attention (QK^T and PV) over each token's context."""
    linear, lm_head, attention = flops_per_token(config)
    total = 0.0
    for prompt, num_out in zip(workload.prompts, workload.output_lens):
        num_tokens = len(prompt) + num_out - 1  # the last sampled token is never fed back
        total += linear * num_tokens + lm_head * num_out + attention * num_tokens * (num_tokens + 1) / 2
    return total


def step_flops(config: LlamaConfig, rows: list[tuple[int, int]]) -> float:
    """FLOPs of one engine step; rows: (new tokens, tokens computed before) per sequence.
    Every new token runs every linear layer and attends over its context (itself included);
    each sequence samples one token through the LM head."""
    linear, lm_head, attention = flops_per_token(config)
    return sum(linear * n + lm_head + attention * (n * before + n * (n + 1) / 2) for n, before in rows)


def decode_step_flops(config: LlamaConfig, context_lens: list[int]) -> float:
    """FLOPs of one decode step: a new token per sequence over its context (new token included)."""
    return step_flops(config, [(1, context - 1) for context in context_lens])


def decode_step_roofline_seconds(config: LlamaConfig, context_lens: list[int], matmul_flops: float,
                                 read_bytes_per_s: float, dtype_bytes: int = 4) -> float:
    """The least time one decode step can take here: its matmuls at the probe's FLOP/s (or
    its weights at read bandwidth, if slower), plus its K/V reads at read bandwidth (or the
    attention FLOPs at the probe, if slower). K/V bytes carry ~1 FLOP each, so at long
    contexts this bound, not the matmul probe, caps a decode step's FLOP/s."""
    linear, lm_head, attention = flops_per_token(config)
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes
    weight_bytes = (linear + lm_head) / 2 * dtype_bytes  # 2 FLOPs per weight per token
    matmuls = max((linear + lm_head) * len(context_lens) / matmul_flops, weight_bytes / read_bytes_per_s)
    kv = max(attention * sum(context_lens) / matmul_flops, kv_bytes_per_token * sum(context_lens) / read_bytes_per_s)
    return matmuls + kv


def print_summary(summary: dict) -> None:
    print(json.dumps(summary, indent=2, sort_keys=True))
