# One image for the API, the workers and the finalizer; compose picks the command.
# A pinned base (a full version tag), and a non-root user that the Kubernetes manifests'
# runAsNonRoot accepts; caches and kernel builds go to /cache, so the root can be read-only.
FROM python:3.11.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOME=/cache TRITON_CACHE_DIR=/cache/triton \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions
WORKDIR /app

# A C/C++ compiler: Triton builds its launcher with it on GPUs, and the CPU attention
# kernel (kvfleet_kernels/csrc) is compiled on a worker's first start. tcmalloc: a worker restarts
# itself with it preloaded (engine/cpu_runtime.py; KVFLEET_MALLOC=glibc opts out).
RUN apt-get update && apt-get install -y --no-install-recommends g++ libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*

# torch first (the CUDA build from PyPI), so the project install does not re-resolve it.
RUN pip install "torch>=2.5,<2.15"
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kvfleet_kernels ./kvfleet_kernels
COPY jobs ./jobs
COPY producers ./producers
COPY workers ./workers
COPY kvfleet ./kvfleet
COPY grammar_support ./grammar_support
RUN pip install .
RUN useradd --system --uid 10001 --home-dir /cache --create-home kvfleet
USER 10001

EXPOSE 8000 9100
CMD ["python", "-m", "producers.api", "--host", "0.0.0.0", "--port", "8000"]
