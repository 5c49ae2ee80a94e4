"""The process around a CPU worker: which cores its threads run on (the malloc it runs on
is chosen before torch loads: workers/allocator.py).

Threads: one OpenMP thread per physical core the process may use (a second hyperthread
shares the core's AVX-512 and AMX units, so it adds contention, not FLOPs), each pinned to
its core. Unpinned threads migrate mid-step, and every parallel region waits for its
slowest thread. Fewer threads than cores, unpinned, where the process was given less
than its cores: an explicit OMP_NUM_THREADS, or a cgroup CPU quota (a Kubernetes CPU
limit leaves the cpuset whole). Pinning N threads to the first N cores of a shared set
would pile every such process on the same cores; a quota of 4 CPUs with 64 pinned threads
would spend its time throttled at the parallel regions' barriers. `workers.serve` keeps
the API, the finalizer and Redis off the worker's cores once there are SERVICE_CORE_FROM
cores: they share the last one; below that, giving them a core would cost the worker
more than their interruptions do.
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


def cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPUs this process's cgroup may use (quota / period), None without a quota:
    cgroup v2's cpu.max, else v1's cfs files."""
    try:
        if (root / "cpu.max").exists():
            quota, period = (root / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        return None if quota <= 0 else quota / int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def thread_plan(cores: list[int], env: dict[str, str], quota: float | None) -> tuple[int, list[int]]:
    """(OpenMP threads, the cores to pin them to) for a process given `cores`: one pinned
    thread per core, unless OMP_NUM_THREADS or the quota asks for fewer: then that many,
    unpinned ([])."""
    limits = [len(cores)]
    if env.get("OMP_NUM_THREADS", "").strip().isdigit():
        limits.append(max(1, int(env["OMP_NUM_THREADS"])))
    if quota is not None:
        limits.append(max(1, int(quota)))
    num_threads = min(limits)
    return num_threads, cores if num_threads == len(cores) else []


def pin_threads(device: str = "cpu", num_shares: int = 1, share: int = 0) -> list[int]:
    """On the CPU (`device` cpu, or auto without CUDA): size this process's OpenMP threads
    by `thread_plan` over its share of the physical cores (tensor-parallel rank `share` of
    `num_shares` on one host), pin them where the plan says, and return the cores pinned;
    elsewhere nothing, []."""
    if device not in ("cpu", "auto") or (device == "auto" and torch.cuda.is_available()):
        return []
    cores = physical_cores(os.sched_getaffinity(0))
    per_share = max(1, len(cores) // num_shares)
    mine = cores[share * per_share:(share + 1) * per_share] or cores[:1]
    quota = cpu_quota()
    num_threads, pinned = thread_plan(mine, dict(os.environ), None if quota is None else quota / num_shares)
    from kvfleet_kernels.cpu_paged_attention import load_error  # noqa: PLC0415

    if pinned and load_error() is None:
        torch.ops.kvfleet_cpu.bind_threads(pinned)
        logger.info("%d OpenMP threads pinned to cores %s", len(pinned), pinned)
        return pinned
    torch.set_num_threads(num_threads)
    why = "no native kernel" if pinned else f"OMP_NUM_THREADS or a CPU quota of {quota} asks for fewer than {len(mine)}"
    logger.info("%d OpenMP threads, not pinned (%s)", num_threads, why)
    return []
