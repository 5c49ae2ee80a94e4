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

# One library, kvfleet_cpu: the decode kernel, the packed attention of embedding models
# (kvfleet_kernels/cpu_varlen_attention.py), bf16 prefill attention (kvfleet_kernels/cpu_prefill_attention.py),
# the CPU layers and the LoRA delta (kvfleet_kernels/cpu_layers.py), bf16 linears on the brgemm microkernel
# (kvfleet_kernels/cpu_linear.py).
_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("paged_decode_cpu.cpp", "varlen_attention_cpu.cpp", "prefill_attention_cpu.cpp", "cpu_layers.cpp",
                         "lora_cpu.cpp", "brgemm_linear_cpu.cpp")]
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


def build_directory() -> Path:
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    return root / f"kvfleet_cpu_ops-torch{torch.__version__}"  # the library is tied to torch's ABI


@functools.cache
def _build() -> str | None:
    """Compile and load the library once per process; the error text when that fails."""
    from torch.utils import cpp_extension  # noqa: PLC0415 (slow import, only when asked)

    _put_ninja_on_path()
    build_dir = build_directory()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_dir / "kvfleet.flock", "w") as guard:
            # torch's own lock is a plain file: a worker killed mid-build would leave it behind and
            # every later start would wait on it forever. An flock dies with its holder, so while we
            # hold it no other build runs here and a leftover torch lock is stale.
            fcntl.flock(guard, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            digest = hashlib.sha256(b"".join(header.read_bytes() for header in _HEADERS)).hexdigest()[:16]
            cpp_extension.load(name="kvfleet_cpu_ops", sources=[str(source) for source in _SOURCES],
                               extra_cflags=[*_CFLAGS, f"-DKVFLEET_CPU_VEC_H={digest}"],
                               extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                               is_python_module=False, verbose=False)
    except Exception as error:  # noqa: BLE001 (no compiler, no ninja, a build error: all mean "not here")
        return f"{type(error).__name__}: {error}"
    return None


def load_error() -> str | None:
    """None when the native kernel is usable; otherwise why not (builds on first call)."""
    return _build()


def require_built() -> None:
    """Builds the library on first use; a RuntimeError saying why when it cannot be built.
    Every launcher of the library's ops calls it before its first op."""
    error = _build()
    if error is not None:
        raise RuntimeError(f"the native CPU kernels could not be built: {error}")


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, out: torch.Tensor | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as kvfleet_kernels.reference.paged_decode_attention.

    query:        [num_seqs, num_heads, head_dim]
    key_cache:    [num_blocks, block_size, num_kv_heads, head_dim] (value_cache alike)
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
                                                 None if sinks is None else sinks.float().contiguous())
    return out
