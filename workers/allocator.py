"""Which malloc a worker process runs on, chosen before anything heavy loads (stdlib only:
`python -m workers` restarts itself with it before torch is imported).

Each CPU step allocates and frees activations of a few MB to a few hundred MB per layer;
glibc malloc hands big blocks back to the OS and faults them in again, where tcmalloc
keeps them. benchmarks/engine_throughput.py measures glibc, tcmalloc and jemalloc (here
tcmalloc gave kvfleet 1.13x glibc on chat, jemalloc 0.87x); the CLIs preload
PREFERRED_ALLOCATOR when it is installed (Debian: libtcmalloc-minimal4), as vLLM's CPU
guide advises. KVFLEET_MALLOC=glibc|tcmalloc|jemalloc overrides the choice.
"""

from __future__ import annotations

import glob
import os
import platform
import sys

# Shared objects per allocator, in order of preference; the first installed one is used.
ALLOCATOR_LIBRARIES = {"tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
                       "jemalloc": ("libjemalloc.so.2",)}
LIBRARY_DIRS = (f"/usr/lib/{platform.machine()}-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
PREFERRED_ALLOCATOR = "tcmalloc"


def find_allocator(name: str) -> str | None:
    """The path of allocator `name` (tcmalloc, jemalloc) on this machine, or None."""
    for library in ALLOCATOR_LIBRARIES[name]:
        for directory in LIBRARY_DIRS:
            found = glob.glob(f"{directory}/{library}")
            if found:
                return found[0]
    return None


def allocator_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the chosen allocator in LD_PRELOAD (a process reads it when it starts)."""
    name = env.get("KVFLEET_MALLOC", PREFERRED_ALLOCATOR)
    if name == "glibc":
        return env
    if name not in ALLOCATOR_LIBRARIES:
        raise ValueError(f"KVFLEET_MALLOC must be glibc, tcmalloc or jemalloc, not {name!r}")
    path = find_allocator(name)
    preloaded = env.get("LD_PRELOAD", "")
    if path is None or path in preloaded.split(":"):
        return env
    return {**env, "LD_PRELOAD": ":".join(filter(None, [path, preloaded]))}


def reexec_with_allocator() -> None:
    """Start this process again with the allocator preloaded, unless it already is (or
    none is installed, or KVFLEET_MALLOC=glibc). For CLIs, before anything else runs."""
    env = allocator_env(dict(os.environ))
    if env.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD") and sys.platform == "linux":
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def preloaded_allocator() -> str:
    """What this process runs on, for its start-up log line."""
    for name, libraries in ALLOCATOR_LIBRARIES.items():
        if any(library in os.environ.get("LD_PRELOAD", "") for library in libraries):
            return name
    return "glibc malloc"
