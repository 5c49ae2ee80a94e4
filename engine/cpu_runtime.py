"""The process around a CPU worker: which malloc it runs on.

The allocator: kvfleet's CPU steps allocate and free activations of a few MB to a few
hundred MB every layer; glibc malloc returns big blocks to the OS and takes them back
(page faults, zeroing) while tcmalloc and jemalloc keep them. benchmarks/engine_throughput.py
measures the three; the launchers preload the winner when it is installed (Debian:
libtcmalloc-minimal4, libjemalloc2), as vLLM's CPU guide advises.
"""

from __future__ import annotations

import glob
import platform

# Shared objects per allocator, in order of preference; the first installed one is used.
ALLOCATOR_LIBRARIES = {"tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
                       "jemalloc": ("libjemalloc.so.2",)}
LIBRARY_DIRS = (f"/usr/lib/{platform.machine()}-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_allocator(name: str) -> str | None:
    """The path of allocator `name` (tcmalloc, jemalloc) on this machine, or None."""
    for library in ALLOCATOR_LIBRARIES[name]:
        for directory in LIBRARY_DIRS:
            found = glob.glob(f"{directory}/{library}")
            if found:
                return found[0]
    return None
