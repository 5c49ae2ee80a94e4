"""paged_decode_attention for the CPU in native code (csrc/paged_decode_cpu.cpp), the
CPU peer of the Triton decode kernel: it reads K/V through the block tables in place.

The C++ source is compiled on first use by torch.utils.cpp_extension (g++ and ninja),
for this machine's instruction set, and cached under TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions); later processes load the cached library in milliseconds.
Where no compiler is present, `load_error()` says why and the engine keeps the torch path.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
from pathlib import Path

import torch

from kvfleet_kernels.reference import is_fp8

# One library, kvfleet_cpu: the decode kernel, the packed attention of embedding models
# (kvfleet_kernels/cpu_varlen_attention.py), bf16 prefill attention (kvfleet_kernels/cpu_prefill_attention.py),
# the CPU layers and the LoRA delta (kvfleet_kernels/cpu_layers.py), bf16 linears on the brgemm microkernel
# (kvfleet_kernels/cpu_linear.py), linears on quantized weights (kvfleet_kernels/cpu_quantized_linear.py), and the caches' own layouts (below: store_kv, gather_keys, gather_values).
_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("paged_decode_cpu.cpp", "varlen_attention_cpu.cpp", "prefill_attention_cpu.cpp", "cpu_layers.cpp",
                         "lora_cpu.cpp", "brgemm_linear_cpu.cpp", "vnni_linear_cpu.cpp", "kv_cache_cpu.cpp",
                         "prefill_attention_brgemm.cpp", "paged_prefill_amx.cpp", "quantized_linear_cpu.cpp",
                         "quantized_linear_amx.cpp", "quantized_weight_cpu.cpp")]
# -fopenmp: at::parallel_for is inlined OpenMP, sharing torch's own libgomp thread pool.
# The math flags let g++ vectorise the dot-product reductions; not -ffast-math, whose
# finite-math assumption would break the -inf masking.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-funsafe-math-optimizations"]
# cpp_extension rebuilds when a source or a flag changes, not when a header does: the headers'
# digest rides in a flag so that editing one rebuilds the library too.
_HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the pip-installed one sits beside this
    interpreter, which is not on PATH when a venv's python is run without activating it."""
    try:
        import ninja  # noqa: PLC0415
    except ImportError:
        return  # a system ninja may still be on PATH
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


LIBRARY = "kvfleet_cpu_ops"


def build_directory(name: str = LIBRARY) -> Path:
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    return root / f"{name}-torch{torch.__version__}"  # a library is tied to torch's ABI


def build_library(name: str, sources: list[Path], cflags: list[str]) -> str | None:
    """Compile (where its sources or flags changed) and load the native library `name` into this
    process's torch.ops; the error text when that fails."""
    from torch.utils import cpp_extension  # noqa: PLC0415 (slow import, only when asked)

    _put_ninja_on_path()
    build_dir = build_directory(name)
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_dir / "kvfleet.flock", "w") as guard:
            # torch's own lock is a plain file: a worker killed mid-build would leave it behind and
            # every later start would wait on it forever. An flock dies with its holder, so while we
            # hold it no other build runs here and a leftover torch lock is stale.
            fcntl.flock(guard, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            cpp_extension.load(name=name, sources=[str(source) for source in sources], extra_cflags=cflags,
                               extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                               is_python_module=False, verbose=False)
    except Exception as error:  # noqa: BLE001 (no compiler, no ninja, a build error: all mean "not here")
        return f"{type(error).__name__}: {error}"
    return None


@functools.cache
def _build() -> str | None:
    """Compile and load kvfleet's library once per process; the error text when that fails."""
    digest = hashlib.sha256(b"".join(header.read_bytes() for header in _HEADERS)).hexdigest()[:16]
    return build_library(LIBRARY, _SOURCES, [*_CFLAGS, f"-DKVFLEET_CPU_VEC_H={digest}"])


def load_error() -> str | None:
    """None when the native kernel is usable; otherwise why not (builds on first call)."""
    return _build()


def require_built() -> None:
    """Builds the library on first use; a RuntimeError saying why when it cannot be built.
    Every launcher of the library's ops calls it before its first op."""
    error = _build()
    if error is not None:
        raise RuntimeError(f"the native CPU kernels could not be built: {error}")


def key_word_elements(dtype: torch.dtype) -> int:
    """x of the key cache layout: elements to a word (1 for fp32; 2 for bf16 and fp16, a 32-bit
    word, and for fp8, one bf16 pair once widened); csrc/decode_keys.h's key_word_elements is its
    C++ twin."""
    return 1 if dtype == torch.float32 else 2


def key_cache_view(key_cache: torch.Tensor) -> torch.Tensor:
    """The decode kernel's key layout over a dense [num_blocks, block_size, Hkv, D] tensor's
    memory: [num_blocks, Hkv, D // x, block_size, x], the same bytes read in that order (for a
    cache still empty: its contents are not moved). Why this layout: csrc/decode_keys.h."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    x = key_word_elements(key_cache.dtype)
    if head_dim % x:
        raise ValueError(f"head_dim {head_dim} must be a multiple of {x} for a {key_cache.dtype} key cache")
    return key_cache.view(num_blocks, num_kv_heads, head_dim // x, block_size, x)


def pack_key_cache(key_cache: torch.Tensor) -> torch.Tensor:
    """A copy of a [num_blocks, block_size, Hkv, D] key cache with its contents in the decode
    kernel's layout, [num_blocks, Hkv, D // x, block_size, x] (tests, and caches filled elsewhere)."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    x = key_word_elements(key_cache.dtype)
    words = key_cache.reshape(num_blocks, block_size, num_kv_heads, head_dim // x, x)
    return words.permute(0, 2, 3, 1, 4).contiguous()


def value_word_elements(dtype: torch.dtype) -> int:
    """y of the value cache layout: positions to a word (2 for bf16 and fp8, 1 otherwise);
    csrc/decode_values.h's value_word_elements is its C++ twin."""
    return 2 if dtype == torch.bfloat16 or is_fp8(dtype) else 1


def value_cache_view(value_cache: torch.Tensor) -> torch.Tensor:
    """The decode kernel's value layout over a dense [num_blocks, block_size, Hkv, D] tensor's
    memory: [num_blocks, Hkv, block_size // y, D, y], the same bytes read in that order (for a
    cache still empty). Why this layout, and why bf16 pairs positions: csrc/decode_values.h."""
    num_blocks, block_size, num_kv_heads, head_dim = value_cache.shape
    y = value_word_elements(value_cache.dtype)
    if block_size % y:
        raise ValueError(f"block_size {block_size} must be a multiple of {y} for a {value_cache.dtype} value cache "
                         "on the CPU (its bf16 layout pairs positions)")
    return value_cache.view(num_blocks, num_kv_heads, block_size // y, head_dim, y)


def pack_value_cache(value_cache: torch.Tensor) -> torch.Tensor:
    """A copy of a [num_blocks, block_size, Hkv, D] value cache with its contents in the decode
    kernel's layout, [num_blocks, Hkv, block_size // y, D, y] (tests, and caches filled elsewhere)."""
    num_blocks, block_size, num_kv_heads, head_dim = value_cache.shape
    y = value_word_elements(value_cache.dtype)
    words = value_cache.reshape(num_blocks, block_size // y, y, num_kv_heads, head_dim)
    return words.permute(0, 3, 1, 4, 2).contiguous()


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """A layer's new K/V into their slots (slot_mapping [num_tokens] int64), reference.store_kv's
    contract with the caches in this kernel's layouts: key [num_tokens, Hkv, D] into the key
    cache (key_cache_view), value [num_tokens, Hkv, D] into the value cache (value_cache_view).
    Read in place when each token's [Hkv, D] is dense (a slice of the fused qkv output is): no
    copy per layer."""
    require_built()
    if key.stride(2) != 1 or key.stride(1) != key.shape[2]:
        key = key.contiguous()
    if value.stride(2) != 1 or value.stride(1) != value.shape[2]:
        value = value.contiguous()
    torch.ops.kvfleet_cpu.store_kv(key_cache, value_cache, key, value, slot_mapping)


def gather_keys(key_cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's first context_len keys from a key cache in the kernel's layout, in token
    order: [context_len, Hkv, D] (as kvfleet_kernels.reference.gather_kv reads the plain layout)."""
    require_built()
    return torch.ops.kvfleet_cpu.gather_keys(key_cache, block_table, context_len)


def gather_values(value_cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """gather_keys for a value cache in the kernel's layout (value_cache_view): [context_len, Hkv, D]."""
    require_built()
    return torch.ops.kvfleet_cpu.gather_values(value_cache, block_table, context_len)


def decode_amx_available() -> bool:
    """Whether bf16 decode attention runs on AMX tiles here (head sizes 64 and 128, GQA groups
    of up to 16, blocks of a multiple of 16): the library was built for a CPU with amx_bf16 and
    Linux lends this process the tile state. Elsewhere it runs on avx512_bf16's dot product."""
    require_built()
    return bool(torch.ops.kvfleet_cpu.decode_amx_available())


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, out: torch.Tensor | None = None,
                           sinks: torch.Tensor | None = None, allow_amx: bool = True,
                           kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """The contract of kvfleet_kernels.reference.paged_decode_attention, with the keys in this
    kernel's layouts (key_cache_view, pack_key_cache, value_cache_view, pack_value_cache). bf16 caches of head size 64 or 128 run on
    AMX tiles where the CPU has them (csrc/decode_amx.h); allow_amx=False keeps them on
    avx512_bf16 (tests compare the two). fp8 caches (float8_e4m3fn, float8_e5m2; x = y = 1) are
    read as their values times kv_scales (k_scale, v_scale), widened in registers.

    query:        [num_seqs, num_heads, head_dim]
    key_cache:    [num_blocks, num_kv_heads, head_dim // x, block_size, x], x = key_word_elements(dtype)
                  (the query's dtype, or fp8)
    value_cache:  [num_blocks, num_kv_heads, block_size // y, head_dim, y], y = value_word_elements(dtype)
    block_tables: [num_seqs, max_blocks_per_seq] int64
    context_lens: [num_seqs] int64, including the new token
    sinks:        [num_heads] or None (read as fp32)
    returns       [num_seqs, num_heads, head_dim]
    """
    require_built()
    out = torch.empty_like(query) if out is None else out
    # Shapes, dtypes and strides are checked in the C++ op (TORCH_CHECK), where they are read.
    torch.ops.kvfleet_cpu.paged_decode_attention(out, query, key_cache, value_cache, block_tables, context_lens,
                                                 scale, sliding_window or 0,
                                                 None if sinks is None else sinks.float().contiguous(), allow_amx,
                                                 float(kv_scales[0]), float(kv_scales[1]))
    return out
