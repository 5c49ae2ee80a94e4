"""The one engine configuration, built once and passed down (nano-vllm style)."""

from __future__ import annotations

import re
from dataclasses import dataclass

# vLLM's names for the KV cache's element type (engine/kv_quant.py maps them to torch dtypes).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_memory(value: int | str | None) -> int | None:
    """Bytes from an int or a string like "2GiB", "512MiB", "1.5GB"."""
    if value is None or isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory: cannot parse {value!r}; use bytes or a size like '2GiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option. Values found at start-up (the number of KV blocks that
    fit) are returned by the model runner, never written back here."""

    model: str
    block_size: int = 16
    """Tokens per KV-cache block."""
    num_kv_blocks: int | None = None
    """Exact size of the KV pool in blocks; wins over `kv_cache_memory`."""
    kv_cache_memory: int | str | None = None
    """Bytes (or "2GiB") for the KV pool. Default: 90% of free memory after weights on
    CUDA; on the CPU, what `max_num_seqs` full-length sequences need, capped at 2 GiB."""
    max_num_seqs: int = 256
    """Most sequences running at once."""
    max_num_batched_tokens: int = 8192
    """Token budget of one step (prefill chunks plus decodes)."""
    max_model_len: int | None = None
    """Longest prompt + completion; default: the model's `max_position_embeddings`."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the step budget across steps."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes (hash-chained full blocks)."""
    dtype: str = "auto"
    """float32, bfloat16, float16, or auto: bf16 on CPUs with avx512_bf16 or AMX, else fp32;
    the checkpoint's dtype on CUDA (engine/model_runner.py: resolve_dtype)."""
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto (cuda when available)."""
    attention_backend: str = "auto"
    """auto: triton on CUDA; on the CPU, cpu (native decode kernel) where a C++ compiler
    can build it, else torch (the reference, gather + SDPA)."""
    onednn_linear: bool = True
    """On the CPU in fp32, reorder linear weights once for oneDNN (faster small-batch matmuls)."""
    quantized_kernels: bool | None = None
    """A GGUF file's quantized linears and embeddings, and the linears of an AWQ, GPTQ or
    compressed-tensors integer checkpoint, stay quantized in memory and compute there
    (engine/quantized_linear.py); False dequantizes them at load to `dtype`. None (auto): on the
    CPU, True; on CUDA, False until the Triton kernels it would run have run on a GPU (`make
    gpu-check`); True takes them there. Always dequantized under tensor parallelism and for MoE
    experts."""
    kv_cache_dtype: str = "auto"
    """The KV cache's element type, by vLLM's names: auto (the model's dtype), or fp8 (= fp8_e4m3)
    and fp8_e5m2, one byte an element: twice the blocks in the same memory, half the bytes a decode
    step reads. Stored as x / scale with a scale per layer and K/V: the checkpoint's k_scale and
    v_scale where it has them, else 1.0, or computed once (`calculate_kv_scales`). engine/kv_quant.py."""
    calculate_kv_scales: bool = False
    """With an fp8 KV cache: each layer's K and V scales from the first step's own keys and values
    (their largest magnitude over vLLM's K_SCALE_CONSTANT 200 and V_SCALE_CONSTANT 100), where the
    checkpoint gives none."""
    enforce_eager: bool = True
    """False: on CUDA, replay decode steps from CUDA graphs (engine/cuda_graphs.py), as vLLM does
    by default. True for now: the graphs are tested on the CPU only, until make gpu-check has
    run them on a GPU."""
    seed: int = 0
    """Seeds unseeded requests' samplers, in arrival order."""
    tokenizer: str | None = None
    """Tokenizer path; default: the model path."""
    tensor_parallel_size: int = 1
    """Devices (GPUs, or processes on the CPU) one engine spans; ranks 1..N-1 are processes
    the engine starts."""
    generation_config: str = "auto"
    """Request defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens):
    auto takes the model's generation_config.json, vllm ignores it, or a folder holding one."""
    skip_tokenizer_init: bool = False
    """Run without a tokenizer: prompts must be token ids, outputs carry token ids and empty
    text, and stop strings are refused (as in vLLM)."""
    task: str = "auto"
    """generate, embed, or auto: embed for encoder checkpoints (BertModel, XLMRobertaModel) and
    sentence-transformers folders (modules.json with a Pooling module), generate otherwise."""
    pooling: str | None = None
    """Embedding models: mean, cls or last; default: the folder's sentence-transformers pooling,
    else mean for encoders and last for decoders."""
    normalize: bool | None = None
    """Embedding models: L2-normalize each embedding; default: as the folder's modules.json says
    (a Normalize module), else no."""
    enable_lora: bool = False
    """Serve LoRA adapters on the base weights: requests name one (engine/lora/)."""
    max_loras: int = 1
    """Adapters in device slots at once: one step mixes at most this many."""
    max_lora_rank: int = 16
    """The largest adapter rank accepted; every slot is sized for it."""
    max_cpu_loras: int | None = None
    """Adapters kept in host memory (beyond those live requests use); default max_loras."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        memory = parse_memory(self.kv_cache_memory)
        if memory is not None and memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory!r}")
        object.__setattr__(self, "kv_cache_memory", memory)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValueError(f"attention_backend must be auto, torch, cpu or triton, got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.task not in ("auto", "generate", "embed"):
            raise ValueError(f"task must be auto, generate or embed, got {self.task!r}")
        if self.pooling is not None and self.pooling not in ("mean", "cls", "last"):
            raise ValueError(f"pooling must be mean, cls or last, got {self.pooling!r}")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras}, {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
