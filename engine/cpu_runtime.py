"""The process around a CPU worker: which cores its threads run on (the malloc it runs on
is chosen before torch loads: workers/allocator.py).

Threads: one OpenMP thread per physical core the process may use (a second hyperthread
shares the core's AVX-512 and AMX units, so it adds contention, not FLOPs), each pinned to
its core. Unpinned threads migrate mid-step, and every parallel region waits for its
slowest thread. `workers.serve` keeps the API, the finalizer and Redis off the worker's
cores once there are SERVICE_CORE_FROM cores: they share the last one; below that, giving
them a core would cost the worker more than their interruptions do.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SERVICE_CORE_FROM = 4


def physical_cores(cpus: set[int]) -> list[int]:
    """One logical CPU (the lowest of its siblings) per physical core among `cpus`."""
    return sorted({first_sibling(cpu, cpus) for cpu in cpus})


def first_sibling(cpu: int, cpus: set[int]) -> int:
    """The lowest CPU among `cpus` on the same physical core as `cpu` (itself without SMT)."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    siblings = {cpu}
    if path.exists():  # e.g. "0,64" or "0-1"
        for chunk in path.read_text().strip().split(","):
            low, _, high = chunk.partition("-")
            siblings.update(range(int(low), int(high or low) + 1))
    return min(siblings & cpus | {cpu})


def core_plan(cpus: set[int]) -> tuple[set[int], set[int]]:
    """(the worker's CPUs, the API's, finalizer's and Redis's): from SERVICE_CORE_FROM
    physical cores the last one, with its siblings, goes to the services; below, all share."""
    cores = physical_cores(cpus)
    if len(cores) < SERVICE_CORE_FROM:
        return set(cpus), set(cpus)
    services = {cpu for cpu in cpus if first_sibling(cpu, cpus) == cores[-1]}
    return set(cpus) - services, services


def pin_threads(device: str = "cpu", num_shares: int = 1, share: int = 0) -> list[int]:
    """On the CPU (`device` cpu, or auto without CUDA): pin this process's OpenMP threads,
    one per physical core of its share (tensor-parallel rank `share` of `num_shares` on one
    host), and return those cores; elsewhere nothing, []."""
    if device not in ("cpu", "auto") or (device == "auto" and torch.cuda.is_available()):
        return []
    cores = physical_cores(os.sched_getaffinity(0))
    per_share = max(1, len(cores) // num_shares)
    mine = cores[share * per_share:(share + 1) * per_share] or cores[:1]
    from kernels.cpu_paged_attention import load_error  # noqa: PLC0415

    if load_error() is None:
        torch.ops.kvfleet_cpu.bind_threads(mine)
        logger.info("%d OpenMP threads pinned to cores %s", len(mine), mine)
    else:
        torch.set_num_threads(len(mine))
        logger.info("%d OpenMP threads (not pinned: no native kernel)", len(mine))
    return mine
